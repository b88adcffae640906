"""ZeRO stage 1 over the data-parallel axis of a 3D mesh (chapter 6, section 3).

    optimizer = Zero1(stage.parameters(), dp_group, "adamw", lr=1e-2)
    ... backward of every microbatch ...
    optimizer.step()          # reduce-scatter the gradients over dp, step 1/dp, all-gather
    optimizer.zero_grad()     # (step = reduce_gradients(), then apply(): clip in between)

What a rank of a dp x tp x pp mesh holds before ZeRO is its stage's parameters, and of each tensor-
parallel weight only its tp shard: its *local* tensors, Psi / (tp pp) elements. Zero1 lays them out
as one flat tensor [N] (padded to a multiple of dp), and dp rank r keeps the optimizer state of the
slice [r S, (r+1) S), S = N / dp, as in chapter 3's stage 1 (`labkit.memory.zero`):

    gradients   [N] --reduce-scatter over dp--> [S]   summed, then scaled (1/dp: the mean)
    master      [S] in the master dtype, with the optimizer's state for [S] only
    parameters  [S] --all-gather over dp--> [N]       copied back into every local tensor

Bytes each rank sends per step: 2 (dp-1)/dp x N b (b bytes per element), whatever the number of
microbatches: the optimizer step happens once, after the last backward (ZeRO paper, section 7;
chapter 3's `ledger.wire_bytes_per_rank(..., stage=1)`). The reduce-scatter is chapter 3's
all-to-all plus a local sum (`memory.zero.reduce_scatter`): gloo's own reduce_scatter is an
all-reduce underneath and sends twice the bytes.

This is the ZeRO-1 of one flat buffer of one stage with the chapter's two optimizers; it is not a
wrapper for any torch.optim optimizer with parameter groups (lab 3, task 1). It never reduces over
tp: the gradient of a replicated parameter (LayerNorm, embedding) is already the whole gradient on
every tp rank, and the gradient of a tp shard belongs to that shard alone.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labkit.memory import zero
from labkit.mesh.model import local, make_optimizer


class Zero1:
    """ZeRO-1 over `dp_group` for `params` (plain tensors or DTensors: their local shards)."""

    def __init__(self, params, dp_group=None, optimizer="adamw", lr=1e-2, master_dtype=None,
                 **options):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("Zero1 needs at least one parameter that requires a gradient")
        self.group = dp_group
        self.dp = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        tensors = [local(p).detach() for p in self.params]
        self.dtype = tensors[0].dtype
        self.numels = [t.numel() for t in tensors]
        self.numel = sum(self.numels)                                       # N
        self.padded = math.ceil(self.numel / self.dp) * self.dp
        self.shard_numel = self.padded // self.dp                           # S
        if master_dtype is None:
            master_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        mine = slice(self.dp_rank * self.shard_numel, (self.dp_rank + 1) * self.shard_numel)
        self.master = self._flat(tensors)[mine].to(master_dtype).clone().requires_grad_(True)
        self.optimizer = make_optimizer([self.master], optimizer, lr=lr, **options)
        self.received = torch.empty(self.padded, dtype=self.dtype, device=tensors[0].device)
        self.steps = 0

    def _flat(self, tensors) -> torch.Tensor:
        """The tensors, flattened and concatenated, zero-padded to [N padded]."""
        flat = torch.zeros(self.padded, dtype=self.dtype, device=tensors[0].device)
        flat[:self.numel] = torch.cat([t.reshape(-1) for t in tensors])
        return flat

    @torch.no_grad()
    def step(self, scale=None):
        """Reduce-scatter the local gradients over dp (a missing gradient counts as zero), scale
        the sum (default 1/dp: the mean over replicas), step this rank's slice, all-gather:
        `reduce_gradients` then `apply`."""
        self.reduce_gradients(scale)
        self.apply()

    @torch.no_grad()
    def reduce_gradients(self, scale=None) -> torch.Tensor:
        """The first half of `step`: this rank's slice [S] of the flat local gradients, summed
        over dp and scaled (default 1/dp), kept as the master's gradient and returned. Whatever
        is done to it in place (clipping, chapter 6) is what `apply` steps with."""
        scale = 1.0 / self.dp if scale is None else scale
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p))
                 for p in self.params]
        flat = self._flat(grads)                                            # [N]
        if self.dp > 1:
            summed = zero.reduce_scatter(flat, self.received, self.group)   # [S]
        else:
            summed = flat
        self.master.grad = summed.to(self.master.dtype) * scale
        return self.master.grad

    @torch.no_grad()
    def apply(self):
        """The second half of `step`: step this rank's slice with the master's gradient, then
        all-gather the slices over dp into every local tensor."""
        if self.master.grad is None:
            raise RuntimeError("Zero1.apply before reduce_gradients: no gradient to step with")
        self.optimizer.step()
        self.master.grad = None
        mine = self.master.detach().to(self.dtype)                          # [S]
        if self.dp > 1:
            gathered = torch.empty(self.padded, dtype=self.dtype, device=mine.device)
            dist.all_gather_single(gathered, mine, group=self.group)   # [N]
        else:
            gathered = mine
        offset = 0
        for p, n in zip(self.params, self.numels):
            target = local(p)
            target.copy_(gathered[offset:offset + n].view_as(target))
            offset += n
        self.steps += 1

    def shard_of(self, tensors) -> torch.Tensor:
        """This rank's slice [S] of `tensors` (one per parameter, shaped like its local tensor)
        laid out as the flat buffer is: what element i of `reduce_gradients`' result belongs to."""
        if len(tensors) != len(self.params):
            raise ValueError(f"one tensor per parameter: {len(tensors)} for {len(self.params)}")
        mine = slice(self.dp_rank * self.shard_numel, (self.dp_rank + 1) * self.shard_numel)
        return self._flat([t.to(self.dtype) for t in tensors])[mine]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def state_elements(self) -> int:
        """Elements of optimizer state this rank holds: the master slice and every per-element
        state tensor of the optimizer (AdamW: m and v; SGD: the momentum buffer)."""
        held = self.master.numel()
        for state in self.optimizer.state.values():
            held += sum(t.numel() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        return held
