"""Lab 5's references that stay with the grader (never in a student's labkit).

gpipe_bubble (task 4): GPipe's bubble with per-stage costs and a latency, in closed form. It
answers bubble_fraction for every GPipe schedule; lab 5's hidden tests import it from here (the
visible test's expected value is the textbook formula).

zb_h2 (task 1): a ZB-H2 schedule for any p and m; the tests check that it meets every bound the
lab's checkers grade (labkit.pipeline.checks.zb_h2_idle, zb_h2_memory_bound), so the bounds are
reachable.
"""
from __future__ import annotations


def gpipe_bubble(costs: list, m: int, latency: float = 0.0) -> float:
    """GPipe's bubble with per-stage costs f_k, b_k and a message time: the step takes
    sum_k (f_k + b_k) + 2 (p - 1) latency + (m - 1)(max f + max b) (a flow shop of identical jobs,
    forwards then backwards); each stage works m (f_k + b_k) of it."""
    p = len(costs)
    f, b = [c["F"] for c in costs], [c["B"] for c in costs]
    step = sum(f) + sum(b) + 2 * (p - 1) * latency + (m - 1) * (max(f) + max(b))
    return 1 - m * (sum(f) + sum(b)) / (p * step)


def zb_h2(p: int, m: int) -> list:
    """ZB-H2 (Qi et al. 2024, section 3.1): F, I, W per microbatch, at most min(m, 2p - 1)
    microbatches alive per stage, no idle time inside a stage's span once m >= 2p - 1.

    A unit-time list schedule: at every tick each stage runs, by priority, the I of its oldest
    microbatch whose gradient has arrived, else its next forward if it has arrived and the stage
    holds fewer than min(m, 2p - 1) microbatches, else its oldest waiting W, else nothing.
    """
    from labkit.pipeline.schedules import Action
    if not (isinstance(p, int) and isinstance(m, int)) or p < 1 or m < 1:
        raise ValueError(f"p and m must be integers >= 1, got p={p!r}, m={m!r}")
    cap = min(m, 2 * p - 1)
    out = [[] for _ in range(p)]
    f_end, i_end = {}, {}
    forwards, inputs, alive = [0] * p, [0] * p, [0] * p
    waiting = [[] for _ in range(p)]
    never = float("inf")
    t = 0
    while any(len(actions) < 3 * m for actions in out):
        ran = []
        for k in range(p):
            i, f = inputs[k], forwards[k]
            if i < f and f_end[(k, i)] <= t and (k == p - 1 or i_end.get((k + 1, i), never) <= t):
                ran.append((k, Action("I", i)))
            elif f < m and alive[k] < cap and (k == 0 or f_end.get((k - 1, f), never) <= t):
                ran.append((k, Action("F", f)))
            elif waiting[k]:
                ran.append((k, Action("W", waiting[k][0])))
        for k, a in ran:
            out[k].append(a)
            if a.kind == "I":
                i_end[(k, a.microbatch)] = t + 1
                inputs[k] += 1
                waiting[k].append(a.microbatch)
            elif a.kind == "F":
                f_end[(k, a.microbatch)] = t + 1
                forwards[k] += 1
                alive[k] += 1
            else:
                waiting[k].pop(0)
                alive[k] -= 1
        t += 1
    return out
