"""Math in the HTML pages of `labkit build`, readable offline: LaTeX turned into MathML.

nbconvert's pages load MathJax from a CDN, so read without a network they show raw LaTeX. Here
each `$...$` and `$$...$$` of a markdown cell becomes MathML (latex2mathml), which browsers draw
natively, and the page template loads no script for math. Math inside code spans and fenced code
is left alone; a formula latex2mathml cannot read stays as its LaTeX, in a code span.
"""
from __future__ import annotations

import re

_FENCE = re.compile(r"(```.*?```|~~~.*?~~~|`[^`\n]*`)", re.S)
_DISPLAY = re.compile(r"\$\$(.+?)\$\$", re.S)
_INLINE = re.compile(r"(?<![\\$])\$(?!\s)([^$\n]+?)(?<!\s)\$(?!\d)")


def _convert(latex: str, display: str) -> str:
    import latex2mathml.converter
    try:
        return latex2mathml.converter.convert(latex.strip(), display=display)
    except Exception:  # noqa: BLE001 (an unreadable formula stays readable as LaTeX)
        return f"`{latex.strip()}`"


def markdown_to_mathml(text: str) -> str:
    """The markdown with its math as MathML (display math as a block of its own)."""
    parts = _FENCE.split(text)
    for i in range(0, len(parts), 2):              # even parts are outside code
        chunk = _DISPLAY.sub(lambda m: "\n\n" + _convert(m.group(1), "block") + "\n\n",
                             parts[i])
        parts[i] = _INLINE.sub(lambda m: _convert(m.group(1), "inline"), chunk)
    return "".join(parts)


def notebook_to_mathml(nb):
    """A copy of the notebook whose markdown cells carry MathML instead of LaTeX."""
    import copy
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "markdown" and "$" in cell.source:
            cell.source = markdown_to_mathml(cell.source)
    return nb
