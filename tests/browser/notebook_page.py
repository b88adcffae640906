"""What a student does and sees in a JupyterLab notebook tab, as Playwright steps.

    nb = NotebookPage(page, server)
    nb.open("course/00_x.ipynb")        # waits until the kernel really is idle (see the race below)
    nb.run_all(); nb.wait_executed(timeout_s=60)
    nb.outputs(3)                       # [(mime type, visible text), ...] of the 4th cell
    nb.add_cell_and_run("%%ranks\\nprint(rank)")
    nb.type_ranks_cell()                # RANKS_CELL: an all_reduce, one checked line per rank

Every wait is bounded; the selectors are the ones measured in shared/notes/browser-testing.md.
"""
from __future__ import annotations

import re
import time

from playwright.sync_api import Page, expect

PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"   # the notebook tab in front
STATUS_TEXT = "#jp-main-statusbar .jp-StatusBar-TextItem"
STDERR = "application/vnd.jupyter.stderr"         # errors and tracebacks render with this type too


# labkit's notice after a hang, written to stderr (so Lab shows it on red): a notice, not an error.
NOTICES = ("labkit: restarting the world",)


# A cell a student types to see the ranks at work: a real all_reduce on every rank of the world.
RANKS_CELL = ("%%ranks\n"
              "x = torch.ones(1)\n"
              "dist.all_reduce(x)\n"
              'print(f"rank {rank} of {world_size}: all_reduce gave {int(x.item())}")')
RANK_LINE = re.compile(r"rank (\d+) of (\d+): all_reduce gave (\d+)")


def error_outputs(outputs: list[tuple[str, str]]) -> list[str]:
    """Outputs shown as errors (tracebacks, stderr), except labkit's known notices."""
    return [t for m, t in outputs if m == STDERR and not t.startswith(NOTICES)]


class NotebookPage:
    def __init__(self, page: Page, server):
        self.page = page
        self.server = server
        self.panel = page.locator(PANEL)

    # -- opening ---------------------------------------------------------------------------------
    def open(self, path: str, timeout_s: float = 30) -> None:
        self.page.goto(self.server.url(f"lab/tree/{path}"))
        self.panel.wait_for(timeout=timeout_s * 1000)
        self.wait_kernel_idle(timeout_s)

    def open_lab(self, timeout_s: float = 60) -> None:
        """Loads Lab without a document: the page then opens notebook after notebook with
        open_from_path, paying Lab's start in the browser once."""
        self.page.goto(self.server.url("lab"))
        self._menu("File").wait_for(timeout=timeout_s * 1000)

    def open_from_path(self, path: str, timeout_s: float = 60) -> None:
        """File > Open from Path...: opens a notebook in the Lab already loaded here (close the
        one before with close_notebook: `panel` is the notebook in front)."""
        self._menu("File").click()
        self.page.locator("li[data-command='filebrowser:open-path']").click()
        dialog = self.page.locator(".jp-Dialog")
        dialog.locator("input").fill(path)
        dialog.locator(".jp-mod-accept").click()
        self.panel.locator(".jp-CodeCell").first.wait_for(timeout=timeout_s * 1000)
        deadline = time.monotonic() + timeout_s
        while not self._has_kernel(path):       # its own kernel, not the status of the one before
            if time.monotonic() > deadline:
                raise TimeoutError(f"no kernel session for {path} after {timeout_s} s")
            time.sleep(0.1)
        self.wait_kernel_idle(max(1.0, deadline - time.monotonic()))

    def _has_kernel(self, path: str) -> bool:
        sessions = self.server.api("GET", "api/sessions")
        return any(s["path"] == path and s.get("kernel") for s in sessions)

    def close_notebook(self, timeout_s: float = 15) -> None:
        """File > Close Tab on the notebook in front, discarding its changes when Lab asks."""
        self._menu("File").click()
        self.page.locator("li[data-command='application:close']").click()
        discard = self.page.locator(".jp-Dialog .jp-mod-warn")   # "Save your work": Discard
        deadline = time.monotonic() + timeout_s
        while self.panel.count():
            if discard.count():
                discard.click()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the notebook tab did not close within {timeout_s} s")
            time.sleep(0.1)

    def _menu(self, label: str):
        return self.page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(rf"^{label}$"))

    def kernel_status(self) -> str:
        texts = self.page.locator(STATUS_TEXT).all_inner_texts()
        return next((t for t in texts if " | " in t), "")

    def wait_kernel_idle(self, timeout_s: float = 30) -> None:
        """The toolbar's indicator reads idle while the kernel still starts, and a Run All sent
        then is dropped; the status bar's "<kernel> | Idle" is only shown once it is ready."""
        deadline = time.monotonic() + timeout_s
        while not self.kernel_status().endswith("| Idle"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"kernel not idle after {timeout_s} s: {self.kernel_status()!r}")
            time.sleep(0.1)

    # -- running ---------------------------------------------------------------------------------
    def run_all(self) -> None:
        self._menu("Run").click()
        self.page.locator("li[data-command='runmenu:run-all']").click()  # unique, unlike the name

    def prompts(self) -> list[str]:
        return self.panel.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()

    def wait_executed(self, timeout_s: float, cells: list[int] | None = None) -> None:
        """Waits until the given code cells (all by default) show an execution count, not [*]."""
        deadline = time.monotonic() + timeout_s
        while True:
            prompts = self.prompts()
            chosen = prompts if cells is None else [prompts[i] for i in cells]
            if chosen and all(re.fullmatch(r"\[\d+\]:", p.strip()) for p in chosen):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cells not done after {timeout_s} s; prompts: {prompts}")
            time.sleep(0.1)

    def wait_run_all(self, timeout_s: float) -> None:
        """Waits until Run All is over: every code cell numbered, or nothing queued ([*]) and the
        kernel idle for a second (Run All stops at the first error; later cells stay [ ])."""
        deadline = time.monotonic() + timeout_s
        settled_since = None
        while True:
            prompts = [p.strip() for p in self.prompts()]
            if prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts):
                return
            if "[*]:" not in prompts and self.kernel_status().endswith("| Idle"):
                settled_since = settled_since or time.monotonic()
                if time.monotonic() - settled_since > 1.0:
                    return
            else:
                settled_since = None
            if time.monotonic() > deadline:
                raise TimeoutError(f"Run All not done after {timeout_s} s; prompts: {prompts}")
            time.sleep(0.1)

    def not_run(self) -> list[int]:
        """Code cells without an execution count."""
        return [i for i, p in enumerate(self.prompts()) if not re.fullmatch(r"\[\d+\]:", p.strip())]

    def wait_running(self, cell: int, timeout_s: float = 10) -> None:
        expect(self.code_cell(cell).locator(".jp-InputPrompt")).to_have_text(
            re.compile(r"\[\*\]"), timeout=timeout_s * 1000)

    def interrupt(self) -> None:
        """The stop button (square) of the notebook's toolbar."""
        self.panel.locator("[data-command='notebook:interrupt-kernel']").click()

    def run_cell(self, index: int) -> None:
        """Clicks into a code cell and runs it with Ctrl+Enter (the focus stays on it)."""
        self.code_cell(index).locator(".jp-InputArea-editor").click()
        self.page.keyboard.press("Control+Enter")

    def add_cell_and_run(self, source: str, timeout_s: float = 30) -> int:
        """Adds a cell below the last one, types source key by key, runs it (Ctrl+Enter: Shift+Enter
        on the last cell would add yet another cell). Returns the new cell's code-cell index.
        The editor auto-indents and closes brackets as it would for a person, so keep source free of
        indented blocks; the typed text is checked before it runs."""
        self.code_cell(-1).locator(".jp-InputArea-editor").click()
        self.page.keyboard.press("Escape")           # command mode
        self.page.keyboard.press("b")                # new cell below, selected
        self.page.keyboard.press("Enter")            # edit mode
        self.page.keyboard.type(source)
        index = len(self.prompts()) - 1
        typed = self.code_cell(index).locator(".cm-content").inner_text()
        assert typed.strip() == source.strip(), f"the editor holds {typed!r}, not {source!r}"
        self.page.keyboard.press("Control+Enter")
        self.wait_executed(timeout_s, cells=[index])
        return index

    def type_ranks_cell(self, timeout_s: float = 60) -> tuple[int, int]:
        """Types RANKS_CELL below the last cell and runs it; asserts that it shows no error and one
        line from each rank of the current world, each with the sum P. Returns (cell, P)."""
        cell = self.add_cell_and_run(RANKS_CELL, timeout_s=timeout_s)
        assert error_outputs(self.outputs(cell)) == [], (
            f"the %%ranks cell shows an error:\n{self.text(cell)}")
        lines = self.rank_lines(cell)
        first = RANK_LINE.fullmatch(lines.get(0, [""])[0])
        assert first, f"no line from rank 0 in the %%ranks cell; it shows:\n{self.text(cell)}"
        size = int(first.group(2))
        expected = {r: [f"rank {r} of {size}: all_reduce gave {size}"] for r in range(size)}
        assert lines == expected, (f"expected one labelled line from each of {size} ranks, each "
                                   f"with the sum {size}; the cell shows:\n{self.text(cell)}")
        return cell, size

    # -- reading ---------------------------------------------------------------------------------
    def code_cell(self, index: int):
        cells = self.panel.locator(".jp-CodeCell")
        return cells.nth(cells.count() - 1 if index == -1 else index)

    def outputs(self, index: int) -> list[tuple[str, str]]:
        """(mime type, text a person sees) for each output of a code cell."""
        return self.code_cell(index).locator(".jp-OutputArea-output").evaluate_all(
            "els => els.map(e => [e.dataset.mimeType || '', e.innerText])")

    def all_outputs(self) -> list[list[tuple[str, str]]]:
        return [self.outputs(i) for i in range(len(self.prompts()))]

    def text(self, index: int) -> str:
        return "\n".join(t for _, t in self.outputs(index))

    def rank_lines(self, index: int) -> dict[int, list[str]]:
        """What each rank printed in a code cell, as a person reads it: from labkit's side-by-side
        view (utils/labkit/display.py) where the cell shows one, else from `[rank k] text` lines."""
        view = self.code_cell(index).locator("td[data-rank]")
        if view.count():
            return {int(td.get_attribute("data-rank")): td.inner_text().rstrip("\n").split("\n")
                    for td in view.all()}
        by_rank: dict[int, list[str]] = {}
        for m in re.finditer(r"^\[rank\s*(\d+)\]\s?(.*)$", self.text(index), flags=re.M):
            by_rank.setdefault(int(m.group(1)), []).append(m.group(2))
        return by_rank

    def errors(self) -> list[tuple[int, str]]:
        """(code-cell index, text) of every error output, see error_outputs()."""
        return [(i, t) for i, outs in enumerate(self.all_outputs()) for t in error_outputs(outs)]

    def code_cell_with(self, text: str) -> int:
        """Index of the first code cell whose source contains text."""
        sources = self.panel.locator(".jp-CodeCell .cm-content").all_inner_texts()
        for i, s in enumerate(sources):
            if text in s:
                return i
        raise LookupError(f"no code cell contains {text!r}")

    def kernel_id(self, path: str | None = None) -> str:
        """The running kernel of this notebook (of `path`: default the page's address), from
        Lab's sessions API."""
        path = path or re.search(r"/lab/tree/([^?]+)", self.page.url).group(1)
        for s in self.server.api("GET", "api/sessions"):
            if s["path"] == path and s.get("kernel"):
                return s["kernel"]["id"]
        raise LookupError(f"no kernel session for {path}")
