"""The schedule checker (chapter 5, section 2): is a schedule complete, can it finish, what does
it cost?

    report = check_schedule(schedule, m)
    report.problems          # [] when every stage runs each F and backward of each microbatch once
    report.deadlock          # None, or where each stage stopped (sends buffered, as the executor)
    report.bubble            # idle / (p * makespan), unit costs: F = 1, B = 2, I = W = 1 (/ v)
    report.peak_alive        # per stage: most microbatches whose activations are held at once
    report.link_order        # messages one stage receives out of the order its neighbour sent them

Dependencies, for microbatch i on virtual stage s = c * p + r (layout "loop"), or r and 2p - 1 - r
for chunks 0 and 1 (layout "v": ZB-V, DualPipeV; see schedules.py):
    F(i) on s     needs F(i) on s - 1          (the activation; none for s = 0)
    B(i) or I(i)  needs F(i) on s itself, and B(i) or I(i) on s + 1   (the gradient; none for the
                  last virtual stage, which computes the loss)
    W(i)          needs I(i) on s itself
Two ways for a rank to wait, two models:
    sends="buffered"  a send never waits (isend): a rank waits only for inputs. This is how
                      labkit's executor runs, and torch's (isend/irecv, batch_isend_irecv).
    sends="blocking"  a send waits until the receiver posts the matching receive (gloo's and
                      NCCL's blocking `send`; MPI's synchronous mode). Rendezvous on every message.
The simulation runs every stage as soon as its next action's inputs exist; with unit costs and
no communication time it gives the timeline, hence the bubble. Per-stage costs and message time
are lab 5, task 4.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

from labkit.pipeline.schedules import (Action, chunks_of, normalise, placement, unit_cost,
                                       virtual_stage)


class _Graph:
    """The dependencies of a schedule, resolved to (rank, action) pairs."""

    def __init__(self, schedule: list, m: int, v: int, layout: str = "loop"):
        self.schedule, self.m, self.v, self.p = schedule, m, v, len(schedule)
        self.layout = layout
        self.S = v * self.p
        self.position = {}                         # (rank, action) -> index in the rank's list
        for rank, actions in enumerate(schedule):
            for index, a in enumerate(actions):
                self.position.setdefault((rank, a), index)

    def has(self, rank, a) -> bool:
        return (rank, a) in self.position

    def gradient_producer(self, rank, microbatch, chunk):
        """The action on (rank, chunk) that produces microbatch's input gradient: its B or I."""
        for kind in ("B", "I"):
            if self.has(rank, Action(kind, microbatch, chunk)):
                return Action(kind, microbatch, chunk)
        return Action("B", microbatch, chunk)      # missing from the schedule

    def inputs(self, rank, a):
        """[(producer rank, producer action, what)] that `a` on `rank` waits for, in order."""
        s = virtual_stage(rank, a.chunk, self.p, self.layout)
        if a.kind == "F":
            if s == 0:
                return []
            prev_rank, prev_chunk = placement(s - 1, self.p, self.layout)
            return [(prev_rank, Action("F", a.microbatch, prev_chunk), "activation")]
        if a.kind == "W":
            return [(rank, Action("I", a.microbatch, a.chunk), "its own input gradient")]
        needs = [(rank, Action("F", a.microbatch, a.chunk), "its own forward")]
        if s < self.S - 1:
            next_rank, next_chunk = placement(s + 1, self.p, self.layout)
            needs.append((next_rank, self.gradient_producer(next_rank, a.microbatch, next_chunk),
                          "gradient"))
        return needs

    def sends(self, rank, a):
        """[(consumer rank, what)] that `a` on `rank` sends to another rank, in order."""
        s = virtual_stage(rank, a.chunk, self.p, self.layout)
        if a.kind == "F" and s < self.S - 1:
            target = placement(s + 1, self.p, self.layout)[0]
            return [(target, "activation")] if target != rank else []
        if a.kind in "BI" and s > 0:
            target = placement(s - 1, self.p, self.layout)[0]
            return [(target, "gradient")] if target != rank else []
        return []


def validate(schedule, m: int, v: int | None = None) -> list:
    """Problems with the structure, as sentences ([] if none): every stage runs, for each of its
    chunks and each microbatch, exactly one F and either exactly one B or exactly one I and one W;
    nothing else."""
    schedule = normalise(schedule)
    v = chunks_of(schedule) if v is None else v
    problems = []
    for rank, actions in enumerate(schedule):
        counts = {}
        for a in actions:
            if a.microbatch >= m or a.chunk >= v:
                problems.append(f"stage {rank}: {a} is outside the step (microbatches 0..{m - 1}"
                                f", chunks 0..{v - 1})")
            counts[a] = counts.get(a, 0) + 1
        for a, n in counts.items():
            if n > 1:
                problems.append(f"stage {rank}: {a} appears {n} times")
        for chunk in range(v):
            for i in range(m):
                has = {k: counts.get(Action(k, i, chunk), 0) for k in "FBIW"}
                name = f"microbatch {i}" + (f", chunk {chunk}" if v > 1 else "")
                if not has["F"]:
                    problems.append(f"stage {rank}: no forward of {name}")
                if has["B"] and (has["I"] or has["W"]):
                    problems.append(f"stage {rank}: {name} has both B and I/W")
                elif not has["B"] and not (has["I"] and has["W"]):
                    missing = "backward (B, or I and W)" if not (has["I"] or has["W"]) else \
                        ("W for its I" if has["I"] else "I for its W")
                    problems.append(f"stage {rank}: {name} has no {missing}")
    return problems


def _ready_time(graph: _Graph, rank, a, end):
    """When all of a's inputs exist (unit costs, no message time), or None if one is missing."""
    ready = Fraction(0)
    for producer_rank, producer, _ in graph.inputs(rank, a):
        done = end.get((producer_rank, producer))
        if done is None:
            return None
        ready = max(ready, done)
    return ready


@dataclasses.dataclass
class Deadlock:
    """Where each unfinished stage stopped: `stuck[rank]` is the action (buffered sends) or the
    operation (blocking sends) it can never get past."""
    sends: str
    stuck: dict
    ran: int
    total: int

    def __str__(self):
        where = "; ".join(f"stage {rank} stopped before {what}" for rank, what in
                          sorted(self.stuck.items()))
        return (f"deadlock with {self.sends} sends: {where} ({self.ran} of {self.total} "
                f"actions ran)")


def simulate(schedule, m: int, v: int | None = None, layout: str = "loop"):
    """Buffered sends, unit costs: (timeline, deadlock). timeline[(rank, action)] = (start, end)
    for every action that ran, as Fractions; deadlock is None or a Deadlock."""
    schedule = normalise(schedule)
    v = chunks_of(schedule) if v is None else v
    graph, p = _Graph(schedule, m, v, layout), len(schedule)
    position, free, end, timeline = [0] * p, [Fraction(0)] * p, {}, {}
    progressed = True
    while progressed:
        progressed = False
        for rank in range(p):
            while position[rank] < len(schedule[rank]):
                a = schedule[rank][position[rank]]
                ready = _ready_time(graph, rank, a, end)
                if ready is None:
                    break
                start = max(ready, free[rank])
                free[rank] = end[(rank, a)] = start + unit_cost(a.kind, v)
                timeline[(rank, a)] = (start, free[rank])
                position[rank] += 1
                progressed = True
    total = sum(map(len, schedule))
    if len(timeline) == total:
        return timeline, None
    stuck = {rank: schedule[rank][position[rank]] for rank in range(p)
             if position[rank] < len(schedule[rank])}
    return timeline, Deadlock("buffered", stuck, len(timeline), total)


def simulate_blocking_sends(schedule, m: int, v: int | None = None, layout: str = "loop"):
    """Blocking (rendezvous) sends: None if every stage finishes, else a Deadlock whose `stuck`
    says which operation each stage is blocked in ("send activation of F1 to stage 1")."""
    schedule = normalise(schedule)
    v = chunks_of(schedule) if v is None else v
    graph, p = _Graph(schedule, m, v, layout), len(schedule)
    programs = []                     # per rank: [("recv", producer_rank, producer, what) |
    for rank, actions in enumerate(schedule):        # ("compute", a) | ("send", to, a, what)]
        program = []
        for a in actions:
            program += [("recv", r, x, what) for r, x, what in graph.inputs(rank, a) if r != rank]
            program.append(("compute", a))
            program += [("send", to, a, what) for to, what in graph.sends(rank, a)]
        programs.append(program)
    position, done = [0] * p, set()
    progressed = True
    while progressed:
        progressed = False
        for rank in range(p):
            while position[rank] < len(programs[rank]):
                op = programs[rank][position[rank]]
                if op[0] == "compute":
                    if any(r == rank and (r, x) not in done for r, x, _ in
                           graph.inputs(rank, op[1])):
                        break
                    done.add((rank, op[1]))
                    position[rank] += 1
                    progressed = True
                    continue
                peer = op[1]
                if position[peer] >= len(programs[peer]):
                    break
                other = programs[peer][position[peer]]
                if op[0] == "send":
                    match = other[:3] == ("recv", rank, op[2])
                else:
                    match = other[0] == "send" and other[1] == rank and other[2] == op[2]
                if not match:
                    break
                position[rank] += 1
                position[peer] += 1
                progressed = True
    if all(position[r] == len(programs[r]) for r in range(p)):
        return None

    def describe(op):
        if op[0] == "compute":
            return f"{op[1]} (its own input is not ready)"
        if op[0] == "send":
            return f"send of the {op[3]} of {op[2]} to stage {op[1]}"
        return f"receive of the {op[3]} of {op[2]} from stage {op[1]}"
    stuck = {r: describe(programs[r][position[r]]) for r in range(p)
             if position[r] < len(programs[r])}
    return Deadlock("blocking", stuck, len(done), sum(map(len, schedule)))


def peak_alive(schedule) -> list:
    """Per stage: the most (microbatch, chunk) activations held at once, walking the stage's own
    order: a forward stores them, the last piece of its backward (B, or W) frees them."""
    peaks = []
    for actions in normalise(schedule):
        alive = peak = 0
        for a in actions:
            alive += 1 if a.kind == "F" else (-1 if a.kind in "BW" else 0)
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


def link_order(schedule, m: int, v: int | None = None, layout: str = "loop") -> list:
    """Links on which the receiver consumes messages in another order than the sender sent them,
    as sentences. gloo matches messages by tag and does not mind; NCCL ignores tags and delivers
    in order, so an executor on NCCL needs this list empty (or a receive posted per message)."""
    schedule = normalise(schedule)
    v = chunks_of(schedule) if v is None else v
    graph, p = _Graph(schedule, m, v, layout), len(schedule)
    sent, received = {}, {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            for to, what in graph.sends(rank, a):
                sent.setdefault((rank, to), []).append((what, a.microbatch, a))
            for frm, x, what in graph.inputs(rank, a):
                if frm != rank:
                    received.setdefault((frm, rank), []).append((what, x.microbatch, x))
    problems = []
    for link, order in sorted(sent.items()):
        if [x for _, _, x in order] != [x for _, _, x in received.get(link, [])]:
            problems.append(f"stage {link[0]} -> stage {link[1]}: sent "
                            f"{' '.join(str(x) for *_, x in order)}, consumed "
                            f"{' '.join(str(x) for *_, x in received.get(link, []))}")
    return problems


@dataclasses.dataclass
class Report:
    """What check_schedule found. Times are in units of one stage's forward (Fractions)."""
    p: int
    m: int
    v: int
    problems: list
    deadlock: Deadlock | None
    blocking_deadlock: Deadlock | None
    timeline: dict
    makespan: Fraction
    busy: list
    bubble: Fraction | None
    peak_alive: list
    link_order: list

    @property
    def ok(self) -> bool:
        """Complete and deadlock-free (with buffered sends)."""
        return not self.problems and self.deadlock is None

    def __str__(self):
        lines = [f"p = {self.p}, m = {self.m}, v = {self.v}: "
                 + ("complete" if not self.problems else f"{len(self.problems)} problems")]
        lines += [f"  {problem}" for problem in self.problems[:8]]
        lines.append(f"  buffered sends: {self.deadlock or 'deadlock-free'}")
        lines.append(f"  blocking sends: {self.blocking_deadlock or 'deadlock-free'}")
        if self.bubble is not None:
            lines.append(f"  makespan {float(self.makespan):g}, bubble {float(self.bubble):.4f} "
                         f"({self.bubble})")
        lines.append(f"  peak alive per stage {self.peak_alive}")
        lines.append(f"  link order: {'as sent' if not self.link_order else self.link_order}")
        return "\n".join(lines)

    def raise_if_not_ok(self) -> None:
        if self.problems:
            raise ValueError(f"the schedule is incomplete: {'; '.join(self.problems[:5])}")
        if self.deadlock is not None:
            raise ValueError(f"the schedule cannot finish: {self.deadlock}")


def check_schedule(schedule, m: int, v: int | None = None, layout: str = "loop") -> Report:
    """Check a schedule for p = len(schedule) stages and m microbatches (v chunks per stage,
    read from the schedule by default): structure, deadlocks under both send models, the unit-cost
    timeline and bubble, peak activations alive, link order. layout: where a rank's chunks sit
    in the model, "loop" (chunk c of rank r = virtual stage c p + r) or "v" (two chunks, r and
    2p - 1 - r: ZB-V, DualPipeV). Never raises on a bad schedule: the report says what is wrong
    (`report.raise_if_not_ok()` to stop)."""
    schedule = normalise(schedule)
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"m must be an integer >= 1, got {m!r}")
    v = chunks_of(schedule) if v is None else v
    p = len(schedule)
    problems = validate(schedule, m, v)
    if layout == "v" and v != 2:
        raise ValueError(f"the V layout has exactly two chunks per rank, the schedule has v = {v}")
    timeline, deadlock = simulate(schedule, m, v, layout)
    blocking = simulate_blocking_sends(schedule, m, v, layout)
    makespan = max((end for _, end in timeline.values()), default=Fraction(0))
    busy = [sum((unit_cost(a.kind, v) for a in actions), Fraction(0)) for actions in schedule]
    bubble = None
    if not problems and deadlock is None and makespan:
        bubble = 1 - sum(busy) / (p * makespan)
    return Report(p, m, v, problems, deadlock, blocking, timeline, makespan, busy, bubble,
                  peak_alive(schedule), link_order(schedule, m, v, layout) if not problems else [])


# ---- the formulas the chapter checks -----------------------------------------------------------

def bubble_formula(p: int, m: int, v: int = 1) -> Fraction:
    """Bubble as a fraction of the step: (p-1) / (v m + p - 1). GPipe and 1F1B (v = 1): the
    idle (p-1)(t_F + t_B) of each stage over its m(t_F + t_B) + (p-1)(t_F + t_B). Interleaved
    (Narayanan et al. 2021): the idle time shrinks to (p-1)(t_F + t_B)/v."""
    return Fraction(p - 1, v * m + p - 1)


def bubble_ratio_formula(p: int, m: int, v: int = 1) -> Fraction:
    """Bubble over ideal time, as Narayanan et al. 2021 state it: (p-1)/m, (p-1)/(v m)
    interleaved. ratio = fraction / (1 - fraction)."""
    return Fraction(p - 1, v * m)
