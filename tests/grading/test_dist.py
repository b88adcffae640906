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


def test_the_copy_is_a_student_environment(tmp_path):
    """The copy's pyproject.toml has no extras (test, instructor: psycopg) and no test
    configuration; its README takes a student from nothing to a handed-in lab (Python, install,
    drill, glossary, what to upload, where); its `labkit --help` lists no instructor command, and
    one typed says so in one line (it was `ModuleNotFoundError: No module named
    'labkit.grading'`)."""
    import subprocess
    import sys
    import tomllib
    dist = tmp_path / "dist"
    build(str(dist), REPO)
    project = tomllib.loads((dist / "pyproject.toml").read_text())
    course_project = tomllib.loads(open(os.path.join(REPO, "pyproject.toml")).read())
    assert "instructor" in course_project["project"]["optional-dependencies"]
    assert "optional-dependencies" not in project["project"]
    assert "pytest" not in project.get("tool", {})
    assert project["project"]["dependencies"] == course_project["project"]["dependencies"]
    assert not [d for d in project["project"]["dependencies"] if "psycopg" in d]
    assert project["project"]["scripts"] == {"labkit": "labkit.tools.cli:main"}
    readme = (dist / "README.md").read_text()
    for needed in ["Python 3.10", "pip install -e .", "labkit student-setup", "jupyter lab",
                   "labkit drill", "course/drill.ipynb", "course/GLOSSARY.md",
                   "labs/labNN_<name>/labNN_<name>.ipynb", "Restart Kernel and Run All Cells",
                   "upload", "deadline", "feedback"]:
        assert needed in readme, needed

    env = dict(os.environ, PYTHONPATH=str(dist / "utils"))
    cli = [sys.executable, "-m", "labkit.tools.cli"]
    where = subprocess.run(cli[:1] + ["-c", "import labkit; print(labkit.__file__)"], env=env,
                           capture_output=True, text=True, cwd=dist, timeout=60)
    assert where.stdout.strip().startswith(str(dist)), where.stdout + where.stderr
    shown = subprocess.run(cli + ["--help"], env=env, capture_output=True, text=True, cwd=dist,
                           timeout=60)
    commands = {line.split()[0] for line in shown.stdout.splitlines()
                if line.startswith("    ") and not line.startswith("     ")}
    assert {"drill", "doctor", "dist", "student-setup"} <= commands, shown.stdout
    assert not commands & {"grade", "regrade", "report", "import", "export"}, shown.stdout
    for command in ["grade", "regrade", "report", "import", "export"]:
        typed = subprocess.run(cli + [command, "lab00_first_collectives"], env=env,
                               capture_output=True, text=True, cwd=dist, timeout=60)
        assert typed.returncode == 2, typed.stderr
        assert "instructor command, not in the student copy" in typed.stderr, typed.stderr
        assert "Traceback" not in typed.stderr and len(typed.stderr.splitlines()) == 1
    # the course repository's own CLI still has them
    here = subprocess.run(cli + ["--help"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert "    grade " in here.stdout and "    import " in here.stdout \
        and "    regrade " in here.stdout, here.stdout
