"""The whole suite: what each test folder costs, printed at the end of every run (the budget is
25 minutes on the 2-core machine; CI's limit is 90), and how `make test TEST_WORKERS=2` shares
the tests between two pytest-xdist workers."""
import collections
import os
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


# -- sharing the suite between workers (`make test TEST_WORKERS=2`: pytest -n 2 --dist loadscope) --
# In one process the suite keeps about half of a 2-core machine idle (a kernel starting, a rank's
# timeout, a sandbox being built); with cores to spare, workers finish it sooner. What a worker
# takes is a whole group: one test file, whose module fixtures (a course built once, a class
# graded once) then run once; and every file that shares a session fixture goes as one group
# (one JupyterLab server for the browser tests; one class graded one at a time for
# test_class_scale and test_parallel). The longest groups start first (LONGEST_FIRST, from the
# one-process runs' durations), so that no long file starts last while the other worker idles.
# The groups are given to xdist through its scheduler hook, not `xdist_group` marks: with pytest
# 9.2 `--dist loadgroup` silently stops grouping (xdist 3.8 appends the group to `item._nodeid`,
# which pytest no longer reads: pytest-xdist issue #1386), and the browser tests then started
# two JupyterLab servers and the course was built twice, once on each worker.
SHARED_SESSION = {"tests/browser": "tests/browser",
                  "tests/grading/test_class_scale.py": "grading-fixture-class",
                  "tests/grading/test_parallel.py": "grading-fixture-class"}
LONGEST_FIRST = ["tests/grading/test_labs.py", "tests/test_build.py", "tests/browser",
                 "grading-fixture-class", "tests/chapters/test_ch09_failures_at_scale.py",
                 "tests/grading/test_attacks.py", "tests/grading/test_regrade.py",
                 "tests/chapters/test_ch08_checkpoints.py", "tests/grading/test_feedback.py",
                 "tests/chapters/test_ch06_3d_parallelism.py"]


def group_of(nodeid: str) -> str:
    """The work unit a test goes in: its shared-session group, else its file."""
    path = nodeid.split("::")[0]
    for prefix, group in SHARED_SESSION.items():
        if path == prefix or path.startswith(prefix + "/"):
            return group
    return path


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope` with this suite's groups as the scopes, in collection order (which
    pytest_collection_modifyitems below makes longest first)."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return group_of(nodeid)

    config.option.loadscopereorder = False      # keep the order the workers collected
    return Groups(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """In an xdist worker: the groups in the order they should start (every worker sorts the
    same way, as xdist requires identical collections)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    first = {group: i for i, group in enumerate(LONGEST_FIRST)}
    position = {}
    for i, item in enumerate(items):
        position.setdefault(group_of(item.nodeid), i)

    def key(item):              # LONGEST_FIRST's groups in its order, then the rest as collected
        group = group_of(item.nodeid)
        return (first.get(group, len(first)), position[group])

    items.sort(key=key)


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
