"""Expected values of graded tasks: computed by the grader's references, or written at release.

The references that answer a graded task live in `labkit.grading.references`, which `labkit dist`
leaves out of the student copy. A checker asks for them here:

    ref = released.reference("mesh")              # labkit.grading.references.mesh, or None
    best = ref.brute_force(...) if ref else released.value("lab06_3d_parallelism", "best", key)

In the course repository (and under `labkit grade`) the reference computes every case, hidden
ones included. In the student copy only the visible cases have an expected value: `labkit
release` writes them to `labs/<lab>/expected.json` (see `labkit.tools.release`).
"""
from __future__ import annotations

import importlib
import json
import os

FILE = "expected.json"


def reference(name: str):
    """labkit.grading.references.<name>, or None where labkit.grading is absent (student copy)."""
    try:
        return importlib.import_module(f"labkit.grading.references.{name}")
    except ModuleNotFoundError as error:
        if error.name and error.name.startswith("labkit.grading"):
            return None
        raise


def key(*arguments) -> str:
    """The canonical text of a case's arguments (how expected.json files its values)."""
    return json.dumps(list(arguments), sort_keys=True, separators=(",", ":"))


def _candidates(lab: str) -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))          # <course>/utils/labkit
    roots = [os.path.dirname(os.path.dirname(here))]
    folder = os.path.abspath(os.getcwd())
    while True:                                               # a notebook runs in labs/<lab>/
        roots.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    paths = [os.path.join(os.getcwd(), FILE)]
    paths += [os.path.join(root, "labs", lab, FILE) for root in roots]
    return paths


def load(lab: str) -> dict:
    for path in _candidates(lab):
        if os.path.isfile(path) and os.path.basename(os.path.dirname(path)) == lab:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
    raise FileNotFoundError(
        f"{lab}: no {FILE} next to the lab notebook (looked in labs/{lab}/). The visible tests "
        "of this copy take their expected values from it; get a fresh copy of the lab folder")


def value(lab: str, name: str, case_key: str):
    """The expected value of a visible case, as `labkit release` wrote it."""
    table = load(lab).get(name, {})
    if case_key not in table:
        raise LookupError(
            f"{lab}: no expected value of {name} for this case ({case_key[:200]}). The student "
            "copy holds the expected values of the visible tests only; the grader computes the "
            "others. Run the lab's visible test cells as they are")
    return table[case_key]
