"""Every lab, graded with `labkit grade` exactly as an instructor runs it: the solution earns full
marks, the untouched student copy zero, and answers that only pass the visible tests lose the
points of the hidden ones. A lab whose grading is broken cannot land."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from grading_helpers import needs_root_sandbox, strip_hidden
from labkit.tools import release

ROOT = Path(__file__).resolve().parents[2]
LABS = release.lab_sources(ROOT)

# Answers that pass the visible tests but not the hidden ones: {lab: (answer cell's grade_id,
# a function of the solution's source that returns the wrong answer)}. They prove the hidden tests
# are restored and run at grading time.
VISIBLE_ONLY = {
    "lab00_first_collectives": ("task3_global_mean", lambda _: '''
def global_mean(local_values):
    mean = torch.tensor([local_values.mean().item()], dtype=torch.float64)
    dist.all_reduce(mean)                      # the mean of the per-rank means
    return mean.item() / dist.get_world_size()
'''),
    # a ZB-H2 that refuses one stage: the visible tests use p = 4, the hidden ones p = 1 too
    "lab05_pipeline_parallel": ("task1_zb_h2", lambda source: source.replace(
        "if p < 1 or m < 1:", "if p < 2 or m < 1:")),
}

# Issue 11's classes of forged or dodged answers, graded in the same run as the solution: {lab:
# {student: (answer cell's grade_id, a function of the solution's source, a scratch cell or None,
# the exact score)}. Lab 1's ring is 5 of its 10 points (values 2, any world 1, traffic 2).
_RING = "def ring_all_reduce(tensor, op=\"sum\"):\n"
_OPS = "    if op not in (\"sum\", \"max\"):\n        raise ValueError(op)\n"
ATTACKS = {
    "lab01_collectives": {
        # 1: the grader's helper in the kernel replaced; it hands over, for every task name, a
        # function that needs no communication
        "forged_plumbing": ("task1_ring_all_reduce", lambda source: source, '''
import types, cloudpickle
import labkit.grading._kernel_side as real_helper
def without_talking(tensor, *rest, **more):
    return tensor.mul_(dist.get_world_size()) if hasattr(tensor, "mul_") else 0.0
forged = types.ModuleType("forged")
forged.export = lambda names: real_helper._send(
    {n: {"kind": "callable", "blob": cloudpickle.dumps(without_talking)} for n in names})
__labkit_grading__ = forged''', 0),
        # 2: every rank's input recomputed from the first edition's rule, no communication
        "predicted_inputs": ("task1_ring_all_reduce", lambda _: _RING + '''
    total = torch.zeros_like(tensor)
    for r in range(dist.get_world_size()):
        g = torch.Generator().manual_seed(1000 * r + tensor.numel())
        total += torch.randint(-20, 21, tensor.shape, generator=g).to(tensor.dtype)
    tensor.copy_(total)
    return tensor''', None, 5),
        # 3: the work done by a collective, the records rewritten to look like a ring
        "forged_records": ("task1_ring_all_reduce", lambda _: _RING + _OPS + '''
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    from labkit.runtime import hooks
    for record in list(hooks.STATE.records or []) + list(hooks.STATE.recent):
        record["op"] = "isend"
    return tensor''', None, 8),
        # 3: the work through a ProcessGroup method, dummy messages of the ring's sizes
        "process_group": ("task1_ring_all_reduce", lambda _: _RING + _OPS + '''
    P, rank = dist.get_world_size(), dist.get_rank()
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    dist.group.WORLD.allreduce([tensor], options).wait()
    chunk = torch.zeros(-(-tensor.numel() // P), dtype=tensor.dtype)
    for _ in range(2 * (P - 1)):
        sending = dist.isend(chunk, (rank + 1) % P)
        dist.irecv(torch.empty_like(chunk), (rank - 1) % P).wait()
        sending.wait()
    return tensor''', None, 8),
        # 4: nothing done, nothing returned
        "empty": ("task1_ring_all_reduce", lambda _: _RING + "    return None", None, 5),
        # 5: the ring right, its sums in float32 (exact for small integers only): the traffic
        # test checks the values of the same call, so all five ring points are lost
        "narrow": ("task1_ring_all_reduce", lambda source: source.replace(
            "mine.add_(received)", "mine.copy_((mine.float() + received.float()).to(mine.dtype))"),
            None, 5),
    },
    # 6: a synchroniser that sends everything from finish() is one of lab 2's graded wrong
    # answers (tests/grading/wrong_answers/lab02_data_parallel.py)
}

from attacks_rank_side import RANK_SIDE_ATTACKS                     # noqa: E402 (after ATTACKS)

for _lab, _attacks in RANK_SIDE_ATTACKS.items():                     # one answer cell or several
    ATTACKS.setdefault(_lab, {}).update(
        {student: (answers, None, scratch, score)
         for student, (answers, scratch, score) in _attacks.items()})

import wrong_answers                                                  # noqa: E402

for _lab, _wrong in wrong_answers.load().items():                    # issue 26, per lab
    assert _lab in LABS, f"tests/grading/wrong_answers/{_lab}.py names no lab"
    clash = set(_wrong) & set(ATTACKS.get(_lab, {}))
    assert not clash, f"{_lab}: student names used twice: {sorted(clash)}"
    ATTACKS.setdefault(_lab, {}).update(
        {student: (answers, None, scratch, score)
         for student, (answers, scratch, score) in _wrong.items()})

# issue 26: the test cells of each lab that no wrong answer graded here fails yet (in notebook
# order) are each wrong-answers module's UNCOVERED. The list only shrinks: add a wrong answer
# (tests/grading/wrong_answers/<lab>.py) that fails the cell and passes the others of its
# submission, then take the cell out.
UNCOVERED = wrong_answers.uncovered()

pytestmark = [needs_root_sandbox(), pytest.mark.timeout(900),
              pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")]


def as_submitted(source: Path, answers: dict | None = None,
                 scratch: str | None = None) -> nbformat.NotebookNode:
    """The lab as a student hands it in: the source's answer cells (or `answers`: grade_id ->
    function of the source), the test cells as released (hidden tests stripped), and a scratch
    cell of the student's after the setup cells."""
    nb = nbformat.read(str(source), as_version=4)
    if scratch:
        last_setup = max(i for i, c in enumerate(nb.cells)
                         if c.metadata.get("nbgrader", {}).get("locked")
                         and not c.metadata["nbgrader"].get("grade")
                         and c.metadata["nbgrader"].get("grade_id") != "teardown"
                         and i < next(j for j, d in enumerate(nb.cells)
                                      if d.metadata.get("nbgrader", {}).get("solution")))
        nb.cells.insert(last_setup + 1, nbformat.v4.new_code_cell(scratch))
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade") and not meta.get("solution"):
            cell.source = strip_hidden(cell.source)
        if meta.get("solution") and answers and meta.get("grade_id") in answers:
            changed = answers[meta["grade_id"]](cell.source)
            assert changed != cell.source or scratch, \
                f"the wrong answer for {meta['grade_id']} is the solution"
            cell.source = changed.strip()
    return nb


def grade_with_cli(lab: str, submissions: dict, tmp: Path) -> dict:
    """`labkit grade LAB DIR --jobs 2 --out OUT`; returns {student: (score, max)}."""
    folder = tmp / "submissions"
    for student, nb in submissions.items():
        (folder / student).mkdir(parents=True)
        nbformat.write(nb, str(folder / student / f"{lab}.ipynb"))
    out = tmp / "out"
    command = [sys.executable, "-m", "labkit", "grade", lab, str(folder), "--jobs", "2",
               "--out", str(out), "--course", str(ROOT)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=840,
                          env=dict(os.environ, PATH=f"{Path(sys.executable).parent}:"
                                                    f"{os.environ.get('PATH', '')}"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out / "grades.csv") as f:
        rows = {r["student_id"]: r for r in csv.DictReader(f)}
    print(done.stdout[-2000:])
    from labkit.grading.report import ClassRecord
    record = ClassRecord("sqlite:///" + str(out / "gradebook.db"))
    try:
        failed = {student: set(row["failures"]) for student, row in record.rows(lab).items()}
    finally:
        record.close()
    return {s: (float(r["score"]), float(r["max_score"]), r["problems"], failed.get(s, set()))
            for s, r in rows.items()}


def _task(grade_id: str) -> str:
    """'task2' for the answer cell task2_norm_and_step and for the test cell test_task2_norm."""
    return grade_id.removeprefix("test_").split("_")[0]


def covered_cells(cells: list, scores: dict, changed: dict) -> set:
    """The test cells (of `cells`) that some graded wrong answer fails while it passes every cell
    of the tasks it left alone and, where its task has several cells, at least one of them: a
    mistake that shows this cell is needed, not a submission that breaks everything (a
    scratch-cell attack that zeroes the lab covers nothing)."""
    per_task = {}
    for cell in cells:
        per_task.setdefault(_task(cell), set()).add(cell)
    covered = set()
    for student, (_, _, _, failed) in scores.items():
        tasks = {_task(g) for g in changed.get(student, ())}
        if not tasks or any(_task(c) not in tasks for c in failed):
            continue
        for cell in failed & set(cells):
            siblings = per_task[_task(cell)]
            if len(siblings) == 1 or siblings - failed:
                covered.add(cell)
    return covered


def graded_cells(source: Path) -> list:
    """The grade_ids of the lab's graded test cells, in notebook order."""
    from labkit.grading import notebook as nbtools
    return [c.metadata.nbgrader["grade_id"] for c in nbformat.read(str(source), as_version=4).cells
            if nbtools.role(c) == "test"]


@pytest.mark.parametrize("lab", LABS)
def test_solution_full_marks_blank_zero(lab, tmp_path):
    source = next((ROOT / "solutions" / lab).glob("*.ipynb"))
    released = ROOT / "labs" / lab / source.name
    assert released.exists(), f"labs/{lab}/{source.name} missing: run `make release`"
    submissions = {"solution": as_submitted(source),
                   "blank": nbformat.read(str(released), as_version=4)}
    changed = {}                                    # student -> the answer cells made wrong
    if lab in VISIBLE_ONLY:
        grade_id, answer = VISIBLE_ONLY[lab]
        submissions["visible-only"] = as_submitted(source, {grade_id: answer})
        changed["visible-only"] = {grade_id}
    for student, (grade_id, answer, scratch, _) in ATTACKS.get(lab, {}).items():
        answers = grade_id if isinstance(grade_id, dict) else {grade_id: answer}
        submissions[student] = as_submitted(source, answers, scratch)
        changed[student] = set(answers)
    scores = grade_with_cli(lab, submissions, tmp_path)
    attacks = {s: (scores[s][0], want, scores[s][2])
               for s, (_, _, _, want) in ATTACKS.get(lab, {}).items()}
    assert all(got == want for got, want, _ in attacks.values()), \
        f"{lab}: (score, expected, problems) per attack: {attacks}"
    score, max_score, problems, _ = scores["solution"]
    assert max_score > 0, f"{lab} has no graded test cells"
    assert score == max_score, f"{lab}: the solution scored {score} of {max_score} ({problems})"
    assert scores["blank"][0] == 0, f"{lab}: the blank copy scored {scores['blank']}"
    if lab in VISIBLE_ONLY:
        got = scores["visible-only"][0]
        assert 0 < got < max_score, \
            f"{lab}: an answer that passes only the visible tests scored {got} of {max_score}"
    # issue 26: every test cell is failed by at least one graded wrong or shortcut answer, so
    # none of its points is earned without the work; the cells not yet covered are listed in
    # UNCOVERED, exactly (a cell newly covered must leave the list, a cell newly uncovered fails)
    cells = graded_cells(source)
    covered = covered_cells(cells, scores, changed)
    uncovered = [c for c in cells if c not in covered]
    assert uncovered == UNCOVERED.get(lab, []), (
        f"{lab}: test cells that no graded wrong answer fails: {uncovered} "
        f"(UNCOVERED lists {UNCOVERED.get(lab, [])})")
