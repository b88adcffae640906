"""Grading in parallel gives exactly what grading one by one gives."""
import csv
import os

import pytest

from grading_helpers import LAB, make_submission, needs_root_sandbox

pytestmark = [needs_root_sandbox(), pytest.mark.timeout(400)]


def _scores(out):
    with open(os.path.join(out, "grades.csv")) as f:
        return {r["student_id"]: (r["score"], r["max_score"]) for r in csv.DictReader(f)}


def test_parallel_equals_serial(course, tmp_path):
    from labkit.grading import grade
    subs = tmp_path / "subs"
    make_submission(str(course), str(subs), "correct")
    make_submission(str(course), str(subs), "half", {"task_rank_sum": "def rank_sum(x):\n"
                                                                      "    return 3.0"})
    make_submission(str(course), str(subs), "wrong_add", {"task_add": "def add(a, b):\n"
                                                                      "    return a * b"})
    serial = grade(LAB, str(subs), jobs=1, out=str(tmp_path / "serial"), course=str(course),
                   cell_timeout=20)
    parallel = grade(LAB, str(subs), jobs=2, out=str(tmp_path / "parallel"),
                     course=str(course), cell_timeout=20)
    assert serial.scores == parallel.scores == {"correct": 6.0, "half": 3.0, "wrong_add": 5.0}
    assert _scores(tmp_path / "serial") == _scores(tmp_path / "parallel")
