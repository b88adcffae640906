"""The throwaway course holding the fixture lab, for every grading test (helpers live in
grading_helpers.py), and the fixture class graded once, one at a time, for the modules that
compare another way of grading with it (test_class_scale: shards; test_parallel: --jobs 2)."""
import os
import shutil
import subprocess

import pytest

from grading_helpers import (FIXTURES, KINDS, cli_env, grade_command, make_submission,
                             student_names)


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    shutil.copytree(os.path.join(FIXTURES, "solutions"), root / "solutions")
    return root


@pytest.fixture(scope="session")
def fixture_class(tmp_path_factory):
    """A course of its own and one submission per kind of KINDS: (course, submissions, names)."""
    root = tmp_path_factory.mktemp("class")
    shutil.copytree(os.path.join(FIXTURES, "solutions"), root / "course" / "solutions")
    names = student_names()
    for kind, (answers, _, _) in KINDS.items():
        make_submission(str(root / "course"), str(root / "subs"), names[kind], answers)
    return root / "course", root / "subs", names


@pytest.fixture(scope="session")
def graded_one_at_a_time(fixture_class, tmp_path_factory):
    """The class graded by `labkit grade --jobs 1` in one process, into its own sqlite gradebook:
    (out folder, the run's output). Graded once per session; each user checks what it needs."""
    course, subs, _ = fixture_class
    out = tmp_path_factory.mktemp("one-at-a-time") / "out"
    done = subprocess.run(grade_command(course, subs, out), capture_output=True, text=True,
                          timeout=900, env=cli_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert f"{len(KINDS)} submissions, 1 at a time" in log, log[-3000:]
    return out, done.stdout
