"""Issue 26's graded wrong answers: one module per lab (`lab03_memory_and_zero.py`, ...), each
defining

    WRONG = {student: (answers, scratch, score)}

where `answers` is {answer cell's grade_id: function of that cell's solution source -> the wrong
source}, `scratch` a cell of the student's inserted after the setup cells (or None), and `score`
the exact score `labkit grade` must give. test_labs.py grades them in the same `labkit grade` run
as the lab's solution and blank copy, so each costs grading seconds: a submission may carry one
wrong answer per task (each losing only the cells of its own task), and the module's docstring
says which test cell each wrong answer is there to fail. A module's `UNCOVERED` lists the
lab's test cells that none of its wrong answers fails yet (test_labs checks the list exactly).

The per-cell coverage (every test cell failed by some wrong answer that passes the others) is
checked fast, outside nbgrader, by the chapter tests (tests/chapters, `lab_notebooks.run_lab`)."""
import importlib
import pkgutil


def edit(source: str, old: str, new: str) -> str:
    """`source` with `old` replaced by `new`; fails loudly when the solution no longer holds
    `old` (a wrong answer that silently became the solution would grade as full marks)."""
    if old not in source:
        raise ValueError(f"the solution changed: {old!r} is gone; update this wrong answer")
    return source.replace(old, new)


def swap(*pairs):
    """The wrong answer made by the edits (old, new) in turn, as a function of the source."""
    def wrong(source: str) -> str:
        for old, new in pairs:
            source = edit(source, old, new)
        return source
    return wrong


def uncovered() -> dict:
    """{lab: the test cells no wrong answer of its module fails yet} (a module's UNCOVERED, in
    notebook order; none when the module has no such list)."""
    return {info.name: list(getattr(importlib.import_module(f"{__name__}.{info.name}"),
                                    "UNCOVERED", []))
            for info in pkgutil.iter_modules(__path__)}


def load() -> dict:
    """{lab: WRONG} for every module of this folder."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found[info.name] = module.WRONG
    return found
