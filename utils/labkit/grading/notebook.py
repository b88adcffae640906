"""What the grader needs to know about a lab notebook: cell roles, hidden lines, task names.

Cell roles (from nbgrader's metadata):
  test    graded, locked code cell: runs ONLY in the trusted grader, never in the student's kernel;
  answer  solution code cell: runs only in the sandboxed kernel;
  setup   locked code cell that is neither (imports, parameters, `world = labkit.world(P)`):
          runs in the sandbox, for the student's code, AND in the trusted grader, for the tests;
  other   any other code cell (a student's scratch cell): runs only in the sandbox.
"""
from __future__ import annotations

import ast
import hashlib

from labkit.common import HIDDEN_BEGIN as BEGIN_HIDDEN, HIDDEN_END as END_HIDDEN


def role(cell) -> str:
    if cell.get("cell_type") != "code":
        return "markdown"
    meta = cell.get("metadata", {}).get("nbgrader", {})
    if meta.get("grade") and not meta.get("solution"):
        return "test"
    if meta.get("solution"):
        return "answer"
    if meta.get("locked"):
        return "setup"
    return "other"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def hidden_lines(source: str) -> set[int]:
    """1-based numbers of the lines inside (and on) the hidden-test markers."""
    hidden, inside = set(), False
    for number, line in enumerate(source.splitlines(), start=1):
        if BEGIN_HIDDEN in line:
            inside = True
        if inside:
            hidden.add(number)
        if END_HIDDEN in line:
            inside = False
    return hidden


def hidden_texts(source: str, min_length: int = 12) -> list[str]:
    """The non-trivial lines of the hidden region, stripped (to check feedback never has them)."""
    lines = source.splitlines()
    return [lines[n - 1].strip() for n in sorted(hidden_lines(source))
            if len(lines[n - 1].strip()) >= min_length
            and BEGIN_HIDDEN not in lines[n - 1] and END_HIDDEN not in lines[n - 1]]


def task_names(source_notebook) -> list[str]:
    """Top-level names the lab's solution cells define (functions, classes, constants).

    Only these names of the student's kernel are ever reachable from a test cell; a student
    cannot slip any other name (a fake `torch`, `assert_close`, ...) into the trusted grader.
    """
    names = []
    for cell in source_notebook.cells:
        if role(cell) != "answer":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names += [t.id for t in targets if isinstance(t, ast.Name)]
    return sorted(set(names))


def restore(nb, db_url: str, lab: str, notebook_id: str, student_id: str, config=None):
    """The submission as nbgrader's autograde sees it before executing: outputs cleared, locked
    and test cells restored from the gradebook (hidden tests included), deleted ones re-added.
    Exactly nbgrader's own sanitize step, so both sides agree cell for cell."""
    from nbgrader.preprocessors import (CheckCellMetadata, ClearOutput, DeduplicateIds,
                                        OverwriteCells, OverwriteKernelspec)
    from traitlets.config import Config
    config = config or Config()
    config.OverwriteCells.add_missing_cells = True
    resources = {"nbgrader": {"student": student_id, "assignment": lab,
                              "notebook": notebook_id, "db_url": db_url}}
    from labkit.grading.nbhooks import Renode
    for cls in (ClearOutput, DeduplicateIds, OverwriteKernelspec, OverwriteCells, Renode,
                CheckCellMetadata):
        nb, resources = cls(config=config).preprocess(nb, resources)
    return nb
