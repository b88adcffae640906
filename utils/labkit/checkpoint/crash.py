"""Crash trials: run a function in a process and SIGKILL it at a chosen point (chapter 8, s. 1-3).

    with Victims() as victims:                                    # one lean helper per rank
        out = victims.run(write_shard, root, sid, "r0.bin", data, plan={"kill_before": 3})
        out["status"]        # "ok", "error" (it raised), "killed" (SIGKILL), "died" (other)
        out["events"]        # [(k, name, info), ...]: every file-system call it made, in order

Points are counted in file-system calls: while a function runs, `os.write`, `os.fsync`,
`os.fdatasync`, `os.link`, `os.rename`, `os.replace`, `os.unlink` and `os.remove` are wrapped;
call k is event k. A plan kills the process just before or just after event k, or after a delay
(`kill_after_seconds`, for points inside writes the wrappers do not see), or pauses it before it
publishes a name (`pause_before_dst`), so that a test can let another process run first.
`timeout` (seconds) bounds a victim that hangs: it is killed and its status is "timeout".

Why a helper: forking a process that has imported torch costs 40-60 ms on the course's 2-core
machine (page tables of ~200 MB), a rank restart after a SIGKILL ~0.1-0.2 s. The helper is a small
Python process without torch, started once per rank: it forks each victim in ~1-2 ms, so hundreds
of trials take seconds. The rank itself stays alive to record what happened.

`install(plan)` puts the same wrappers into the current process (a real rank that kills itself at
event k: the DCP trials of the course).
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import stat
import struct
import subprocess
import sys
import time

EVENT_NAMES = ("write", "fsync", "fdatasync", "link", "rename", "replace", "unlink", "remove")
PUBLISHING = ("link", "rename", "replace")
PLAN_KEYS = ("kill_before", "kill_after", "kill_after_seconds", "pause_before_dst", "watch",
             "timeout")
_REAL = {name: getattr(os, name) for name in EVENT_NAMES}
_REAL_KILL, _REAL_READ, _REAL_WRITE = os.kill, os.read, os.write


def _fd_of(value):
    return value if isinstance(value, int) else value.fileno()


def _path_of_fd(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"


def _describe(name: str, args: tuple, plan: dict) -> dict:
    """What an event touches, in plain data (paths absolute)."""
    try:
        if name == "write":
            return {"path": _path_of_fd(args[0]), "nbytes": len(args[1])}
        if name in ("fsync", "fdatasync"):
            fd = _fd_of(args[0])
            st = os.fstat(fd)
            info = {"path": _path_of_fd(fd), "size": st.st_size, "ino": st.st_ino,
                    "dir": stat.S_ISDIR(st.st_mode)}
            if plan.get("watch"):
                info["watched_exists"] = os.path.exists(plan["watch"])
            return info
        if name in PUBLISHING:
            return {"src": os.path.abspath(os.fspath(args[0])),
                    "dst": os.path.abspath(os.fspath(args[1]))}
        return {"path": os.path.abspath(os.fspath(args[0]))}
    except (OSError, TypeError, ValueError, IndexError, AttributeError):
        return {}


def install(plan: dict, emit=None, wait_release=None):
    """Wrap the file-system calls of this process as `plan` says; returns a function that undoes
    it. emit(("event", k, name, info)) is called before each event; emit(("paused", ...)) then
    wait_release() when a pause point is reached."""
    unknown = set(plan) - set(PLAN_KEYS)
    if unknown:
        raise ValueError(f"unknown plan keys {sorted(unknown)}; known: {list(PLAN_KEYS)}")
    counter = [0]
    pause_dst = plan.get("pause_before_dst")
    pause_dst = os.path.abspath(pause_dst) if pause_dst else None

    def make(name):
        real = _REAL[name]

        def wrapper(*args, **kwargs):
            counter[0] += 1
            k = counter[0]
            info = _describe(name, args, plan)
            if emit is not None:
                emit(("event", k, name, info))
            if pause_dst and name in PUBLISHING and info.get("dst") == pause_dst \
                    and wait_release is not None:
                emit(("paused", k, name, info))
                wait_release()
            if plan.get("kill_before") == k:
                _REAL_KILL(os.getpid(), signal.SIGKILL)
            result = real(*args, **kwargs)
            if plan.get("kill_after") == k:
                _REAL_KILL(os.getpid(), signal.SIGKILL)
            return result
        wrapper.__name__ = name
        return wrapper

    for name in EVENT_NAMES:
        setattr(os, name, make(name))

    def uninstall():
        for name in EVENT_NAMES:
            setattr(os, name, _REAL[name])
    return uninstall


# ---- framing over pipes (both sides) ----------------------------------------------------------

def send_frame(fd: int, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        view = view[_REAL_WRITE(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = _REAL_READ(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def recv_frame(fd: int):
    """The next object, or None at end of file (also for a frame cut short by a kill)."""
    header = _read_exact(fd, 8)
    if header is None:
        return None
    data = _read_exact(fd, struct.unpack("<Q", header)[0])
    return None if data is None else pickle.loads(data)


# ---- the rank side ----------------------------------------------------------------------------

class Victims:
    """A lean helper process that forks victims on request (see the module's docstring)."""

    def __init__(self, preload=("labkit.checkpoint.store",)):
        import json
        import cloudpickle
        self._cloudpickle = cloudpickle
        to_helper, from_rank = os.pipe()[::-1]
        from_helper, to_rank = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from labkit.checkpoint._victim_server import main; main()",
             str(from_rank), str(to_rank), str(os.getpid()), json.dumps(list(preload))],
            pass_fds=(from_rank, to_rank), env=env, close_fds=True)
        os.close(from_rank)
        os.close(to_rank)
        self._send, self._recv = to_helper, from_helper
        ready = recv_frame(self._recv)
        if ready != "ready":
            raise RuntimeError(f"the crash-trial helper did not start (got {ready!r})")

    def run(self, fn, *args, plan: dict | None = None) -> dict:
        """fn(*args) in a fresh victim process, under `plan`; its outcome."""
        return self.run_group([(fn, args, plan or {})], [("start", 0), ("finish", 0)])[0]

    def run_group(self, jobs: list, schedule: list) -> list:
        """Several victims, driven step by step: schedule entries are ("start", i),
        ("until_paused", i), ("finish", i), ("release", i). Returns one outcome per job."""
        for _, _, plan in jobs:
            unknown = set(plan or {}) - set(PLAN_KEYS)
            if unknown:
                raise ValueError(f"unknown plan keys {sorted(unknown)}; known: {list(PLAN_KEYS)}")
        payload = [(self._cloudpickle.dumps((fn, tuple(args))), dict(plan or {}))
                   for fn, args, plan in jobs]
        send_frame(self._send, ("group", payload, list(schedule)))
        reply = recv_frame(self._recv)
        if reply is None:
            raise RuntimeError("the crash-trial helper died")
        return reply

    def close(self) -> None:
        if self.process is None:
            return
        try:
            send_frame(self._send, ("close",))
        except OSError:
            pass
        for fd in (self._send, self._recv):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


_SHARED: dict = {}


def shared(preload=("labkit.checkpoint.store",)) -> Victims:
    """This process's helper for `preload`, started on first use and kept for later calls (a
    rank program calls this to keep one helper across calls; helpers with torch preloaded fork
    victims that can use torch without importing it: ~40 ms a fork instead of ~2 ms)."""
    key = tuple(preload)
    helper = _SHARED.get(key)
    if helper is None or helper.process is None or helper.process.poll() is not None:
        helper = _SHARED[key] = Victims(preload)
    return helper


def count_events(outcome: dict, names=EVENT_NAMES) -> int:
    return sum(1 for _, name, _ in outcome["events"] if name in names)


def random_plan(rng, n_events: int, timer_seconds: float | None = None,
                timer_share: float = 0.0) -> dict:
    """A kill point drawn uniformly: just before or just after one of `n_events` events, or
    (with probability timer_share) after a delay drawn uniformly in [0, timer_seconds]."""
    if timer_seconds and rng.random() < timer_share:
        return {"kill_after_seconds": rng.uniform(0.0, timer_seconds)}
    k = rng.randint(1, n_events)
    return {"kill_before": k} if rng.random() < 0.5 else {"kill_after": k}


def now() -> float:
    return time.perf_counter()


class RestartCount:
    """labkit's "restarting the world" lines, counted instead of printed: each `with
    count.quiet():` block (a call that may kill a rank) adds the restarts it printed to
    `count.restarts` and passes every other line it printed through."""

    LINE = "labkit: restarting the world"

    def __init__(self):
        self.restarts = 0

    @contextlib.contextmanager
    def quiet(self):
        said = io.StringIO()
        try:
            with contextlib.redirect_stdout(said):
                yield
        finally:
            for line in said.getvalue().splitlines():
                if line.startswith(self.LINE):
                    self.restarts += 1
                else:
                    print(line)
