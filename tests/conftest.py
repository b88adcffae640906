"""The whole suite: what each test folder costs, printed at the end of every run (the budget is
25 minutes on the 2-core machine; CI's limit is 90)."""
import collections
import signal
import time

import pytest

_FOLDERS = collections.defaultdict(float)
_STARTED = time.monotonic()


def _folder(nodeid: str) -> str:
    """tests/<folder> for tests in a folder, tests/<file> for the top-level ones."""
    return "/".join(nodeid.split("::")[0].split("/")[:2])


def pytest_runtest_logreport(report):
    _FOLDERS[_folder(report.nodeid)] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FOLDERS:
        return
    terminalreporter.section("seconds per test folder")
    for folder, seconds in sorted(_FOLDERS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{folder:<40} {seconds:7.1f}")
    terminalreporter.write_line(f"{'all (wall clock)':<40} {time.monotonic() - _STARTED:7.1f}")


@pytest.fixture(autouse=True)
def _interrupts_still_reach_the_kernel():
    """A test that leaves SIGINT ignored or rerouted in this process breaks every later test of
    an interrupt (and, in a notebook, the stop button): fail that test, by name."""
    before = signal.getsignal(signal.SIGINT)
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        signal.signal(signal.SIGINT, before)
        pytest.fail(f"this test left SIGINT's handler changed: {before!r} -> {after!r}")
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []) and not blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        pytest.fail("this test left SIGINT blocked in the main thread")
