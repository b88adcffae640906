"""Where the pieces of a tensor live: placement metadata (chapter 4, section 6).

Every tensor of a tensor-parallel layer is one of three things on the tp ranks of a mesh axis:

    Shard(d)     rank r holds block r of the global tensor along dim d: [.., n, ..] -> [.., n/t, ..]
    Replicate()  every rank holds the whole tensor, the same values
    Partial()    every rank holds a tensor of the global shape; the global tensor is their sum

A `Placed` record keeps a local tensor together with its global shape, its mesh axis and its
placement, and checks that they agree. The conversions between placements are the collectives of
chapter 1 (rank side: they call torch.distributed on the current group):

    Partial -> Replicate   all-reduce            Shard(d) -> Replicate   all-gather along d
    Partial -> Shard(d)    reduce-scatter along d Replicate -> Shard(d)   take block r, no message

torch's DTensor keeps the same record (`placements`, `to_local()`, `shape` for the global shape,
`device_mesh`); `from_dtensor` reads one into a `Placed`, so the two can be compared.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self):
        return f"Shard({self.dim})"


@dataclasses.dataclass(frozen=True)
class Replicate:
    def __str__(self):
        return "Replicate()"


@dataclasses.dataclass(frozen=True)
class Partial:
    op: str = "sum"

    def __str__(self):
        return f"Partial({self.op})"


def local_shape(global_shape, placement, tp):
    """The shape one rank holds: the global shape, divided by tp along a sharded dim."""
    shape = list(global_shape)
    if isinstance(placement, Shard):
        d = placement.dim % len(shape)
        if shape[d] % tp:
            raise ValueError(f"dim {d} of a tensor of global shape {tuple(global_shape)} has "
                             f"{shape[d]} entries, not divisible by tp ({tp}): pad it to a "
                             f"multiple of {tp}, or shard another dim")
        shape[d] //= tp
    return tuple(shape)


@dataclasses.dataclass
class Placed:
    """A rank's local tensor with the metadata that says what it is a piece of."""
    local: torch.Tensor
    global_shape: tuple
    placement: object                    # Shard(d), Replicate() or Partial()
    mesh_axis: str = "tp"
    tp: int = 1                          # ranks along the mesh axis

    def __post_init__(self):
        self.global_shape = tuple(self.global_shape)
        expected = local_shape(self.global_shape, self.placement, self.tp)
        if tuple(self.local.shape) != expected:
            raise ValueError(f"a {self.placement} piece of a {self.global_shape} tensor over "
                             f"tp={self.tp} ranks is {expected} on each rank, got "
                             f"{tuple(self.local.shape)}")

    @property
    def local_shape(self):
        return tuple(self.local.shape)

    def row(self, name=""):
        """One line: name, global shape, local shape, axis, placement."""
        return (f"{name:<14} global {str(self.global_shape):<14} local {str(self.local_shape):<14}"
                f" axis {self.mesh_axis!r} {self.placement}")


def place(full: torch.Tensor, placement, rank: int, tp: int, mesh_axis="tp") -> Placed:
    """Rank `rank`'s piece of a full tensor. Partial: rank 0 holds the tensor, the others zeros
    (one of many ways to write a sum; any split whose pieces add up is a Partial)."""
    if isinstance(placement, Shard):
        size = local_shape(full.shape, placement, tp)[placement.dim % full.dim()]
        local = full.narrow(placement.dim, rank * size, size)
    elif isinstance(placement, Replicate):
        local = full
    elif isinstance(placement, Partial):
        local = full if rank == 0 else torch.zeros_like(full)
    else:
        raise TypeError(f"placement must be Shard(d), Replicate() or Partial(), got {placement!r}")
    return Placed(local.clone(), tuple(full.shape), placement, mesh_axis, tp)


def redistribute(placed: Placed, target, group=None) -> Placed:
    """Rank side: the same global tensor under another placement, with the collective it needs."""
    import torch.distributed as dist
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if tp != placed.tp:
        raise ValueError(f"the record says tp={placed.tp}, the group has {tp} ranks")
    source, x = placed.placement, placed.local
    if source == target:
        return placed
    if isinstance(source, Partial) and isinstance(target, Replicate):
        out = x.clone()
        dist.all_reduce(out, group=group)
    elif isinstance(source, Shard) and isinstance(target, Replicate):
        d = source.dim % x.dim()
        pieces = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        out = torch.cat(pieces, dim=d)
    elif isinstance(source, Partial) and isinstance(target, Shard):
        d = target.dim % x.dim()
        moved = x.movedim(d, 0).contiguous()                      # the sharded dim first
        out = torch.empty((moved.shape[0] // tp, *moved.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_single(out, moved, group=group)
        out = out.movedim(0, d)
    elif isinstance(source, Replicate) and isinstance(target, Shard):
        out = place(x, target, rank, tp, placed.mesh_axis).local
    else:
        raise ValueError(f"no conversion from {source} to {target} here (Shard(i) -> Shard(j) "
                         "is an all-to-all; Replicate/Shard -> Partial needs no message)")
    return Placed(out, placed.global_shape, target, placed.mesh_axis, tp)


def from_dtensor(dtensor, mesh_dim: int = 0) -> Placed:
    """The `Placed` record of a DTensor on a 1-D mesh (torch's names mapped to ours)."""
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    if not hasattr(dtensor, "placements"):
        raise TypeError(f"not a DTensor: {type(dtensor).__name__} (parallelize_module leaves the "
                        "parameters of modules outside its plan as plain tensors)")
    theirs = dtensor.placements[mesh_dim]
    if isinstance(theirs, TorchShard):
        ours = Shard(theirs.dim)
    elif isinstance(theirs, TorchReplicate):
        ours = Replicate()
    elif isinstance(theirs, TorchPartial):
        ours = Partial(str(theirs.reduce_op))
    else:
        raise TypeError(f"unknown DTensor placement {theirs!r}")
    mesh = dtensor.device_mesh
    axis = (mesh.mesh_dim_names or ("dim0",))[mesh_dim]
    return Placed(dtensor.to_local(), tuple(dtensor.shape), ours, axis, mesh.size(mesh_dim))
