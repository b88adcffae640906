"""Chapter 10: long sequences (context parallelism, ring attention, Ulysses, the fifth mesh axis).

The bench, formulas and reference pieces that are not graded answers live here; lab 10's
checkers live in `checks.py`.

Shapes: q, k, v are [B, H, T, d] (batch, heads, tokens, head dim); a rank of a context-parallel
group of P ranks holds T / P of the tokens. Positions are global token indices, so a causal mask
can be built for any pair of blocks: query i sees key j when j <= i.
"""
import math

import torch

__all__ = ["chunk_ids", "positions", "shard", "attention"]


def chunk_ids(P: int, rank: int, balanced: bool) -> list:
    """The chunks of the sequence rank `rank` of P holds, in order.

    plain: the sequence cut in P chunks, rank r holds chunk r (under a causal mask rank P-1 has
    about P times the work of rank 0: its queries see every earlier key);
    balanced: cut in 2P chunks, rank r holds chunks r and 2P-1-r (one early, one late chunk: every
    rank has the same causal work), the split Megatron-LM and torchtitan use."""
    if not (isinstance(P, int) and P >= 1 and isinstance(rank, int) and 0 <= rank < P):
        raise ValueError(f"chunk_ids: need an int P >= 1 and 0 <= rank < P, got P={P!r}, "
                         f"rank={rank!r}")
    return [rank, 2 * P - 1 - rank] if balanced else [rank]


def positions(T: int, P: int, rank: int, balanced: bool) -> torch.Tensor:
    """The global token positions (int64, ascending within each chunk) that rank `rank` holds
    of a sequence of T tokens split over P ranks."""
    pieces = 2 * P if balanced else P
    if T % pieces:
        raise ValueError(f"positions: T={T} tokens do not split into {pieces} equal chunks "
                         f"(P={P}, balanced={balanced}); pad the sequence to a multiple of "
                         f"{pieces}")
    size = T // pieces
    return torch.cat([torch.arange(c * size, (c + 1) * size)
                      for c in chunk_ids(P, rank, balanced)])


def shard(x: torch.Tensor, P: int, rank: int, balanced: bool, dim: int = 2) -> torch.Tensor:
    """The tokens of `x` (sequence along `dim`) that rank `rank` holds: x at `positions`."""
    return x.index_select(dim, positions(x.shape[dim], P, rank, balanced))


def attention(q, k, v, causal: bool = False, q_pos=None, k_pos=None):
    """Softmax attention in one process, the reference: (out [B, H, Tq, d], lse [B, H, Tq]).

    out = softmax(q k^T / sqrt(d) + mask) v, lse = log sum_j exp(q k_j / sqrt(d)) over the keys
    each query sees (-inf for a query that sees none). With `causal`, query at position q_pos[i]
    sees key at k_pos[j] when k_pos[j] <= q_pos[i]; positions default to 0..T-1."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])     # [B, H, Tq, Tk]
    if causal:
        qp = torch.arange(q.shape[-2]) if q_pos is None else q_pos
        kp = torch.arange(k.shape[-2]) if k_pos is None else k_pos
        hidden = (kp[None, :] > qp[:, None]).to(scores.device)     # positions may live on the CPU
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                           # [B, H, Tq]
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return weights @ v, lse


from labkit.context.costs import (activation_bytes, blocks_computed, ring_bytes,  # noqa: E402
                                  ulysses_bytes)

__all__ += ["activation_bytes", "blocks_computed", "ring_bytes", "ulysses_bytes"]
