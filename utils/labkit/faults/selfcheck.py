"""The self-checks of chapter 9 (`course/09_failures_at_scale.ipynb`): the reader answers first,
then these functions compare the answer with what the chapter measured and say why, so that no
answer stands in the visible source below its question. None of them answers a graded task of
lab 9.

    from labkit.faults import selfcheck
    selfcheck.straggler_wait(answer_wait, measured_wait, delay=0.1)   # section 3
    selfcheck.elastic_resume(answer_resume, answer_redone, summary)    # section 4
"""
from __future__ import annotations


def straggler_wait(answer, measured: float, delay: float, rel_tol: float = 0.3) -> bool:
    """Section 3: how long rank 0 waits inside the all-reduce per step while rank 1 sleeps
    `delay` s before it. `measured`: the median wait the chapter recorded. Right within
    `rel_tol` of the measurement. Returns whether the answer is right."""
    if answer is None:
        print("set answer_wait first (seconds), then run the cell again")
        return False
    right = abs(answer - measured) <= rel_tol * measured
    if right:
        print(f"right: rank 0 waited {measured:.3f} s per step (median) in the run above")
    else:
        print(f"not quite: rank 0 waited {measured:.3f} s per step, you said {answer:g} s. A rank "
              f"leaves an all-reduce only once the last rank has entered it, so rank 0 waits for "
              f"rank 1's extra {delay:g} s whatever its own work takes.")
    return right


def elastic_resume(answer_resume, answer_redone, summary: dict) -> bool:
    """Section 4: the step the first restart resumed from, and how many completed steps it did
    again. `summary`: `elastic.summary(...)` of the job the chapter ran. Prints a verdict per
    answer given; returns whether both are given and right."""
    if answer_resume is None and answer_redone is None:
        print("set answer_resume and answer_redone first, then run the cell again")
        return False
    resumed, redone = summary["resumed_from"], len(summary["redone"])
    right = True
    if answer_resume is not None:
        ok = answer_resume == resumed
        right &= ok
        print("resume step: right" if ok else
              f"resume step: {resumed}, you said {answer_resume} (the restarted ranks load the "
              f"newest complete snapshot taken before the kill)")
    if answer_redone is not None:
        ok = answer_redone == redone
        right &= ok
        print("steps done twice: right" if ok else
              f"steps done twice: {redone}, you said {answer_redone} (the steps that had "
              f"completed after that snapshot and before the kill are lost and done again)")
    return right and answer_resume is not None and answer_redone is not None
