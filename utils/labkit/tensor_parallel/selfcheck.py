"""The self-check of chapter 4, section 8: the reader answers first, then this explains.

The right answers are computed from the chapter's formulas when the check runs; a question left
at None is skipped without showing its answer.
"""
from __future__ import annotations

import math

from labkit.tensor_parallel import tp_layer_bytes, vocab_parallel_ce_bytes


def _questions():
    """{key: (right answer, how it is derived)}."""
    loss = vocab_parallel_ce_bytes(8192, 4, itemsize=4)
    return {
        "column weight shape": (
            (16384 // 8, 4096),
            "a column-parallel layer splits W: [out, in] by rows (output features): [F/t, H]"),
        "block bytes": (
            tp_layer_bytes(1, 4096, 8192, 8, itemsize=2),
            "4 all-reduces (f and g of attention and MLP) of n = B T H b = 64 MiB, each "
            "2(t-1)/t n per rank: 4 x 2 x 7/8 x 67,108,864 B"),
        "g under sequence parallelism": (
            "reduce-scatter",
            "the partial sums are added and cut along the sequence: a reduce-scatter (its backward "
            "is an all-gather)"),
        "loss bytes": (
            loss,
            "three all-reduces of N values (max, sum of exponentials, target logit): "
            "3 x 2(t-1)/t x N x 4 B"),
        "loss bytes, vocabulary doubled": (
            loss,
            "the same: V never appears in what the ranks exchange"),
    }


def _matches(given, right) -> bool:
    if isinstance(right, str):
        words = str(given).lower().replace("_", "-").replace(" ", "-")
        return words in (right, right.replace("-", ""), "reducescatter")
    if isinstance(right, tuple):
        return isinstance(given, (tuple, list)) and tuple(given) == right
    try:
        return math.isclose(float(given), float(right), rel_tol=1e-3)
    except (TypeError, ValueError):
        return False


def self_check(answers: dict) -> int:
    """Print a verdict for every answered question; return how many are right."""
    questions = _questions()
    unknown = set(answers) - set(questions)
    if unknown:
        raise KeyError(f"no question named {sorted(unknown)}; the questions are "
                       f"{sorted(questions)}")
    right = 0
    for key, (expected, why) in questions.items():
        given = answers.get(key)
        if given is None:
            print(f"{key}: not answered yet")
        elif _matches(given, expected):
            right += 1
            print(f"{key}: right ({why})")
        else:
            print(f"{key}: {given!r} is not it; the answer is {expected!r}: {why}")
    print(f"{right} of {len(questions)} right")
    return right
