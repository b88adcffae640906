"""The crash-trial helper's main loop (see crash.py). Runs in its own small process, no torch.

Each victim is forked from here with one pipe to report on (its events, then its result) and one
to be released by (after a pause). Every victim dies with the helper (PR_SET_PDEATHSIG), and the
helper dies with the rank that started it.
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import select
import signal
import sys
import time
import traceback

from labkit.checkpoint import crash

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


class _Job:
    def __init__(self, payload: bytes, plan: dict):
        self.payload, self.plan = payload, plan
        self.pid = None
        self.events_fd = None
        self.release_fd = None
        self.started = 0.0
        self.outcome = {"status": "not started", "value": None, "error": None, "events": [],
                        "killed_at": None, "seconds": 0.0}
        self.paused = False
        self.done = False
        self.timed_out = False


def _child(job: _Job, events_w: int, release_r: int, others: list) -> None:
    for fd in others:
        try:
            os.close(fd)
        except OSError:
            pass
    _die_with_parent(os.getppid())
    import cloudpickle

    def emit(message):
        crash.send_frame(events_w, message)

    def wait_release():
        crash._REAL_READ(release_r, 1)
    try:
        fn, args = cloudpickle.loads(job.payload)
        crash.install(job.plan, emit, wait_release)
        value = fn(*args)
        crash.send_frame(events_w, ("result", "ok", value, None))
    except BaseException as error:  # noqa: BLE001 (reported as data)
        info = {"type": type(error).__name__, "message": str(error)[:2000],
                "classes": [c.__name__ for c in type(error).__mro__],
                "traceback": traceback.format_exc()[-4000:]}
        try:
            crash.send_frame(events_w, ("result", "error", None, info))
        except Exception:  # noqa: BLE001 (an unpicklable error: nothing more to say)
            pass
    os._exit(0)


def _start(job: _Job, open_fds: list) -> None:
    events_r, events_w = os.pipe()
    release_r, release_w = os.pipe()
    job.started = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        _child(job, events_w, release_r, open_fds + [events_r, release_w])
    os.close(events_w)
    os.close(release_r)
    job.pid, job.events_fd, job.release_fd = pid, events_r, release_w
    open_fds += [events_r, release_w]


def _pump(job: _Job, until_paused: bool) -> None:
    """Read the job's reports until it pauses (if asked) or exits; apply its timer."""
    deadline = limit = None
    if job.plan.get("kill_after_seconds") is not None:
        deadline = job.started + float(job.plan["kill_after_seconds"])
    if job.plan.get("timeout") is not None:
        limit = job.started + float(job.plan["timeout"])
    while not job.done:
        if until_paused and job.paused:
            return
        ends = [t for t in (deadline, limit) if t is not None]
        timeout = None if not ends else max(0.0, min(ends) - time.perf_counter())
        ready, _, _ = select.select([job.events_fd], [], [], timeout)
        if not ready:                                  # a timer fired: kill it now
            os.kill(job.pid, signal.SIGKILL)
            if deadline is not None and time.perf_counter() >= deadline:
                job.outcome["killed_at"] = "timer"
            else:
                job.timed_out = True
            deadline = limit = None
            continue
        message = crash.recv_frame(job.events_fd)
        if message is None:
            _reap(job)
            return
        kind = message[0]
        if kind == "event":
            job.outcome["events"].append(message[1:])
        elif kind == "paused":
            job.paused = True
        elif kind == "result":
            _, status, value, error = message
            job.outcome.update(status=status, value=value, error=error)


def _reap(job: _Job) -> None:
    _, status = os.waitpid(job.pid, 0)
    job.outcome["seconds"] = time.perf_counter() - job.started
    if job.timed_out:
        job.outcome["status"] = "timeout"
    elif os.WIFSIGNALED(status):
        job.outcome["status"] = "killed" if os.WTERMSIG(status) == signal.SIGKILL else "died"
        if job.outcome["killed_at"] is None and job.outcome["events"]:
            last = job.outcome["events"][-1]
            when = "before" if job.plan.get("kill_before") == last[0] else "after"
            job.outcome["killed_at"] = (last[0], when, last[1])
    elif job.outcome["status"] == "not started":
        job.outcome["status"] = "died"
    for fd in (job.events_fd, job.release_fd):
        try:
            os.close(fd)
        except OSError:
            pass
    job.done = True


def _run_group(payload: list, schedule: list) -> list:
    jobs = [_Job(blob, plan) for blob, plan in payload]
    open_fds: list = []
    for step, index in schedule:
        job = jobs[index]
        if step == "start":
            _start(job, open_fds)
        elif step == "until_paused":
            _pump(job, until_paused=True)
        elif step == "finish":
            _pump(job, until_paused=False)
        elif step == "release":
            if not job.done:
                os.write(job.release_fd, b"g")
                job.paused = False
        else:
            raise ValueError(f"unknown schedule step {step!r}")
    for job in jobs:                                    # nothing is left running
        if job.pid is not None and not job.done:
            if job.paused:
                os.write(job.release_fd, b"g")
            _pump(job, until_paused=False)
    return [job.outcome for job in jobs]


def main() -> None:
    requests, replies, parent = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    _die_with_parent(parent)
    for name in json.loads(sys.argv[4]):
        importlib.import_module(name)
    import cloudpickle  # noqa: F401 (loaded once here, not in every victim)
    crash.send_frame(replies, "ready")
    while True:
        request = crash.recv_frame(requests)
        if request is None or request[0] == "close":
            return
        try:
            reply = _run_group(request[1], request[2])
        except Exception as error:  # noqa: BLE001
            reply = [{"status": "died", "value": None, "events": [], "killed_at": None,
                      "error": {"type": type(error).__name__, "message": str(error)},
                      "seconds": 0.0}]
        crash.send_frame(replies, reply)
