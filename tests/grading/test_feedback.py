"""Feedback students and instructors can use (issue 24): what is secret is decided by provenance,
a visible failure reaches the student in full (the test cell's line, the checker's message, no
labkit internals, long lines wrapped), and why a hidden test failed is kept for instructors only
(results JSON, the gradebook, `labkit report`), never in a notebook or a feedback file."""
import glob
import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from grading_helpers import needs_root_sandbox
from labkit.grading import feedback
from labkit.grading import notebook as nbtools
from labkit.grading.trusted import hidden_failure_record, render_error

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")]

LABS = sorted(p.name for p in (ROOT / "solutions").iterdir() if list(p.glob("*.ipynb")))


def repeated_lines(lab):
    """{grade_id: hidden lines of that test cell that its own visible part repeats} (13 cells
    of labs 0, 2, 5, 6 and 8 had one when issue 24 was filed)."""
    repeated = {}
    for path in sorted((ROOT / "solutions" / lab).glob("*.ipynb")):
        for cell in nbformat.read(str(path), as_version=4).cells:
            if nbtools.role(cell) != "test":
                continue
            hidden = nbtools.hidden_lines(cell.source)
            shown = {line.strip() for n, line in enumerate(cell.source.splitlines(), 1)
                     if n not in hidden}
            lines = [t for t in nbtools.hidden_texts(cell.source) if t in shown]
            if lines:
                repeated[cell.metadata.nbgrader["grade_id"]] = lines
    return repeated


def _lab(lab):
    source = ROOT / "solutions" / lab
    ids = sorted(p.stem for p in source.glob("*.ipynb"))
    return str(source), str(ROOT / "labs" / lab), ids


def _raise(source, filename, namespace=None):
    try:
        exec(compile(source, filename, "exec"), dict(namespace or {}))
    except Exception as error:  # noqa: BLE001
        return error
    raise AssertionError("the cell was meant to fail")


def test_repeated_visible_lines_are_not_secret_the_rest_are():
    found = 0
    for lab in LABS:
        source_dir, release_dir, ids = _lab(lab)
        secret = feedback.secret_texts(source_dir, release_dir, ids)
        strict = feedback.secret_texts(source_dir, None, ids)
        for grade_id, lines in repeated_lines(lab).items():
            found += 1
            for line in lines:
                assert line in strict[grade_id], (lab, grade_id)     # the old, strict rule
                assert line not in secret[grade_id], (lab, grade_id, secret[grade_id])
        visible = feedback.student_lines(release_dir, ids)
        for cell_id, lines in secret.items():        # nothing secret is in the student's copy
            assert not any(t in v for t in lines for v in visible), (lab, cell_id)
        assert sum(map(len, secret.values())) > 0.5 * sum(map(len, strict.values())), lab
    assert found >= 5 and "test_task3_no_values" in repeated_lines("lab00_first_collectives")


def test_scrub_keeps_a_visible_failure_that_quotes_a_repeated_line():
    """The pipeline's lists, as ScrubHidden gets them: a visible failure of lab 0's
    test_task3_no_values quotes its line, which the hidden block repeats; a quoted secret line
    is still replaced."""
    from labkit.grading.nbhooks import ScrubHidden
    from labkit.grading.pipeline import _hidden_texts
    source_dir, release_dir, ids = _lab("lab00_first_collectives")
    hidden = _hidden_texts(source_dir, ids, release_dir)
    nb = nbformat.read(os.path.join(source_dir, ids[0] + ".ipynb"), as_version=4)
    cell = next(c for c in nb.cells
                if c.metadata.get("nbgrader", {}).get("grade_id") == "test_task3_no_values")
    visible = {"output_type": "error", "ename": "AssertionError", "evalue": "not raised",
               "traceback": ["Test cell test_task3_no_values, where it failed:",
                             "  line 2: basics.check_no_values_raise(world, global_mean)",
                             "AssertionError: every rank should raise ValueError"]}
    leaking = {"output_type": "stream", "name": "stdout",
               "text": "world = labkit.world(3, backend=BACKEND)\n"}
    cell.outputs = [nbformat.from_dict(visible), nbformat.from_dict(leaking)]
    ScrubHidden(hidden=hidden).preprocess(nb, {})
    assert cell.outputs[0].get("traceback") == visible["traceback"], cell.outputs[0]
    assert "hidden" in cell.outputs[1]["text"] and "world(3" not in cell.outputs[1]["text"]


def test_check_feedback_names_the_cell_and_reads_through_highlighting(tmp_path):
    secret = {"test_a": ["assert f(5) == 10, 'secret'"], "test_b": []}
    clean, highlighted = tmp_path / "clean.html", tmp_path / "leak.html"
    clean.write_text("<pre>assert f(1) == 2</pre>")
    highlighted.write_text('<span class="k">assert</span> <span class="n">f</span>(5) == 10, '
                           '<span class="s">&#39;secret&#39;</span>')
    leaks = feedback.check_feedback(str(tmp_path), secret)
    assert leaks == [(str(highlighted), "test_a")]
    assert clean.exists() and not highlighted.exists()


CELL = ("world = W\ncheck(world)\n### BEGIN HIDDEN TESTS\nworld = W\n"
        "check(world, 'big')\n### END HIDDEN TESTS\n")


def _checker():
    def check(world, case="small"):
        if case == "big":
            raise AssertionError("wrong sum [lab 9, big case (case seed 4242)]")
    return check


def test_hidden_failure_record_for_instructors_only():
    error = _raise(CELL, "<test t_big>", {"W": 1, "check": _checker()})
    hidden = nbtools.hidden_lines(CELL)
    shown = render_error(error, CELL, "<test t_big>", hidden)
    assert shown["ename"] == "HiddenTestFailed"
    assert "4242" not in json.dumps(shown) and "big" not in json.dumps(shown)
    record = hidden_failure_record(error, CELL, "<test t_big>", hidden, "t_big")
    assert record["grade_id"] == "t_big" and record["type"] == "AssertionError"
    assert record["seed"] == 4242 and "wrong sum" in record["message"]
    assert record["traceback"] == ["line 5: check(world, 'big')"]

    from labkit.grading.worker import instructor_only
    result = {"notebooks": {"nb": {"cells": {"3": {"outputs": [shown], "hidden_failure": record},
                                             "1": {"outputs": []}}}}}
    records = instructor_only(result)
    assert records == [dict(record, notebook="nb", cell=3)]
    assert "hidden_failure" not in json.dumps(result["notebooks"])   # what InjectVerdicts reads


def test_visible_failure_names_the_cell_and_hides_labkit_frames():
    from labkit.errors import RankError
    student = ('Traceback (most recent call last, your code):\n'
               '  File "/opt/course/utils/labkit/pipeline/checks.py", line 212, in _program\n'
               '    fn(share["actions"], chunks, activation_shape)\n'
               '    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n'
               '  File "/tmp/ipykernel_7/123.py", line 6, in run_pipeline\n'
               '    raise ValueError("no stage 3")\n'
               'ValueError: no stage 3')
    raised = RankError(f"rank 1 raised ValueError: no stage 3\n\n{student}\n\nrank 0 raised "
                       "too: ValueError: no stage 3", 1, student, {1: student})
    source = "run(world)\n"
    try:
        exec(compile(source, "<test test_task3_gradients>", "exec"),
             {"run": lambda w: (_ for _ in ()).throw(raised), "world": None})
    except RankError as error:
        out = render_error(error, source, "<test test_task3_gradients>", set())
    text = "\n".join(out["traceback"])
    assert out["traceback"][0] == "Test cell test_task3_gradients, where it failed:"
    assert "line 1: run(world)" in text and "rank 1 raised ValueError: no stage 3" in text
    assert 'raise ValueError("no stage 3")' in text and "rank 0 raised too" in text
    assert "labkit/pipeline/checks.py" not in text and "share[" not in text, text


def test_hidden_failures_in_the_gradebook_and_the_report(tmp_path):
    """A gradebook made before the table existed gains it; the report lists each hidden failure
    per cell and per student in its instructors-only section, and still refuses a hidden line
    anywhere else."""
    from sqlalchemy import MetaData, create_engine
    from labkit.grading import report
    db = "sqlite:///" + str(tmp_path / "gradebook.db")
    old = MetaData()
    built, graded, _ = report._tables(old)
    old.remove(_)
    old.create_all(create_engine(db))                     # labkit's two tables of before
    record = report.ClassRecord(db)
    failure = {"notebook": "lab", "grade_id": "test_big", "type": "AssertionError",
               "message": "wrong sum (case seed 4242)", "seed": 4242,
               "traceback": ["line 5: check(world, 'big')"]}
    record.save("lab", "alice", 1.0, [], {"test_big": "HiddenTestFailed"}, "-", [failure])
    record.save("lab", "bob", 1.0, [], {}, "-", [])
    record.save("lab", "alice", 1.0, [], {"test_big": "HiddenTestFailed"}, "-", [failure])
    rows = record.hidden_failures("lab")
    record.close()
    assert rows == [{"student": "alice", "notebook": "lab", "grade_id": "test_big",
                     "kind": "AssertionError", "message": "wrong sum (case seed 4242)",
                     "seed": "4242", "traceback": ["line 5: check(world, 'big')"]}]
    data = report.ClassData("lab", [("test_big", "lab", 1.0)], {"alice": (0.0, 1.0)},
                            {"alice": {"test_big": 0.0}},
                            {"alice": {"seconds": 1.0, "problems": [], "failures": {}, "shard": "-"}},
                            ["check(world, 'big')"], rows)
    assert "4242" not in report.render(data) and "Hidden failures: 1" in report.render(data)
    page = report.render_hidden(data)
    section = page[page.index("Hidden failures (instructors only)"):]
    assert "alice" in section and "4242" in section and html.escape("check(world, 'big')") \
        in section and "test_big" in section
    data.record["alice"]["problems"] = ["quoting check(world, 'big')"]
    assert "[withheld" in report.render(data)


# ---- end to end: lab 0 graded with `labkit grade` as an instructor runs it ------------------
WRONG = {   # visible failures in cells whose hidden block repeats a visible line, and a hidden one
    # the mean of the per-rank means: passes the visible "equal" case, fails the hidden "uneven"
    # one (test_task3_global_mean) and returns nan for no values (test_task3_no_values, visible)
    "task3_global_mean": '''
def global_mean(local_values):
    mean = torch.tensor([local_values.mean().item()], dtype=torch.float64)
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()''',
    # a message without the lengths (test_task2_length_message, visible; it repeats `except`)
    "task2_all_reduce_result": '''
def all_reduce_result(per_rank_values, op="sum"):
    reducers = {"sum": sum, "product": math.prod, "max": max, "min": min}
    if op not in reducers:
        raise ValueError(op)
    if len({len(v) for v in per_rank_values}) > 1:
        raise ValueError("the ranks disagree")
    reduced = [reducers[op](column) for column in zip(*per_rank_values)]
    return [list(reduced) for _ in per_rank_values]''',
}
VISIBLE = {"test_task3_no_values": ["line 2: basics.check_no_values_raise(world, global_mean)",
                                    "every rank should raise ValueError when no rank holds a "
                                    "value, not return"],
           "test_task2_length_message": ["line 4: basics.check_length_message(str(error), [2, 3])",
                                         "the error message 'the ranks disagree' does not list "
                                         "every rank's length"]}


def _page_text(path):
    with open(path, encoding="utf-8") as f:
        content = f.read()
    return content, html.unescape(re.sub(r"<[^>]*>", "", content))


@needs_root_sandbox()
@pytest.mark.timeout(600)
def test_lab0_feedback_shows_visible_failures_and_keeps_hidden_ones_for_instructors(tmp_path):
    from test_labs import as_submitted
    lab = "lab00_first_collectives"
    source_dir, release_dir, ids = _lab(lab)
    nb = as_submitted(Path(source_dir) / f"{lab}.ipynb",
                      {gid: (lambda text: lambda _: text)(text) for gid, text in WRONG.items()})
    (tmp_path / "subs" / "ann").mkdir(parents=True)
    nbformat.write(nb, str(tmp_path / "subs" / "ann" / f"{lab}.ipynb"))
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    done = subprocess.run([sys.executable, "-m", "labkit", "grade", lab, str(tmp_path / "subs"),
                           "--jobs", "1", "--out", str(out), "--course", str(ROOT)],
                          capture_output=True, text=True, timeout=560, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "feedback withheld" not in done.stdout, done.stdout

    page = out / "feedback" / "ann" / lab / f"{lab}.html"
    content, text = _page_text(page)
    for grade_id, wanted in VISIBLE.items():          # each visible failure, in full
        assert f"Test cell {grade_id}, where it failed:" in text, grade_id
        for line in wanted:
            assert line in text, (grade_id, line)
    assert "output of" not in text and "quoted a hidden test" not in text
    assert "white-space: pre-wrap" in content          # long messages wrap
    hidden = feedback.secret_texts(source_dir, release_dir, ids)
    assert feedback.quotes(content, [t for lines in hidden.values() for t in lines]) is None
    visible = feedback.student_lines(release_dir, ids)
    source_nb = nbformat.read(os.path.join(source_dir, f"{lab}.ipynb"), as_version=4)
    for cell in source_nb.cells:                       # no hidden line the student lacks
        for line in nbtools.hidden_texts(cell.source):
            assert line not in text or any(line in v for v in visible), line

    with open(out / "work" / "results" / "ann.json") as f:
        result = json.load(f)
    records = result["instructor_only"]["hidden_failures"]
    mine = [r for r in records if r["grade_id"] == "test_task3_global_mean"]
    assert len(mine) == 1, records
    record = mine[0]
    assert record["type"] == "AssertionError" and isinstance(record["seed"], int), record
    assert str(record["seed"]) in record["message"]
    assert all(line.startswith("line ") for line in record["traceback"]) and record["traceback"]
    assert "HiddenTestFailed" in text
    autograded = glob.glob(str(out / "work" / "autograded" / "ann" / lab / "*.ipynb"))
    for path in [str(page)] + autograded:            # never in a notebook or a feedback file
        with open(path, encoding="utf-8") as f:
            blob = f.read()
        assert str(record["seed"]) not in blob and record["message"][:40] not in blob, path
        assert html.escape(record["message"][:40]) not in blob, path

    report_path = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "labkit", "report", lab, "--db",
                           "sqlite:///" + str(out / "gradebook.db"), "--out", str(report_path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    content, text = _page_text(report_path)
    assert str(record["seed"]) not in text and "Hidden failures: " in text   # shareable page
    content, text = _page_text(tmp_path / "report-hidden-failures.html")
    section = text[text.index("Hidden failures (instructors only)"):]
    assert "test_task3_global_mean" in section and "ann" in section
    assert str(record["seed"]) in section and record["message"][:40] in section
