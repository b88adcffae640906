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


def _c_level_sigint():
    """The address of the C function the kernel runs on SIGINT (sigaction), and its flags:
    Python's own trampoline while Python's handler is in charge. A C library that installs its
    own handler replaces it behind `signal.getsignal`'s back, and Python never sees a SIGINT again
    (the suspected cause of the interrupt test's lost SIGINTs, seen only in full-suite runs)."""
    import ctypes
    buffer = ctypes.create_string_buffer(256)          # struct sigaction, with room to spare
    if _LIBC.sigaction(signal.SIGINT, None, buffer) != 0:
        return None
    return int.from_bytes(buffer.raw[:8], "little")


try:
    import ctypes as _ctypes
    _LIBC = _ctypes.CDLL(None, use_errno=True)
except OSError:                                         # no libc to ask: the check is skipped
    _LIBC = None


@pytest.fixture(autouse=True)
def _interrupts_still_reach_the_kernel():
    """A test that leaves SIGINT ignored or rerouted in this process breaks every later test of
    an interrupt (and, in a notebook, the stop button): fail that test, by name, whether the
    change is Python's (`signal.signal`) or a C library's (`sigaction`)."""
    before = signal.getsignal(signal.SIGINT)
    before_c = _c_level_sigint() if _LIBC is not None else None
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        signal.signal(signal.SIGINT, before)
        pytest.fail(f"this test left SIGINT's handler changed: {before!r} -> {after!r}")
    after_c = _c_level_sigint() if _LIBC is not None else None
    if before_c is not None and after_c != before_c:
        signal.signal(signal.SIGINT, before)            # puts Python's C trampoline back
        pytest.fail(f"this test left SIGINT's C-level handler replaced (sigaction: "
                    f"{before_c:#x} -> {after_c:#x}) while Python's stayed {after!r}: a C "
                    "library installed its own; Python would never see a SIGINT again")
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []) and not blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        pytest.fail("this test left SIGINT blocked in the main thread")
