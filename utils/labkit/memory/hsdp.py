"""Hybrid sharding (HSDP) on real ranks: ZeRO-3 within a "node" of s ranks, plain data
parallelism across the r nodes (chapter 3, section 6, "Beyond the three stages").

    results = world.run(hsdp.run_hsdp, hsdp.case(nodes=2, per_node=2))     # a 2 x 2 world
    hsdp.wire_bytes(psi, nodes=2, per_node=2, b=2)    # {"intra": ..., "inter": ...} per rank

Rank g = node * s + local. The shard group of a rank is its node (ranks node*s .. node*s + s-1);
its replicate group is the ranks with the same local index on every node. Per block and step,
inside the node: an all-gather before forward, another before backward, and the reduce-scatter
of the gradient (all-to-all + sum, as labkit.memory.zero): 3 (s-1)/s Psi b bytes per rank. Across
nodes: one all-reduce of the rank's gradient slice, Psi b / s bytes, over the r replicas:
2 (r-1)/r Psi b / s per rank. FSDP2 does the same with a 2D mesh (replicate, shard) and
`fully_shard(..., mesh=mesh)` (torch/distributed/fsdp/_fully_shard/_fully_shard.py: "HSDP" when
the mesh is 2D); FSDP1 calls it ShardingStrategy.HYBRID_SHARD.
Memory per rank is ZeRO-3's with P = s: 16 Psi / s, not 16 Psi / (r s).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.memory import bench, zero

_GROUPS = {}


def groups(per_node: int, size: int | None = None):
    """(shard group, replicate group) of this rank, for the first `size` ranks of the world
    (default: all) in nodes of `per_node` consecutive ranks; (None, None) on the ranks past them.
    Collective: every rank of the world calls it; made once per world. Made without teaching
    mode's check, like zero.subgroup, so that its fingerprints add no bytes."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    size = world_size if size is None else size
    if per_node < 1 or size % per_node or not 1 <= size <= world_size:
        raise ValueError(f"{size} ranks are not nodes x per_node (per_node = {per_node}), or "
                         f"more than the world's {world_size}")
    key = (world_size, size, per_node, id(dist.group.WORLD))
    if key not in _GROUPS:
        nodes = size // per_node
        level = dist.get_debug_level()
        dist.set_debug_level(dist.DebugLevel.OFF)
        try:
            made = {}
            for node in range(nodes):                  # every rank creates every group, in order
                made["shard", node] = dist.new_group(list(range(node * per_node, (node + 1) * per_node)))
            for local in range(per_node):
                made["replicate", local] = dist.new_group(list(range(local, size, per_node)))
        finally:
            dist.set_debug_level(level)
        _GROUPS[key] = made
    if rank >= size:
        return None, None
    made = _GROUPS[key]
    return made["shard", rank // per_node], made["replicate", rank % per_node]


def wire_bytes(psi: float, nodes: int, per_node: int, b: float = 2) -> dict:
    """Bytes one rank sends per step: {"intra": to its own node, "inter": to the other nodes}.
    intra = 3 (s-1)/s Psi b (two all-gathers and a reduce-scatter); inter = 2 (r-1)/r Psi b / s
    (a ring all-reduce of its gradient slice over the r replicas)."""
    s, r = per_node, nodes
    return {"intra": 3 * (s - 1) / s * psi * b, "inter": 2 * (r - 1) / r * psi * b / s}


class HybridTrainer(zero.ZeroTrainer):
    """ZeRO-3 over the shard group, then the gradient slices all-reduced over the replicate
    group before the step, and the mean taken over all r s ranks."""

    def __init__(self, blocks, shard_group, replicate_group, **options):
        super().__init__(blocks, 3, group=shard_group, **options)
        self.replicate_group = replicate_group
        self.world_size = dist.get_world_size(shard_group) * dist.get_world_size(replicate_group)

    def _summed_gradient(self, block):
        slice_ = block.shard.grad                                  # [S], summed over the node
        dist.all_reduce(slice_, group=self.replicate_group)         # ... and over the replicas
        return slice_


def case(nodes=2, per_node=2, layers=2, hidden=16, batch=2, seq=4, steps=1, dtype="bfloat16",
         lr=1e-2, weight_decay=0.1, seed=0, history=False) -> dict:
    """Plain data for `run_hsdp` (the bench of labkit.memory.bench, on nodes x per_node ranks)."""
    return dict(bench.bench_case(3, P=nodes * per_node, layers=layers, hidden=hidden, batch=batch,
                                 seq=seq, steps=steps, dtype=dtype, lr=lr,
                                 weight_decay=weight_decay, seed=seed, history=history),
                nodes=nodes, per_node=per_node)


def run_hsdp(case):
    """On every rank: the first nodes x per_node ranks train the bench with HSDP (the others
    return None). Returns the weights after each step (history=True, float64 copies)."""
    import labkit
    P = case["nodes"] * case["per_node"]
    if dist.get_world_size() < P:
        raise ValueError(f"run_hsdp needs nodes x per_node = {case['nodes']} x "
                         f"{case['per_node']} = {P} ranks, the world has {dist.get_world_size()}")
    shard_group, replicate_group = groups(case["per_node"], P)
    rank, s = dist.get_rank(), case["per_node"]
    if rank >= P:
        return None
    dtype, device = getattr(torch, case["dtype"]), labkit.device()
    blocks = zero.make_blocks(case["layers"], case["hidden"], case["seed"], s, rank % s, 3,
                              dtype=dtype, device=device, group=shard_group)
    trainer = HybridTrainer(blocks, shard_group, replicate_group, lr=case["lr"],
                            weight_decay=case["weight_decay"],
                            master_dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    history = []
    for x in bench.batches(case, rank, P):
        trainer.forward(x.to(device=device, dtype=dtype)).to(loss_dtype).square().mean().backward()
        trainer.step()
        if case["history"]:
            history.append([w.cpu() for w in trainer.full_weights()])
    return {"history": history}
