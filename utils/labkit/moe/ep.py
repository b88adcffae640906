"""Expert parallelism, the rank side: the differentiable all-to-all, the count exchange, and the
single-process reference an expert-parallel layer must equal (chapter 7, sections 4-6; lab 7).

    from labkit.moe import ep
    recv_counts = ep.exchange_counts(send_counts)                      # on every rank
    received = ep.all_to_all(packed, send_counts, recv_counts)         # [sum(recv_counts), H]
    router, experts = ep.layer_weights(seed=0, hidden=16, experts=8)   # same in every process
    y = ep.reference_layer(x, router, experts, top_k=2)                # one process, all experts

Experts are laid out in contiguous blocks: with E experts on P ranks, rank r holds experts
r * E/P ... (r + 1) * E/P - 1, so `expert // (E // P)` is the rank that owns an expert.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labkit.moe import route


def exchange_counts(send_counts, group=None, device=None) -> list:
    """Tell every rank how many rows it will receive: one all_to_all_single of P int64 counts.

    send_counts[q]: rows this rank will send to rank q. Returns recv_counts, where recv_counts[q]
    is what rank q will send here. Uneven splits need this first: a receiver must size its
    buffer before the data arrives (DeepEP's normal kernels make the CPU wait for exactly this
    count, per its documentation).
    """
    P = dist.get_world_size(group)
    if len(send_counts) != P:
        raise ValueError(f"one count per rank: group has {P} ranks, got {len(send_counts)} "
                         f"counts {list(send_counts)}")
    if device is None:
        from labkit import device as rank_device
        device = rank_device()
    send = torch.tensor([int(c) for c in send_counts], dtype=torch.int64, device=device)   # [P]
    recv = torch.empty_like(send)                                                          # [P]
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits, differentiable.

    Forward: rank r sends rows [sum(send[:q]), sum(send[:q+1])) of x to rank q and receives
    recv[q] rows from it. Backward: the gradient of every received row belongs to the rank that
    sent it, so it travels back along the same edge: the same all-to-all with the splits
    swapped (send <-> recv).
    """

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group):
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        x = x.contiguous()
        out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))          # [sum(recv), ...]
        dist.all_to_all_single(out, x, output_split_sizes=list(recv_counts),
                               input_split_sizes=list(send_counts), group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()
        grad_in = grad_out.new_empty((sum(ctx.send_counts),) + tuple(grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out, output_split_sizes=list(ctx.send_counts),
                               input_split_sizes=list(ctx.recv_counts), group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x, send_counts, recv_counts, group=None):
    """Differentiable all-to-all of the rows of x (see `AllToAll`); x: [sum(send_counts), ...]."""
    if x.size(0) != sum(send_counts):
        raise ValueError(f"x has {x.size(0)} rows but send_counts {list(send_counts)} add up to "
                         f"{sum(send_counts)}")
    return AllToAll.apply(x, [int(c) for c in send_counts], [int(c) for c in recv_counts], group)


def owner(expert, experts: int, world_size: int):
    """The rank that holds `expert` (an int or a tensor of ids) when E experts sit on P ranks."""
    if experts % world_size:
        raise ValueError(f"experts ({experts}) must be a multiple of the ranks ({world_size})")
    return expert // (experts // world_size)


def layer_weights(seed: int, hidden: int, experts: int, dtype=torch.float64):
    """(router [H, E], experts [E, H, H]): the same weights in every process that asks for `seed`.

    Each expert is one linear map x -> x @ W_e; enough to tell apart every routing mistake, and
    its output scales with its input, so a hot expert's time grows with its tokens.
    """
    generator = torch.Generator().manual_seed(seed)
    router = torch.randn(hidden, experts, generator=generator, dtype=torch.float64)
    expert_weights = torch.randn(experts, hidden, hidden, generator=generator,
                                 dtype=torch.float64) / math.sqrt(hidden)
    return router.to(dtype), expert_weights.to(dtype)


def reference_layer(x, router, expert_weights, top_k: int, bias=None):
    """One process, every expert at hand: y_t = sum_j w_tj * (x_t @ W_{e_tj}).

    x [N, H], router [H, E], expert_weights [E, H, H] -> y [N, H]. Written as a loop over experts
    with a mask, the dense reference the lab's layer must equal (outputs and gradients).
    """
    weights, chosen = route(x @ router, top_k, bias)                 # [N, K], [N, K]
    y = torch.zeros_like(x)                                          # [N, H]
    for e in range(expert_weights.size(0)):
        gate = (weights * (chosen == e)).sum(dim=-1, keepdim=True)   # [N, 1], 0 if not chosen
        y = y + gate * (x @ expert_weights[e])
    return y


def balanced_logits(tokens: int, experts: int, top_k: int, offset: int = 0,
                    dtype=torch.float64) -> torch.Tensor:
    """Router logits [N, E] whose top-k sends token t to experts (t + offset + j) mod E, j < K.

    With N a multiple of E every expert gets exactly N * K / E assignments: the even routing
    that the byte formula assumes, made exact.
    """
    if top_k > experts:
        raise ValueError(f"top_k ({top_k}) > experts ({experts})")
    logits = torch.full((tokens, experts), -4.0, dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            logits[t, (t + offset + j) % experts] = 4.0 - j     # distinct: a strict order
    return logits.to(dtype)


def hot_logits(tokens: int, experts: int, hot_expert: int, share: float, seed: int = 0,
               dtype=torch.float64) -> torch.Tensor:
    """Router logits [N, E] (top-1) that send about `share` of the tokens to `hot_expert` and
    spread the rest evenly: the "one popular expert" of the source material's incident."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=generator, dtype=torch.float64)
    hot = torch.rand(tokens, generator=generator, dtype=torch.float64) < share
    logits[hot, hot_expert] += 100.0
    logits[~hot, hot_expert] -= 100.0
    return logits.to(dtype)
