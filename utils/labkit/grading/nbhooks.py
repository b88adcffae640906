"""nbgrader preprocessors: put the trusted verdicts into autograde, keep hidden tests out of feedback.

InjectVerdicts replaces nbgrader's `Execute` in `Autograde.autograde_preprocessors`. Instead of
running the notebook, it copies the outputs the trusted run recorded (worker.py) onto the
restored notebook, cell by cell, after checking that each cell's source is the one that run saw.
A test cell keeps no error output only if the trusted grader ran it to its end under this run's
nonce; every other test cell gets an error output, so nbgrader's own SaveAutoGrades scores it 0.

ScrubHidden runs in `GenerateFeedback.preprocessors` after nbgrader's ClearHiddenTests: every
output of a test cell that has hidden tests is checked, and any output quoting a secret hidden
line (one the student's copy does not hold, see feedback.py) is replaced by a one-line note.
FeedbackCSS (last) adds the feedback page's CSS: nbconvert's, and outputs that wrap.
"""
from __future__ import annotations

import json
import os

from nbgrader.preprocessors import NbGraderPreprocessor
from traitlets import Dict, Unicode

from labkit.grading import notebook as nbtools


def _fail(text: str):
    """An error output, as a NotebookNode: nbgrader's preprocessors after this one read outputs
    by attribute (LimitOutput: `output.output_type`), and a plain dict there failed the whole
    notebook's autograde ("No notebooks were matched") instead of scoring the cell 0."""
    return _as_node({"output_type": "error", "ename": "NotGraded", "evalue": text,
                     "traceback": [f"NotGraded: {text}"]})


class InjectVerdicts(NbGraderPreprocessor):
    results_dir = Unicode("", help="folder of <student>.json written by the workers").tag(
        config=True)
    nonces = Dict({}, help="student id -> nonce of this run").tag(config=True)

    def preprocess(self, nb, resources):
        student = resources["nbgrader"]["student"]
        notebook_id = resources["nbgrader"]["notebook"]
        path = os.path.join(self.results_dir, f"{student}.json")
        try:
            with open(path) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = {}
        nonce = self.nonces.get(student)
        graded = result.get("notebooks", {}).get(notebook_id, {}) \
            if result.get("nonce") == nonce and nonce else {}
        cells = graded.get("cells", {})
        problem = result.get("error") or ("no trusted result for this notebook"
                                          if not cells else None)
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            entry = cells.get(str(index))
            kind = nbtools.role(cell)
            cell.outputs = []
            cell.execution_count = None
            if entry is None or entry.get("sha") != nbtools.sha(cell.source):
                if kind == "test":
                    cell.outputs = [_fail(problem or "this cell was not graded (it differs from "
                                          "the one the grader ran)")]
                continue
            outputs = [dict(o) for o in entry.get("outputs", []) if isinstance(o, dict)]
            for out in outputs:
                if out.get("output_type") == "display_data":
                    out.setdefault("metadata", {})
            if kind == "test":
                outputs = [o for o in outputs if o.get("output_type") in ("stream", "error")]
                for o in outputs:          # nbgrader: stderr in a test cell = fail; keep it ours
                    if o.get("output_type") == "stream":
                        o["name"] = "stdout"
                passed = entry.get("passed") is True and entry.get("nonce") == nonce
                if not passed and not any(o["output_type"] == "error" for o in outputs):
                    outputs.append(_fail("this test did not run to completion"))
                if passed:
                    outputs = [o for o in outputs if o["output_type"] != "error"]
            cell.outputs = [_as_node(o) for o in outputs]
        return nb, resources


def _as_node(output):
    import nbformat
    return nbformat.from_dict(output)


class Renode(NbGraderPreprocessor):
    """After OverwriteCells: a re-added cell's metadata is a plain dict (nbgrader 0.9.6 builds it
    with a shallow NotebookNode), which CheckCellMetadata then trips over; make it nodes again."""

    def preprocess(self, nb, resources):
        import nbformat
        return nbformat.from_dict(nb), resources


class ScrubHidden(NbGraderPreprocessor):
    """A test cell's output that quotes a secret line of that cell is replaced by a note.

    `hidden` holds the secret lines only (feedback.secret_texts: hidden lines the student's copy
    does not hold), so a visible failure that quotes a visible line repeated in the hidden block
    reaches the student in full. Which output comes from a hidden line was decided where the test
    ran (trusted.render_error); this is the net behind it."""
    hidden = Dict({}, help="grade_id -> secret hidden lines of that test cell").tag(config=True)

    def preprocess(self, nb, resources):
        from labkit.grading.feedback import quotes
        for cell in nb.cells:
            if nbtools.role(cell) != "test":
                continue
            grade_id = cell.metadata.nbgrader.get("grade_id")
            texts = self.hidden.get(grade_id, [])
            clean = []
            for out in cell.get("outputs", []):
                if quotes(json.dumps(out), texts) is not None:
                    clean.append(_as_node({"output_type": "stream", "name": "stdout",
                                           "text": f"[grader] output of {grade_id} hidden: it "
                                                   "quoted a hidden test\n"}))
                else:
                    clean.append(out)
            cell.outputs = clean
        return nb, resources


class FeedbackCSS(NbGraderPreprocessor):
    """The feedback page's own CSS, in nbgrader's `resources.inlining.css`: the code highlighting
    (what nbconvert's CSSHTMLHeaderPreprocessor would add; registered by nbgrader, it stays
    disabled) and outputs that wrap (`white-space: pre-wrap`), so a long failure message stays
    on the page instead of running off to the right."""

    def preprocess(self, nb, resources):
        from jupyterlab_pygments import JupyterStyle
        from pygments.formatters import HtmlFormatter
        from labkit.grading.feedback import WRAP_CSS
        css = resources.setdefault("inlining", {}).setdefault("css", [])
        css += [HtmlFormatter(style=JupyterStyle).get_style_defs(".highlight"), WRAP_CSS]
        return nb, resources
