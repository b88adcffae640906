"""Chapter 0 (`course/00_the_lab_environment.ipynb`) and lab 0: the self-check of the first
all_reduce, and lab 0's own checkers (strict error messages, exact inputs drawn fresh per case).

    basics.check_prediction(prediction, world_size)     # the reader predicted, then ran
    basics.check_length_message(message, lengths)       # lab 0, task 2: the refusal names them

The answers are computed here when a check runs; a prediction left at None is not checked and its
answer is not shown.
"""
from __future__ import annotations

import math
import re


def first_all_reduce_result(world_size: int) -> list:
    """What every rank holds after all_reduce(SUM) of [r + 1, 1] over P ranks."""
    P = world_size
    return [[P * (P + 1) / 2, float(P)] for _ in range(P)]


def check_prediction(prediction, world_size: int) -> bool:
    """Chapter 0, section 3: compare the reader's prediction with the rule, and explain."""
    if prediction is None:
        print("No prediction yet: set `prediction` in the cell above (one list per rank), run "
              "that cell, then this one.")
        return False
    expected = first_all_reduce_result(world_size)
    P = world_size
    try:
        right = (len(prediction) == P and all(
            len(row) == 2 and all(math.isclose(float(a), b) for a, b in zip(row, want))
            for row, want in zip(prediction, expected)))
    except TypeError:
        right = False
    why = (f"every rank holds the same values: the first entry is 1 + 2 + ... + P = P(P + 1)/2 "
           f"= {P * (P + 1) // 2}, the second is P = {P}, because each rank contributed a 1 and "
           "summing ones counts the ranks")
    if right:
        print(f"Right: {why}.")
    else:
        print(f"Not quite: you predicted {prediction!r}, the ranks hold {expected!r}; {why}.")
    return right


def check_length_message(message: str, lengths: list) -> None:
    """Lab 0, task 2: the ValueError for ragged inputs must list the length on every rank.

    Accepted: every length appears as a number of its own, in rank order (for example
    "per rank: [2, 1, 2]" or "rank 0 has 2, rank 1 has 1, rank 2 has 2"). A message that only
    says the lengths differ, or names them out of order, fails.
    """
    numbers = [int(n) for n in re.findall(r"(?<![\w.])\d+(?![\w.])", str(message))]
    position = 0
    for length in lengths:
        try:
            position = numbers.index(length, position) + 1
        except ValueError:
            raise AssertionError(
                f"the error message {str(message)!r} does not list every rank's length in rank "
                f"order; the lengths were {lengths}: say what each rank passed (for example "
                f"'per rank: {lengths}')") from None
