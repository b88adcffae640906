"""Every course notebook (and, with LABKIT_BROWSER_LABS=1, every released lab), opened in
JupyterLab as a student opens it: its setup cells run, a `%%ranks` cell typed in and run, each
rank's line seen, no error, a screenshot.
Chapters 0 and 1 are left to test_chapters.py, which runs all their cells and then types the same
`%%ranks` cell (notebook_page.RANKS_CELL).

    .venv/bin/pytest tests/browser/test_every_notebook.py -v
    LABKIT_BROWSER_LABS=1 .venv/bin/pytest tests/browser/test_every_notebook.py -k lab03

The setup cells, by one rule that holds for every notebook (checked on the file first): the
`parameters` cell and the code cell after it, which imports labkit and, in most notebooks, makes
the world. Where it makes none (today chapters 7 and 10, the drill, lab 6), the student's first
step is typed in before the `%%ranks` cell: `world = labkit.world(WORLD_SIZE, backend=BACKEND)`. No
notebook runs `%load_ext labkit` in those cells: `%%ranks` must work because a world exists.

Time is what this file costs, so the notebooks share the session's one Lab server and one browser,
in TABS pages that each load Lab once and open notebook after notebook (File > Open from Path,
then File > Close Tab): while one page's kernel starts its ranks, another's is typed into. One
fixture visits every selected notebook; each test then reports its own notebook's outcome.
Screenshots: build/screenshots/every-notebook-<name>.png (not in git: build/ is ignored).

Measured on this project's 2-core machine, shared with other jobs: the suite's 10 (chapters 2-10,
the drill) in 180 s at load 3-4; with the labs, 21 notebooks in 304 s at load 4-5 with TABS = 2,
392 s with 3, about 15 s a notebook one at a time. A notebook costs ~2 s to open with its kernel,
5-9 s of setup (torch in the kernel; labkit's forkserver, which preloads torch for the ranks; the
world's ranks), 2-3 s to type and run the `%%ranks` cell. That is over the 120 s the issue budgets:
nearly all of it is the kernel's and the ranks' own start, CPU-bound.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from lab_server import REPO

pytestmark = [pytest.mark.browser]

SCREENSHOTS = REPO / "build" / "screenshots"
# test_chapters.py runs all of chapters 0 and 1 and types the same %%ranks cell after Run All.
RUN_ALL_ELSEWHERE = {"course/00_the_lab_environment.ipynb", "course/01_collectives.ipynb"}
# The suite opens every chapter (and the drill); the released labs share their setup rule and
# double the time (~150 s more), so they join with LABKIT_BROWSER_LABS=1 (lab 0 is always opened,
# by test_chapters.py; every lab runs headless under labkit grade in tests/grading).
WITH_LABS = os.environ.get("LABKIT_BROWSER_LABS") == "1"
NOTEBOOKS = [str(p.relative_to(REPO)) for p in
             sorted((REPO / "course").glob("*.ipynb"))
             + (sorted((REPO / "labs").glob("*/*.ipynb")) if WITH_LABS else [])
             if str(p.relative_to(REPO)) not in RUN_ALL_ELSEWHERE]
TABS = int(os.environ.get("LABKIT_BROWSER_TABS", 2))   # notebooks in flight (see the docstring)
SETUP_TIMEOUT_S = 150           # kernel start, imports, a world of up to 8 ranks on a busy machine
MAKE_WORLD = "world = labkit.world(WORLD_SIZE, backend=BACKEND)"


def setup_rule(path: str) -> bool:
    """Checks the rule on the notebook's file; returns whether its setup cells make a world."""
    book = json.loads((REPO / path).read_text())     # (nbformat would warn about cell ids)
    cells = [dict(c, source="".join(c["source"])) for c in book["cells"]
             if c["cell_type"] == "code"]
    assert len(cells) >= 2, f"{path}: fewer than two code cells"
    first, second = cells[0], cells[1]
    assert "parameters" in first.get("metadata", {}).get("tags", []), (
        f"{path}: the first code cell is not tagged `parameters` (papermill overrides it)")
    assert re.search(r"^WORLD_SIZE = ", first["source"], re.M) and re.search(
        r"^BACKEND = ", first["source"], re.M), f"{path}: no WORLD_SIZE or BACKEND in `parameters`"
    assert re.search(r"^import labkit$", second["source"], re.M), (
        f"{path}: the code cell after `parameters` does not `import labkit`")
    for cell in (first, second):
        grading = cell.get("metadata", {}).get("nbgrader", {})
        assert not (grading.get("solution") or grading.get("grade")), (
            f"{path}: a setup cell is an nbgrader answer or test cell")
        assert "%load_ext labkit" not in cell["source"], f"{path}: the setup loads %%ranks itself"
    return "labkit.world(" in first["source"] + second["source"]


class Visit:
    """One notebook in one of the tour's Lab pages (a slot): start() opens it there and queues its
    setup cells; finish() waits, types, checks, screenshots, closes it and shuts its kernel down.
    A failure is kept as the notebook's result (the other slots go on)."""

    def __init__(self, path: str, slot, lab):
        self.path, self.nb, self.lab = path, slot, lab
        self.name = Path(path).stem
        self.started = time.monotonic()
        self.error: str | None = None
        self.seconds = 0.0
        self.ranks = 0
        self.slot_broken = False            # the page could not close the notebook: replace it
        self.phases: dict[str, float] = {}  # seconds per step, for the report
        self._last = self.started

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = now - self._last
        self._last = now

    def start(self) -> None:
        try:
            self.makes_world = setup_rule(self.path)
            self.nb.open_from_path(self.path, timeout_s=60)
            self.lap("open")
            self.nb.run_cell(0)
            self.nb.run_cell(1)
        except Exception as e:                        # noqa: BLE001 (this notebook's result)
            self.fail(e)

    def finish(self) -> None:
        if self.error is None:
            try:
                self.check()
            except Exception as e:                    # noqa: BLE001
                self.fail(e)
        self.seconds = time.monotonic() - self.started
        self.close()

    def check(self) -> None:
        nb = self.nb
        nb.wait_executed(SETUP_TIMEOUT_S, cells=[0, 1])
        self.lap("setup")
        assert nb.errors() == [], f"setup cells show an error:\n" + "\n".join(
            f"cell {i}: {t[-800:]}" for i, t in nb.errors())
        if not self.makes_world:
            nb.add_cell_and_run(MAKE_WORLD, timeout_s=SETUP_TIMEOUT_S)
            self.lap("world")
        cell, self.ranks = nb.type_ranks_cell(timeout_s=60)     # checks each rank's line
        self.lap("ranks")
        self.shoot(nb.code_cell(cell))
        assert nb.errors() == [], f"a cell shows an error:\n" + "\n".join(
            f"cell {i}: {t[-800:]}" for i, t in nb.errors())

    def shoot(self, locator=None, prefix: str = "every-notebook") -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        try:
            if locator is not None:
                locator.evaluate("e => e.scrollIntoView({block: 'nearest'})")
                time.sleep(0.1)                       # let the last output paint
            self.nb.page.screenshot(path=str(SCREENSHOTS / f"{prefix}-{self.name}.png"),
                                    timeout=5000)
        except Exception:                             # noqa: BLE001 (a picture is best effort)
            pass

    def fail(self, error: Exception) -> None:
        self.error = f"{type(error).__name__}: {error}"
        self.shoot(prefix="FAILED-every-notebook")

    def close(self) -> None:
        """Closes the notebook (discarding the typed cells) and asks Lab to shut its kernel
        down, without waiting."""
        try:
            kernel = self.nb.kernel_id(self.path)
        except Exception:                             # noqa: BLE001 (no session: nothing to stop)
            kernel = None
        try:
            self.nb.close_notebook()
        except Exception:                             # noqa: BLE001
            self.slot_broken = True
        self.lab.track()                              # its ranks: stop() ends them for sure
        if kernel:
            threading.Thread(target=self.lab._delete_kernel, args=(kernel,), daemon=True).start()


def visit_all(paths: list[str], browser, lab, tabs: int = TABS) -> dict[str, Visit]:
    """Visits the notebooks in order, `tabs` at a time, each in one of `tabs` Lab pages loaded
    once (File > Open from Path); returns each one's Visit."""
    from notebook_page import NotebookPage

    def new_slot():
        slot = NotebookPage(browser.new_page(), lab)
        slot.page.set_default_timeout(30_000)
        slot.open_lab()
        return slot

    slots = [new_slot() for _ in range(min(tabs, len(paths)))]
    free, waiting, running, done = list(slots), list(paths), [], {}
    try:
        while waiting or running:
            while waiting and free:
                visit = Visit(waiting.pop(0), free.pop(0), lab)
                visit.start()
                running.append(visit)
            visit = running.pop(0)                    # the oldest has had the longest to start
            visit.finish()
            done[visit.path] = visit
            if visit.slot_broken:
                slots.remove(visit.nb)
                visit.nb.page.close()
                slots.append(new_slot())
                free.append(slots[-1])
            else:
                free.append(visit.nb)
    finally:
        for slot in slots:
            slot.page.close()
    return done


@pytest.fixture(scope="module")
def tour(request, browser, lab):
    """Visits every notebook that this session's selection (-k) kept, once."""
    chosen = [item.callspec.params["path"] for item in request.session.items
              if item.originalname == "test_notebook_in_lab" and hasattr(item, "callspec")]
    started = time.monotonic()
    visits = visit_all(chosen, browser, lab)
    return visits, time.monotonic() - started


# The first test's setup holds the whole tour: its limit is the tour's, not one notebook's.
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[Path(p).stem for p in NOTEBOOKS])
def test_notebook_in_lab(path, tour, note):
    visits, total = tour
    visit = visits[path]
    note(f"{visit.seconds:5.1f} s in its tab, {visit.ranks} ranks ("
         + ", ".join(f"{k} {v:.1f}" for k, v in visit.phases.items() if k != "start") + ")"
         + (f"; the tour of {len(visits)} notebooks, {TABS} tabs at once: {total:.1f} s"
            if path == next(iter(visits)) else ""))
    assert visit.error is None, (
        f"{path}: {visit.error}\n(screenshot: build/screenshots/FAILED-every-notebook-"
        f"{visit.name}.png)")
