"""`labkit dist OUT_DIR`: the folder students get, and nothing they must not have.

    labkit dist build/student-dist        # from the course repository

Copies: course/, labs/ (the released, hidden-test-free notebooks), the labkit package (without
labkit.grading, which is instructor tooling), pyproject.toml, and writes a student README and
environment.yml. Never copies solutions/, tests/, a gradebook, grading output, git metadata or
any virtual environment. It then checks the result: no `solutions` path, no `*.db`, no notebook
cell containing a solution or hidden-test marker (`labkit.tools.release.MARKERS`), no notebook
naming a kernel the copy does not register; any of these fails the build.

The copy works as handed out: its README's steps (`pip install -e .`, then `jupyter lab`) must
give the kernel its notebooks name. In the course repository they name `labkit`, which `make
setup` registers; nothing in a plain `pip install -e .` can (an editable install installs no
data files, and pip runs no post-install step). So the copy's notebooks name `python3`, the
kernel ipykernel itself provides in every environment that has it, which runs on the Python
that runs JupyterLab: the environment the README made. nbgrader puts the source's kernelspec back
when it grades, so this changes nothing there. Its environment.yml installs the project without
the test extras (Playwright, ipyparallel: the course's CI needs them, students do not).
"""
from __future__ import annotations

import json
import os
import shutil

from labkit.tools.release import HIDDEN_BEGIN, HIDDEN_END, SOLUTION_BEGIN

COPIED = ["course", "labs", "pyproject.toml"]
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
ENVIRONMENT = """# conda env create -f environment.yml && conda activate labkit && jupyter lab
# The packages come from pyproject.toml (the same list as `pip install -e .`, without the
# course's test extras).
name: labkit
channels:
  - conda-forge
dependencies:
  - python=3.11
  - pip
  - pip:
      - -e .
"""
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.db", "*.egg-info",
                              "grading", ".git")
FORBIDDEN_TEXT = [SOLUTION_BEGIN, HIDDEN_BEGIN, HIDDEN_END]

README = """# Distributed LLM training: student copy

1. Install: `python -m venv .venv && . .venv/bin/activate && pip install -e .`
   (or `conda env create -f environment.yml && conda activate labkit`).
2. Start JupyterLab: `jupyter lab`, then open `course/` (chapters) and `labs/` (graded labs).
   The notebooks run on the "Python 3 (ipykernel)" kernel of that environment.
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
    with open(os.path.join(out, "environment.yml"), "w") as f:
        f.write(ENVIRONMENT)
    for folder, _, names in os.walk(out):
        for name in names:
            if name.endswith(".ipynb"):
                set_kernel(os.path.join(folder, name))
    files = sorted(os.path.relpath(os.path.join(d, n), out)
                   for d, _, names in os.walk(out) for n in names)
    problems = check(out, files)
    if problems:
        shutil.rmtree(out)
        raise RuntimeError("the distribution would leak instructor material:\n  "
                           + "\n  ".join(problems))
    return files


def set_kernel(path: str) -> None:
    """Make the notebook at `path` name ipykernel's own `python3` kernel (see the docstring)."""
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    nb.setdefault("metadata", {})["kernelspec"] = dict(KERNELSPEC)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(nb, f, indent=1, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def check(out: str, files: list[str]) -> list[str]:
    problems = []

    for rel in files:
        parts = rel.split(os.sep)
        if "solutions" in parts or rel.endswith(".db") or "grading" in parts:
            problems.append(f"{rel}: instructor-only path")
        if rel.endswith(".ipynb"):
            with open(os.path.join(out, rel), encoding="utf-8") as f:
                nb = json.load(f)
            kernel = nb.get("metadata", {}).get("kernelspec", {}).get("name")
            if kernel != KERNELSPEC["name"]:
                problems.append(f"{rel}: names kernel {kernel!r}; `pip install -e .` gives "
                                f"only {KERNELSPEC['name']!r}")
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
