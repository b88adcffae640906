"""`labkit dist OUT_DIR`: the folder students get, and nothing they must not have.

    labkit dist build/student-dist        # from the course repository

Copies: course/, labs/ (the released, hidden-test-free notebooks), the labkit package (without
labkit.grading, which is instructor tooling), pyproject.toml, environment.yml, and writes a
student README. Never copies solutions/, tests/, a gradebook, grading output, git metadata or
any virtual environment. It then checks the result: no `solutions` path, no `*.db`, no notebook
cell containing a solution or hidden-test marker (`labkit.tools.release.MARKERS`); any of these fails
the build.
"""
from __future__ import annotations

import json
import os
import shutil

from labkit.tools.release import HIDDEN_BEGIN, HIDDEN_END, SOLUTION_BEGIN

COPIED = ["course", "labs", "pyproject.toml", "environment.yml"]
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.db", "*.egg-info",
                              "grading", ".git")
FORBIDDEN_TEXT = [SOLUTION_BEGIN, HIDDEN_BEGIN, HIDDEN_END]

README = """# Distributed LLM training: student copy

1. Install: `python -m venv .venv && . .venv/bin/activate && pip install -e .`
   (or `conda env create -f environment.yml`).
2. Start JupyterLab: `jupyter lab`, then open `course/` (chapters) and `labs/` (graded labs).
3. Each lab's test cells show the visible tests; the grader adds hidden tests of the same
   functions. Run every cell from the top in a fresh kernel before you hand a lab in.
4. `labkit` (in `utils/labkit/`) starts real torch.distributed ranks from a notebook:
   see `utils/labkit/runtime/README.md`.
"""


def add_arguments(parser) -> None:
    parser.add_argument("out", help="folder to create (must not exist, or be empty)")
    parser.add_argument("--course", default=None, help="course repository (default: here)")


def build(out: str, course: str | None = None) -> list[str]:
    """Build the student distribution into `out`; return its files (relative paths)."""
    from labkit.grading.pipeline import find_course_root
    course = find_course_root(course)
    out = os.path.abspath(out)
    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"{out} exists and is not empty")
    if os.path.commonpath([out, course]) == course and \
            os.path.relpath(out, course).split(os.sep)[0] in COPIED + ["utils"]:
        raise ValueError(f"{out} is inside a folder that is copied")
    os.makedirs(out, exist_ok=True)
    for name in COPIED:
        path = os.path.join(course, name)
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(out, name), ignore=SKIP, symlinks=False)
        elif os.path.isfile(path):
            shutil.copy2(path, os.path.join(out, name))
    shutil.copytree(os.path.join(course, "utils", "labkit"), os.path.join(out, "utils", "labkit"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "grading"),
                    symlinks=False)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(README)
    files = sorted(os.path.relpath(os.path.join(d, n), out)
                   for d, _, names in os.walk(out) for n in names)
    problems = check(out, files)
    if problems:
        shutil.rmtree(out)
        raise RuntimeError("the distribution would leak instructor material:\n  "
                           + "\n  ".join(problems))
    return files


def check(out: str, files: list[str]) -> list[str]:
    problems = []
    for rel in files:
        parts = rel.split(os.sep)
        if "solutions" in parts or rel.endswith(".db") or "grading" in parts:
            problems.append(f"{rel}: instructor-only path")
        if rel.endswith(".ipynb"):
            with open(os.path.join(out, rel), encoding="utf-8") as f:
                nb = json.load(f)
            for cell in nb.get("cells", []):
                source = "".join(cell.get("source", ""))
                for text in FORBIDDEN_TEXT:
                    if text in source:
                        problems.append(f"{rel}: a cell contains {text!r}")
    return problems


def run(args) -> int:
    files = build(args.out, args.course)
    print(f"labkit dist: {len(files)} files in {os.path.abspath(args.out)}")
    return 0
