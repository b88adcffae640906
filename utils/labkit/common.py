"""What every wing of labkit may import (runtime, tools, grading, the chapter packages): the course
root, the nbgrader markers, the runner of a subcommand module, the stopping of multiprocessing's
helper processes. Standard library only, and nothing
here imports another labkit module, so no wing reaches into another through it.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

# Spelled in pieces so that this file itself never matches a grep for the markers.
_B, _E = "BEGIN ", "END "
SOLUTION_BEGIN, SOLUTION_END = _B + "SOLUTION", _E + "SOLUTION"
HIDDEN_BEGIN, HIDDEN_END = _B + "HIDDEN TESTS", _E + "HIDDEN TESTS"
MARKERS = (SOLUTION_BEGIN, SOLUTION_END, HIDDEN_BEGIN, HIDDEN_END, _B + "MARK SCHEME")


def find_course_root(start: str | None = None) -> str:
    """The course repository (the folder holding solutions/) at or above `start` (the current
    folder by default)."""
    here = os.path.abspath(start or os.getcwd())
    while True:
        if os.path.isdir(os.path.join(here, "solutions")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            raise FileNotFoundError("no course repository here (a folder with solutions/): run "
                                    "`labkit grade` from the course repository or pass --course")
        here = parent


def run_module(module, argv=None, prog=None, description=None) -> int:
    """Parse `argv` with the module's `add_arguments` and call its `run`: what both `labkit NAME`
    and `python -m labkit.<wing>.NAME` do."""
    parser = argparse.ArgumentParser(
        prog=prog or f"python -m {getattr(module.__spec__, 'name', None) or module.__name__}",
        description=description or (module.__doc__ or "").split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(sys.argv[1:] if argv is None else argv)) or 0)


def kill_forkserver() -> None:
    """SIGKILL multiprocessing's forkserver and reap it, if one runs; not ask it to leave.
    Asked (its pipe closed, as multiprocessing does when this process exits), it runs a whole
    interpreter's finalization with torch imported: about a CPU-second, 1.2 s of wall time at
    a kernel's shutdown on an idle 2-core machine, 3-51 s at load 10-30 when it also holds
    nbgrader (tests/stress/stress_sigterm.py). It runs no user code and keeps nothing worth
    saving (its children, the ranks, are gone by then); a later start in this process makes a
    new one (ForkServer.ensure_running sees it gone). CPython's private `_stop_unlocked` closes
    its pipe, reaps it and removes its socket (Lib/multiprocessing/forkserver.py), hence the
    guard."""
    from multiprocessing import forkserver
    server = getattr(forkserver, "_forkserver", None)
    if server is None or not hasattr(server, "_stop_unlocked"):
        return
    with server._lock:
        if server._forkserver_pid is None:
            return
        try:
            os.kill(server._forkserver_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server._stop_unlocked()


def stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker and wait for it. A forkserver starts one (a child
    of this process); left alone it sees its pipe close only when this process has exited, and
    it exits a moment after, adopted by whoever reaps orphans, and it ignores SIGTERM. `_stop`
    closes the pipe and waits (CPython's Lib/multiprocessing/resource_tracker.py); it is
    private, hence the guard. Only on the way out: a tracker stopped in a process that goes on
    would clean up what it still uses."""
    from multiprocessing import resource_tracker
    stop = getattr(getattr(resource_tracker, "_resource_tracker", None), "_stop", None)
    if stop is not None:
        stop()
