"""Where gradients live when parameters are sharded: the test bench of the global gradient norm.

    case = placement.example_case(world_size=2)
    placement.describe(case, 2)                          # who holds what, as text
    norms = world.call(placement.run_grad_norm, args=(your_norm_fn, case), timeout=30)
    placement.full_norm(case)                            # the norm of the full gradient

A case is plain data: the full gradients `full` (one tensor per parameter) and, per parameter, a
placement:
  {"kind": "shard"}                    split along dim 0 over all ranks (a rank may get no rows)
  {"kind": "replicate", "ranks": [..]} a full, identical copy on each of these ranks
  {"kind": "only", "rank": k}          held by rank k alone
On rank r, `local_grads(case, r, R)` gives the tensors r holds and, for each, `replicas`: how many
ranks hold an identical copy of it (1 for a shard). Chapter 2, section 5 teaches the norm
||g||_2 = sqrt(sum over distinct pieces p of ||g_p||^2); computing it is lab 2 task 2.
"""
from __future__ import annotations

import math

import torch

KINDS = ("shard", "replicate", "only")


def random_case(seed: int, world_size: int, n_params: int = 4, dtype=torch.float32) -> dict:
    """A random placement of n_params random gradients over world_size ranks."""
    g = torch.Generator().manual_seed(seed)
    full, where = [], []
    for _ in range(n_params):
        rows = int(torch.randint(1, 2 * world_size + 2, (), generator=g))
        full.append((torch.randn(rows, 3, generator=g, dtype=torch.float64) * 3).to(dtype))
        kind = KINDS[int(torch.randint(0, 3, (), generator=g))]
        if kind == "replicate":
            size = int(torch.randint(1, world_size + 1, (), generator=g))
            ranks = sorted(torch.randperm(world_size, generator=g)[:size].tolist())
            where.append({"kind": kind, "ranks": ranks})
        elif kind == "only":
            where.append({"kind": kind, "rank": int(torch.randint(0, world_size, (), generator=g))})
        else:
            where.append({"kind": kind})
    return {"full": full, "where": where}


def example_case(world_size: int, dtype=torch.float32) -> dict:
    """One of each kind: a shard, a replica on every rank, a parameter of rank 0 alone."""
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
            for shape in [(2 * world_size + 1, 4), (3, 4), (2, 2)]]
    where = [{"kind": "shard"}, {"kind": "replicate", "ranks": list(range(world_size))},
             {"kind": "only", "rank": 0}]
    return {"full": full, "where": where}


def lonely_case(world_size: int, dtype=torch.float32) -> dict:
    """The last rank holds no gradient at all (when world_size > 1); the others share the rest."""
    g = torch.Generator().manual_seed(8)
    others = list(range(max(world_size - 1, 1)))
    full = [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
            for shape in [(max(world_size - 1, 1), 4), (3, 4), (5,)]]
    where = [{"kind": "shard"}, {"kind": "replicate", "ranks": others}, {"kind": "only", "rank": 0}]
    return {"full": full, "where": where}


def small_contributions_case(world_size: int, n_small: int = 64) -> dict:
    """BF16 gradients: one of squared norm 256, then many of squared norm 0.5 (all on rank 0).

    Added one by one into a BF16 accumulator (8 significant bits), every 0.5 vanishes next to
    256; in FP32 they add up to n_small / 2.
    """
    full = [torch.full((4,), 8.0, dtype=torch.bfloat16)]                 # ||g||^2 = 256
    full += [torch.full((2,), 0.5, dtype=torch.bfloat16) for _ in range(n_small)]  # 0.5 each
    where = [{"kind": "only", "rank": 0}] * len(full)
    return {"full": full, "where": where}


def local_grads(case: dict, rank: int, world_size: int):
    """(grads, replicas, index): the tensors `rank` holds, how many ranks hold each, which parameter."""
    grads, replicas, index = [], [], []
    for i, (tensor, where) in enumerate(zip(case["full"], case["where"])):
        if where["kind"] == "shard":
            piece = torch.tensor_split(tensor, world_size, dim=0)[rank]     # [rows/R (+1), ...]
            if piece.shape[0]:
                grads.append(piece.clone()), replicas.append(1), index.append(i)
        elif where["kind"] == "replicate" and rank in where["ranks"]:
            grads.append(tensor.clone()), replicas.append(len(where["ranks"])), index.append(i)
        elif where["kind"] == "only" and rank == where["rank"]:
            grads.append(tensor.clone()), replicas.append(1), index.append(i)
    return grads, replicas, index


def describe(case: dict, world_size: int) -> str:
    lines = []
    for rank in range(world_size):
        grads, replicas, index = local_grads(case, rank, world_size)
        held = ", ".join(f"p{i}{list(g.shape)} x{k}" for g, k, i in zip(grads, replicas, index))
        lines.append(f"rank {rank}: {held or 'no gradient'}")
    return "\n".join(lines)


def full_norm(case: dict) -> float:
    """||g||_2 of the full (unsharded, one copy of each parameter) gradient, in float64."""
    return float(torch.cat([t.double().reshape(-1) for t in case["full"]]).norm())


def run_grad_norm(norm_fn, case: dict) -> float:
    """On every rank: norm_fn(grads, replicas, labkit.device()) with this rank's share; a float."""
    import torch.distributed as dist
    from labkit import device
    rank, world_size = dist.get_rank(), dist.get_world_size()
    grads, replicas, _ = local_grads(case, rank, world_size)
    grads = [g.to(device()) for g in grads]
    return float(norm_fn(grads, replicas, device()))


def run_clip(clip_fn, case: dict, max_norm: float) -> dict:
    """On every rank: clip_fn(grads, replicas, max_norm, device) -> {"norm", "grads"} (clipped)."""
    import torch.distributed as dist
    from labkit import device
    rank, world_size = dist.get_rank(), dist.get_world_size()
    grads, replicas, _ = local_grads(case, rank, world_size)
    grads = [g.to(device()) for g in grads]
    norm = clip_fn(grads, replicas, max_norm, device())
    return {"norm": float(norm), "grads": [g.cpu() for g in grads]}


def assemble(case: dict, per_rank_grads: list) -> list:
    """Full gradients back from each rank's (clipped) local tensors; checks replicas agree."""
    world_size = len(per_rank_grads)
    pieces = {i: [] for i in range(len(case["full"]))}
    for rank, grads in enumerate(per_rank_grads):
        _, _, index = local_grads(case, rank, world_size)
        if len(grads) != len(index):
            raise AssertionError(f"rank {rank}: {len(grads)} gradients came back, it holds "
                                 f"{len(index)}")
        for i, grad in zip(index, grads):
            pieces[i].append((rank, grad))
    full = []
    for i, where in enumerate(case["where"]):
        if where["kind"] == "shard":
            full.append(torch.cat([g for _, g in pieces[i]], dim=0))
            continue
        (first_rank, first), *others = pieces[i]
        for rank, other in others:
            if not torch.allclose(other.double(), first.double(), rtol=1e-6, atol=1e-7):
                raise AssertionError(f"parameter {i}: the copies on ranks {first_rank} and {rank} "
                                     "differ after clipping: every replica must be scaled alike")
        full.append(first)
    return full


def reference_clip(case: dict, max_norm: float) -> list:
    """torch's own clip_grad_norm_ on the full gradients (float64)."""
    params = [torch.nn.Parameter(torch.zeros_like(t, dtype=torch.float64)) for t in case["full"]]
    for p, t in zip(params, case["full"]):
        p.grad = t.double().clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    return [p.grad for p in params]


# ---- lab 2, task 2: each rank is sent only its own pieces -----------------------------------------

def shares(case: dict, world_size: int, params: list | None = None) -> list:
    """Per rank: {"grads", "replicas"} (and "params": the matching pieces of `params`)."""
    out = []
    for rank in range(world_size):
        grads, replicas, _ = local_grads(case, rank, world_size)
        share = {"grads": grads, "replicas": replicas}
        if params is not None:
            share["params"] = local_grads({"full": params, "where": case["where"]}, rank,
                                          world_size)[0]
        out.append(share)
    return out


def norm_program(share: dict, norm_fn, dtype=None) -> float:
    """On a rank: norm_fn(grads, replicas, labkit.device()[, dtype]) on this rank's pieces."""
    from labkit import device
    grads = [g.to(device()) for g in share["grads"]]
    if dtype is None:
        return float(norm_fn(grads, share["replicas"], device()))
    return float(norm_fn(grads, share["replicas"], device(), dtype=dtype))


def step_program(share: dict, step_fn, lr: float, max_norm: float) -> dict:
    """On a rank: step_fn(params, grads, replicas, lr, max_norm, device) on this rank's pieces;
    the norm it returns, and the params and grads read back from the tensors handed over."""
    from labkit import device
    params = [p.to(device()) for p in share["params"]]
    grads = [g.to(device()) for g in share["grads"]]
    handed = (list(params), list(grads))        # the tensors themselves: read back from these
    norm = step_fn(params, grads, share["replicas"], lr, max_norm, device())
    return {"norm": float(norm), "params": [p.cpu() for p in handed[0]],
            "grads": [g.cpu() for g in handed[1]]}


def reference_step(case: dict, params: list, lr: float, max_norm: float):
    """One process: (norm, params after, grads after) of a clipped SGD step on the full tensors,
    skipped (nothing changes) when the norm is not finite."""
    norm = full_norm(case)
    grads = [t.clone() for t in case["full"]]
    if not math.isfinite(norm):
        return norm, [p.clone() for p in params], grads
    scale = min(1.0, max_norm / (norm + 1e-6))
    grads = [(g.double() * scale).to(g.dtype) for g in grads]
    params = [(p.double() - lr * g.double()).to(p.dtype) for p, g in zip(params, grads)]
    return norm, params, grads


def expected_pieces(case: dict, full: list, rank: int, world_size: int) -> list:
    """What `rank` holds of the full tensors `full`, laid out as `case` places them."""
    return local_grads({"full": full, "where": case["where"]}, rank, world_size)[0]
