"""Per-rank output shown side by side in JupyterLab, and as plain labelled lines everywhere else.

What a world call's ranks print arrives interleaved: with 4 ranks printing 5 lines each, the cell
shows 20 `[rank k] ...` lines in arrival order, and a student reads one rank's story by skipping
three lines out of four. In a notebook frontend this module shows the same lines as one column per
rank (a table, at most 4 columns a row, so 8 ranks make two rows), each column headed `rank k`,
stderr lines in red, the whole view collapsible. The same display carries a text/plain version,
the labelled lines grouped by rank, which is what headless runs (papermill, nbclient, nbconvert,
the test suite) read and what a terminal prints.

    from labkit.runtime.display import show_rank_outputs
    show_rank_outputs({0: ["loss 2.31", "loss 2.05"], 1: ["loss 2.29", "loss 2.07"]})

    view = RankOutputView()          # live: one display, updated in place as lines arrive
    view.add(0, "loss 2.31")         # re-rendered at most every `min_interval` seconds
    view.add(1, "oops", stream="err")
    view.close()                     # the final render

The launcher asks `live_view()` for a view at the start of every call and hands it each line; where
that returns None (no frontend, `LABKIT_OUTPUT=text`, nbgrader executing, papermill runs started
by `labkit build`), lines are printed as `[rank k] text` the moment they arrive. A table is used (not CSS grid)
because JupyterLab's HTML sanitizer, applied when a saved notebook is reopened untrusted, keeps
tables but drops most inline styles.
"""
from __future__ import annotations

import html
import os
import sys
import time

COLUMNS = 4          # ranks side by side before the view wraps to a new row
MAX_LINES = 200      # per rank in the HTML view; the text/plain version keeps every line
CSS_CLASS = "labkit-rank-outputs"


def live_view():
    """A `RankOutputView` for one call, or None where the output should stay plain text."""
    if os.environ.get("LABKIT_OUTPUT", "auto") == "text" or os.environ.get("NBGRADER_EXECUTION"):
        return None
    return RankOutputView() if frontend_present() else None


def frontend_present() -> bool:
    """True inside a Jupyter kernel (IPython's ZMQ shell), where a display is rendered; False in a
    plain Python process or a terminal IPython, where only text is shown."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _as_lines(lines) -> list[tuple[str, str]]:
    """Accepts ["text", ...] or [("out" | "err", "text"), ...]."""
    return [(item[0], item[1]) if isinstance(item, tuple) else ("out", item) for item in lines]


def rank_outputs_text(lines_by_rank: dict) -> str:
    """The plain-text version: `[rank k] text` lines, grouped by rank, ranks in order."""
    if not lines_by_rank:
        return ""
    width = len(str(max(lines_by_rank)))
    return "\n".join(f"[rank {rank:>{width}}] {text}" for rank in sorted(lines_by_rank)
                     for _, text in _as_lines(lines_by_rank[rank]))


def rank_outputs_html(lines_by_rank: dict, title: str = "") -> str:
    """One column per rank, COLUMNS to a row; stderr lines in red; inside a <details> element."""
    ranks = sorted(lines_by_rank)
    total = sum(len(lines_by_rank[r]) for r in ranks)
    rows = []
    for start in range(0, len(ranks), COLUMNS):
        chunk = ranks[start:start + COLUMNS]
        head = "".join(f'<th style="text-align:left">rank {r}</th>' for r in chunk)
        cells = "".join(f'<td style="vertical-align:top;text-align:left" data-rank="{r}">'
                        f"<pre>{_column(lines_by_rank[r])}</pre></td>" for r in chunk)
        rows.append(f"<tr>{head}</tr><tr>{cells}</tr>")
    summary = html.escape(title or f"output of {len(ranks)} ranks ({total} lines)")
    return (f'<details open class="{CSS_CLASS}"><summary>{summary}</summary>'
            f'<table class="{CSS_CLASS}-table">{"".join(rows)}</table></details>')


def _column(lines) -> str:
    lines = _as_lines(lines)
    shown = lines[-MAX_LINES:]
    out = []
    if len(lines) > len(shown):
        out.append(f"... {len(lines) - len(shown)} earlier lines: see the text version ...")
    for stream, text in shown:
        escaped = html.escape(text)
        out.append(f'<span style="color:#c00">{escaped}</span>' if stream == "err" else escaped)
    return "\n".join(out)


def rank_outputs_bundle(lines_by_rank: dict) -> dict:
    """The display's MIME bundle: text/plain for headless readers, text/html for a frontend."""
    return {"text/plain": rank_outputs_text(lines_by_rank),
            "text/html": rank_outputs_html(lines_by_rank)}


def show_rank_outputs(lines_by_rank: dict) -> None:
    """Shows a call's per-rank lines once: the side-by-side view in a frontend, else the text."""
    if not any(lines_by_rank.values()):
        return
    if frontend_present():
        from IPython.display import display
        display(rank_outputs_bundle(lines_by_rank), raw=True)
    else:
        print(rank_outputs_text(lines_by_rank), flush=True)


class RankOutputView:
    """A live per-rank view: one display that is updated in place as lines arrive."""

    def __init__(self, min_interval: float = 0.25):
        self.lines_by_rank: dict[int, list[tuple[str, str]]] = {}
        self.min_interval = min_interval
        self._handle = None
        self._last_render = 0.0
        self._dirty = False

    def add(self, rank: int, text: str, stream: str = "out") -> None:
        self.lines_by_rank.setdefault(rank, []).append((stream, text))
        self._dirty = True
        if time.monotonic() - self._last_render >= self.min_interval:
            self._render()

    def close(self) -> None:
        if self._dirty:
            self._render()

    def _render(self) -> None:
        from IPython.display import display
        bundle = rank_outputs_bundle(self.lines_by_rank)
        if self._handle is None:
            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)
        self._last_render = time.monotonic()
        self._dirty = False
