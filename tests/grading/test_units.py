"""Fast checks of the grader's pieces (no kernel, no sandbox)."""
import os
import tempfile

import pytest

from labkit.grading import check
from labkit.grading.notebook import hidden_lines, hidden_texts
from labkit.grading.trusted import rebuild, render_error

pytestmark = pytest.mark.timeout(60)

CELL = "assert f(1) == 2\n### BEGIN HIDDEN TESTS\nassert f(5) == 10, 'secret'\n### END HIDDEN TESTS"


def _fail(source):
    try:
        exec(compile(source, "<test t>", "exec"), {"f": lambda x: x})
    except AssertionError as error:
        return error


def test_hidden_lines_and_texts():
    assert hidden_lines(CELL) == {2, 3, 4}
    assert hidden_texts(CELL) == ["assert f(5) == 10, 'secret'"]


def test_visible_failure_shows_its_line():
    out = render_error(_fail(CELL), CELL, "<test t>", hidden_lines(CELL))
    assert out["ename"] == "AssertionError" and "assert f(1) == 2" in "\n".join(out["traceback"])


def test_hidden_failure_shows_no_source_and_no_message():
    source = CELL.replace("f(1) == 2", "f(1) == 1")
    out = render_error(_fail(source), source, "<test t>", hidden_lines(source))
    text = repr(out)
    assert out["ename"] == "HiddenTestFailed" and "secret" not in text and "f(5)" not in text


def test_student_errors_are_rebuilt_as_local_classes():
    from labkit.errors import RankError
    raised = RankError("rank 0 raised ValueError: bad size\n\ntraceback", 0, "tb", {0: "tb"},
                       kind="ValueError", module="builtins")
    rebuilt = rebuild(raised)
    assert type(rebuilt) is ValueError and str(rebuilt) == "bad size"
    assert rebuilt.student_traceback == "tb"
    # a BaseException (SystemExit) or a class of the student's own is never rebuilt as itself
    for kind, module in (("SystemExit", "builtins"), ("MyError", "__main__")):
        error = RankError("x", 0, "tb", {0: "tb"}, kind=kind, module=module)
        assert rebuild(error) is error


def test_check():
    import torch
    check([torch.ones(2), 3], [torch.ones(2), 3.0])
    with pytest.raises(AssertionError, match=r"out\[0\]: shape"):
        check([torch.ones(3)], [torch.ones(2)], "out")


def test_normalise_metadata_restores_flags():
    import nbformat
    from labkit.grading.pipeline import normalise_metadata
    source = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "assert x", metadata={"nbgrader": {"grade": True, "grade_id": "t", "locked": True,
                                           "points": 2, "solution": False,
                                           "schema_version": 3}})])
    student = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("assert True", metadata={"nbgrader": {
            "grade": False, "grade_id": "t", "locked": False, "points": 100, "solution": True,
            "schema_version": 3}}),
        nbformat.v4.new_code_cell("pass", metadata={"nbgrader": {
            "grade": True, "grade_id": "invented", "points": 50, "solution": False,
            "locked": True, "schema_version": 3}})])
    fixed = nbformat.reads(normalise_metadata(nbformat.writes(student).encode(), source), 4)
    assert fixed.cells[0].metadata.nbgrader["points"] == 2
    assert fixed.cells[0].metadata.nbgrader["grade"] is True
    assert "nbgrader" not in fixed.cells[1].metadata


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups are made by root")
def test_a_grading_worker_joins_a_memory_cgroup_of_its_own(tmp_path):
    """Issue 33: the root worker that reads a submission's replies runs in a memory cgroup of
    its own (a child process here, as the pipeline's workers are)."""
    import multiprocessing
    from labkit.grading import sandbox
    if "memory" not in sandbox.cgroup_dirs():
        pytest.skip("no cgroup v1 memory controller on this machine")
    run_id = "unit-" + os.urandom(4).hex()

    def worker(queue):
        path = sandbox.join_worker_cgroup(run_id, 3, 1 << 30)
        with open("/proc/self/cgroup") as f:
            queue.put((path, f.read()))
    queue = multiprocessing.get_context("fork").Queue()
    child = multiprocessing.get_context("fork").Process(target=worker, args=(queue,))
    child.start()
    path, membership = queue.get(timeout=30)
    child.join(30)
    try:
        assert path.endswith(f"labkit-grading/{run_id}/worker-3")
        assert f"/labkit-grading/{run_id}/worker-3" in membership
        with open(os.path.join(path, "memory.limit_in_bytes")) as f:
            assert int(f.read()) == 1 << 30
    finally:
        sandbox._empty_and_remove(path)
        os.rmdir(os.path.dirname(path))
    assert not os.path.exists(path)


def test_the_default_jobs_follow_the_cores_and_the_memory(monkeypatch):
    """Issue 30: `--jobs` defaulted to the core count, but each submission starts 2+ ranks."""
    import psutil
    from labkit.grading import pipeline
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert pipeline.default_jobs() == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    free = type("Memory", (), {"available": 40 << 30})
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    assert pipeline.default_jobs() == 6                    # 40 GiB / (4 + 2) GiB, not 16
    assert pipeline.default_jobs({"memory_bytes": 1 << 30}) == 13
    free.available = 64 << 40
    assert pipeline.default_jobs() == 16                   # 32 cores // 2


def test_a_cell_counts_as_covered_only_by_a_mistake_confined_to_its_task():
    from test_labs import covered_cells
    cells = ["test_task1_values", "test_task1_traffic", "test_task2_only"]
    changed = {"shortcut": {"task1_ring"}, "breaks_all": {"task1_ring"}, "none": {"task1_ring"},
               "task2": {"task2_x"}, "scratch": set()}
    scores = {"solution": (10, 10, "", set()),
              "shortcut": (7, 10, "", {"test_task1_traffic"}),            # passes the values
              "breaks_all": (0, 10, "", set(cells)),                      # leaks into task 2
              "none": (2, 10, "", {"test_task1_values", "test_task1_traffic"}),  # all of task 1
              "task2": (8, 10, "", {"test_task2_only"}),                   # a one-cell task
              "scratch": (0, 10, "", set(cells))}
    assert covered_cells(cells, scores, changed) == {"test_task1_traffic", "test_task2_only"}
    del scores["shortcut"]
    assert covered_cells(cells, scores, changed) == {"test_task2_only"}


def test_the_gradebook_stamp_read_in_process_is_nbgraders_own():
    """labkit stamps a new gradebook with the alembic head read in-process; nbgrader asks
    `alembic heads` in a subprocess (what get_alembic_version runs). Both must name the same
    revision, and a gradebook made with the in-process answer carries it."""
    import subprocess
    import sys
    from nbgrader import dbutil
    from labkit.grading import pipeline
    bindir = os.path.dirname(sys.executable)
    with dbutil._temp_alembic_ini("sqlite:////nonexistent/gradebook.db") as ini:
        printed = subprocess.check_output([os.path.join(bindir, "alembic"), "-c", ini, "heads"])
    theirs = printed.decode().split("\n")[0].split(" ")[0]
    assert theirs and pipeline.alembic_head_in_process() == theirs
    pipeline.use_alembic_head_in_process()
    from nbgrader.api import Gradebook
    import sqlalchemy
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/gradebook.db"
        Gradebook(url).close()
        engine = sqlalchemy.create_engine(url)
        with engine.connect() as connection:
            stamped = connection.execute(sqlalchemy.text(
                "SELECT version_num FROM alembic_version")).scalar()
        engine.dispose()
    assert stamped == theirs
