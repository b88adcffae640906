"""Mixture of experts and expert parallelism: the bench of chapter 7
(`course/07_mixture_of_experts.ipynb`), lab 7 and the interview drill.

    from labkit import moe
    weights, experts = moe.route(logits, top_k=2)        # softmax, top-k, renormalised (k > 1)
    moe.route(logits, 8, bias, score="sigmoid", groups=8, top_groups=4)   # DeepSeek-V3's gate
    moe.capacity(tokens=4096, top_k=8, experts=256, factor=1.25)   # -> 160 slots per expert
    moe.ep_bytes_per_rank(tokens=4096, top_k=8, hidden=7168, ep=64)  # dispatch + combine, BF16
    moe.imbalance([950, 1020, 890, 3200])                      # cv, max_over_mean, gini

What is here: routing, the capacity formula, the bytes an expert-parallel layer moves, the
DeepSeek-V3 figures those formulas are applied to, and load-imbalance metrics; `moe.ep` holds the
rank side (the differentiable all-to-all, the count exchange, the layer's single-process
reference), `moe.fp8` the float8 facts, `moe.toy` a tiny MoE to train routers on,
`moe.nodes` the node-limited byte counts, `moe.selfcheck` the chapter's questions. What is not
here: dispatch and combine with capacity, the expert-parallel layer, the balance step over ranks
and the FP8 dispatch (lab 7, tasks 1-4).

Notation (chapter 7): a rank holds N tokens (b * s in the source material's words) of hidden
size H; there are E experts, each token goes to K of them (top-k); P ranks form the
expert-parallel group (`ep`); C is an expert's capacity. Shapes: x [N, H], router logits [N, E],
weights and experts [N, K].
"""
from __future__ import annotations

import math

import torch

# DeepSeek-V3 (external figures, DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437,
# sections 2.1.2 and 4.2). Used to put the chapter's formulas to work at production size.
DEEPSEEK_V3 = {
    "hidden": 7168,              # H
    "routed_experts": 256,       # E
    "shared_experts": 1,         # every token goes through it: no routing, no all-to-all
    "top_k": 8,                  # K routed experts per token
    "expert_hidden": 2048,       # intermediate size of each expert's FFN
    "layers": 61,
    "moe_layers": 58,            # every FFN except those of the first three layers
    "max_nodes_per_token": 4,    # node-limited routing
    "bias_update_speed": 0.001,  # gamma, for the first 14.3T tokens (0 for the last 500B)
    "balance_loss_alpha": 0.0001,  # the small sequence-wise auxiliary loss kept alongside
    "source": "DeepSeek-V3 Technical Report (arXiv:2412.19437), sections 2.1.2 and 4.2",
}


def route(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None,
          renormalise: bool | None = None, score: str = "softmax", groups: int | None = None,
          top_groups: int | None = None):
    """Top-k routing: scores over the E experts, the k largest, their weights.

    logits: [N, E]. Returns (weights [N, K], experts [N, K] int64), each row's choices in
    decreasing order of selection score. With `bias` ([E], DeepSeek-V3's auxiliary-loss-free
    balancing) the experts are selected by scores + bias, but the weights still come from the
    scores alone: the bias steers who is chosen, never how much an expert's output counts.
    Half-precision logits are routed in float32 (a softmax in BF16 ties and misorders experts).

    `score`: "softmax" (probabilities over the E experts: Switch, GShard, Mixtral) or "sigmoid"
    (an independent affinity per expert: DeepSeek-V3, section 2.1.2 of its report).

    `renormalise`: divide the k chosen scores by their sum (GShard's top-2 and Mixtral do;
    DeepSeek-V3 does it over its sigmoid scores) or keep them as they are (Switch Transformer's
    top-1: the gate is the chosen expert's probability p, so the router learns through y = p E(x);
    renormalised, a single choice is exactly 1 and the router gets no gradient from the task).
    The default, None, is what those models do: renormalise when top_k > 1, not at top_k = 1.
    (DeepSeek-V3 also multiplies its weights by a constant, 2.5: not done here.)

    `groups`, `top_groups`: group-limited routing, DeepSeek-V3's node-limited routing with a
    group per node. The E experts form `groups` contiguous groups; a group's score is the sum of
    its top_k // top_groups (at least 1) largest selection scores; a token selects its top_k
    experts among the `top_groups` best groups only, so it reaches at most top_groups nodes
    (DeepSeek-V3: 8 groups, 4 of them, top-8). Taught in chapter 7, sections 1 and 5.
    """
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [N, E], got shape {tuple(logits.shape)}")
    n_experts = logits.size(-1)
    if not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be an int between 1 and the number of experts "
                         f"({n_experts}), got {top_k!r}")
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    scores = logits.softmax(dim=-1) if score == "softmax" else logits.sigmoid()   # [N, E]
    if bias is None:
        selection = scores
    else:
        if bias.shape != (n_experts,):
            raise ValueError(f"bias must be [E] = [{n_experts}], got {tuple(bias.shape)}")
        selection = scores + bias.to(scores.dtype)
    if groups is not None or top_groups is not None:
        selection = _limit_to_groups(selection, top_k, groups, top_groups)
    _, experts = selection.topk(top_k, dim=-1)                       # [N, K]
    weights = scores.gather(1, experts)                              # [N, K]
    if renormalise is None:
        renormalise = top_k > 1
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _limit_to_groups(selection, top_k, groups, top_groups):
    """selection [N, E] with every expert outside a token's `top_groups` best groups at -inf."""
    n_tokens, n_experts = selection.shape
    if not (isinstance(groups, int) and isinstance(top_groups, int)):
        raise ValueError(f"group-limited routing needs both groups and top_groups as ints, got "
                         f"groups={groups!r}, top_groups={top_groups!r}")
    if groups < 1 or n_experts % groups:
        raise ValueError(f"groups ({groups}) must divide the number of experts ({n_experts})")
    per_group = n_experts // groups
    if not 1 <= top_groups <= groups or top_groups * per_group < top_k:
        raise ValueError(f"top_groups ({top_groups}) must be between 1 and groups ({groups}), "
                         f"and top_groups * experts per group ({top_groups} * {per_group}) "
                         f">= top_k ({top_k})")
    by_group = selection.view(n_tokens, groups, per_group)                     # [N, G, E/G]
    best = min(per_group, max(1, top_k // top_groups))
    group_score = by_group.topk(best, dim=-1).values.sum(dim=-1)               # [N, G]
    keep = torch.zeros(n_tokens, groups, dtype=torch.bool, device=selection.device)
    keep.scatter_(1, group_score.topk(top_groups, dim=-1).indices, True)       # [N, G]
    return by_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n_tokens, n_experts)


def capacity(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """C = ceil(tokens * K / E * factor): the most assignments one expert accepts.

    tokens * K assignments spread evenly would give each expert tokens * K / E; the capacity
    factor is the headroom above that (Switch Transformer: "expert capacity"; Megatron-Core:
    --moe-expert-capacity-factor). The product is rounded to 1e-9 before the ceiling, so that
    1000 tokens, K = 2, E = 8, factor 1.1 give 275 and not 276 (1.1 is not exact in binary).
    Chapter 7, section 2.
    """
    for name, value in (("tokens", tokens), ("top_k", top_k), ("experts", experts)):
        least = 0 if name == "tokens" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if not factor > 0:
        raise ValueError(f"the capacity factor must be > 0, got {factor!r}")
    return math.ceil(round(tokens * top_k * factor / experts, 9))


def dropped_assignments(load, cap: int) -> int:
    """Assignments an expert-wise capacity `cap` turns away: sum over experts of max(0, n_e - C)."""
    return int(sum(max(0, int(n) - cap) for n in load))


def ep_bytes_per_rank(tokens: int, top_k: int, hidden: int, ep: int, dispatch_bytes: float = 2,
                      combine_bytes: float = 2, grad_bytes: float = 2,
                      backward: bool = False) -> float:
    """Bytes one rank sends over the network for one MoE layer, routing spread evenly.

    Each of the rank's tokens * K assignments goes to a uniformly random expert; (P - 1) / P of
    them live on another rank. Dispatch sends those rows there, combine sends the expert outputs
    back: every routed token crosses the network twice in forward,

        forward  = (P - 1) / P * K * N * H * (dispatch_bytes + combine_bytes)   (4 K N H in BF16)

    and backward moves the gradients of both along the reverse paths,

        backward = (P - 1) / P * K * N * H * 2 * grad_bytes                     (+4 K N H in BF16)

    `dispatch_bytes` is bytes per element on the dispatch wire (2 for BF16; for FP8 with per-block
    scales use `moe.fp8.row_bytes(H) / H`). Chapter 7, section 5; the source material's
    derivation rounds (P - 1) / P to 1.
    """
    if ep < 1 or tokens < 0 or top_k < 1 or hidden < 1:
        raise ValueError(f"need ep >= 1, tokens >= 0, top_k >= 1, hidden >= 1; got ep={ep}, "
                         f"tokens={tokens}, top_k={top_k}, hidden={hidden}")
    remote = (ep - 1) / ep * top_k * tokens * hidden
    forward = remote * (dispatch_bytes + combine_bytes)
    return forward + (remote * 2 * grad_bytes if backward else 0.0)


def exchange_bytes(counts, hidden: int, itemsize: int) -> dict:
    """Bytes each rank sends to the others, from the real counts.

    counts[r][q]: rows rank r dispatches to rank q (its diagonal stays home). Dispatch: rank r
    sends sum_{q != r} counts[r][q] rows; combine returns what it received: sum_{q != r}
    counts[q][r] rows. Returns {"dispatch": [bytes per rank], "combine": [bytes per rank]}.
    """
    P = len(counts)
    if any(len(row) != P for row in counts):
        raise ValueError(f"counts must be a P x P matrix, got rows of lengths "
                         f"{[len(row) for row in counts]}")
    row = hidden * itemsize
    dispatch = [sum(int(counts[r][q]) for q in range(P) if q != r) * row for r in range(P)]
    combine = [sum(int(counts[q][r]) for q in range(P) if q != r) * row for r in range(P)]
    return {"dispatch": dispatch, "combine": combine}


def imbalance(load) -> dict:
    """How unevenly a load (tokens per expert, or time per rank) is spread.

    cv: coefficient of variation, population std / mean (0 when even; sqrt(E - 1) when one expert
    takes everything). max_over_mean: the busiest over the average (1 when even; E at worst): the
    slowdown of a step that waits for the busiest expert. gini: sum_ij |x_i - x_j| / (2 E^2 mean)
    (0 when even; (E - 1) / E at worst). Chapter 7, section 3.
    """
    values = torch.as_tensor(load, dtype=torch.float64).reshape(-1)
    if values.numel() == 0:
        raise ValueError("imbalance of an empty load: give one number per expert")
    if (values < 0).any():
        raise ValueError(f"a load cannot be negative, got {values.tolist()}")
    mean = values.mean()
    if mean == 0:
        raise ValueError("every expert has load 0: imbalance is undefined (route some tokens)")
    n = values.numel()
    cv = values.std(unbiased=False) / mean
    gini = (values[:, None] - values[None, :]).abs().sum() / (2 * n * n * mean)
    return {"cv": float(cv), "max_over_mean": float(values.max() / mean), "gini": float(gini)}


def skewed_logits(tokens: int, experts: int, skew: float, seed: int = 0,
                  dtype=torch.float32) -> torch.Tensor:
    """Router logits [N, E] with a popularity skew: expert e gets an extra -skew * log(1 + e).

    skew = 0 is an unbiased random router; larger skews pile tokens onto the low-numbered
    experts (a Zipf-like popularity, like a router that has started to collapse).
    """
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(tokens, experts, generator=generator, dtype=torch.float64)
    popularity = -skew * torch.log1p(torch.arange(experts, dtype=torch.float64))
    return (noise + popularity).to(dtype)
