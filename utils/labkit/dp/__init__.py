"""Data parallelism: the test bench of chapter 2 (`course/02_data_parallel.ipynb`) and lab 2.

    from labkit import dp
    model = dp.make_model(seed=0)                       # the same weights in every process
    batch = dp.ragged_batch(seed=1, n_sequences=6, max_len=9)
    reference = dp.reference_gradients(batch, seed=0)   # one process, the whole global batch
    per_rank = world.call(dp.token_loss_gradients, args=(loss_fn, case), timeout=60)
    dp.assert_grads_match(per_rank, reference)          # or a coaching AssertionError

What is here: a tiny deterministic language model (with tied, frozen or optional weights on
request), ragged batches as plain lists, ways to split a batch over ranks and microbatches, the
single-process reference, a rank-side harness that runs a loss function of yours inside a step,
and comparisons with stated tolerances. Beside it: `training` (whole training runs as plain data,
and the loop that drives a synchroniser), `placement` (sharded and replicated gradients),
`checks` and `sync_checks` (lab 2's checkers), `selfcheck` (chapter 2's questions). What is not
here: the answers of lab 2 (the accumulation step, the norm and clipped step, the synchroniser).

Notation (chapter 2): R ranks; rank r holds n_r valid tokens whose losses sum to S_r; the global
token loss is L = sum_r S_r / sum_r n_r. Shapes: B sequences, T positions, V vocabulary, H hidden.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN = 11, 8
IGNORE = -100           # the target of a padding position (cross_entropy's ignore_index)
# float64 comparisons: every correct variant agrees to ~1e-15; a wrong scale is off by >1e-3.
RTOL, ATOL = 1e-7, 1e-10


class TinyLM(nn.Module):
    """tokens [B, T] -> logits [B, T, V]: embedding, `layers` GELU blocks, output head.

    Options that a real model has and a synchroniser must survive (all off by default):
    `tied`: the head's weight is the embedding's (one parameter used twice, as in GPT-2);
    `optional`: one more block, `detour`, used only when the forward is asked to
    (`model(tokens, detour=True)`): a parameter that gets no gradient in some steps or on some
    ranks, like an expert no token was routed to;
    `crossed`: forward uses the blocks in the reverse of the order they were created, so
    backward's order is not the reverse of `model.parameters()` (chapter 2, section 2; lab 2,
    task 3's buckets follow the order gradients arrive in, not the order of creation).
    """

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = 1,
                 tied: bool = False, optional: bool = False, crossed: bool = False):
        super().__init__()
        self.crossed = crossed
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        if tied:
            self.head.weight = self.embed.weight    # [V, H] both: one parameter, two uses
        self.detour = nn.Linear(hidden, hidden) if optional else None

    def forward(self, tokens, detour: bool = False):
        x = self.embed(tokens)                      # x: [B, T, H]
        for block in (self.blocks[::-1] if self.crossed else self.blocks):
            x = x + F.gelu(block(x))                # [B, T, H]
        if detour and self.detour is not None:
            x = x + F.gelu(self.detour(x))          # [B, T, H]
        return self.head(x)                         # logits: [B, T, V]


def make_model(seed: int = 0, layers: int = 1, hidden: int = HIDDEN, dtype=torch.float64,
               device="cpu", tied: bool = False, optional: bool = False,
               frozen: tuple = (), crossed: bool = False) -> TinyLM:
    """A TinyLM whose weights depend only on `seed`: every process that calls this agrees.

    `frozen`: names of parameters that get requires_grad=False (fine-tuning keeps them fixed).
    """
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = TinyLM(hidden=hidden, layers=layers, tied=tied, optional=optional,
                   crossed=crossed).to(dtype)
    torch.random.set_rng_state(generator_state)
    names = dict(model.named_parameters())
    unknown = sorted(set(frozen) - set(names))
    if unknown:
        raise ValueError(f"frozen names {unknown} are not parameters of this model; its "
                         f"parameters are {sorted(names)}")
    for name in frozen:
        names[name].requires_grad_(False)
    return model.to(device)


def ragged_batch(seed: int, n_sequences: int, max_len: int, min_len: int = 0) -> list:
    """n_sequences (tokens, targets) pairs of random lengths in [min_len, max_len], as lists."""
    g = torch.Generator().manual_seed(seed)
    batch = []
    for _ in range(n_sequences):
        length = int(torch.randint(min_len, max_len + 1, (), generator=g))
        tokens = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        targets = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        batch.append((tokens, targets))
    return batch


def count_tokens(sequences) -> int:
    """Valid (non-padding) tokens in a list of sequences."""
    return sum(len(tokens) for tokens, _ in sequences)


def pad(sequences, extra: int = 0, device="cpu"):
    """-> tokens [B, T], targets [B, T]; T = longest + extra, padding has target IGNORE."""
    width = max((len(t) for t, _ in sequences), default=0) + extra
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)        # [B, T]
    targets = torch.full((len(sequences), width), IGNORE, dtype=torch.long)
    for row, (tok, tgt) in enumerate(sequences):
        tokens[row, :len(tok)] = torch.tensor(tok, dtype=torch.long)
        targets[row, :len(tgt)] = torch.tensor(tgt, dtype=torch.long)
    return tokens.to(device), targets.to(device)


def token_loss_sum(model, sequences, extra_padding: int = 0, detour: bool = False):
    """(S, n): the summed cross-entropy over valid tokens (differentiable) and their count.

    `detour`: run the model's optional block (TinyLM(optional=True)) for these sequences."""
    device = next(model.parameters()).device
    tokens, targets = pad(sequences, extra_padding, device)              # [B, T], [B, T]
    logits = model(tokens, detour=True) if detour else model(tokens)     # [B, T, V]
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                            ignore_index=IGNORE, reduction="sum")
    return total, int((targets != IGNORE).sum())


def split(items: list, sizes: list) -> list:
    """Consecutive pieces of `items` with the given sizes (which must add up to len(items))."""
    if sum(sizes) != len(items) or min(sizes, default=0) < 0:
        raise ValueError(f"sizes {sizes} (sum {sum(sizes)}) must be >= 0 and add up to "
                         f"{len(items)} items")
    pieces, start = [], 0
    for size in sizes:
        pieces.append(items[start:start + size])
        start += size
    return pieces


def even_sizes(n_items: int, parts: int) -> list:
    """As even as possible, the first parts one larger: even_sizes(5, 3) == [2, 2, 1]."""
    base, extra = divmod(n_items, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def token_loss_case(batch, rank_sizes, microbatches: int = 1, extra_padding: int = 0,
                    seed: int = 0) -> dict:
    """Plain data for token_loss_gradients: rank r gets rank_sizes[r] sequences of `batch`, in
    `microbatches` pieces (the same count on every rank; pieces may be empty)."""
    per_rank = [split(share, even_sizes(len(share), microbatches))
                for share in split(batch, list(rank_sizes))]
    return {"per_rank": per_rank, "extra_padding": extra_padding, "seed": seed}


def grads_of(model) -> dict:
    """{name: gradient on CPU} (zeros for a parameter that got none)."""
    return {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu().clone()
            for name, p in model.named_parameters()}


def reference_gradients(batch, seed: int = 0, layers: int = 1, hidden: int = HIDDEN) -> dict:
    """One process, the whole batch: the gradient of L = (sum of token losses) / (token count)."""
    model = make_model(seed, layers, hidden)
    total, count = token_loss_sum(model, batch)
    if count == 0:
        raise ValueError("the global batch has no valid token: the loss is undefined")
    (total / count).backward()
    return grads_of(model)


def token_loss_gradients(loss_fn, case: dict) -> dict:
    """On every rank: one data-parallel step whose per-microbatch loss is loss_fn(S, n_local).

    S is the differentiable summed token loss of this rank's microbatch; n_local an int64 0-dim
    tensor on labkit.device(), the valid tokens of this rank over all its microbatches. Gradients
    are accumulated over the microbatches, then summed over ranks and divided by R (what DDP
    does). Returns {name: averaged gradient}.
    """
    import torch.distributed as dist
    from labkit import device
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model(case["seed"], device=device())
    mine = case["per_rank"][rank]                                        # microbatches of rank r
    n_local = torch.tensor(sum(count_tokens(m) for m in mine), device=device())
    for microbatch in mine:
        total, _ = token_loss_sum(model, microbatch, case["extra_padding"])
        loss_fn(total, n_local).backward()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= world_size
    return grads_of(model)


def max_difference(per_rank: list, reference: dict) -> float:
    """Largest absolute difference between any rank's gradient (or parameter) and the reference;
    NaN if any rank holds a NaN."""
    gaps = [float((result[name].double() - ref.double()).abs().max())
            for result in per_rank for name, ref in reference.items()]
    return math.nan if any(math.isnan(g) for g in gaps) else max(gaps)


def _hint(actual, expected, world_size) -> str:
    ratio = float(actual.double().norm() / max(float(expected.double().norm()), 1e-300))
    if world_size > 1 and math.isclose(ratio, world_size, rel_tol=1e-3):
        return "it is R times too large: did you divide by the world size after all_reduce?"
    if world_size > 1 and math.isclose(ratio * world_size, 1.0, rel_tol=1e-3):
        return "it is R times too small: is the world size in the scale of each rank's loss?"
    if math.isclose(ratio, 2.0, rel_tol=1e-3):
        return "it is twice too large: is a gradient all-reduced twice?"
    if not math.isfinite(ratio):
        return "it is not finite: is a rank dividing by its own (zero) token count?"
    return ("ranks with few tokens count as much as ranks with many: a mean of per-rank means "
            "is not the mean over tokens")


def assert_grads_match(per_rank: list, reference: dict, what: str = "grad", rtol: float = RTOL,
                       atol: float = ATOL, hint: str | None = None) -> None:
    """Every rank's {name: tensor} equals the single-process reference, within rtol/atol."""
    world_size = len(per_rank)
    for rank, result in enumerate(per_rank):
        if not isinstance(result, dict) or set(result) != set(reference):
            raise AssertionError(f"rank {rank}: expected tensors named {sorted(reference)}, got "
                                 f"{sorted(result) if isinstance(result, dict) else type(result).__name__}")
        for name, expected in reference.items():
            actual = result[name].to(expected.dtype)
            if actual.shape != expected.shape:
                raise AssertionError(f"rank {rank}: {name}.{what} has shape {tuple(actual.shape)}, "
                                     f"expected {tuple(expected.shape)}")
            if not torch.allclose(actual, expected, rtol=rtol, atol=atol):
                gap = float((actual.double() - expected.double()).abs().nan_to_num(math.inf).max())
                raise AssertionError(
                    f"rank {rank}: {name}.{what} differs from the single-process reference by "
                    f"{gap:.1e} (tolerance rtol={rtol:g}, atol={atol:g}); "
                    f"{hint or _hint(actual, expected, world_size)}")
