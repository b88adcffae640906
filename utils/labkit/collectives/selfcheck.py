"""Self-checks that ask first: the reader types an answer, then a cell checks and explains it.

    answers = {"ring bytes": None, ...}        # the reader replaces each None
    selfcheck.check(answers, selfcheck.chapter1())

A question left at None is reported as not answered, and its answer is not shown. The right
answers are computed from the chapter's formulas when the check runs (never typed in here), so
the check and the chapter cannot disagree. Chapters 0 and 2 use `check` with their own questions
(`labkit.basics.chapter0_questions`, `labkit.dp.selfcheck`).
"""
from __future__ import annotations

import math

from labkit.collectives import busbw, ring_all_reduce_time, ring_bytes_sent


def _matches(given, right, rel_tol: float) -> bool:
    if isinstance(right, bool):
        return isinstance(given, bool) and given is right
    if isinstance(right, str):
        return str(given).strip().lower().replace("_", "-").replace(" ", "-") == right
    if isinstance(right, (tuple, list)):
        return (isinstance(given, (tuple, list)) and len(given) == len(right)
                and all(_matches(g, r, rel_tol) for g, r in zip(given, right)))
    try:
        return math.isclose(float(given), float(right), rel_tol=rel_tol)
    except (TypeError, ValueError):
        return False


def check(answers: dict, questions: dict, rel_tol: float = 1e-2) -> int:
    """Print a verdict for every answered question (and why); return how many are right.

    questions: {key: (right answer, how it is derived)}. Numbers are compared within rel_tol
    (1% by default: answers worked out by hand are rounded), booleans and strings exactly.
    """
    unknown = sorted(set(answers) - set(questions))
    if unknown:
        raise KeyError(f"no question named {unknown}; the questions are {sorted(questions)}")
    right = answered = 0
    for key, (expected, why) in questions.items():
        given = answers.get(key)
        if given is None:
            print(f"{key}: not answered yet (replace None with your answer, then run this cell)")
            continue
        answered += 1
        if _matches(given, expected, rel_tol):
            right += 1
            print(f"{key}: right. {why}")
        else:
            print(f"{key}: {given!r} is not it; the answer is {expected!r}. {why}")
    print(f"{right} of {len(questions)} right" + ("" if answered else
                                                     ": answer the questions above first"))
    return right


def chapter1() -> dict:
    """The questions of chapter 1, section 7."""
    return {
        "ring bytes": (
            ring_bytes_sent("all_reduce", 1e9, 8),
            "2(P - 1)/P n = 2 x 7/8 x 1e9 = 1.75e9 bytes per rank"),
        "busbw": (
            busbw("all_reduce", 1e9, 0.5, 8),
            "algbw = n / t = 2e9 B/s; busbw = algbw x 2(P - 1)/P = 3.5e9 B/s"),
        "all_gather input shape": (
            (8 * 1024 * 1024 // 4,),
            "all_gather's output is [N]; each of the P ranks hands in one block [N/P]"),
        "ring time ms": (
            1e3 * ring_all_reduce_time(40e6, 4, 10e-6, 1 / 10e9),
            "2(P - 1)(alpha + n/P beta) = 6 x (10 us + 10 MB / 10 GB/s) = 6 x 1.01 ms"),
        "bytes grow with P": (
            False,
            "2(P - 1)/P n is below 2n for every P: the bytes per rank barely move, the number "
            "of steps (latencies) grows"),
        "ring neighbour at P=2": (
            True,
            "with two ranks, the rank to the left and the rank to the right are the same rank, "
            "so a byte count at P = 2 cannot show which way a ring turns"),
    }
