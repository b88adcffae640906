"""The self-check of chapter 5 ("Check yourself"): the reader answers first, then `check` says
which answers are right and why. The answers are computed here, from the chapter's functions,
when the check runs, so the notebook's visible source never shows them.

    from labkit.pipeline import selfcheck
    _ = selfcheck.check(answers)        # answers = {"q1": None, ..., "q5": None}
"""
from __future__ import annotations


def questions() -> dict:
    """{question: (right answer, how it is derived)}, in the chapter's order."""
    from labkit import pipeline
    p, t_f, t_i, t_w = 6, 1, 1, 1                  # question 5: six stages, unit costs
    return {
        "q1": (float(pipeline.bubble_formula(8, 24)), "GPipe's bubble is (p-1)/(m+p-1)"),
        "q2": (float(pipeline.bubble_ratio_formula(8, 24, 4)),
               "relative to the ideal time, interleaving gives (p-1)/(v m)"),
        "q3": (tuple(pipeline.check_schedule(pipeline.torch_schedule("1F1B", 8, 64), 64)
                     .peak_alive[k] for k in (0, 7)),
               "1F1B holds min(m, p - k) on stage k, however large m is"),
        "q4": (pipeline.check_schedule(pipeline.parse("F0 F1 B1 B0\nF1 F0 B0 B1"), 2).deadlock is None,
               "simulate it: run any action whose inputs exist, until nothing can move"),
        "q5": (((p - 1) * (t_f + t_i + t_w), (p - 1) * (t_f + t_i - t_w)),
               "1F1B idles (p-1)(t_F + t_I + t_W) per stage, zero bubble (p-1)(t_F + t_I - t_W)"),
    }


def _right(given, right) -> bool:
    return given == right or (isinstance(right, float) and isinstance(given, (int, float))
                              and abs(given - right) < 1e-3)


def check(answers: dict) -> dict:
    """Print a verdict for each question; return {question: None (not answered: nothing of the
    answer is shown), True or False}."""
    verdicts = {}
    for key, (right, why) in questions().items():
        given = answers.get(key)
        given = tuple(given) if isinstance(given, list) else given
        if given is None:
            print(f"{key}: not answered yet")
            verdicts[key] = None
        elif _right(given, right):
            print(f"{key}: right. {why}")
            verdicts[key] = True
        else:
            print(f"{key}: you said {given!r}; not quite. {why}")
            verdicts[key] = False
    return verdicts
