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
    # a 1F1B that refuses one stage: the visible tests use p = 4, the hidden ones p = 1 too
    "lab05_pipeline_parallel": ("task1_one_f_one_b", lambda source: source.replace(
        "if p < 1 or m < 1:", "if p < 2 or m < 1:")),
}

pytestmark = [needs_root_sandbox(), pytest.mark.timeout(900),
              pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")]


def as_submitted(source: Path, answers: dict | None = None) -> nbformat.NotebookNode:
    """The lab as a student hands it in: the source's answer cells (or `answers`: grade_id ->
    function of the source), the test cells as released (hidden tests stripped)."""
    nb = nbformat.read(str(source), as_version=4)
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade") and not meta.get("solution"):
            cell.source = strip_hidden(cell.source)
        if meta.get("solution") and answers and meta.get("grade_id") in answers:
            changed = answers[meta["grade_id"]](cell.source)
            assert changed != cell.source, f"the wrong answer for {meta['grade_id']} is the solution"
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
    return {s: (float(r["score"]), float(r["max_score"]), r["problems"]) for s, r in rows.items()}


@pytest.mark.parametrize("lab", LABS)
def test_solution_full_marks_blank_zero(lab, tmp_path):
    source = next((ROOT / "solutions" / lab).glob("*.ipynb"))
    released = ROOT / "labs" / lab / source.name
    assert released.exists(), f"labs/{lab}/{source.name} missing: run `make release`"
    submissions = {"solution": as_submitted(source),
                   "blank": nbformat.read(str(released), as_version=4)}
    if lab in VISIBLE_ONLY:
        grade_id, answer = VISIBLE_ONLY[lab]
        submissions["visible-only"] = as_submitted(source, {grade_id: answer})
    scores = grade_with_cli(lab, submissions, tmp_path)
    score, max_score, problems = scores["solution"]
    assert max_score > 0, f"{lab} has no graded test cells"
    assert score == max_score, f"{lab}: the solution scored {score} of {max_score} ({problems})"
    assert scores["blank"][0] == 0, f"{lab}: the blank copy scored {scores['blank']}"
    if lab in VISIBLE_ONLY:
        got = scores["visible-only"][0]
        assert 0 < got < max_score, \
            f"{lab}: an answer that passes only the visible tests scored {got} of {max_score}"
