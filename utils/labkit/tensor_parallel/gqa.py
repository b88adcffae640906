"""Grouped-query attention under tensor parallelism: lab 4, task 2's bench and byte formula.

    params = gqa.random_params(generator, hidden=40, heads=12, kv_heads=4, head_dim=3)
    y = gqa.attention_reference(params, x, heads=12, kv_heads=4)     # one process, [B, T, H]
    gqa.pair_bytes(B, T, H, head_dim, holders, tp, itemsize)         # [tp][tp] bytes, per pair

Chapter 4 (section 3) splits GQA's heads only while t divides the kv heads or the kv heads divide
t, in forward. Lab 4, task 2 takes the next step: any t that divides the query heads, with each
rank holding exactly the kv heads its query heads read (so a kv head may live on several ranks),
forward and backward. What is not here: which heads a rank holds (task 2's `gqa_placement`) and
the parallel attention (task 2's `tp_gqa_attention`).

Shapes (the course's letters): x [B, T, H]; q.weight [heads d, H], k.weight and v.weight
[kv_heads d, H] (head j owns rows [j d, (j+1) d)); o.weight [H, heads d]. Query head i reads
kv head i // (heads / kv_heads), as in Llama's `repeat_kv` (Hugging Face transformers) and in
Megatron-Core's query groups.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from labkit import tensor_parallel as tpk

NAMES = ("q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias", "o.weight", "o.bias")
KV_NAMES = ("k.weight", "k.bias", "v.weight", "v.bias")


def random_params(generator: torch.Generator, hidden: int, heads: int, kv_heads: int,
                  head_dim: int, dtype=torch.float64) -> dict:
    """Fresh attention weights under task 2's names (what a checker draws for each case)."""
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    shapes = {"q.weight": (q_width, hidden), "q.bias": (q_width,),
              "k.weight": (kv_width, hidden), "k.bias": (kv_width,),
              "v.weight": (kv_width, hidden), "v.bias": (kv_width,),
              "o.weight": (hidden, q_width), "o.bias": (hidden,)}
    params = {}
    for name, shape in shapes.items():
        values = torch.randn(shape, generator=generator, dtype=torch.float64)
        params[name] = (values / math.sqrt(shape[-1] if len(shape) == 2 else hidden)).to(dtype)
    return params


def attention_reference(params: dict, x, heads: int, kv_heads: int):
    """One process: y = o(attention(q, k, v)) + o.bias, causal; x: [B, T, H] -> [B, T, H]."""
    head_dim = params["q.weight"].shape[0] // heads
    q = tpk.split_heads(F.linear(x, params["q.weight"], params["q.bias"]), head_dim)  # [B, heads, T, d]
    k, v = (tpk.split_heads(F.linear(x, params[f"{n}.weight"], params[f"{n}.bias"]), head_dim)
            for n in "kv")                                                    # [B, kv_heads, T, d]
    group = heads // kv_heads                                # query heads per kv head
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # [B, heads, T, d]
    context = tpk.merge_heads(tpk.attention_core(q, k, v))                    # [B, T, heads d]
    return F.linear(context, params["o.weight"], params["o.bias"])           # [B, T, H]


def ring_pairs(members, n_bytes: float, tp: int) -> list:
    """[tp][tp]: what gloo's ring all-reduce of n bytes over the ranks `members` sends per pair.

    Each of the s members sends 2(s-1)/s n (chapter 1), all of it to the member before it in
    the group's (sorted) order: measured with world.traffic() on torch 2.13's gloo, rank r's
    payload goes to rank r - 1 (mod s); the receiver only answers with gloo's notices."""
    members = sorted(members)
    s = len(members)
    matrix = [[0.0] * tp for _ in range(tp)]
    if s < 2:
        return matrix
    for i, rank in enumerate(members):
        matrix[rank][members[i - 1]] += 2 * (s - 1) / s * n_bytes
    return matrix


def kv_head_bytes(hidden: int, head_dim: int, itemsize: int) -> int:
    """One kv head's weights: k and v rows [d, H] and biases [d]: 2 d (H + 1) values."""
    return 2 * head_dim * (hidden + 1) * itemsize


def pair_bytes(B, T, H, head_dim, holders, tp, itemsize=8, phase="step"):
    """[tp][tp] payload bytes per pair for one forward + backward of the attention (or
    phase="forward" / "backward"), Megatron's layout with replicated kv heads:

      forward:  g, one all-reduce of the output [B, T, H] over the t ranks: n = B T H b;
      backward: f, one all-reduce of x.grad [B, T, H] over the t ranks, and, for every kv head j
                held by s_j > 1 ranks, one all-reduce of its gradient (2 d (H + 1) values) over
                exactly those ranks.

    holders[j]: the ranks that hold kv head j. Each all-reduce is gloo's ring (`ring_pairs`)."""
    n = B * T * H * itemsize
    total = [[0.0] * tp for _ in range(tp)]

    def add(matrix):
        for r in range(tp):
            for q in range(tp):
                total[r][q] += matrix[r][q]

    if phase in ("forward", "step"):
        add(ring_pairs(range(tp), n, tp))
    if phase in ("backward", "step"):
        add(ring_pairs(range(tp), n, tp))
        for ranks in holders:
            add(ring_pairs(ranks, kv_head_bytes(H, head_dim, itemsize), tp))
    if phase not in ("forward", "backward", "step"):
        raise ValueError(f"phase must be 'forward', 'backward' or 'step', got {phase!r}")
    return total
