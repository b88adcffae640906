"""What is secret in a lab's feedback, decided by provenance, and the last check of every file.

    secret = secret_texts(source_dir, release_dir, notebook_ids)  # {grade_id: [hidden lines]}
    leaks = check_feedback(feedback_folder, secret)               # [(path, grade_id)], deleted

A hidden-test line is secret only if the student's copy of the lab (nbgrader's release of
solutions/<LAB>, the same notebooks as labs/<LAB>) does not hold it: 13 test cells repeat a
visible line inside their hidden block (the same checker call, `world = labkit.world(...)`), and a
visible failure that quotes such a line must reach the student in full. Which output comes from a
hidden line is decided where the test ran (trusted.py `render_error`); these lists are the safety
net behind it: ScrubHidden (nbhooks.py) replaces a test cell's output that quotes a secret line,
and check_feedback deletes a feedback file that still holds one, as text, as HTML-escaped text, or
once the HTML's tags are stripped (a highlighted source line is split into spans).
"""
from __future__ import annotations

import glob
import html
import json
import os
import re

# written into each feedback file's <head>: long messages wrap instead of running off the page
WRAP_CSS = ("div.output_area pre, div.output_subarea pre, div.output_text pre "
            "{white-space: pre-wrap; overflow-wrap: anywhere; word-break: normal;}")
_TAG = re.compile(r"<[^>]*>")


def student_lines(release_dir: str, notebook_ids: list) -> set[str]:
    """Every stripped line of every cell of the student's copy (code and prose alike)."""
    import nbformat
    lines = set()
    for nb_id in notebook_ids:
        path = os.path.join(release_dir, nb_id + ".ipynb")
        if not os.path.isfile(path):
            continue
        for cell in nbformat.read(path, as_version=4).cells:
            lines.update(line.strip() for line in cell.source.splitlines() if line.strip())
    return lines


def secret_texts(source_dir: str, release_dir: str | None, notebook_ids: list) -> dict:
    """{grade_id: the hidden lines of that test cell that the student's copy does not hold}.

    A hidden line that is (part of) a line of the student's copy is not secret: the student
    has it. Without a release folder every hidden line counts as secret (the strict old rule)."""
    import nbformat
    from labkit.grading import notebook as nbtools
    visible = student_lines(release_dir, notebook_ids) if release_dir else set()
    secret = {}
    for nb_id in notebook_ids:
        nb = nbformat.read(os.path.join(source_dir, nb_id + ".ipynb"), as_version=4)
        for cell in nb.cells:
            if nbtools.role(cell) != "test":
                continue
            texts = nbtools.hidden_texts(cell.source)
            secret[cell.metadata.nbgrader.get("grade_id")] = [
                t for t in texts if t not in visible and not any(t in v for v in visible)]
    return secret


def quotes(text: str, lines: list) -> str | None:
    """The first of `lines` that `text` holds: plainly, JSON- or HTML-escaped, or in the text of
    an HTML page with its tags stripped."""
    if not lines:
        return None
    stripped = html.unescape(_TAG.sub("", text))
    for line in lines:
        forms = {line, html.escape(line), html.escape(line, quote=False),
                 json.dumps(line)[1:-1]}
        if any(form in text for form in forms) or line in stripped:
            return line
    return None


def check_feedback(folder: str, secret: dict) -> list:
    """[(path, grade_id)] of feedback files under `folder` that quote a secret line of test cell
    grade_id; each such file is deleted."""
    owners = [(line, grade_id) for grade_id, lines in secret.items() for line in lines]
    leaks = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "*"), recursive=True)):
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            content = f.read()
        found = quotes(content, [line for line, _ in owners])
        if found is not None:
            leaks.append((path, next(g for line, g in owners if line == found)))
            os.remove(path)
    return leaks
