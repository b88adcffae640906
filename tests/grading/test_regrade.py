"""`labkit regrade` (issue 30): a hidden test found wrong after grading began is fixed, the lab
is regraded in two shards into one PostgreSQL gradebook, the grades and comments typed in the
formgrader are kept, and the students whose score changed are listed, old -> new.

The class: the fixture lab, graded once with a wrong hidden test in test_add (it wants
add(-5, 7) == -2, so every correct `add` loses the cell's point), two students, one per shard of
2: `right` (all correct) and `half` (a wrong rank_sum). A grader then does in the gradebook what
the formgrader's API handlers do (nbgrader/server_extensions/formgrader/apihandlers.py: set
Grade.manual_score and Comment.manual_comment): `right` gets 1.5 of 2 on test_scale and a comment
on task_add, `half` gets 0.5 on test_add, the cell the fix changes.
"""
import csv
import json
import os
import re
import shutil
import stat
import subprocess
import sys

import nbformat
import pytest

from grading_helpers import (FIXTURES, HIDDEN_SENTINELS, LAB, cli_env, make_submission,
                             needs_root_sandbox)
from test_class_scale import postgres  # noqa: F401 (the throwaway PostgreSQL server fixture)

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")]
WRONG_TEST = "assert add(-5, 7) == 2, 'HIDDEN_SENTINEL_ADD negative numbers'"
BROKEN_TEST = "assert add(-5, 7) == -2, 'HIDDEN_SENTINEL_ADD negative numbers'"
COMMENT = "Good docstring; see me about the float case."


def _names():
    """`right` lands in shard 0 of 2, `half` in shard 1 (sha256 of the id, as labkit grade)."""
    from labkit.grading.pipeline import in_shard
    names = {}
    for kind, shard in (("right", 0), ("half", 1)):
        n = 0
        while not in_shard(f"{kind}{n}", (shard, 2)):
            n += 1
        names[kind] = f"{kind}{n}"
    return names


def _edit_test(course, old, new):
    path = os.path.join(course, "solutions", LAB, f"{LAB}.ipynb")
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "test_add")
    assert old in cell.source
    cell.source = cell.source.replace(old, new)
    nbformat.write(nb, path)


def _regrade_command(course, out, db_url, *extra):
    return [sys.executable, "-m", "labkit.tools.cli", "regrade", LAB, "--out", str(out),
            "--course", str(course), "--db", db_url, "--jobs", "1", "--cell-timeout", "10",
            *extra]


def _grades(db_url):
    """{student: (total, {cell: (auto, manual, needs_manual_grade)}, {cell: manual comment})}."""
    from nbgrader.api import Gradebook
    with Gradebook(db_url, "default_course") as gb:
        return {s.student.id: (s.score,
                               {g.name: (g.auto_score, g.manual_score, g.needs_manual_grade)
                                for nb in s.notebooks for g in nb.grades},
                               {c.name: c.manual_comment for nb in s.notebooks
                                for c in nb.comments})
                for s in gb.assignment_submissions(LAB)}


def _table(db_url, name):
    from sqlalchemy import create_engine, inspect, text
    engine = create_engine(db_url)
    try:
        if not inspect(engine).has_table(name):
            return []
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(text(f"SELECT * FROM {name}"))]
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def graded(tmp_path_factory, postgres):  # noqa: F811 (the imported fixture)
    """The class graded with the broken test, then by hand: (course, subs, out, db, names)."""
    root = tmp_path_factory.mktemp("regrade")
    course, subs, out = root / "course", root / "subs", root / "out"
    shutil.copytree(os.path.join(FIXTURES, "solutions"), course / "solutions")
    _edit_test(course, WRONG_TEST, BROKEN_TEST)
    names = _names()
    make_submission(str(course), str(subs), names["right"])
    make_submission(str(course), str(subs), names["half"],
                    {"task_rank_sum": "def rank_sum(x):\n    return 3.0"})
    db_url = postgres.url("regrade")
    from labkit.grading import grade                    # in this process: no start-up to pay
    lines = []
    report = grade(LAB, str(subs), jobs=2, out=str(out), course=str(course), db_url=db_url,
                   cell_timeout=10, log=lines.append)
    assert not report.not_graded, "\n".join(lines)[-3000:]
    from nbgrader.api import Gradebook
    with Gradebook(db_url, "default_course") as gb:       # what the formgrader's handlers do
        scale = gb.find_grade("test_scale", LAB, LAB, names["right"])
        scale.manual_score, scale.needs_manual_grade = 1.5, False
        gb.find_comment("task_add", LAB, LAB, names["right"]).manual_comment = COMMENT
        add = gb.find_grade("test_add", LAB, LAB, names["half"])
        add.manual_score, add.needs_manual_grade = 0.5, False
        gb.db.commit()
    before = _grades(db_url)
    # the broken test took test_add's point from both; the manual grades count
    assert before[names["right"]][0] == 0 + 1.5 + 3 and before[names["half"]][0] == 0.5 + 2 + 0
    assert before[names["right"]][1]["test_add"][0] == 0
    return course, subs, out, db_url, names


@needs_root_sandbox()
def test_a_fix_that_adds_a_cell_is_refused_before_anything_changes(graded, tmp_path):
    course, _, out, db_url, names = graded
    added = tmp_path / "course"
    shutil.copytree(course, added)
    path = added / "solutions" / LAB / f"{LAB}.ipynb"
    nb = nbformat.read(str(path), as_version=4)
    index = next(i for i, c in enumerate(nb.cells)
                 if c.metadata.get("nbgrader", {}).get("grade_id") == "test_add")
    cell = nbformat.v4.new_code_cell("assert add(2, 2) == 4")
    cell.metadata["nbgrader"] = dict(nb.cells[index].metadata["nbgrader"], grade_id="test_add_2")
    nb.cells.insert(index + 1, cell)
    nbformat.write(nb, str(path))
    stamp = _table(db_url, "labkit_gradebook")
    before = _grades(db_url)
    from labkit.grading.regrade import RegradeRefused, regrade
    with pytest.raises(RegradeRefused) as refused:       # in this process: no start-up to pay
        regrade(LAB, db_url=db_url, out=str(out), course=str(added), shard="0/2")
    assert "graded cells added: test_add_2" in str(refused.value)
    assert "put new assertions into the existing test cell" in str(refused.value)
    assert "Nothing was changed" in str(refused.value)
    assert _grades(db_url) == before
    assert _table(db_url, "labkit_gradebook") == stamp
    assert _table(db_url, "labkit_regrade_round") == []


@needs_root_sandbox()
def test_regrade_in_two_shards_keeps_manual_grades_and_lists_the_changes(graded, capsys):
    course, subs, out, db_url, names = graded
    right, half = names["right"], names["half"]
    _edit_test(course, BROKEN_TEST, WRONG_TEST)                      # the fix
    # at once: shard 0 by the command, regrading the copies `labkit grade` kept in OUT; shard 1
    # in this process (no start-up to pay), given the submissions folder
    shard0 = subprocess.Popen(_regrade_command(course, out, db_url, "--shard", "0/2"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=cli_env())
    from labkit.grading.regrade import regrade
    lines = []
    try:
        result = regrade(LAB, str(subs), db_url=db_url, out=str(out), course=str(course),
                         shard="1/2", jobs=1, cell_timeout=10, log=lines.append)
    finally:
        logs = [shard0.communicate(timeout=400)[0], "\n".join(lines) + "\n"]
    assert shard0.returncode == 0, logs[0][-4000:]
    assert not result.report.not_graded and not result.not_regraded, logs[1][-4000:]
    assert [r["student"] for r in result.rows] == [half]

    after = _grades(db_url)
    total, cells, comments = after[right]
    assert total == 1 + 1.5 + 3                          # test_add's point back; 1.5 kept
    assert cells["test_add"][:2] == (1, None)
    assert cells["test_scale"][:2] == (2, 1.5) and cells["test_scale"][2] is True   # review it
    assert comments["task_add"] == COMMENT
    total, cells, _ = after[half]
    assert total == 0.5 + 2 + 0                          # the manual 0.5 still wins ...
    assert cells["test_add"] == (1, 0.5, True)           # ... over the autograder's new 1
    assert cells["test_rank_sum"][0] == 0

    # each shard lists its own student; --changes, the whole class
    assert re.search(rf"{right} +4\.5 -> +5\.5  test_add 0 -> 1\n", logs[0]), logs[0][-3000:]
    assert half not in logs[0]
    assert "test_add: manual 0.5 kept, autograder 0 -> 1" in logs[1], logs[1][-3000:]
    assert "changed test cells: test_add (text)" in logs[0] + logs[1]
    from labkit.tools.cli import main                        # in this process: no start-up
    assert main(["regrade", LAB, "--db", db_url, "--changes", "--csv", str(out / "class.csv"),
                 "--course", str(course)]) == 0
    whole = capsys.readouterr().out
    assert "2 students regraded: 1 total score(s) changed, 1 manual grade(s) kept" in whole, whole
    with open(out / "class.csv") as f:
        rows = {r["student_id"]: r for r in csv.DictReader(f)}
    assert (rows[right]["old_score"], rows[right]["new_score"]) == ("4.5", "5.5")
    assert (rows[half]["old_score"], rows[half]["new_score"]) == ("2.5", "2.5")
    for name in ("regrade-*-shard-0-of-2.csv", "regrade-*-shard-1-of-2.csv"):
        found = list(out.glob(name))
        assert len(found) == 1 and stat.S_IMODE(found[0].stat().st_mode) == 0o600, found
    # the gradebook rebuilt once, for the fixed tests; no hidden line in anything printed
    from labkit.grading.pipeline import _tree_hash
    stamp = _table(db_url, "labkit_gradebook")
    assert [r["source_hash"] for r in stamp] == [_tree_hash(str(course / "solutions" / LAB))]
    rounds = _table(db_url, "labkit_regrade_round")
    assert len(rounds) == 1 and json.loads(rounds[0]["changes"]) == [["test_add", "text"]]
    printed = "".join(logs) + whole
    assert not [s for s in HIDDEN_SENTINELS if s in printed]


def test_differences_and_refusals_without_grading():
    from labkit.grading.rounds import RegradeRefused, compare, differences
    changed, kept = differences({"a": [0, None], "b": [2, 1.5], "c": [1, None]},
                                {"a": [1, None], "b": [0, 1.5], "c": [1, None]})
    assert changed == ["a 0 -> 1"] and kept == ["b: manual 1.5 kept, autograder 2 -> 0"]
    old = {"nb": {"grade": {"t1": 1.0, "t2": 2.0}, "task": {}, "solution": {"s1": ""},
                  "source": {"t1": ("code", True, "x"), "t2": ("code", True, "y"),
                             "s1": ("code", False, "z")}}}
    new = json.loads(json.dumps(old))
    new["nb"]["grade"]["t2"] = 3.0
    new["nb"]["source"]["t1"] = ["code", True, "x fixed"]
    assert compare(old, new, "lab") == [("t1", "text"), ("t2", "points 2 -> 3")]
    del new["nb"]["grade"]["t2"], new["nb"]["source"]["t2"]
    with pytest.raises(RegradeRefused, match="graded cells removed: t2"):
        compare(old, new, "lab")
    with pytest.raises(RegradeRefused, match="notebook other.ipynb added"):
        compare(old, dict(old, other=old["nb"]), "lab")


def test_plain_grade_after_a_fix_points_to_regrade(tmp_path):
    """build_gradebook says when it replaced an earlier version of the lab, and _graded_count
    how many submissions were graded against it: together `labkit grade` prints one line that
    points to `labkit regrade` instead of replacing scores silently (no grading needed here)."""
    from nbgrader.api import Gradebook
    from labkit.grading import pipeline
    course = tmp_path / "course"
    shutil.copytree(os.path.join(FIXTURES, "solutions"), course / "solutions")
    out = tmp_path / "out"
    private = out / "work"
    os.makedirs(private / "release")
    db_url = "sqlite:///" + str(out / "gradebook.db")
    config = pipeline._config(str(course), str(course / "solutions"), str(out), db_url, LAB,
                              str(private))
    course_id = config.CourseDirectory.course_id
    assert pipeline.build_gradebook(config, str(course / "solutions"), LAB, str(out),
                                    str(private)) is False            # first build: nothing replaced
    assert pipeline._graded_count(db_url, course_id, LAB) == 0
    with Gradebook(db_url, course_id) as gb:
        gb.add_student("s1")
        gb.add_submission(LAB, "s1")
    assert pipeline._graded_count(db_url, course_id, LAB) == 1
    assert pipeline.build_gradebook(config, str(course / "solutions"), LAB, str(out),
                                    str(private)) is False            # unchanged: nothing replaced
    source = next((course / "solutions" / LAB).glob("*.ipynb"))
    text = source.read_text()
    assert WRONG_TEST in text
    source.write_text(text.replace(WRONG_TEST, BROKEN_TEST))
    assert pipeline.build_gradebook(config, str(course / "solutions"), LAB, str(out),
                                    str(private)) is True             # the fix replaced it
