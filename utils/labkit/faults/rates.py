"""Lab 9's graded batches: fresh runs of real ranks, many per launch, a student's rule run on
each, its false-alarm and detection rates counted (labkit.faults.checks uses this).

    runs = [rates.draw(kind, seed, P, ranges) for kind, seed in ...]   # what each run injects
    traces = rates.record(world, runs)        # one launch of the ranks records them all
    verdicts = rates.diagnose_each(world, diagnose, traces)   # the rule, on ranks, refused
                                                              # labkit.faults.detect

A run is drawn from its own seed (`draw`), so a missed run is named by its seed and recorded
again alone (`replay(run)` writes the traces.record_run call). Its kind says what was injected
(traces.record_run's faults, at the sizes the ranges allow):

    healthy    one-off pauses ("hiccups") of some ranks, no fault (runs 0 and 1 of a batch: one
               rank paused twice for the longest the range allows and nothing else, on purpose)
    straggler  one rank sleeps `delay` s before its collective in every step from a step in the
               first third on
    missing    one rank stops before a collective in the second half; the others give up after
               `timeout` s
    hot        about `share` of every rank's tokens go to one expert of 8

The sizes are drawn stratified (`stratum` i of n: the i-th n-th of the range), and the faulty
rank (expert) runs through every rank (expert) in turn: a batch of n runs spans the range and the
ranks on purpose (issue 26, class 4), so a rule tuned to one end of it, or one that never reads
some rank, misses a known number of runs, not a lucky few.

The student's rule runs on the world's ranks, the runs dealt round-robin (`diagnose_each`; task
2's streams in checks_guard), inside `labkit.refusal.refused`: every function of
`labkit.faults.detect` (chapter 9's rules) raises for the length of the call. Only plain data (the
traces; the batches as tokens) reaches it.
"""
from __future__ import annotations

import random

from labkit.faults import traces

KINDS = ("healthy", "straggler", "missing", "hot")
EXPERTS = 8
REFUSED = ("lab 9 asks for a rule of your own: labkit.faults.detect holds chapter 9's rules and "
           "cannot be used inside diagnose or SpikeGuard (the tests measure your rule's false "
           "alarms and detections, not the chapter's); write it with Python (statistics.median) "
           "and torch")


def _span(low, high, stratum, rng):
    """A value in the stratum-th of n equal parts of [low, high] (stratum = (i, n))."""
    i, n = stratum
    width = (high - low) / n
    return low + width * (i + rng.random())


def draw(kind: str, seed: int, size: int, ranges: dict, stratum=(0, 1)) -> dict:
    """What one run injects, from its own seed: {"kind", "seed", "steps", the record_run faults,
    "expected": the answer, "what": in words}. `ranges`: steps, hiccups (count, low, high),
    delay (low, high), share (low, high), timeout; `stratum` (i, n) places the fault's size in
    the i-th n-th of its range and its rank (expert) at i + ranges["offset"] mod P (mod 8)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    rng, i = random.Random(seed), stratum[0]
    steps = ranges.get("steps", 8)
    run = {"kind": kind, "seed": seed, "steps": steps, "experts": 0, "straggler": None,
           "delay": 0.0, "delay_from": 0, "hiccups": [], "skip": None, "hot_expert": None,
           "share": 0.5, "timeout": ranges.get("long_timeout", 4.0)}
    expected = {"straggler": None, "missing": None, "hot_expert": None}
    count, low, high = ranges.get("hiccups", (1, 0.05, 0.25))
    offset = ranges.get("offset", 0)      # the batch's: run i's faulty rank is i + offset
    faulty = (i + offset) % size if kind != "hot" else None
    pauses = {}
    for _ in range(count):                 # at most two per rank
        rank = rng.randrange(size)
        if pauses.get(rank, 0) < 2:
            pauses[rank] = pauses.get(rank, 0) + 1
            run["hiccups"].append((rank, rng.randrange(steps), round(rng.uniform(low, high), 3)))
    if kind == "healthy" and i < 2 and count >= 2:       # the worst on purpose: one rank paused
        rank, first = rng.randrange(size), rng.randrange(steps)        # twice, as long as allowed
        second = (first + 1 + rng.randrange(steps - 1)) % steps
        run["hiccups"] = [(rank, first, high), (rank, second, high)]
    what = ""
    if kind == "healthy":
        chosen = ranges.get("experts")
        run["experts"] = chosen if chosen is not None else (EXPERTS if rng.random() < 0.5 else 0)
        what = "a healthy run"
    elif kind == "straggler":
        run["straggler"], run["delay_from"] = faulty, rng.randrange(max(1, steps // 3))
        run["delay"] = round(_span(*ranges.get("delay", (0.04, 0.2)), stratum, rng), 3)
        run["hiccups"] = [h for h in run["hiccups"] if h[0] != faulty]
        expected["straggler"] = faulty
        what = (f"rank {faulty} sleeps {run['delay']} s in steps {run['delay_from']}.."
                f"{steps - 1}")
    elif kind == "missing":
        step = steps // 2 + rng.randrange(steps - steps // 2)
        run["skip"], run["timeout"] = (faulty, step), ranges.get("timeout", 1.0)
        run["hiccups"] = [h for h in run["hiccups"] if h[1] < step]
        expected["missing"] = faulty
        what = f"rank {faulty} never joins step {step}'s all-reduce"
    else:
        run["experts"] = EXPERTS
        run["hot_expert"] = (i + offset) % EXPERTS
        run["share"] = round(_span(*ranges.get("share", (0.3, 0.6)), stratum, rng), 3)
        run["hiccups"] = []
        expected["hot_expert"] = run["hot_expert"]
        what = f"expert {run['hot_expert']} gets {run['share']:.0%} of the tokens"
    if run["hiccups"]:
        what += " (pauses: " + ", ".join(f"rank {r} {s:.2f} s in step {t}"
                                          for r, t, s in run["hiccups"]) + ")"
    return dict(run, expected=expected, what=what)


def replay(run: dict, clock_skew: float = 1.0) -> str:
    """The traces.record_run call that records `run` again (the same faults, seed and clocks)."""
    args = [f"steps={run['steps']}"]
    if run["straggler"] is not None:
        args.append(f"straggler={run['straggler']}, delay={run['delay']}, "
                    f"delay_from={run['delay_from']}")
    if run["hiccups"]:
        args.append(f"hiccups={run['hiccups']}")
    if run["skip"] is not None:
        args.append(f"skip={tuple(run['skip'])}, timeout={run['timeout']}")
    if run["experts"]:
        args.append(f"experts={run['experts']}")
    if run["hot_expert"] is not None:
        args.append(f"hot_expert={run['hot_expert']}, share={run['share']}")
    return (f"traces.record_run(world, {', '.join(args)}, seed={run['seed']}, "
            f"clock_skew={clock_skew})")


def _record_each(shares, runs):
    """Rank program: traces._rank_program once per run, in turn (one launch, many runs). A run
    where a rank never joins ends in a collective that timed out on purpose, its group destroyed:
    the rank's record of a failed operation is cleared, so a later error on this rank is not
    taken for a broken world (labkit.runtime.hooks)."""
    from labkit.runtime import hooks
    out = []
    for share, run in zip(shares, runs):
        out.append(traces._rank_program(share, *run))
        hooks.STATE.failed_op = None
    return out


def record(world, runs: list, clock_skew: float = 1.0) -> list:
    """The traces of `runs` (drawn by `draw`), recorded on the world's ranks in one launch, each
    rank's clock skewed by up to `clock_skew` s (traces.skew_clocks, one offset per run and rank).
    Runs on ranks where no student code runs."""
    size = world.size
    shares = [[] for _ in range(size)]
    for run in runs:
        plan = traces.plan(size, run["steps"], run["straggler"], run["delay"], run["delay_from"],
                           run["hiccups"], run["skip"], run["hot_expert"], run["share"])
        for rank in range(size):
            shares[rank].append(plan[rank])
    common = [(run["steps"], run["experts"], run["timeout"], run["seed"]) for run in runs]
    seconds = sum(run["steps"] * (0.05 + run["delay"]) + sum(h[2] for h in run["hiccups"])
                  + (run["timeout"] if run["skip"] else 0) for run in runs)
    per_rank = world.run_each(_record_each, shares, common, timeout=3 * seconds + 60)
    out = []
    for i, run in enumerate(runs):
        trace = {"world_size": size, "steps": run["steps"],
                 "ranks": [per_rank[rank][i] for rank in range(size)]}
        out.append(traces.skew_clocks(trace, clock_skew, run["seed"]) if clock_skew > 0
                   else trace)
    return out


def _deal(items: list, size: int) -> list:
    """Round-robin: rank r gets items r, r + P, ..."""
    return [items[rank::size] for rank in range(size)]


def _undeal(per_rank: list, count: int) -> list:
    size = len(per_rank)
    return [per_rank[i % size][i // size] for i in range(count)]


def _diagnose_program(share, diagnose):
    """On a rank: the student's diagnose on each trace of this rank's share, with chapter 9's
    rules refused."""
    from labkit import refusal
    from labkit.faults import detect
    with refusal.refused(diagnose, detect, refusal.functions_of(detect), REFUSED):
        return [diagnose(trace) for trace in share]


def diagnose_each(world, diagnose, trace_list: list, timeout: float = 120) -> list:
    """diagnose(trace) for every trace, on the world's ranks (dealt round-robin); the answers in
    the order of `trace_list`."""
    per_rank = world.run_each(_diagnose_program, _deal(list(trace_list), world.size), diagnose,
                              timeout=timeout)
    _check_lengths(per_rank, [len(s) for s in _deal(list(trace_list), world.size)], "diagnose")
    return _undeal(per_rank, len(trace_list))


def _check_lengths(per_rank, wanted, what):
    for rank, (got, n) in enumerate(zip(per_rank, wanted)):
        if not isinstance(got, list) or len(got) != n:
            raise AssertionError(f"rank {rank}: the {what} calls returned {type(got).__name__}, "
                                 f"not one answer per call")
