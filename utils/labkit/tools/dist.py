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

The copy's pyproject.toml is the course's without its extras (`test`; `instructor`: the
PostgreSQL driver of class-scale gradebooks) and without the test configuration. nbgrader stays
(its Validate button runs a lab's visible tests), but its instructor panels (Formgrader, Create
Assignment, the course and assignment lists of nbgrader's exchange, the Nbgrader menu) are
turned off by the README's install step, `labkit student-setup`: `jupyter labextension disable`
and `lock` at that environment's sys-prefix level, and a jupyter_server_config.d file there
that turns the matching server extensions off; `jupyter labextension list` and `jupyter server
extension list` then report them disabled.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

from labkit.common import HIDDEN_BEGIN, HIDDEN_END, SOLUTION_BEGIN

COPIED = ["course", "labs"]
# pyproject.toml sections the student copy leaves out (instructor and CI material)
DROPPED_SECTIONS = ["project.optional-dependencies", "tool.pytest.ini_options"]
INSTRUCTOR_LAB_PLUGINS = ["@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment",
                          "@jupyter/nbgrader:course-list", "@jupyter/nbgrader:assignment-list",
                          "@jupyter/nbgrader:menu"]
INSTRUCTOR_SERVER_EXTENSIONS = ["nbgrader.server_extensions.formgrader",
                                "nbgrader.server_extensions.course_list",
                                "nbgrader.server_extensions.assignment_list"]
SERVER_CONFIG = "zz-labkit-student-copy.json"      # sorts after nbgrader.json
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

A notebook course on training large language models across many processes. Each chapter in
`course/` teaches and measures one idea on real `torch.distributed` ranks started from the
notebook; each lab in `labs/` is graded. Everything runs on a laptop CPU.

## 1. Install (once)
You need Python 3.10 or newer (3.11 is what the course is tested on) and about 3 GB of disk
(most of it torch). In this folder:

```
python3 -m venv .venv
. .venv/bin/activate          # Windows: .venv\\Scripts\\activate
pip install -e .
labkit student-setup
labkit doctor
```
`labkit student-setup` turns off nbgrader's instructor panels in this environment's JupyterLab
(you keep its Validate button); `labkit doctor` checks that this machine runs the course. With
conda instead: `conda env create -f environment.yml && conda activate labkit`, then the last two
lines.

## 2. Study
`jupyter lab` (with the environment active), then open `course/` for the chapters and `labs/`
for the labs. The notebooks run on the "Python 3 (ipykernel)" kernel of this environment. Read
chapter N, then do lab N. `course/GLOSSARY.md` maps the course's terms (with the Chinese terms of
the source material). Practise for interviews with `course/drill.ipynb` or, in a terminal,
`labkit drill` (e.g. `labkit drill --topic moe -n 10`): the chapters' formulas with fresh
numbers each time.

## 3. Do a lab
Open `labs/labNN_<name>/labNN_<name>.ipynb` and write your code where a cell says `raise
NotImplementedError(...)`. The test cells next to each task are the visible tests; the grader
adds hidden tests of the same functions with fresh inputs, so make your functions right, not
just the visible cases. Do not edit or delete test cells (the grader restores them).

## 4. Hand it in
1. Kernel > Restart Kernel and Run All Cells: every cell runs without an error from the top in a
   fresh kernel (the Validate button in the notebook's toolbar does the same check).
2. Save, and upload that one file, `labs/labNN_<name>/labNN_<name>.ipynb`, to the lab's
   assignment on the course's learning platform (Canvas, Moodle, ...): the `.ipynb` itself, not
   a zip, a PDF or a copy under another lab's name. Uploading again replaces it; the newest
   upload counts, and one after the deadline is marked late.
3. Your feedback comes back through the platform: one HTML page per lab with each test cell's
   verdict (a visible test's failure in full, with its case seed: replay it with
   `LABKIT_CASE_SEED=...`; a hidden test's failure as `HiddenTestFailed`).

`labkit` (in `utils/labkit/`) starts real torch.distributed ranks from a notebook:
see `utils/labkit/runtime/README.md`.
"""


def add_arguments(parser) -> None:
    parser.add_argument("out", help="folder to create (must not exist, or be empty)")
    parser.add_argument("--course", default=None, help="course repository (default: here)")


def build(out: str, course: str | None = None) -> list[str]:
    """Build the student distribution into `out`; return its files (relative paths)."""
    from labkit.common import find_course_root
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
    if os.path.isfile(os.path.join(course, "pyproject.toml")):
        with open(os.path.join(course, "pyproject.toml"), encoding="utf-8") as f:
            project = student_pyproject(f.read())
        with open(os.path.join(out, "pyproject.toml"), "w", encoding="utf-8") as f:
            f.write(project)
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


def student_pyproject(text: str) -> str:
    """The course's pyproject.toml without DROPPED_SECTIONS (each from its header to the next)."""
    kept, dropping = [], False
    for line in text.splitlines(keepends=True):
        header = re.match(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$", line)
        if header:
            dropping = header[1].strip() in DROPPED_SECTIONS
        if not dropping:
            kept.append(line)
    return "".join(kept)


class StudentSetup:
    """`labkit student-setup`: nbgrader's instructor panels off in this environment's JupyterLab
    (the Validate button stays)."""

    @staticmethod
    def add_arguments(parser) -> None:
        parser.add_argument("--user", action="store_true",
                            help="write the settings to this user's Jupyter config folder "
                                 "($JUPYTER_CONFIG_DIR or ~/.jupyter) instead of the "
                                 "environment's (a shared environment one cannot write to)")

    @staticmethod
    def run(args) -> int:
        # server extensions: a config file of our own after nbgrader's in the same .d folder
        # (later files win); `jupyter server extension disable` validates nbgrader's modules,
        # fails (they have no _jupyter_server_extension_points) and writes nothing
        user = bool(getattr(args, "user", False))
        if user:
            from jupyter_core.paths import jupyter_config_dir
            base = jupyter_config_dir()
        else:
            base = os.path.join(sys.prefix, "etc", "jupyter")
        level = "user" if user else "sys_prefix"
        folder = os.path.join(base, "jupyter_server_config.d")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, SERVER_CONFIG), "w") as f:
            json.dump({"ServerApp": {"jpserver_extensions": {
                name: False for name in INSTRUCTOR_SERVER_EXTENSIONS}}}, f, indent=2)
        jupyter = [sys.executable, "-m", "jupyter"]
        # lab plugins: disabled, and locked (JupyterLab >= 4.1 lets a user re-enable otherwise)
        for command in (["labextension", "disable", f"--level={level}",
                         *INSTRUCTOR_LAB_PLUGINS],
                        ["labextension", "lock", f"--level={level}",
                         *INSTRUCTOR_LAB_PLUGINS]):
            done = subprocess.run(jupyter + command, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"labkit student-setup: `jupyter {' '.join(command[:3])} ...` failed "
                      f"(exit {done.returncode}): {(done.stderr or done.stdout).strip()[-500:]}"
                      "; is this the environment of `pip install -e .` (nbgrader installed)?",
                      file=sys.stderr)
                return 1
        print(f"labkit student-setup: nbgrader's instructor panels are off in "
              f"{base if user else sys.prefix} "
              "(Formgrader, Create Assignment, course and assignment lists); Validate stays. "
              "Check: jupyter labextension list")
        return 0


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
        if rel == "pyproject.toml":
            with open(os.path.join(out, rel), encoding="utf-8") as f:
                text = f.read()
            for section in DROPPED_SECTIONS:
                if re.search(rf"^\s*\[{re.escape(section)}\]", text, re.M):
                    problems.append(f"{rel}: has [{section}] (instructor or test material)")
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
