"""The self-checks of chapter 10 (section 7): the reader answers first, then `check` says which
answers are right and why. The answers are computed here, from the chapter's formulas, when the
check runs, so the notebook's visible source never prints them.

    from labkit.context import selfcheck
    selfcheck.check([answer_1, answer_2, answer_3, answer_4, answer_5])
"""
from __future__ import annotations


def questions() -> list:
    """[(right answer, relative tolerance, how it is derived)], in the chapter's order."""
    from labkit import context
    return [
        (float(context.blocks_computed(8, 5, False)), 0, "plain split: rank r computes r + 1 blocks"),
        (float(context.blocks_computed(8, 5, True)), 1e-9,
         "balanced: (2P + 1)/4 = 17/4 for every rank"),
        (round(context.ring_bytes(1, 8, 131072, 128, 8, 2) / 1e6, 1), 1e-3,
         "2 (P-1) n_blk, n_blk = B H_kv (T/P) d e = 8 * 16384 * 128 * 2"),
        (round(context.ulysses_bytes(1, 64, 8, 131072, 128, 8, 2) / 1e6, 1), 1e-3,
         "(P-1)/P B (T/P) d e (2 H + 2 H_kv) = 7/8 * 16384 * 128 * 2 * 144"),
        (False, 0, "each rank takes whole heads: P must divide the 8 K/V heads"),
    ]


def check(answers: list) -> list:
    """One verdict per question: None (not answered: nothing of the answer is shown), True, False.
    Prints each verdict with its derivation."""
    found = questions()
    if len(answers) != len(found):
        raise ValueError(f"{len(found)} answers expected (answer_1 .. answer_{len(found)}), "
                         f"got {len(answers)}")
    verdicts = []
    for number, (given, (expected, tolerance, why)) in enumerate(zip(answers, found), start=1):
        if given is None:
            print(f"question {number}: not answered yet")
            verdicts.append(None)
            continue
        if isinstance(expected, bool) or not isinstance(given, (int, float)):
            right = given is expected
        else:
            right = abs(given - expected) <= tolerance * max(1.0, abs(expected))
        verdicts.append(right)
        print(f"question {number}: " + (f"right ({why})" if right else
                                        f"{given!r} is off; {why} = {expected}"))
    return verdicts
