"""labs/ is the release of solutions/: in sync, complete, and free of solutions and hidden tests."""
import json
import re
import shutil
from pathlib import Path

import pytest

from labkit.tools import release

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIRS = ("course", "solutions", "labs")


def notebooks(*places):
    return sorted(p for place in places for p in (ROOT / place).rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in p.parts)


def test_every_lab_has_a_source_and_a_release():
    sources = release.lab_sources(ROOT)
    assert sources, "solutions/ holds no lab"
    released = sorted(p.name for p in (ROOT / "labs").iterdir() if p.is_dir())
    assert released == sources, (f"labs/ has {released}, solutions/ has {sources}: "
                                 "run `make release` (and delete labs without a source)")


@pytest.mark.timeout(120)
def test_labs_match_a_fresh_release():
    problems = release.sync_problems(ROOT)
    assert not problems, "\n".join(problems + ["fix: `make release`, then commit labs/"])


def test_no_solution_or_hidden_test_text_outside_solutions():
    problems = release.leak_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_leak_scan_finds_a_planted_leak(tmp_path):
    for place in ("solutions", "labs"):
        shutil.copytree(ROOT / place, tmp_path / place)
    (tmp_path / "course").mkdir()
    (tmp_path / "utils").mkdir()
    assert release.leak_problems(tmp_path) == []
    secret = max(release.secret_lines(tmp_path), key=len)  # one long line of a solution/hidden test
    (tmp_path / "utils" / "helper.py").write_text(f"def f():\n    {secret}\n")
    lab = next((tmp_path / "labs").iterdir())
    marker = "### " + "BEGIN " + "HIDDEN TESTS"
    (lab / "notes.md").write_text(f"{marker}\n")
    problems = "\n".join(release.leak_problems(tmp_path))
    assert "utils/helper.py: line 2 is text from solutions/" in problems
    assert "notes.md: line 1 holds an nbgrader marker" in problems


@pytest.mark.timeout(120)
def test_sync_check_finds_a_stale_copy_and_an_orphan(tmp_path):
    for place in ("solutions", "labs"):
        shutil.copytree(ROOT / place, tmp_path / place)
    shutil.copy(ROOT / "nbgrader_config.py", tmp_path)
    lab = release.lab_sources(tmp_path)[0]
    student_copy = next((tmp_path / "labs" / lab).glob("*.ipynb"))
    student_copy.write_text(student_copy.read_text().replace("YOUR CODE HERE", "my edit"))
    (tmp_path / "labs" / "lab99_gone").mkdir()
    problems = "\n".join(release.sync_problems(tmp_path))
    assert f"labs/{lab}/{student_copy.name}: differs from a fresh release" in problems
    assert "labs/lab99_gone: no source" in problems


@pytest.mark.parametrize("path", notebooks(*NOTEBOOK_DIRS), ids=lambda p: str(p.relative_to(ROOT)))
def test_notebook_is_committed_clean_with_a_parameters_cell(path):
    cells = json.loads(path.read_text())["cells"]
    dirty = [i for i, c in enumerate(cells) if c.get("outputs") or c.get("execution_count")]
    assert not dirty, f"cells {dirty} hold outputs or execution counts: clear them before committing"
    tagged = [i for i, c in enumerate(cells) if "parameters" in c["metadata"].get("tags", [])]
    first_code = next(i for i, c in enumerate(cells) if c["cell_type"] == "code")
    assert tagged == [first_code], "the first code cell, and only it, must be tagged `parameters`"


def _graded_cells(path):
    for cell in json.loads(path.read_text())["cells"]:
        meta = cell["metadata"].get("nbgrader", {})
        yield cell, meta, "".join(cell["source"])


@pytest.mark.parametrize("path", notebooks("labs"), ids=lambda p: str(p.relative_to(ROOT)))
def test_released_lab_has_named_stubs_and_visible_checks(path):
    lab_number = int(re.match(r"lab(\d+)", path.parent.name).group(1))
    answers = tests = 0
    for cell, meta, source in _graded_cells(path):
        if meta.get("solution"):
            answers += 1
            assert re.search(rf'NotImplementedError\("Lab {lab_number}, task \d+: ', source), \
                f"stub without a task-naming NotImplementedError:\n{source}"
        elif meta.get("grade"):
            tests += 1
            # a visible check is an assert, or a call to one of labkit's checkers (check_...)
            visible = [line for line in source.splitlines()
                       if not line.lstrip().startswith("#")
                       and (re.match(r"\s*assert\b", line) or "assert_" in line
                            or re.search(r"\bcheck_\w+\(", line))]
            assert visible, f"test cell {meta['grade_id']} has no visible check left:\n{source}"
    assert answers >= 2 and tests >= answers, f"{answers} answer cells, {tests} test cells"


@pytest.mark.parametrize("path", notebooks("solutions"), ids=lambda p: p.parent.name)
def test_readme_states_each_labs_points(path):
    """The chapter table in README.md says what each lab is worth; it must match the notebook."""
    points = sum(meta.get("points", 0) for _, meta, _ in _graded_cells(path) if meta.get("grade"))
    claim = re.search(rf"`labs/{path.parent.name}/`, ([\d.]+) points",
                      (ROOT / "README.md").read_text())
    assert claim, f"README.md's chapter table does not state the points of {path.parent.name}"
    assert float(claim.group(1)) == points, \
        f"README.md says {path.parent.name} is worth {claim.group(1)} points; its test cells give {points}"
