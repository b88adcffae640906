"""Lab 5, task 4's reference: GPipe's bubble with per-stage costs and a latency, in closed form.

It answers bubble_fraction for every GPipe schedule, so it stays with the grader; lab 5's hidden
tests import it from here (the visible test's expected value is the textbook formula).
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
