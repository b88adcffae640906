"""Instructor autograding for labs whose code runs on several ranks.

    labkit grade LAB SUBMISSIONS_DIR [--jobs N] [--out DIR]     # see docs/INSTRUCTORS.md

    from labkit.grading import grade
    report = grade("lab00_first_collectives", "incoming/", jobs=2)

nbgrader keeps the bookkeeping (gradebook, restored test cells, feedback); the verdicts come from a
trusted process in which no student code runs (trusted.py), while the student's cells run in a
sandboxed kernel (sandbox.py). For lab authors, `check` is the comparison to use in test cells.

Kept light on purpose: the sandboxed kernel imports labkit.grading._kernel_side.
"""


def grade(*args, **kwargs):
    from labkit.grading.pipeline import grade as _grade
    return _grade(*args, **kwargs)


def check(*args, **kwargs) -> None:
    """labkit.checks.check (kept here for lab sources that import it from labkit.grading)."""
    from labkit.checks import check as _check
    return _check(*args, **kwargs)
