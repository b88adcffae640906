"""Lab 10's bench: the load-balanced ring's forward (a given, not a graded task) and its ring step.

    from labkit.context import bench
    received = bench.ring_pass([k, v])               # on a rank: send to rank + 1, get from rank - 1
    out, lse = bench.ring_forward(q, k, v)           # on a rank: ring attention, balanced causal split

Shapes (chapter 10's table): q, k, v are [B, H, T/P, d]; a rank of the context-parallel group of
P ranks holds the tokens `labkit.context.positions(T, P, rank, balanced=True)`: chunks r and
2P-1-r of 2P chunks, in that order. `lse` is [B, H, T/P], the log-sum-exp of each query's scores
over every key it sees (the quantity the backward pass needs to rebuild the softmax).

The forward merges the partial results of the P blocks exactly: for block results (o_b, l_b),
l = logaddexp(l, l_b) and o = o exp(l_old - l) + o_b exp(l_b - l) (chapter 10, section 2). The
backward pass of this split is lab 10's task 1, so it is not here.
"""
from __future__ import annotations

import torch

from labkit import context

__all__ = ["ring_pass", "merge", "ring_forward"]


def ring_pass(tensors: list) -> list:
    """On a rank: send every tensor of `tensors` to rank (r + 1) mod P, receive as many tensors
    of the same shapes and dtypes from rank (r - 1) mod P, and return them (one ring step; P
    isend and P irecv, all waited for). With P = 1 it returns the tensors themselves."""
    import torch.distributed as dist
    rank, P = dist.get_rank(), dist.get_world_size()
    if P == 1:
        return list(tensors)
    received = [torch.empty_like(t) for t in tensors]
    sends = [dist.isend(t.contiguous(), (rank + 1) % P) for t in tensors]
    receives = [dist.irecv(buffer, (rank - 1) % P) for buffer in received]
    for work in sends + receives:
        work.wait()
    return received


def merge(out, lse, block_out, block_lse):
    """Two partial softmax results over disjoint key sets, merged exactly: (out, lse) of the union.
    out: [B, H, Tq, d], lse: [B, H, Tq] (-inf for a query that saw no key yet)."""
    new = torch.logaddexp(lse, block_lse)                                   # [B, H, Tq]
    keep = torch.exp(lse - new).nan_to_num(0.0).unsqueeze(-1)               # -inf - -inf: 0
    take = torch.exp(block_lse - new).nan_to_num(0.0).unsqueeze(-1)
    return out * keep + block_out * take, new


def ring_forward(q, k, v, causal: bool = True):
    """On a rank of P: ring attention over the load-balanced split, (out [B, H, T/P, d],
    lse [B, H, T/P]) of this rank's queries, equal to `context.attention` of the whole sequence
    at these positions. K and V go around the ring P - 1 times (`ring_pass`): every rank sends
    2 (P - 1) blocks of [B, H, T/P, d]."""
    import torch.distributed as dist
    rank, P = dist.get_rank(), dist.get_world_size()
    T = q.size(2) * P                                                       # the whole sequence
    q_pos = context.positions(T, P, rank, True)                   # [T/P] (balanced)
    out = torch.zeros_like(q)                                               # [B, H, T/P, d]
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)            # [B, H, T/P]
    k_block, v_block = k, v
    for step in range(P):
        if step:
            k_block, v_block = ring_pass([k_block, v_block])
        source = (rank - step) % P                                          # whose block we hold
        k_pos = context.positions(T, P, source, balanced=True)
        block_out, block_lse = context.attention(q, k_block, v_block, causal, q_pos, k_pos)
        out, lse = merge(out, lse, block_out, block_lse)
    return out, lse
