"""The loss-spike bench of chapter 9 (section 5) and lab 9 (task 2): a tiny language model that a
batch of extreme tokens throws off, and data-parallel training loops with and without defences.

    records = world.run(spikes.train, {"steps": 60, "plan": {"bad": [30]}, "defence": "clip"})

The model reads characters (chapter 8's vocabulary). Its context layer keeps a running sum of
the token vectors seen so far, scaled by 1 / sqrt(t) at position t: the right scale when the
tokens are unrelated (a sum of t random vectors grows like sqrt(t)), and sqrt(t) times too big
when they are all the same token. A window of one repeated character (the source material's
"long runs of one meaningless symbol") therefore drives the activations up several-fold and the
gradient norm up tens of times, while ordinary text does not.

Batches are named by an id; `plan` says which ids are bad (extreme tokens), which are hard (real
text read backwards) and which are noisy (random letters, like a hash or base64 in web text):
the last two have a legitimately higher loss and gradient norm, the noise a spike detector must
accept.
Every rank computes the same global batch of GLOBAL_BATCH windows and keeps rows rank::P.

Per step, every loop records global (all-reduced) statistics: the loss, the gradient norm of the
averaged gradient (before clipping), and the activation norm (root mean square of the context
layer over the global batch). Notation: T positions, V vocabulary, H hidden, B global batch.
"""
from __future__ import annotations

import copy
import math
import random

import torch
import torch.distributed as dist
from torch import nn

from labkit.faults import detect

VOCAB = "abcdefghijklmnopqrstuvwxyz .,"      # chapter 8's tokenizer
SEQ_LEN, GLOBAL_BATCH, HIDDEN, LR, BETAS = 64, 12, 32, 1e-2, (0.9, 0.95)
BAD_TOKEN = ","                               # never seen in the training text
_TEXT: list[int] | None = None


def text_tokens() -> list[int]:
    """Chapter 8's corpus as one long stream of token ids."""
    global _TEXT
    if _TEXT is None:
        from labkit.checkpoint import bench
        tokenizer = bench.Tokenizer(VOCAB)
        _TEXT = tokenizer.encode(" ".join(bench.corpus(0, 300)))
    return _TEXT


class SpikeLM(nn.Module):
    """tokens [B, T] -> logits [B, T, V]; `last_act_squares` keeps the sum of squares and the
    count of the context layer's values of the last forward (for the activation norm)."""

    def __init__(self, vocab: int = len(VOCAB), hidden: int = HIDDEN):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.into_context = nn.Linear(hidden, hidden, bias=False)
        self.mix = nn.Linear(2 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.last_act_squares = (0.0, 0)

    def forward(self, tokens):
        x = self.embed(tokens)                                           # [B, T, H]
        positions = torch.arange(1, tokens.shape[1] + 1, dtype=x.dtype, device=x.device)
        context = torch.cumsum(self.into_context(x), dim=1) / positions.sqrt()[None, :, None]
        self.last_act_squares = (float(context.detach().float().square().sum()),
                                 context.numel())                        # context: [B, T, H]
        hidden = nn.functional.gelu(self.mix(torch.cat([x, context], dim=-1)))   # [B, T, H]
        return self.head(hidden)                                         # [B, T, V]


def make_model(seed: int = 0) -> SpikeLM:
    torch.manual_seed(seed)
    return SpikeLM()


def make_optimizer(model, config: dict | None = None):
    """AdamW with the betas of large language model training (0.9, 0.95: GPT-3, Llama), no
    weight decay. With beta2 = 0.95 the second moment forgets in ~20 steps, so one huge gradient
    inflates it for tens of steps and every later update shrinks: training stalls after a spike."""
    config = config or {}
    return torch.optim.AdamW(model.parameters(), lr=config.get("lr", LR),
                             betas=config.get("betas", BETAS), weight_decay=0.0)


def kind_of(batch_id: int, plan: dict) -> str:
    for kind in ("bad", "hard", "noisy"):
        if batch_id in plan.get(kind, ()):
            return kind
    return "clean"


def batch(seed: int, batch_id: int, plan: dict, rank: int = 0, size: int = 1):
    """This rank's rows of global batch `batch_id`: x, y [B/P, T] (int64)."""
    if GLOBAL_BATCH % size:
        raise ValueError(f"global batch ({GLOBAL_BATCH}) is not divisible by the world size "
                         f"({size})")
    kind, text = kind_of(batch_id, plan), text_tokens()
    rng = random.Random(seed * 1_000_003 + batch_id)
    rows = []
    for _ in range(GLOBAL_BATCH):
        if kind == "bad":
            rows.append([VOCAB.index(BAD_TOKEN)] * (SEQ_LEN + 1))
            continue
        if kind == "noisy":                 # random letters: a hash, base64, a table of codes
            rows.append([rng.randrange(26) for _ in range(SEQ_LEN + 1)])
            continue
        start = rng.randrange(len(text) - SEQ_LEN - 1)
        window = text[start:start + SEQ_LEN + 1]
        rows.append(window[::-1] if kind == "hard" else window)
    mine = torch.tensor(rows[rank::size], dtype=torch.int64)            # [B/P, T + 1]
    return mine[:, :-1], mine[:, 1:]


def _world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def forward_backward(model, x, y, precision: str = "fp32", scaler=None):
    """Loss of this rank's rows, backward (gradients of the *sum* of token losses, times the
    loss scale of `scaler` if given; the sync below turns them into the global mean), and this
    rank's statistics
    [loss sum, tokens, activation squares, activation count] (float64)."""
    dtypes = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
    if precision not in dtypes:
        raise ValueError(f"precision must be one of {sorted(dtypes)}, got {precision!r}")
    with torch.autocast("cpu", dtype=dtypes[precision] or torch.float32,
                        enabled=dtypes[precision] is not None):
        logits = model(x)                                                # [B/P, T, V]
    loss_sum = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                           y.reshape(-1), reduction="sum")
    (scaler.scale(loss_sum) if scaler is not None else loss_sum).backward()
    squares, count = model.last_act_squares
    return torch.tensor([loss_sum.item(), y.numel(), squares, count], dtype=torch.float64)


def sync(model, local_stats):
    """Sum gradients and statistics over the ranks (one flat all-reduce each); divide the
    gradients by the global token count. Returns the global stats dict."""
    params = [p for p in model.parameters() if p.grad is not None]
    totals = local_stats.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        flat = torch.cat([p.grad.reshape(-1) for p in params])           # [Psi]
        dist.all_reduce(flat)
        dist.all_reduce(totals)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
    tokens = totals[1].item()
    for p in params:
        p.grad.div_(tokens)
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in params)).item()
    return {"loss": totals[0].item() / tokens, "grad_norm": norm,
            "act_norm": math.sqrt(totals[2].item() / totals[3].item())}


def train(config: dict) -> list[dict]:
    """Rank program: `steps` data-parallel AdamW steps on batches 0, 1, 2, ... with a defence.

    config: steps, seed (0), plan ({"bad": [...], "hard": [...]}), lr (LR), precision ("fp32",
    "fp16" with torch's GradScaler, "bf16"), defence: "none"; "clip" (clip_grad_norm to
    `max_norm`, 1.0); "skip" (skip the update when the gradient norm is non-finite or a
    `detect.window_spike` against the accepted steps); "skip_act" (the same on the activation
    norm), with `factor`, `window`. init_scale and growth_interval for the scaler.
    Returns one record per step: loss, grad_norm, act_norm, applied, scale, kind.
    """
    rank, size = _world()
    plan, seed = config.get("plan", {}), config.get("seed", 0)
    precision, defence = config.get("precision", "fp32"), config.get("defence", "none")
    model = make_model(seed)
    optimizer = make_optimizer(model, config)
    scaler = torch.amp.GradScaler("cpu", init_scale=config.get("init_scale", 2.0 ** 16),
                                  growth_interval=config.get("growth_interval", 20),
                                  enabled=precision == "fp16")
    accepted = {"grad_norm": [], "act_norm": []}
    records = []
    for step in range(config["steps"]):
        x, y = batch(seed, step, plan, rank, size)
        optimizer.zero_grad(set_to_none=True)
        local = forward_backward(model, x, y, precision,
                                 scaler if scaler.is_enabled() else None)
        stats = sync(model, local)
        if scaler.is_enabled():
            stats["grad_norm"] /= scaler.get_scale()
            scaler.unscale_(optimizer)
        watched = {"skip": "grad_norm", "skip_act": "act_norm"}.get(defence)
        spike = watched is not None and detect.window_spike(
            accepted[watched], stats[watched], config.get("factor", detect.SPIKE_FACTOR),
            config.get("window", detect.SPIKE_WINDOW))
        if defence == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.get("max_norm", 1.0))
        scale = scaler.get_scale() if scaler.is_enabled() else None
        if spike:
            applied = False
            if scaler.is_enabled():
                scaler.update()
        elif scaler.is_enabled():
            scaler.step(optimizer)
            scaler.update()
            applied = scaler.get_scale() >= scale       # a backed-off scale: the step was skipped
        else:
            optimizer.step()
            applied = True
        if applied:
            for key in accepted:
                accepted[key].append(stats[key])
        records.append(dict(stats, applied=applied, scale=scale, kind=kind_of(step, plan)))
    return records


def guarded_train(config: dict, guard_class, guard_kwargs: dict | None = None) -> dict:
    """Rank program of lab 9, task 2: training with a guard that watches each step *after* its
    update and may roll back.

    Each iteration draws the next batch id of the stream 0, 1, 2, ... that is not in
    `guard.quarantined`, runs forward, backward, sync and the AdamW update, then calls
    `guard.after_step(step, batch_id, stats)`. None: step + 1 comes next. An int k <= step: the
    guard has put the model and optimizer back to their state before step k; training goes on
    from step k, with the stream where step k drew its batch (quarantined ids skipped). Stops
    after `steps` steps (or 4 x steps iterations, a guard that loops). guard_class=None trains
    without a guard (the reference: give it a plan whose bad ids are listed in "removed").
    Returns {"weights": flat final weights, "losses": the loss of every iteration, "rollbacks":
    [(from step, to step)], "quarantined": sorted ids, "iterations": n}.
    """
    rank, size = _world()
    plan, seed = config.get("plan", {}), config.get("seed", 0)
    model = make_model(seed)
    optimizer = make_optimizer(model, config)
    guard = guard_class(model, optimizer, **(guard_kwargs or {})) if guard_class else None
    removed = set(config.get("removed", ()))
    step, cursor, started_at = 0, 0, {0: 0}
    losses, rollbacks, iterations = [], [], 0
    while step < config["steps"] and iterations < 4 * config["steps"]:
        iterations += 1
        skip = removed | set(getattr(guard, "quarantined", ()) or ())
        while cursor in skip:
            cursor += 1
        batch_id = cursor
        cursor += 1
        x, y = batch(seed, batch_id, plan, rank, size)
        optimizer.zero_grad(set_to_none=True)
        stats = sync(model, forward_backward(model, x, y))
        optimizer.step()
        losses.append(stats["loss"])
        back = guard.after_step(step, batch_id, dict(stats)) if guard is not None else None
        if back is None:
            step += 1
            started_at[step] = cursor
            continue
        check_resume_step(back, step)
        rollbacks.append((step, back))
        step, cursor = back, started_at[back]
    return guarded_result(model, losses, rollbacks, guard, iterations)


def check_resume_step(back, step, who: str = "") -> None:
    """A guard's `after_step` answer that is not None must be a step to resume from, 0..step."""
    if isinstance(back, bool) or not isinstance(back, int) or not 0 <= back <= step:
        raise ValueError(f"{who}after_step returned {back!r} at step {step}: expected None or "
                         f"the step to resume from, an int between 0 and {step}")


def guarded_result(model, losses, rollbacks, guard, iterations) -> dict:
    """What a guarded training run hands back: the weights flat, the losses, the rollbacks, the
    guard's quarantined batch ids, the iterations run."""
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"weights": weights, "losses": losses, "rollbacks": rollbacks,
            "quarantined": sorted(int(i) for i in (getattr(guard, "quarantined", ()) or ())),
            "iterations": iterations}


def snapshot(model, optimizer) -> dict:
    """An in-memory copy of the model's and the optimizer's state (deep: later steps do not
    change it)."""
    return {"model": copy.deepcopy(model.state_dict()),
            "optimizer": copy.deepcopy(optimizer.state_dict())}


def restore(model, optimizer, state: dict) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
