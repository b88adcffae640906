"""`labkit dist` ships the course and labs, and nothing of solutions/, hidden tests or gradebooks."""
import os

import pytest

from labkit.tools.dist import build

pytestmark = pytest.mark.timeout(120)
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_dist_has_no_instructor_material(tmp_path):
    files = build(str(tmp_path / "dist"), REPO)
    assert "README.md" in files and "utils/labkit/__init__.py" in files
    assert any(f.startswith("labs/") and f.endswith(".ipynb") for f in files)
    assert not [f for f in files if f.startswith(("solutions", "tests", ".git"))
                or "grading" in f.split(os.sep) or f.endswith(".db")]
    for f in files:
        if f.endswith(".ipynb"):
            text = open(tmp_path / "dist" / f, encoding="utf-8").read()
            assert "HIDDEN TESTS" not in text and "BEGIN SOLUTION" not in text, f


def test_dist_refuses_a_leaking_tree(tmp_path):
    course = tmp_path / "course"
    (course / "solutions").mkdir(parents=True)
    (course / "labs" / "lab").mkdir(parents=True)
    (course / "labs" / "lab" / "x.ipynb").write_text(
        '{"cells": [{"cell_type": "code", "source": "### BEGIN HIDDEN TESTS"}]}')
    (course / "utils" / "labkit").mkdir(parents=True)
    with pytest.raises(RuntimeError, match="HIDDEN TESTS"):
        build(str(tmp_path / "dist"), str(course))
    assert not (tmp_path / "dist").exists()
