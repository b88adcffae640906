"""What the chapter tests need from a lab's nbgrader source (a module with its own name, imported
by the test files): its answer cells run in one namespace, and its test cells run against them.

    REF = answer_cells("lab07_mixture_of_experts", torch=torch, moe=moe)   # the reference
    outcome = run_lab("lab01_collectives", ["test_task1_ring_values"],
                      answers={"task1_ring_all_reduce": WRONG_RING})       # {test_id: error|None}
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def solution(lab: str) -> Path:
    return ROOT / "solutions" / lab / f"{lab}.ipynb"


class Node(dict):
    """A notebook's JSON object with attribute access (`cell.metadata.nbgrader`), as
    nbformat's NotebookNode gives it."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _node(value):
    if isinstance(value, dict):
        return Node({key: _node(item) for key, item in value.items()})
    if isinstance(value, list):
        return [_node(item) for item in value]
    return value


def notebook_cells(path) -> list:
    """The cells of a notebook file, each with `source` as one string and `metadata`.

    Read with json, not nbformat: these test modules are imported again in every rank that runs
    one of their functions (cloudpickle pickles a module's functions by reference), and importing
    nbformat costs a rank 1-4 s (jsonschema builds its IRI parsers at import, jsonschema #1428)."""
    import json
    with open(path, encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    for cell in cells:
        if isinstance(cell.get("source"), list):
            cell["source"] = "".join(cell["source"])
        cell.setdefault("metadata", {})
    return [_node(cell) for cell in cells]


def cells(lab: str) -> dict:
    """{grade_id: cell} of the lab's source notebook (cells without a grade_id are left out)."""
    found = {}
    for cell in notebook_cells(solution(lab)):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id:
            found[grade_id] = cell
    return found


def answer(lab: str, grade_id: str) -> str:
    """The source of one answer cell of the solution."""
    return cells(lab)[grade_id].source


def answer_cells(lab: str, answers: dict | None = None, **preset) -> dict:
    """Every answer cell of the solution (or `answers[grade_id]` instead), executed in one
    namespace that starts with `preset` (the modules and names the lab's setup cell imports)."""
    namespace = dict(preset, __name__="__main__")
    for grade_id, cell in cells(lab).items():
        if cell.metadata["nbgrader"].get("solution"):
            source = (answers or {}).get(grade_id, cell.source)
            exec(compile(source, f"{lab}:{grade_id}", "exec"), namespace)
    return namespace


def run_lab(lab: str, test_ids: list, answers: dict | None = None,
            setup: tuple = ("parameters", "setup")) -> dict:
    """The lab's `setup` cells, its answer cells (`answers`: grade_id -> replacement source),
    then the test cells `test_ids`, visible and hidden lines, in one namespace.
    Returns {test_id: None if it passed, else the error}."""
    by_id = cells(lab)
    namespace = {"__name__": "__main__"}
    for grade_id in setup:
        if grade_id in by_id:
            exec(compile(by_id[grade_id].source, f"{lab}:{grade_id}", "exec"), namespace)
    answer_cells_into = answer_cells(lab, answers, **{k: v for k, v in namespace.items()
                                                      if k != "__name__"})
    namespace.update(answer_cells_into)
    outcome = {}
    for test_id in test_ids:
        try:
            exec(compile(by_id[test_id].source, f"{lab}:{test_id}", "exec"), namespace)
            outcome[test_id] = None
        except Exception as error:            # noqa: BLE001 - a failing test cell, recorded
            outcome[test_id] = error
    return outcome


def wrong_answers(lab: str):
    """tests/grading/wrong_answers/<lab>.py as a module: the wrong answers `labkit grade` grades
    (combined into a few submissions there, tests/grading/test_labs.py), run one at a time here,
    so each is written once."""
    import importlib
    import sys
    grading = str(ROOT / "tests" / "grading")
    if grading not in sys.path:
        sys.path.insert(0, grading)
    return importlib.import_module(f"wrong_answers.{lab}")
