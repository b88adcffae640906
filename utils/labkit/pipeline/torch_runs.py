"""torch.distributed.pipelining on the chapter's bench model (chapter 5, section 6).

    results = world.call(torch_step, args=("1F1B", case), timeout=60)

Each rank wraps its piece(s) of the bench model in torch's `PipelineStage` and runs one step of
torch's `ScheduleGPipe`, `Schedule1F1B` or `ScheduleInterleaved1F1B`. The loss is the step's
token loss (sum over the microbatch's valid tokens / N, N the valid tokens of the whole step), so
torch is told not to divide the gradients by m again (`scale_grads=False`). Every forward and
backward torch asks a stage for is recorded (and padded to `costs`, as labkit's executor does),
so the order torch really ran can be checked, and timed, like any schedule.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labkit.pipeline import bench
from labkit.pipeline.schedules import Action, virtual_stage

CLASSES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B",
           "Interleaved1F1B": "ScheduleInterleaved1F1B"}


def _recorded(stage, method, kind, chunk, events, costs):
    """Replace stage.<method> by one that records (kind, microbatch, chunk, start, end)."""
    original = getattr(stage, method)

    def run(microbatch, *args, **kwargs):
        start = time.time()
        result = original(microbatch, *args, **kwargs)
        if costs and costs.get(kind):
            time.sleep(max(0.0, start + costs[kind] - time.time()))
        events.append((kind, microbatch, start, time.time(), chunk))
        return result
    setattr(stage, method, run)


def torch_step(name: str, case: dict, v: int = 1, costs=None, mean_loss: bool = False):
    """On every rank: one step of torch's schedule `name` ("GPipe", "1F1B", "Interleaved1F1B")
    with v chunks per rank. case: as labkit.pipeline.executor.pipeline_step.

    costs: seconds per action of a whole stage, as for pipeline_step; a chunk, 1/v of a stage's
    layers, is padded to 1/v of them.
    mean_loss: use the habit of torch's examples instead (each microbatch's own mean loss, and
    torch divides the gradients by m): right only when every microbatch has as many tokens.
    Returns {"grads", "events": [(kind, microbatch, start, end, chunk)], "order": the actions in
    the order they ran}.
    """
    from torch.distributed import pipelining
    rank, p = dist.get_rank(), dist.get_world_size()
    if name not in CLASSES:
        raise ValueError(f"name must be one of {tuple(CLASSES)}, got {name!r}")
    if name != "Interleaved1F1B" and v != 1:
        raise ValueError(f"torch's {name} runs one chunk per rank: v must be 1, got {v}")
    m = case["m"]
    from labkit import device
    model = bench.make_model(case["model_seed"], case.get("layers", bench.LAYERS),
                             case.get("hidden", bench.HIDDEN)).to(device())
    pieces = bench.cut(model, p * v)
    tokens, targets = bench.microbatches(case["data_seed"], m, case.get("b", 2), case.get("T", 6))
    tokens, targets = tokens.to(device()), targets.to(device())
    N = bench.token_count(targets)
    events, stages = [], []
    for chunk in range(v):
        s = virtual_stage(rank, chunk, p)
        stage = pipelining.PipelineStage(pieces[s], s, p * v, device())
        per_chunk = {kind: seconds / v for kind, seconds in (costs or {}).items()}
        _recorded(stage, "forward_one_chunk", "F", chunk, events, per_chunk)
        _recorded(stage, "backward_one_chunk", "B", chunk, events, per_chunk)
        stages.append(stage)

    def token_loss(logits, y):                 # logits: [b, T, V], y: [b, T]
        total, count = bench.loss_sum(logits, y)
        return total / count if mean_loss else total / N

    cls = getattr(pipelining, CLASSES[name])
    schedule = cls(stages if name == "Interleaved1F1B" else stages[0], m, loss_fn=token_loss,
                   scale_grads=mean_loss)
    x = tokens.reshape(m * case.get("b", 2), -1)                # [m*b, T]: torch cuts it in m
    y = targets.reshape(m * case.get("b", 2), -1)               # [m*b, T]
    holds_first, holds_last = rank == 0, rank == p - 1          # stage 0; stage v*p - 1
    args = (x,) if holds_first else ()
    schedule.step(*args, **({"target": y} if holds_last else {}))
    grads = {}
    for chunk in range(v):
        grads.update(pieces[virtual_stage(rank, chunk, p)].gradients())
    return {"grads": grads, "events": [e[:4] for e in events],
            "order": [Action(kind, microbatch, chunk) for kind, microbatch, _, _, chunk in events]}
