"""Looking at a run that has stopped moving: py-spy stacks of every rank, heartbeats, and the
verdict "deadlock" or "straggler" (chapter 9, section 2).

    with hang.Watch(world, at=(1.0, 2.5), heartbeat=folder) as watch:   # samples in a thread
        try:
            world.call(program, args=(folder,), timeout=4)
        except labkit.CallTimeout as error:
            print(error.diagnosis)                                   # labkit's own diagnosis
    for sample in watch.samples:
        print(sample["t"], sample["beats"],
              {rank: hang.top_frame(dump) for rank, dump in sample["dumps"].items()})
    hang.verdict(watch.samples)          # "deadlock", "straggler", or "moving"

py-spy (`pip install py-spy`) reads another process's memory to print its Python stack, without
stopping it or needing anything inside it: the tool people run on a hung job's nodes
(`py-spy dump --pid PID`, `--native` for the C++ frames below). It needs the right to trace the
process: root, or the same user with `kernel.yama.ptrace_scope` = 0 (or 1 for a child), or the
CAP_SYS_PTRACE capability (in Docker: `--cap-add SYS_PTRACE`; on Kubernetes, the pod's
securityContext). Without it `py_spy_dump` returns py-spy's own error text.

One stack dump cannot tell a deadlock from a straggler: in both, the healthy ranks sit in a
collective and one rank sits elsewhere. Two samples can: a straggler's step counter (its
heartbeat) moves between them, a deadlocked rank's does not.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time

_FRAME = re.compile(r"^\s{4}(\S+) \((\S+):(\d+)\)$")
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")          # py-spy colours its output in some terminals
COLLECTIVE_NAMES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
                    "barrier", "reduce", "gather", "scatter", "send", "recv", "wait")


def py_spy() -> str | None:
    """The py-spy executable: next to this Python's, else on PATH; None if not installed."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def py_spy_dump(pid: int, native: bool = False, timeout: float = 20.0) -> str:
    """`py-spy dump --pid PID`: every thread's Python stack, innermost frame first."""
    tool = py_spy()
    if tool is None:
        return ("py-spy is not installed: `pip install py-spy` (the course's README installs it "
                "with the other dependencies)")
    command = [tool, "dump", "--pid", str(pid)] + (["--native"] if native else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"py-spy dump of {pid} did not answer within {timeout:g} s"
    text = done.stdout if done.returncode == 0 else (done.stdout + done.stderr).strip()
    return _COLOUR.sub("", text)


def main_thread_frames(dump: str) -> list[tuple[str, str, int]]:
    """(function, file, line) of the main thread's frames in a py-spy dump, innermost first."""
    frames, inside = [], False
    for line in dump.splitlines():
        if line.startswith("Thread "):
            inside = '"MainThread"' in line
            continue
        match = _FRAME.match(line)
        if inside and match:
            frames.append((match.group(1), match.group(2), int(match.group(3))))
    return frames


def top_frame(dump: str, skip=("labkit/runtime/", "c10d_logger.py")) -> str:
    """The innermost main-thread frame worth showing: `function (file:line)`, labkit's wrapper
    and torch's logging decorator skipped."""
    for function, path, line in main_thread_frames(dump):
        if not any(s in path for s in skip):
            return f"{function} ({os.path.basename(path)}:{line})"
    return "(no Python frame: stopped outside Python?)"


def in_collective(dump: str) -> bool:
    """Whether the main thread's innermost frames are in torch.distributed's communication."""
    for function, path, _ in main_thread_frames(dump)[:3]:
        if "torch/distributed" in path and any(name in function for name in COLLECTIVE_NAMES):
            return True
    return False


def beat(folder: str, step: int) -> None:
    """Inside a rank: record that this rank has reached `step` (a heartbeat file per rank)."""
    import torch.distributed as dist
    path = os.path.join(folder, f"rank{dist.get_rank()}.beat")
    with open(path + ".tmp", "w") as stream:
        stream.write(str(step))
    os.replace(path + ".tmp", path)


def read_beats(folder: str, size: int) -> list:
    """The last step each rank reported (None before its first beat)."""
    beats = []
    for rank in range(size):
        try:
            with open(os.path.join(folder, f"rank{rank}.beat")) as stream:
                beats.append(int(stream.read()))
        except (OSError, ValueError):
            beats.append(None)
    return beats


class Watch:
    """Samples every rank (py-spy dump, heartbeat) at the given seconds after entering, from a
    background thread, while the main thread runs the world's call. `samples`: a list of
    {"t": seconds, "beats": [step per rank], "dumps": {rank: text}}."""

    def __init__(self, world, at=(1.0, 2.5), heartbeat: str | None = None):
        self.world, self.at, self.heartbeat = world, tuple(at), heartbeat
        self.samples: list[dict] = []
        self._stop = threading.Event()

    def _run(self, pids, start):
        for moment in self.at:
            if self._stop.wait(max(0.0, start + moment - time.monotonic())):
                return
            sample = {"t": round(time.monotonic() - start, 2)}
            if self.heartbeat:
                sample["beats"] = read_beats(self.heartbeat, self.world.size)
            sample["dumps"] = {rank: py_spy_dump(pid) for rank, pid in sorted(pids.items())}
            self.samples.append(sample)

    def __enter__(self):
        start = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(self.world.rank_pids(), start),
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._thread.join()
        return False


def verdict(samples) -> str:
    """"deadlock": between the first and last sample no heartbeat moved while some rank sat in
    a collective; "straggler": heartbeats moved while some rank sat in a collective in both
    samples; "moving" otherwise. Needs samples with heartbeats and dumps."""
    if len(samples) < 2:
        raise ValueError("one sample cannot tell a deadlock from a straggler: take two, seconds "
                         "apart")
    first, last = samples[0], samples[-1]
    waiting = all(any(in_collective(d) for d in s["dumps"].values()) for s in (first, last))
    moved = first["beats"] != last["beats"]
    if waiting and not moved:
        return "deadlock"
    if waiting and moved:
        return "straggler"
    return "moving"
