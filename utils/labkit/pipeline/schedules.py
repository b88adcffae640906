"""Pipeline schedules as data (chapter 5, `course/05_pipeline_parallel.ipynb`, section 1).

A schedule says, for each pipeline stage (one rank each), the order in which that rank runs its
work. It is a list with one entry per rank; each entry is a list of actions:

    Action("F", 3)        forward of microbatch 3 on this rank's (only) model chunk
    Action("B", 3)        backward of microbatch 3 (input gradient and weight gradient together)
    Action("I", 3)        input-gradient half of a backward (zero-bubble schedules)
    Action("W", 3)        weight-gradient half of a backward: needs only this rank's own I
    Action("F", 3, 1)     forward of microbatch 3 on this rank's model chunk 1 (interleaving)

Notation: p stages (ranks), m microbatches, v model chunks per rank. The model is cut into
S = v * p *virtual stages* s = 0 .. S-1 in layer order; chunk c of rank r is virtual stage
s = c * p + r (the looped placement of Narayanan et al. 2021, which Megatron-LM and torch's
ScheduleInterleaved1F1B use). With v = 1 the virtual stage is the rank.

What is here: the Action type, parsing and printing, the virtual-stage map, GPipe, interleaved
1F1B (v >= 2), the zero-bubble variant built from a given 1F1B, and the orders torch's own
schedule classes run (`torch_schedule`). What is not: ZB-H2 (lab 5, task 1), and a 1F1B
generator of its own; use `torch_schedule("1F1B", p, m)` where torch accepts the case (m >= p).
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import NamedTuple

KINDS = ("F", "B", "I", "W")
_PATTERN = re.compile(r"^\s*([FBIW])\s*(\d+)(?:\s*[.,/]\s*(\d+))?\s*$")


class Action(NamedTuple):
    """One unit of a stage's work: kind ("F", "B", "I" or "W"), microbatch, model chunk."""
    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self):
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

    def __repr__(self):
        return f"Action({str(self)!r})"


def action(value) -> Action:
    """An Action from an Action, a tuple ("F", 3) / ("F", 3, 1), or a string "F3" / "F3.1".

    Raises ValueError naming what was received and the accepted forms.
    """
    if isinstance(value, Action):
        return value
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match:
            return Action(match.group(1), int(match.group(2)), int(match.group(3) or 0))
    elif isinstance(value, (tuple, list)) and len(value) in (2, 3):
        kind, microbatch, *chunk = value
        if kind in KINDS and _is_index(microbatch) and all(_is_index(c) for c in chunk):
            return Action(kind, int(microbatch), int(chunk[0]) if chunk else 0)
    raise ValueError(f"not an action: {value!r}; write Action('F', 3), ('F', 3), ('F', 3, 1), "
                     f"'F3' or 'F3.1' (kinds {', '.join(KINDS)}, microbatch and chunk >= 0)")


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def normalise(schedule) -> list:
    """A schedule as a list (one per rank) of lists of Action; raises ValueError on bad input."""
    if isinstance(schedule, dict):
        if sorted(schedule) != list(range(len(schedule))):
            raise ValueError(f"a schedule given as a dict needs the keys 0 .. p-1, got "
                             f"{sorted(schedule)}")
        schedule = [schedule[rank] for rank in range(len(schedule))]
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError(f"a schedule is a non-empty list with one list of actions per stage, got "
                         f"{type(schedule).__name__}")
    out = []
    for rank, actions in enumerate(schedule):
        if not isinstance(actions, (list, tuple)):
            raise ValueError(f"stage {rank}: expected a list of actions, got "
                             f"{type(actions).__name__}")
        try:
            out.append([action(a) for a in actions])
        except ValueError as error:
            raise ValueError(f"stage {rank}: {error}") from None
    return out


def parse(text: str) -> list:
    """A schedule from text, one line per stage: "F0 F1 B0 B1" (chunks as "F0.1")."""
    lines = [line.split("#")[0].strip() for line in text.strip().splitlines()]
    return normalise([[a for a in line.replace(",", " ").split()] for line in lines if line])


def format_schedule(schedule, width: int = 5) -> str:
    """One line per stage, every action in a column `width` characters wide."""
    schedule = normalise(schedule)
    return "\n".join(f"stage {rank}: " + "".join(f"{str(a):<{width}}" for a in actions).rstrip()
                     for rank, actions in enumerate(schedule))


def chunks_of(schedule) -> int:
    """v: the number of model chunks per rank the schedule uses (largest chunk index + 1)."""
    return 1 + max((a.chunk for actions in normalise(schedule) for a in actions), default=0)


# ---- the virtual-stage map ---------------------------------------------------------------------

LAYOUTS = ("loop", "v")


def virtual_stage(rank: int, chunk: int, p: int, layout: str = "loop") -> int:
    """Where chunk `chunk` of rank `rank` sits in the model's layer order.

    layout "loop" (Megatron's interleaving, torch's Interleaved1F1B): s = chunk * p + rank.
    layout "v" (ZB-V, DualPipeV: two chunks per rank, torch's `generate_stage_to_rank_mapping(...,
    style="v")`): chunk 0 of rank r is virtual stage r, chunk 1 is 2p - 1 - r, so rank p - 1
    holds the two middle stages and rank 0 the first and the last."""
    if layout == "loop":
        return chunk * p + rank
    if layout == "v":
        if chunk not in (0, 1):
            raise ValueError(f"the V layout has two chunks per rank (0 and 1), got chunk {chunk}")
        return rank if chunk == 0 else 2 * p - 1 - rank
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def placement(s: int, p: int, layout: str = "loop") -> tuple:
    """(rank, chunk) that holds virtual stage s: (s mod p, s // p) looped; in the V layout
    (s, 0) for s < p and (2p - 1 - s, 1) after."""
    if layout == "loop":
        return s % p, s // p
    if layout == "v":
        if not 0 <= s < 2 * p:
            raise ValueError(f"the V layout of p = {p} ranks has virtual stages 0..{2 * p - 1}, "
                             f"got {s}")
        return (s, 0) if s < p else (2 * p - 1 - s, 1)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


# ---- unit costs --------------------------------------------------------------------------------

def unit_cost(kind: str, v: int = 1) -> Fraction:
    """Cost of one action when a whole stage's forward costs 1: F = 1, B = 2, I = W = 1, each
    divided by v for one of v chunks. (Backward ~ 2x forward: it computes two products per
    matrix multiply, one for the input gradient and one for the weight gradient.)"""
    return Fraction({"F": 1, "B": 2, "I": 1, "W": 1}[kind], v)


# ---- generators --------------------------------------------------------------------------------

def _check_sizes(p: int, m: int, v: int = 1) -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        if not _is_index(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def gpipe(p: int, m: int) -> list:
    """GPipe (Huang et al. 2019): every stage runs all m forwards, then all m backwards.

    Bubble (p-1)/(m+p-1) of the step; every stage holds all m microbatches' activations at the
    turn from forward to backward. Backwards in microbatch order, as torch's ScheduleGPipe.
    """
    _check_sizes(p, m)
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
            for _ in range(p)]


def interleaved_1f1b(p: int, m: int, v: int) -> list:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2): v >= 2 chunks per rank.

    Forwards go through the chunks in groups of p microbatches: the k-th forward of a rank
    (k = 0 .. v*m - 1) is microbatch (k // (p*v)) * p + k % p on chunk (k // p) % v; backwards
    take the chunks in reverse. Rank r first runs 2(p - r - 1) + (v - 1) p forwards (all of them
    when m = p), then alternates one forward and one backward, then drains the backwards: the
    warm-up of Megatron-LM's `forward_backward_pipelining_with_interleaving`.
    Bubble (p-1)/(v m) of the ideal time, for m a multiple of p.
    """
    _check_sizes(p, m, v)
    if v < 2:
        raise ValueError("interleaved_1f1b needs v >= 2 chunks per rank; v = 1 is plain 1F1B "
                         "(torch_schedule('1F1B', p, m) for m >= p)")
    if m % p:
        raise ValueError(f"interleaved_1f1b needs m ({m}) to be a multiple of p ({p}): "
                         f"m % p = {m % p}; use m = {m + p - m % p}, or torch's flexible "
                         "variant: torch_schedule('Interleaved1F1B', p, m, v)")
    total = v * m

    def forward(k):
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k):
        return Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    schedule = []
    for rank in range(p):
        warmup = total if m == p else min(total, 2 * (p - rank - 1) + (v - 1) * p)
        actions = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(warmup + k), backward(k)]
        actions += [backward(k) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


def zero_bubble(one_f_one_b, m: int) -> list:
    """The zero-bubble idea (Qi et al. 2024, "ZB-H1") applied to a given F/B schedule (v = 1).

    Every B becomes I (input gradient: the stage below waits for it) followed later by W
    (weight gradient: nobody waits for it). The F and I order stays that of the given schedule.
    Each W is placed by a unit-cost simulation: into a moment where the stage would otherwise
    wait, or before a forward that would make more than p microbatches alive on the stage (the
    first stage's peak under 1F1B), or at the end. From a 1F1B with m >= p, this cuts each
    stage's idle time from (p-1)(t_F + t_B) to (p-1)(t_F + t_I - t_W): a third when all are equal.
    """
    from labkit.pipeline.analysis import _Graph, _ready_time
    schedule = normalise(one_f_one_b)
    if chunks_of(schedule) != 1 or any(a.kind not in "FB" for acts in schedule for a in acts):
        raise ValueError("zero_bubble takes a schedule of F and B actions on one chunk per rank")
    p = len(schedule)
    order = [[Action("I", a.microbatch) if a.kind == "B" else a for a in acts]
             for acts in schedule]
    graph = _Graph([list(acts) + [Action("W", a.microbatch) for a in acts if a.kind == "I"]
                    for acts in order], m, 1)
    end, out = {}, [[] for _ in range(p)]
    position, free, pending = [0] * p, [Fraction(0)] * p, [[] for _ in range(p)]
    alive = [0] * p

    def run(rank, a, start):
        free[rank] = end[(rank, a)] = start + unit_cost(a.kind)
        out[rank].append(a)
        alive[rank] += {"F": 1, "W": -1}.get(a.kind, 0)

    while any(position[r] < len(order[r]) or pending[r] for r in range(p)):
        progressed = False
        for rank in range(p):
            nxt = order[rank][position[rank]] if position[rank] < len(order[rank]) else None
            ready = None if nxt is None else _ready_time(graph, rank, nxt, end)
            over_cap = nxt is not None and nxt.kind == "F" and alive[rank] >= p
            if ready is not None and not (over_cap and pending[rank]) and \
                    (ready <= free[rank] or not pending[rank]):
                run(rank, nxt, max(ready, free[rank]))
                position[rank] += 1
                if nxt.kind == "I":
                    pending[rank].append(Action("W", nxt.microbatch))
                progressed = True
            elif pending[rank]:         # the stage would wait, or hold too much: run a W
                run(rank, pending[rank].pop(0), free[rank])
                progressed = True
        if not progressed:
            raise ValueError("zero_bubble: the given schedule deadlocks; check it first")
    return out


# ---- torch's own schedules ---------------------------------------------------------------------

TORCH_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")
TORCH_V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")      # V placement: rank r holds r, 2p-1-r


class _RecordingStage:
    """Stands in for a torch PipelineStage: records what torch's schedule code asks it to run,
    communicates nothing (every send/recv op list is empty)."""

    def __init__(self, stage_index, num_stages):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.device, self.has_backward, self.actions = "cpu", True, []

    def forward_one_chunk(self, microbatch, *args, **kwargs):
        self.actions.append(Action("F", microbatch))

    def backward_one_chunk(self, microbatch, **kwargs):
        self.actions.append(Action("B", microbatch))

    def _nothing(self, *args, **kwargs):
        return []

    _get_init_p2p_neighbors_ops = get_fwd_recv_ops = get_fwd_send_ops = _nothing
    get_bwd_recv_ops = get_bwd_send_ops = _nothing
    _prepare_forward_infra = _prepare_backward_infra = perform_reduce_grad = _nothing
    clear_runtime_states = _nothing


def torch_schedule(name: str, p: int, m: int, v: int = 1) -> list:
    """The order torch.distributed.pipelining runs, as a schedule (torch 2.13's own code).

    "GPipe" and "1F1B": torch's `_step_microbatches` is run against a stand-in stage that records
    each forward and backward it is asked for (no ranks, no messages). "Interleaved1F1B": the
    schedule's `pipeline_order`, the table its runtime executes; likewise
    "InterleavedZeroBubble" (F, I, W; looped placement). torch raises its own errors
    where it refuses a case (1F1B with m < p).
    """
    from types import SimpleNamespace
    from torch.distributed import pipelining
    _check_sizes(p, m, v)
    if name not in TORCH_SCHEDULES:
        raise ValueError(f"name must be one of {TORCH_SCHEDULES}, got {name!r}")
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        import torch
        stages = [SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0,
                                  stage_index=c * p, submod=torch.nn.Identity())
                  for c in range(v)]
        table = getattr(pipelining, f"Schedule{name}")(stages, m).pipeline_order
        return [[_from_torch_action(a, p) for a in table[rank] if a is not None]
                for rank in range(p)]
    if v != 1:
        raise ValueError(f"torch's {name} runs one chunk per rank: v must be 1, got {v}")
    cls = pipelining.ScheduleGPipe if name == "GPipe" else pipelining.Schedule1F1B
    schedule = []
    for rank in range(p):
        stage = _RecordingStage(rank, p)
        cls(stage, m)._step_microbatches([()] * m, [{}] * m, None, None, return_outputs=False)
        schedule.append(stage.actions)
    return schedule


def _torch_v_table(name: str, p: int, m: int) -> list:
    """`pipeline_order` of torch's V-shaped schedule class `Schedule<name>` for p ranks and m
    microbatches (per rank, a list of actions or None), built from stand-in stages: the table
    needs only the stage counts and indices, not modules or a process group."""
    from types import SimpleNamespace
    import torch
    from torch.distributed import pipelining
    _check_sizes(p, m)
    if name not in TORCH_V_SCHEDULES:
        raise ValueError(f"name must be one of {TORCH_V_SCHEDULES}, got {name!r}")
    stages = [SimpleNamespace(num_stages=2 * p, group_size=p, group_rank=0, stage_index=index,
                              submod=torch.nn.Identity()) for index in (0, 2 * p - 1)]
    return getattr(pipelining, f"Schedule{name}")(stages, m).pipeline_order


def torch_table_kinds(name: str, p: int, m: int) -> dict:
    """How many actions of each kind torch's V-shaped tables ("ZBVZeroBubble", "DualPipeV": two
    chunks per rank, rank r holding virtual stages r and 2p - 1 - r) list over all ranks, e.g.
    {"F": 2pm, "I": ..., "W": ..., "OVERLAP_F_B": ...}. To score a table (bubble, deadlocks,
    memory), read it with `torch_v_schedule` and check it with `check_schedule(..., layout="v")`."""
    table = _torch_v_table(name, p, m)
    kinds = {}
    for rank in range(p):
        for a in table[rank]:
            if a is not None:
                kinds[a.computation_type.name] = kinds.get(a.computation_type.name, 0) + 1
    return kinds


def torch_v_schedule(name: str, p: int, m: int) -> list:
    """The table of torch's V-shaped schedules ("ZBVZeroBubble", "DualPipeV") as a schedule in
    the V layout (check it with `check_schedule(..., layout="v")`): each class's
    `pipeline_order` (torch 2.13, `torch/distributed/pipelining/schedules.py`), idle slots
    dropped, chunk 0 = virtual stage r, chunk 1 = 2p - 1 - r. DualPipeV's OVERLAP_F_B, one
    chunk's forward run together with another's full backward (so that on GPUs one's
    communication hides behind the other's compute), becomes its two sub-actions in torch's
    order, F then B: on the checker's unit clock they take the sum of their costs."""
    table = _torch_v_table(name, p, m)
    schedule = []
    for rank in range(p):
        actions = []
        for a in table[rank]:
            if a is None:
                continue
            for one in (a.sub_actions or (a,)):
                kind = one.computation_type.value
                if kind not in KINDS:
                    raise ValueError(f"torch's {name} table has {one!r}, which is not F, B, I or W")
                placed_rank, chunk = placement(one.stage_index, p, "v")
                if placed_rank != rank:
                    raise ValueError(f"torch's {name} table puts {one!r} on rank {rank}; the V "
                                     f"layout puts stage {one.stage_index} on rank {placed_rank}")
                actions.append(Action(kind, one.microbatch_index, chunk))
        schedule.append(actions)
    return schedule


def torch_pipeline_order(name: str, p: int, m: int) -> list:
    """The table torch's single-stage schedules publish as `pipeline_order` (used by torch's
    schedule visualiser), as a schedule; idle slots (None) and REDUCE_GRAD are dropped."""
    from types import SimpleNamespace
    from torch.distributed import pipelining
    cls = {"GPipe": pipelining.ScheduleGPipe, "1F1B": pipelining.Schedule1F1B}[name]
    table = cls(SimpleNamespace(num_stages=p), m).pipeline_order
    return [[_from_torch_action(a, p) for a in table[rank]
             if a is not None and a.computation_type.value in KINDS] for rank in range(p)]


def _from_torch_action(torch_action, p: int) -> Action:
    kind = torch_action.computation_type.value         # "F", "B", "I" or "W"
    rank, chunk = placement(torch_action.stage_index, p)
    return Action(kind, torch_action.microbatch_index, chunk)
