"""Shared pieces of the grading tests (a module with its own name: test files import it, never
`conftest`, which other test folders also have): the fixture lab, and submissions built from its
source notebook (answer cells replaced, hidden tests stripped as in a release)."""
import os
import sys

import nbformat
import pytest

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LAB = "labfx"
MAX_SCORE = 6.0
SOLVED = {
    "task_add": "def add(a, b):\n    return a + b",
    "task_scale": "def scale(x, k):\n    return x * k",
    "task_rank_sum": ("def rank_sum(x):\n    t = torch.tensor([float(x) + dist.get_rank()])\n"
                      "    dist.all_reduce(t)\n    return t.item()"),
}
HIDDEN_SENTINELS = ["HIDDEN_SENTINEL", "x_hidden_sentinel", "trace_hidden_sentinel"]


def needs_root_sandbox():
    from labkit.grading.sandbox import can_isolate
    ok, why = can_isolate()
    return pytest.mark.skipif(not ok, reason=f"grading sandbox not available here: {why}")


def strip_hidden(source):
    out, inside = [], False
    for line in source.splitlines():
        if "BEGIN HIDDEN TESTS" in line:
            inside = True
        elif "END HIDDEN TESTS" in line:
            inside = False
        elif not inside:
            out.append(line)
    return "\n".join(out)


def make_submission(course, folder, student, answers=None, edit=None, lab=LAB, solved=None):
    """Write folder/<student>/<lab>.ipynb from the lab's source: answers maps grade_id -> source
    (default: `solved`, the fixture lab's answers), test cells as released (hidden tests
    stripped); `edit(nb)` may change the notebook further (insert cells, tamper with tests...)."""
    nb = nbformat.read(os.path.join(course, "solutions", lab, f"{lab}.ipynb"), as_version=4)
    answers = dict(SOLVED if solved is None else solved, **(answers or {}))
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution"):
            cell.source = answers[meta["grade_id"]]
        elif meta.get("grade"):
            cell.source = strip_hidden(cell.source)
    if edit:
        edit(nb)
    os.makedirs(os.path.join(folder, student), exist_ok=True)
    nbformat.write(nb, os.path.join(folder, student, f"{lab}.ipynb"))


def insert_cell(nb, after_grade_id, source):
    """A scratch code cell (no nbgrader metadata) right after the cell `after_grade_id`."""
    index = next(i for i, c in enumerate(nb.cells)
                 if c.metadata.get("nbgrader", {}).get("grade_id") == after_grade_id)
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell(source))


def read_outputs(out, student):
    """All output text of a student's autograded notebook (what the grader recorded)."""
    nb = nbformat.read(os.path.join(out, "work", "autograded", student, LAB, f"{LAB}.ipynb"),
                       as_version=4)
    texts = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            texts.append(o.get("text", "") + o.get("evalue", "") + "".join(o.get("traceback", []))
                         + str(o.get("data", {}).get("text/plain", "")))
    return "\n".join(texts)


if "labkit" not in sys.modules:
    sys.path.insert(0, os.path.join(os.path.dirname(FIXTURES), "..", "..", "utils"))


def make_class(root, n):
    """A copy of the fixture course under `root` and `n` submissions to it, a third of them right,
    a third with a wrong `add`, a third with a wrong `rank_sum`: (course, submissions folder)."""
    import shutil
    course, subs = os.path.join(root, "course"), os.path.join(root, "subs")
    shutil.copytree(os.path.join(FIXTURES, "solutions"), os.path.join(course, "solutions"))
    variants = [{}, {"task_add": "def add(a, b):\n    return a - b"},
                {"task_rank_sum": "def rank_sum(x):\n    return 3.0"}]
    for i in range(n):
        make_submission(course, subs, f"student{i:02d}", variants[i % len(variants)])
    return course, subs
