"""Fixtures for the browser tests: a throwaway JupyterLab server and Debian's chromium (Playwright).

    make test                                   # runs these with the rest
    .venv/bin/pytest -m browser -v              # only these
    .venv/bin/pytest tests/browser -k ranks     # one scenario

Needs /usr/lib/chromium/chromium (`.ci/install-browser` installs it; $LABKIT_CHROMIUM points
elsewhere) and the `playwright` Python package; without either the tests skip and say why. One Lab
server and one browser serve the whole session; each test gets a fresh page, and at its end every
kernel is asked to shut down. At the end of the session Lab stops, and any process that outlived
it (a kernel's ranks, say) is killed and listed in the summary; Lab also dies with this process.
Screenshots go to build/screenshots/<test>-<step>.png (FAILED-<test>.png when a test fails), with
the time of each scenario in build/screenshots/timings.txt.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the helpers next to this file, in any import mode
from lab_server import REPO, LabServer  # noqa: E402

SCREENSHOTS = REPO / "build" / "screenshots"
CHROMIUM = os.environ.get("LABKIT_CHROMIUM", "/usr/lib/chromium/chromium")
# Measured in shared/notes/browser-testing.md: what this headless chromium needs on these machines.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]
_leftovers: list[str] = []         # processes a test left behind (killed), for the summary
_times: dict[str, dict[str, float]] = {}
_notes: list[str] = []             # measurements the tests report, for the summary


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives JupyterLab in headless chromium (slow-ish)")


# -- reporting ------------------------------------------------------------------------------------
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
    if item.get_closest_marker("browser"):   # (item.keywords would also hold the folder's name)
        _times.setdefault(item.name, {})[rep.when] = rep.duration


def pytest_terminal_summary(terminalreporter):
    if not _times:
        return
    tr = terminalreporter
    tr.section("browser scenarios: seconds")
    lines = [f"{name:<50} {t['took']:5.1f}" if "took" in t else
             f"{name:<50} {t.get('call', 0):5.1f}   (setup {t.get('setup', 0):.1f}, "
             f"teardown {t.get('teardown', 0):.1f})" for name, t in _times.items()]
    lines += _notes
    for line in lines:
        tr.write_line(line)
    if SCREENSHOTS.is_dir():
        (SCREENSHOTS / "timings.txt").write_text("\n".join(lines) + "\n")
        tr.write_line(f"screenshots: {SCREENSHOTS}")
    for line in _leftovers:
        tr.write_line(f"WARNING left behind by a test and killed: {line}")


# -- the browser and the server -------------------------------------------------------------------
@pytest.fixture(scope="session")
def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        pytest.skip(f"browser tests need the playwright package ({e}); install the test extra: "
                    f"pip install -e '.[test]'")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"browser tests need Debian's chromium at {CHROMIUM}, which is missing: run "
                    f".ci/install-browser as root (make test does), or set LABKIT_CHROMIUM")
    return sync_playwright


@pytest.fixture(scope="session")
def lab_root(tmp_path_factory) -> Path:
    """The folder Lab shows: copies of the course's notebooks (so Run All and autosave never touch
    the working tree) plus the tests' own scratch notebooks."""
    root = tmp_path_factory.mktemp("lab_root")
    for name in ("course", "labs"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, root / name,
                            ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    if (REPO / "nbgrader_config.py").exists():   # read by Validate from Lab's working directory
        shutil.copy(REPO / "nbgrader_config.py", root)
    (root / "scratch").mkdir()
    return root


@pytest.fixture(scope="session")
def lab(sync_playwright, lab_root, tmp_path_factory):
    server = LabServer(lab_root, tmp_path_factory.mktemp("lab_state"))
    try:
        started = time.monotonic()
        server.start()
        _times["(JupyterLab start)"] = {"took": time.monotonic() - started}
        yield server
    finally:
        started = time.monotonic()
        _leftovers.extend(server.stop())
        _times["(stop Lab, kernels, ranks)"] = {"took": time.monotonic() - started}


@pytest.fixture(scope="session")
def browser(sync_playwright, tmp_path_factory):
    if SCREENSHOTS.is_dir():   # the screenshots show the last run only
        for old in [*SCREENSHOTS.glob("*.png"), SCREENSHOTS / "timings.txt"]:
            old.unlink(missing_ok=True)
    started = time.monotonic()
    pw = sync_playwright().start()
    try:
        try:
            context = pw.chromium.launch_persistent_context(
                str(tmp_path_factory.mktemp("chromium_profile")), executable_path=CHROMIUM,
                headless=True, args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000},
                timeout=30_000)
        except Exception as e:  # a chromium that is there but cannot start here: say so, skip
            pytest.skip(f"chromium at {CHROMIUM} did not start: {str(e).splitlines()[0]}")
        _times["(chromium start)"] = {"took": time.monotonic() - started}
        yield context
        context.close()
    finally:
        pw.stop()


@pytest.fixture
def nb(request, lab, browser):
    """A fresh page on the session's Lab, as a NotebookPage. Afterwards every kernel is asked to
    shut down (without waiting); at the end of the session, anything a kernel left running is
    killed and listed in the summary."""
    from notebook_page import NotebookPage

    page = browser.new_page()
    page.set_default_timeout(15_000)
    notebook = NotebookPage(page, lab)
    try:
        yield notebook
    finally:
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            try:
                page.screenshot(path=str(SCREENSHOTS / f"FAILED-{request.node.name}.png"),
                                timeout=5000)
            except Exception:
                pass
        page.close()
        lab.track()                          # remember this test's ranks: stop() ends them for sure
        lab.shutdown_kernels(wait=False)


@pytest.fixture
def shot(request, nb):
    """shot("step") writes build/screenshots/<test>-<step>.png of the page as it is now."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    test = request.node.name.removeprefix("test_")

    def take(step: str, locator=None, end: bool = False) -> Path:
        """locator: scrolled into view first; end=True brings its bottom into view instead (the
        last lines of a long output, where a diagnosis ends with its verdict)."""
        path = SCREENSHOTS / f"{test}-{step}.png"
        page = nb.page if locator is None else locator.page   # a test may use a second tab
        if locator is not None:
            locator.evaluate(f"e => e.scrollIntoView({{block: '{'end' if end else 'nearest'}'}})")
        time.sleep(0.1)  # let the last output paint
        page.screenshot(path=str(path))
        return path

    return take


@pytest.fixture
def note(request):
    """note("text") adds a line (a measured latency, say) to the summary and timings.txt."""
    return lambda text: _notes.append(f"  {request.node.name}: {text}")


@pytest.fixture
def scratch_notebook(lab_root):
    """scratch_notebook("name", [source, ...]) writes a notebook under the Lab root and returns its
    path relative to it, for nb.open()."""
    import nbformat

    def write(name: str, sources: list[str]) -> str:
        book = nbformat.v4.new_notebook()
        book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                       "language": "python"}
        book.cells = [nbformat.v4.new_code_cell(s) for s in sources]
        rel = f"scratch/{name}.ipynb"
        nbformat.write(book, lab_root / rel)
        return rel

    return write
