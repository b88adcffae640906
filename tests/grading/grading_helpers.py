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


# --- the fixture class graded once, one at a time (test_class_scale's reference, test_parallel's
# serial side): name -> (answers, shard it must land in of 2, expected score) -----------------
KINDS = {
    "full": ({}, 0, 6.0),
    "slow": ({"task_scale": "import time\ntime.sleep(600)"}, 0, 4.0),   # a timeout, a restart
    "half": ({"task_rank_sum": "def rank_sum(x):\n    return 3.0"}, 1, 3.0),
    "wrong_add": ({"task_add": "def add(a, b):\n    return a * b"}, 1, 5.0),
}
CELL_TIMEOUT = 10


def student_names():
    """One id per kind, chosen so that each lands in the shard KINDS says (of 2)."""
    from labkit.grading.pipeline import in_shard
    names = {}
    for kind, (_, shard, _) in KINDS.items():
        n = 0
        while not in_shard(f"{kind}{n}", (shard, 2)):
            n += 1
        names[kind] = f"{kind}{n}"
    return names


def cli_env():
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def grade_command(course, subs, out, *extra):
    """`labkit grade` of the fixture lab, one submission at a time (extra options appended)."""
    return [sys.executable, "-m", "labkit.tools.cli", "grade", LAB, str(subs), "--out", str(out),
            "--course", str(course), "--jobs", "1", "--cell-timeout", str(CELL_TIMEOUT),
            *extra]
