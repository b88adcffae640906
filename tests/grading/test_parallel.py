"""Grading in parallel gives exactly what grading one by one gives: the fixture class graded 2 at
a time here, one at a time once per session (conftest.py's `graded_one_at_a_time`, which
test_class_scale's shards are compared with too)."""
import csv
import os

import pytest

from grading_helpers import CELL_TIMEOUT, KINDS, LAB, needs_root_sandbox

pytestmark = [needs_root_sandbox(), pytest.mark.timeout(400)]


def _scores(out):
    with open(os.path.join(out, "grades.csv")) as f:
        return {r["student_id"]: (r["score"], r["max_score"]) for r in csv.DictReader(f)}


def test_parallel_equals_serial(fixture_class, graded_one_at_a_time, tmp_path):
    from labkit.grading import grade
    course, subs, names = fixture_class
    serial_out, _ = graded_one_at_a_time
    parallel = grade(LAB, str(subs), jobs=2, out=str(tmp_path / "parallel"),
                     course=str(course), cell_timeout=CELL_TIMEOUT)
    assert parallel.jobs == 2
    expected = {names[k]: score for k, (_, _, score) in KINDS.items()}
    assert parallel.scores == expected
    assert {s: float(score) for s, (score, _) in _scores(serial_out).items()} == expected
    assert _scores(serial_out) == _scores(tmp_path / "parallel")
