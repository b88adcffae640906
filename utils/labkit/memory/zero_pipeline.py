"""ZeRO inside the stages of a pipeline (chapter 3, section 6; lab 3, task 3).

    case = pipeline.case(zero_stage=3, layers=2, microbatches=4, schedule="1f1b")
    with world.tracing() as trace:                 # a world of pp * dp ranks
        world.call(pipeline.train_step, args=(case,))
    pipeline.count(trace, rank=0, "all_gather_single")

Rank r is data-parallel rank r % dp of pipeline stage r // dp; it sends activations to r + dp and
gradients back to r - dp. Each stage holds `layers` blocks of `labkit.memory.zero`, sharded with
ZeRO `zero_stage` over the dp ranks of its stage. One training step runs `microbatches` forwards
and backwards in the order of the schedule, then one optimizer step.

Two policies for stages 2-3 (`reshard`, the same switch as chapter 6's cost model):
    "microbatch"  (the default, DeepSpeed's ZeRO-3) stage 3 gathers a block's parameters whenever a
                  forward or a backward needs them and they are not held: with
                  `reshard_after_forward` they are freed after every forward and every backward,
                  so every microbatch gathers each block twice; every backward reduce-scatters.
    "step"        (torch's pipelining stage with FSDP2, torchtitan with pp > 1) the gathered weights
                  and a full gradient stay from the first use in the step to its last backward,
                  then one reduce-scatter per block: ZeRO-1's traffic, ZeRO-1's memory during the
                  step, the shards' memory between steps (`zero.Block.keep_for_step`).
Stage 1 gathers once per block per step, after the optimizer step, whatever the number of
microbatches.

`train_step` also reads, on the rank, the bytes of its weights, gradients and communication
buffers (each storage once) after every forward and backward ("during": the largest) and after the
optimizer step ("between").
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.memory import zero

SCHEDULES = ("gpipe", "1f1b")
RESHARD = ("microbatch", "step")
_GROUPS = {}                     # (world size, dp) -> this rank's dp group, made once per world


def schedule(kind: str, pp: int, stage: int, microbatches: int) -> list:
    """The order of work on one pipeline stage: ("F", i) and ("B", i) for microbatch i.

    GPipe: every forward, then every backward. 1F1B: pp - stage - 1 forwards to fill the pipe,
    then one forward and one backward in turn, then the remaining backwards."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}")
    if microbatches < 1 or not 0 <= stage < pp:
        raise ValueError(f"need microbatches >= 1 and 0 <= stage < pp, got m={microbatches}, "
                         f"stage={stage}, pp={pp}")
    m = microbatches
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(pp - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]
    return order


def case(zero_stage=3, layers=2, microbatches=4, schedule="1f1b", pp=2, hidden=16,
         micro_batch=2, seq=4, reshard_after_forward=True, seed=0, reshard="microbatch") -> dict:
    """Plain data describing one pipeline training step (what `train_step` runs on every rank)."""
    if zero_stage not in zero.STAGES:
        raise ValueError(f"zero_stage must be one of {zero.STAGES}, got {zero_stage!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if reshard not in RESHARD:
        raise ValueError(f"reshard must be one of {RESHARD}, got {reshard!r}")
    if reshard == "step" and zero_stage < 2:
        raise ValueError(f"reshard='step' is a policy for ZeRO stages 2-3, got zero_stage="
                         f"{zero_stage}; stages 0-1 already reduce once per step")
    for name, value in (("layers", layers), ("microbatches", microbatches), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return dict(zero_stage=zero_stage, layers=layers, microbatches=microbatches, schedule=schedule,
                pp=pp, hidden=hidden, micro_batch=micro_batch, seq=seq,
                reshard_after_forward=bool(reshard_after_forward), seed=seed, reshard=reshard)


def _dp_group(dp):
    """This rank's data-parallel group (every rank creates every group, in the same order)."""
    world_size = dist.get_world_size()
    key = (world_size, dp, id(dist.group.WORLD))
    if key not in _GROUPS:
        mine = None
        for first in range(0, world_size, dp):
            group = dist.new_group(list(range(first, first + dp)))
            if first <= dist.get_rank() < first + dp:
                mine = group
        _GROUPS[key] = mine
    return _GROUPS[key]


def stage_trainer(case: dict):
    """On every rank: this rank's place (rank r is stage r // dp, dp rank r % dp) and its ZeRO
    blocks and trainer for `case`, the stage-3 policy applied (resharding every microbatch, after
    forward or not, or once per step). Returns (rank, dp, stage, dp_rank, device, blocks,
    trainer); train_step and the lab's memory checker both start here."""
    import labkit
    rank, world_size, pp = dist.get_rank(), dist.get_world_size(), case["pp"]
    if world_size % pp:
        raise ValueError(f"world size ({world_size}) is not a multiple of pp ({pp})")
    dp = world_size // pp
    stage, dp_rank = divmod(rank, dp)
    group = _dp_group(dp)
    device = labkit.device()
    H, L = case["hidden"], case["layers"]
    blocks = zero.make_blocks(L, H, case["seed"], dp, dp_rank, case["zero_stage"],
                              dtype=torch.float32, device=device, group=group, first_layer=stage * L)
    step_policy = case.get("reshard", "microbatch") == "step"
    for block in blocks:
        if step_policy:
            block.keep_for_step()
        elif not case["reshard_after_forward"]:
            block.keep_after_forward()
    trainer = zero.ZeroTrainer(blocks, case["zero_stage"], group=group, lr=1e-3)
    if step_policy:                                  # each block has its own full copies instead
        trainer.buffers.gathered = trainer.buffers.gathered.new_zeros(0)
        trainer.buffers.gradient = trainer.buffers.gradient.new_zeros(0)
    return rank, dp, stage, dp_rank, device, blocks, trainer


def train_step(case: dict) -> dict:
    """On every rank: one pipeline step (see the module docstring). Returns what this rank did:
    its stage, its dp rank, the order of its work, and the bytes it held (`held_bytes`) during
    the step (the most, read after each forward and backward) and after it."""
    rank, dp, stage, dp_rank, device, blocks, trainer = stage_trainer(case)
    readings = []
    run_step(case, trainer, blocks, read=lambda: readings.append(held_bytes(trainer)))
    order = schedule(case["schedule"], case["pp"], stage, case["microbatches"])
    return {"stage": stage, "dp_rank": dp_rank, "order": [f"{k}{i}" for k, i in order],
            "bytes_during": max(readings), "bytes_between": held_bytes(trainer),
            "masters": [master.detach().double().clone() for master in trainer.masters]}


def held_bytes(trainer) -> int:
    """Bytes of this rank's weights, gradients (full ones kept for the step included) and
    communication buffers, each storage counted once."""
    tensors = [t for t in vars(trainer.buffers).values()]
    for block in trainer.blocks:
        for p in (block.flat, block.shard, block.gathered):
            if p is not None:
                tensors += [p] + ([p.grad] if p.grad is not None else [])
        for kept in (block.unsharded_gradient, block.main_grad):
            if kept is not None:
                tensors.append(kept)
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run_step(case, trainer, blocks, seed=None, read=None, forward_context=None):
    """One training step on this rank (rank r: stage r // dp, dp rank r % dp): the forwards and
    backwards of the schedule's order, activations sent to r + dp and gradients back to r - dp,
    then the optimizer step. `seed` (default case["seed"]) draws stage 0's microbatches;
    `read()`, if given, is called after each forward and each backward, when the loop itself
    holds no tensor of that microbatch (train_step reads `held_bytes` there, lab 3's memory
    checker also the bytes saved for backward); `forward_context()`, if given, is entered around
    each forward (the checker's saved_tensors_hooks)."""
    import contextlib
    rank, world_size, pp = dist.get_rank(), dist.get_world_size(), case["pp"]
    dp = world_size // pp
    stage, dp_rank = divmod(rank, dp)
    device = trainer.blocks[0].device()
    H, m = case["hidden"], case["microbatches"]
    seed = case["seed"] if seed is None else seed
    shape = (case["micro_batch"], case["seq"], H)                      # [b, T, H]
    inputs, outputs, works = {}, {}, []
    order = schedule(case["schedule"], pp, stage, m)
    last = max(j for j, (kind, _) in enumerate(order) if kind == "B")
    for j, (kind, i) in enumerate(order):
        for block in blocks:
            block.last_backward = j == last
        if kind == "F":
            if stage == 0:
                x = torch.randn(shape, generator=torch.Generator().manual_seed(
                    seed * 7919 + 31 * dp_rank + i)).to(device)
            else:
                x = torch.empty(shape, device=device)
                dist.recv(x, src=rank - dp)
                x.requires_grad_(True)
                inputs[i] = x
            with forward_context() if forward_context else contextlib.nullcontext():
                outputs[i] = trainer.forward(x)
            if stage < pp - 1:
                works.append(dist.isend(outputs[i].detach(), dst=rank + dp))
        else:
            out = outputs.pop(i)
            if stage == pp - 1:
                (out.square().mean() / m).backward()
            else:
                grad = torch.empty(shape, device=device)
                dist.recv(grad, src=rank + dp)
                out.backward(grad)
            if stage > 0:
                works.append(dist.isend(inputs.pop(i).grad, dst=rank - dp))
        x = out = grad = None                                          # the loop holds nothing
        if read is not None:
            read()
    for work in works:
        work.wait()
    trainer.step()


def count(trace, rank: int, op) -> int:
    """How many `op` calls (a name or a tuple of names) `rank` made in the trace."""
    return len(trace.ops(rank, op))
