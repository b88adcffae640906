"""Lab 8, task 4's reference: the wall time of an asynchronous run with at most one failure
(that failure may strike again during its restart), from the model's definition.

With no failure this is simulate_async's answer, and with one failure it is a simulator of the
task, so it stays with the grader. `labkit.checkpoint.checks_async` calls it through
`labkit.released.reference("checkpoint")`; the student copy gets the visible cases' rows and
values from `labs/lab08_checkpoints/expected.json`.
"""
from __future__ import annotations

import math

from labkit import checks as base

LAB = "lab08_checkpoints"
VISIBLE_SEED = 8004          # the visible test's cases in the student copy (expected.json)
VISIBLE_CASES = 12           # check_simulate_async's default


def _run_without_failure(t0, w0, work, tau, stall, write):
    """From wall time t0 at work position w0, no failure: (end time, [(durable time, work)])."""
    t, w, durable, last = t0, w0, [], None
    while True:
        segment = min(tau, work - w)
        t += segment
        w += segment
        if w >= work - 1e-12:
            return t, durable
        if last is not None and last > t:
            t = last                                     # one write in flight: wait for it
        t += stall
        last = t + write
        durable.append((last, w))


def one_failure_wall_time(work, tau, stall, write, restart, failure=None, during_restart=()):
    """The wall time of a run with at most one failure, from the model's definition; the
    failure may strike again during its restart, `during_restart` seconds into each one."""
    end, durable = _run_without_failure(0.0, 0.0, work, tau, stall, write)
    if failure is None or failure >= end:
        return end
    kept = max([w for when, w in durable if when <= failure], default=0.0)
    t = failure
    for delay in during_restart:
        if not 0 <= delay < restart:
            raise ValueError(f"a failure during a restart of {restart} s comes 0 to {restart} s "
                             f"into it, got {delay}")
        t += delay                                        # failed again: the restart starts over
    return _run_without_failure(t + restart, kept, work, tau, stall, write)[0]


def simulate_cases(case, cases: int) -> tuple[list, list]:
    """check_simulate_async's rows [work, tau, stall, write, restart, failures] and their wall
    times: runs with no failure and with one (anywhere: computing, copying, waiting for a write,
    with a write in flight, restarting), drawn from `case`. Besides 4 failures drawn uniformly
    over the run, each configuration has one in the middle of a copy and one with that
    checkpoint's write in flight (when write >= 1), both on the run's own schedule: a bug that
    shows only there (a random failure lands in a copy about 1 time in 10) fails every
    configuration, instead of surviving the draws with probability ~0.9 ** (4 x cases)."""
    rows, expected = [], []
    for _ in range(cases):
        tau = float(case.integer(20, 100))
        work = tau * case.integer(2, 8) + float(case.integer(0, 19))
        stall = float(case.integer(1, 10))
        write = float(case.integer(0, int(1.5 * tau)))
        restart = float(case.integer(0, 30))
        end, durable = _run_without_failure(0.0, 0.0, work, tau, stall, write)
        # on the snapshot schedule on purpose (issue 26, class 4): in the middle of a copy and
        # with a write in flight, of a checkpoint drawn from the run's own schedule
        when, _ = durable[case.integer(0, len(durable) - 1)] if durable else (None, None)
        scheduled = [] if when is None else \
            [when - write - stall / 2] + ([when - write / 2] if write >= 1 else [])
        for failure in [None] + [float(case.integer(0, int(end))) + 0.5 for _ in range(4)] \
                + scheduled:
            rows.append([work, tau, stall, write, restart, [] if failure is None else [failure]])
            expected.append(one_failure_wall_time(work, tau, stall, write, restart, failure))
        if restart >= 2:                                  # and again while restarting, twice
            failure = float(case.integer(0, int(end))) + 0.5
            delays = [float(case.integer(0, int(restart) - 1)) + 0.25 for _ in range(2)]
            times = [failure, failure + delays[0], failure + delays[0] + delays[1]]
            rows.append([work, tau, stall, write, restart, times[::-1]])    # not sorted
            expected.append(one_failure_wall_time(work, tau, stall, write, restart, failure,
                                                  delays))
    return rows, expected


def async_interval(stall: float, write: float, mtbf: float) -> float:
    """Lab 8, task 4's answer in the lab's model: a cycle is max(tau, write) + stall of wall time
    (training waits for the write in flight before the next copy) and computes tau, so
    lost(tau) ~ stall / tau + (tau / 2 + write + restart) / M for tau >= write (least at
    sqrt(2 stall M)) and falls with tau below write: tau* = max(write, sqrt(2 stall M))."""
    return max(write, math.sqrt(2 * stall * mtbf))


def released() -> dict:
    from labkit.checkpoint.checks_async import interval_cases
    case = base.Case("lab 8, task 4: simulate_async", seed=VISIBLE_SEED)
    rows, expected = simulate_cases(case, VISIBLE_CASES)
    interval = base.Case("lab 8, task 4: async_interval", seed=VISIBLE_SEED)
    interval_rows = interval_cases(interval, 8)
    return {"simulate_async": {"seed": VISIBLE_SEED, "rows": rows, "expected": expected},
            "async_interval": {"seed": VISIBLE_SEED, "rows": interval_rows,
                               "expected": [async_interval(*row) for row in interval_rows]}}
