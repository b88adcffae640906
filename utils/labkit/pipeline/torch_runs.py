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


class _Blocks(torch.nn.Module):
    """One chunk of `layers` residual GELU blocks, [b, T, H] -> [b, T, H], in float64. Its input is
    copied first: torch hands the first stage views of one batch tensor (`tensor_split` in
    `pipelining/microbatch.py`), and a saved view would count the whole batch's storage; the
    copy is saved instead, as a received activation is on every other stage. Saved for backward
    per block: the linear's input and the GELU's input, 2 [b, T, H] storages."""

    def __init__(self, layers: int, hidden: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, dtype=torch.float64)
                                          for _ in range(layers))
        with torch.no_grad():
            for block in self.blocks:
                block.weight.copy_(torch.randn(block.weight.shape, generator=g,
                                               dtype=torch.float64) / hidden ** 0.5)

    def forward(self, x):                           # x: [b, T, H]
        x = x.clone()
        for block in self.blocks:
            x = x + torch.nn.functional.gelu(block(x))
        return x


def torch_activation_peak(name: str, m: int, v: int = 1, layers_per_chunk: int = 1,
                          b: int = 2, T: int = 6, hidden: int = 16) -> dict:
    """On every rank: one step of torch's `Schedule1F1B` (v = 1) or `ScheduleInterleaved1F1B`
    (v >= 2 chunks per rank, looped placement) on a stack of v p `layers_per_chunk`-block chunks,
    with every tensor autograd saves counted as it is saved and freed (ActivationMeter, the
    pipeline's weights left out). Returns {"peak_bytes": the most bytes saved at once on this
    rank, "one_chunk_microbatch": 2 layers_per_chunk b T H x 8, the bytes one microbatch
    saves in one chunk by the block's ops (the formula the peak is compared with)}.
    Chapter 5, section 5: interleaving's first-stage penalty p (1 + (p-1)/(p v))."""
    from torch.distributed import pipelining
    from labkit import device
    from labkit.pipeline.executor import ActivationMeter
    if name not in ("1F1B", "Interleaved1F1B") or (name == "1F1B") != (v == 1):
        raise ValueError(f"name and v must be ('1F1B', 1) or ('Interleaved1F1B', v >= 2), got "
                         f"({name!r}, {v})")
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = [_Blocks(layers_per_chunk, hidden, seed=virtual_stage(rank, c, p)).to(device())
              for c in range(v)]
    stages = [pipelining.PipelineStage(chunk, virtual_stage(rank, c, p), p * v, device())
              for c, chunk in enumerate(chunks)]
    meter = ActivationMeter([q for chunk in chunks for q in chunk.parameters()])
    cls = getattr(pipelining, CLASSES[name])
    schedule = cls(stages if v > 1 else stages[0], m, loss_fn=lambda out, y: out.square().sum(),
                   scale_grads=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m * b, T, hidden, generator=g, dtype=torch.float64).to(device())  # [m b, T, H]
    with meter.hooks():
        if rank == 0:
            schedule.step(x, **({"target": torch.zeros_like(x)} if p == 1 else {}))
        elif rank == p - 1:
            schedule.step(target=torch.zeros_like(x))
        else:
            schedule.step()
    return {"peak_bytes": meter.peak, "one_chunk_microbatch": 2 * layers_per_chunk * b * T * hidden * 8}
