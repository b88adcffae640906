"""Kernel side: a persistent world of rank processes, started once and reused by every call.

Design (the measurements behind it are in shared/notes/launching-ranks.md):
- Ranks come from a forkserver that has preloaded torch: a fresh world of 4 starts in a fraction
  of a second, and no rank is ever forked from the kernel (a fork after any OpenMP op hangs, and
  a fork after CUDA was touched cannot use CUDA).
- Rendezvous through one TCPStore hosted by the kernel on a port the OS picks, bound to
  127.0.0.1, with a key prefix per world generation: no fixed port, no clash between restarts.
- Functions are shipped by value (cloudpickle), with the source of your cells, so a rank's
  traceback shows your lines.
- The kernel's main thread does all the waiting: it reads the ranks' output pipes, their replies
  and their process sentinels together, so an interrupt lands in a place that can diagnose and
  clean up.
"""

import atexit
import collections
import io
import itertools
import json
import linecache
import multiprocessing
import os
import pickle
import selectors
import shutil
import subprocess
import sys
import time
import types
from multiprocessing.reduction import ForkingPickler

import cloudpickle

from labkit.runtime import diagnose, display
from labkit.runtime.output import RankOutput
from labkit.errors import (CallInterrupted, CallTimeout, LabkitError, PicklingError, RankDied,
                           RankError, WorldError)

GRACE_SECONDS = 1.5        # how long ranks may keep running after another rank failed
START_SECONDS = 120.0      # a cold world on a busy 2-core machine, forkserver start included
MEMORY_PER_RANK = 200 << 20
BACKENDS = ("auto", "gloo", "nccl")

_CURRENT = None
_STORE = None
_GENERATION = itertools.count(1)


def _context():
    context = multiprocessing.get_context("forkserver")
    # torch._dynamo too: the first optimizer step of a rank imports it (2.5-5 s per rank on this
    # machine, every new world); imported once in the server, every rank starts with it. The same
    # for torch.distributed.checkpoint (chapters 8 and 9).
    context.set_forkserver_preload(["labkit.runtime.worker", "torch._dynamo",
                                    "torch.distributed.checkpoint"])
    return context


def _store():
    """One TCPStore per kernel, on a port the OS picks; worlds use their own key prefix."""
    global _STORE
    if _STORE is None:
        import torch.distributed as dist
        from datetime import timedelta
        _STORE = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=60))
    return _STORE


def gpu_count():
    """GPUs visible to ranks, found without initialising CUDA in this process."""
    if not os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is None:
        return 0
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    count = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


def max_world_size():
    """How many ranks this machine can hold: ~200 MiB each, at most 8 per core."""
    cores = os.cpu_count() or 1
    try:
        import psutil
        available = psutil.virtual_memory().available
    except ImportError:
        available = 8 << 30
    return max(1, min(8 * cores, available // MEMORY_PER_RANK)), cores, available


def _resolve_backend(size, backend):
    if backend not in BACKENDS:
        raise WorldError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "gloo":
        return "gloo"
    gpus = gpu_count()
    if backend == "nccl" and gpus < size:
        raise WorldError(
            f"backend='nccl' needs one GPU per rank: world size ({size}) > GPUs visible ({gpus}). "
            f"Use backend='gloo' to run on CPU, or backend='auto' to pick NCCL only where it fits.")
    return "nccl" if gpus >= size else "gloo"


class _Handles:
    """Connections and file descriptors to wait on, registered once per call (a fresh selector
    per wait, as multiprocessing.connection.wait builds, costs more than a no-op call)."""

    def __init__(self):
        self.selector = selectors.PollSelector()   # no syscall per registration, unlike epoll
        self.tags = {}

    def add(self, handle, tag):
        self.selector.register(handle, selectors.EVENT_READ, tag)
        self.tags[handle] = tag

    def remove(self, handle):
        if self.tags.pop(handle, None) is not None:
            self.selector.unregister(handle)

    def wait(self, timeout):
        """[(handle, tag)] ready to read within `timeout` seconds."""
        if not self.tags:
            time.sleep(timeout)
            return []
        try:
            events = self.selector.select(timeout)
        except InterruptedError:
            return []
        return [(key.fileobj, key.data) for key, _ in events]

    def close(self):
        self.selector.close()


class _Rank:
    """The kernel's handles on one rank process."""

    def __init__(self, rank, process, commands, diagnostics, output):
        self.rank = rank
        self.process = process
        self.commands = commands
        self.diagnostics = diagnostics
        self.output = output
        self.pid = None          # the rank's own process id, as it reported it when ready

    def alive(self):
        return self.process.is_alive()

    def close(self, kill=True):
        if kill and self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        for connection in (self.commands, self.diagnostics):
            connection.close()
        self.output.close()
        self.process.close()


class World:
    """A group of `size` rank processes holding a torch.distributed process group.

    Build it with `labkit.world(n)`. `run` and `call` run a function on the ranks; `tracing`
    records their communication; `close` stops them.
    """

    plain = False          # results come back pickled (a grader's world: plain data only)
    echo = True            # show what ranks print as they print it (else only in last_output)
    records_always = False # every reply carries the call's communication records (hints)
    MARK_WAIT = 2.0        # seconds the other ranks get to reach a mark the first one reached

    def __init__(self, size, backend="auto", timeout=60.0, teaching=True, lazy=False):
        """lazy: start the ranks on the first call, not now."""
        self.size = size
        self.requested_backend = backend
        self.timeout = timeout
        self.teaching = teaching
        self.backend = _resolve_backend(size, backend)
        self.settings = (size, backend, timeout, teaching)
        self._ranks = []
        self._measures = []       # world.traffic() blocks open now
        self.last_records = {}    # rank -> records of the last call (records_always worlds)
        self._unstarted = lazy
        self._waiter = None       # what the kernel waits on: every rank's replies, end, output
        self._broken = None       # why the world must be restarted before the next call
        self._closed = False
        self._tasks = itertools.count(1)
        self._sent_sources = set()
        self._finished = {}
        self._deadlock = None     # the verdict of _DeadlockWatch in the last call, if any
        self.last_output = {}     # rank -> [(stream, line)] of the last call
        self.last_exit = {}       # rank -> exit code at close (None: still running, killed)
        self.last_leave = {}      # rank -> its "stopped" message at close (see close)
        if not lazy:
            self._start()

    def __repr__(self):
        state = "closed" if self._closed else ("to restart" if self._broken else "running")
        return (f"World(size={self.size}, backend={self.backend!r}, teaching={self.teaching}, "
                f"{state})")

    @property
    def alive(self):
        return (not self._closed and not self._broken and not self._unstarted
                and all(r.alive() for r in self._ranks))

    # -- start and stop -------------------------------------------------------------------
    def _start(self):
        generation = next(_GENERATION)
        self.generation = generation   # these ranks' start: what they were given is theirs
        threads = max(1, (os.cpu_count() or 1) // self.size)
        width = len(str(self.size - 1))
        for rank in range(self.size):
            settings = {"rank": rank, "world_size": self.size, "backend": self.backend,
                        "teaching": self.teaching, "host": "127.0.0.1",
                        "prefix": f"labkit/world{generation}/",
                        "pg_timeout": self.timeout + 60, "threads": threads,
                        "plain": self.plain, "records": self.records_always}
            process, commands, diagnostics, out_reader, err_reader = self._spawn(rank, settings)
            output = RankOutput(rank, width, out_reader, err_reader)
            self._ranks.append(_Rank(rank, process, commands, diagnostics, output))
        self._sent_sources = set()
        self._waiter = self._handles()
        self._await_ready()

    def _spawn(self, rank, settings):
        """Start rank `rank`; return (process, commands, diagnostics, stdout and stderr readers).
        Here: a child of the forkserver that preloaded torch; the grader overrides this."""
        context = _context()
        settings["port"] = _store().port
        from labkit.runtime import worker as _worker
        commands, commands_child = context.Pipe(duplex=True)
        diagnostics, diagnostics_child = context.Pipe(duplex=True)
        out_reader, out_writer = context.Pipe(duplex=False)
        err_reader, err_writer = context.Pipe(duplex=False)
        process = context.Process(
            target=_worker.main, name=f"labkit-rank-{rank}", daemon=True,
            args=(settings, commands_child, diagnostics_child, out_writer, err_writer))
        process.start()
        for child_end in (commands_child, diagnostics_child, out_writer, err_writer):
            child_end.close()
        return process, commands, diagnostics, out_reader, err_reader

    def _await_ready(self):
        ready, failures = set(), {}
        deadline = time.monotonic() + START_SECONDS
        while len(ready) + len(failures) < self.size:
            if time.monotonic() > deadline:
                failures.update({r: "did not start in time" for r in range(self.size)
                                 if r not in ready and r not in failures})
                break
            for rank, message in self._pump(0.1):
                if message is None:
                    failures[rank] = f"exited with code {self._ranks[rank].process.exitcode}"
                elif message["kind"] == "ready":
                    ready.add(rank)
                    self._ranks[rank].pid = message.get("pid")
                else:
                    failures[rank] = message.get("message", str(message))
        if failures:
            self._stop_all(kill=True)
            self._closed = True
            detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
            raise WorldError(f"the world of {self.size} ranks ({self.backend}) could not start: "
                             f"{detail}")

    def _stop_all(self, kill):
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None
        for rank in self._ranks:
            rank.close(kill=kill)
        self._ranks = []

    def close(self):
        """Stop every rank (gracefully if it answers, else SIGKILL). Safe to call twice."""
        global _CURRENT
        if self._closed:
            return
        self._closed = True
        for rank in self._ranks:
            if rank.alive() and not self._broken:
                try:
                    rank.commands.send(("stop",))
                except OSError:
                    pass
        deadline = time.monotonic() + 3.0
        # each rank's word on leaving: {"waited_out": whether it waited out a bound for a peer}
        self.last_leave = {}
        while any(r.alive() for r in self._ranks) and time.monotonic() < deadline:
            for rank, message in self._pump(0.05, quiet=True):
                if isinstance(message, dict) and message.get("kind") == "stopped":
                    self.last_leave[rank] = message
        self.last_exit = {r.rank: r.process.exitcode for r in self._ranks}  # None: killed below
        _log_close(self, {r.rank: [line for stream, line in r.output.lines if stream == "err"]
                          for r in self._ranks})
        self._stop_all(kill=True)
        if _CURRENT is self:
            _CURRENT = None

    def _restart_if_needed(self):
        if self._closed:
            raise WorldError("this world is closed; create a new one with labkit.world(n)")
        if self._unstarted:
            self._unstarted = False
            self._start()
        if self._broken:   # (a rank that died since the last call is caught by its sentinel)
            why = self._broken
            print(f"labkit: restarting the world of {self.size} ranks ({why}); variables "
                  f"defined in earlier %%ranks cells are gone.")
            self._stop_all(kill=True)
            self._broken = None
            self._start()

    # -- the wait loop ------------------------------------------------------------------------
    def _handles(self):
        """What to wait on: every rank's replies, process end and output, registered once."""
        handles = _Handles()
        for r in self._ranks:
            handles.add(r.commands, ("msg", r))
            handles.add(r.process.sentinel, ("died", r))
            for fd in r.output.open_fds():
                handles.add(fd, ("out", r))
        return handles

    def _pump(self, timeout, quiet=False):
        """Wait up to `timeout` s; read output; return [(rank, message or None if it died)]."""
        handles = self._waiter
        messages = []
        for handle, (kind, r) in handles.wait(timeout):
            if kind == "out":
                r.output.echo = self.echo and not quiet
                r.output.read(handle)
                if handle in r.output.closed:
                    handles.remove(handle)
            elif kind == "msg":
                try:
                    messages.append((r.rank, _receive(r.commands)))
                except (EOFError, OSError, ValueError):
                    messages.append((r.rank, None))
                    handles.remove(handle)
            elif not r.commands.poll():
                messages.append((r.rank, None))
                handles.remove(handle)
        return messages

    # -- running code ---------------------------------------------------------------------
    def run(self, fn, *args, ranks=None, **kwargs):
        """Run `fn(*args, **kwargs)` on the ranks; return the results, one per rank.

        `ranks` (a list of ranks) restricts the call; results then follow that list's order.
        """
        __tracebackhide__ = True   # IPython: show the diagnosis, not labkit's frames
        return self.call(fn, args, kwargs, ranks=ranks)

    def call(self, fn, args=(), kwargs=None, ranks=None, timeout=None):
        """Like `run`, with explicit `args`/`kwargs` and a per-call `timeout` in seconds."""
        __tracebackhide__ = True   # IPython: show the diagnosis, not labkit's frames
        if not callable(fn):
            raise TypeError(f"World.run needs a function to run on the ranks, got "
                            f"{type(fn).__name__}")
        payload = _serialize(fn, tuple(args), dict(kwargs or {}))
        return self._dispatch("call", payload, ranks, timeout)

    def run_each(self, fn, shares, *args, timeout=None, **kwargs):
        """Run `fn(shares[r], *args, **kwargs)` on every rank r: each rank is sent its own share
        only. Returns the results, one per rank. (A checker's way to give each rank its part of
        a case without handing any rank the whole case.)"""
        __tracebackhide__ = True   # IPython: show the diagnosis, not labkit's frames
        if not callable(fn):
            raise TypeError(f"World.run_each needs a function to run on the ranks, got "
                            f"{type(fn).__name__}")
        shares = list(shares)
        if len(shares) != self.size:
            raise ValueError(f"run_each needs one share per rank: the world has {self.size} "
                             f"ranks, got {len(shares)} shares")
        payloads = [_serialize(fn, (share,) + tuple(args), dict(kwargs)) for share in shares]
        return self._dispatch("call", payloads, None, timeout)

    def run_source(self, source, ranks=None, timeout=None, filename=None):
        """Run Python source on the ranks, each in its own persistent namespace (`%%ranks`).

        Returns the value of the source's last expression on each rank (None if it has none).
        """
        __tracebackhide__ = True   # IPython: show the diagnosis, not labkit's frames
        return self._dispatch("exec", source, ranks, timeout, filename=filename)

    def _targets(self, ranks):
        if ranks is None:
            return list(range(self.size))
        if isinstance(ranks, int):
            ranks = [ranks]
        ranks = list(ranks)
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.size]
        if bad or not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks must be distinct ranks of this world (0..{self.size - 1}), "
                             f"got {ranks}")
        return ranks

    def _new_sources(self):
        """Source lines of notebook cells the ranks have not seen yet (for their tracebacks)."""
        sources = {}
        for filename, entry in list(linecache.cache.items()):
            if filename in self._sent_sources or len(entry) < 3 or not entry[2]:
                continue
            if "ipykernel_" in filename or filename.startswith("<ipython-input"):
                sources[filename] = entry[2]
                self._sent_sources.add(filename)
        return sources

    def _dispatch(self, kind, payload, ranks, timeout, filename=None):
        __tracebackhide__ = True   # IPython: show the diagnosis, not labkit's frames
        targets = self._targets(ranks)
        timeout = self.timeout if timeout is None else timeout
        self._restart_if_needed()
        task_id = next(self._tasks)
        sources = self._new_sources()
        if kind == "exec":
            sources["__filename__"] = filename or f"<ranks cell {task_id}>"
        view = display.live_view() if self.echo else None
        for r in self._ranks:
            r.output.take_lines()
            r.output.echo = self.echo
            r.output.sink = None if view is None else view.add
        if isinstance(payload, list):               # run_each: one payload per rank
            messages = {rank: ForkingPickler.dumps((kind, task_id, payload[rank], sources))
                        for rank in targets}
        else:
            message = ForkingPickler.dumps((kind, task_id, payload, sources))   # pickled once
            messages = dict.fromkeys(targets, message)
        for rank in targets:
            try:
                self._ranks[rank].commands.send_bytes(messages[rank])
            except OSError:
                pass  # the rank is gone: its sentinel reports it below
        started = time.monotonic()
        try:
            outcome = self._collect(targets, task_id, started + timeout)
        except KeyboardInterrupt:
            diagnosis = self._diagnose_and_stop(targets, {}, self._finished)
            raise CallInterrupted(
                f"interrupted after {time.monotonic() - started:.1f} s; where each rank was:\n\n"
                f"{diagnosis}\nThe world restarts on the next call.", diagnosis) from None
        finally:
            self.last_output = {r.rank: r.output.take_lines() for r in self._ranks}
            for r in self._ranks:
                r.output.sink = None
            if view is not None:
                view.close()
        results, errors, deaths, stuck = outcome
        if stuck is not None and not errors and not deaths and self._deadlock is not None:
            diagnosis = self._diagnose_and_stop(targets, {}, set(results))
            raise CallTimeout(f"the call on ranks {targets} can never finish (a deadlock, found "
                              f"after {time.monotonic() - started:.1f} s, not at the "
                              f"{timeout:g} s timeout): {self._deadlock}. Where each rank "
                              f"was:\n\n{diagnosis}\nThe world restarts on the next call.",
                              diagnosis)
        if stuck is not None and not errors and not deaths:
            diagnosis = self._diagnose_and_stop(targets, {}, set(results))
            raise CallTimeout(f"the call on ranks {targets} did not finish within {timeout:g} s "
                              f"(a hang?). Where each rank was:\n\n{diagnosis}\n"
                              f"The world restarts on the next call.", diagnosis)
        if errors or deaths:
            self._raise_failure(targets, errors, deaths, stuck)
        return [self._decode(results[rank]) for rank in targets]

    def _decode(self, data):
        if self.plain:
            from labkit.runtime.plain import loads
            return loads(data)
        return pickle.loads(data)

    def _collect(self, targets, task_id, deadline):
        """Wait for every target's reply and output marker; stop early on failure + grace."""
        results, errors, deaths = {}, {}, {}
        self._finished = results     # read by the interrupt handler in _dispatch
        self.last_records = {}
        marks = _Marks(self, targets, results, errors, deaths)
        grace_deadline = None
        self._deadlock = None
        watch = _DeadlockWatch(self)
        while True:
            pending = [r for r in targets if r not in results and r not in errors
                       and r not in deaths]
            undrained = [r for r in targets if not self._ranks[r].output.complete(task_id)]
            if not pending and not undrained:
                return results, errors, deaths, None
            now = time.monotonic()
            if pending and grace_deadline is not None and now > grace_deadline:
                return results, errors, deaths, pending
            if now > deadline:
                return results, errors, deaths, pending or undrained
            if pending and results and not errors and not deaths and not marks.waiting:
                self._deadlock = watch.check(pending, results)
                if self._deadlock is not None:
                    return results, errors, deaths, pending
            for rank, message in self._pump(0.1):
                if message is None:
                    if rank not in results and rank not in errors:
                        self._ranks[rank].process.join(timeout=1)
                        deaths[rank] = self._ranks[rank].process.exitcode
                    continue
                kind = message.get("kind")
                if rank not in targets or message.get("task") != task_id:
                    continue   # not an answer to this call
                if kind == "mark":
                    marks.reached(rank, str(message.get("label")))
                    continue
                if kind not in ("ok", "err"):
                    continue
                if kind == "ok":
                    results[rank] = message.get("data", b"")
                else:
                    errors[rank] = message["error"]
                if message.get("records") is not None:
                    self.last_records[rank] = message["records"]
                if message.get("group_gone") and not self._broken:
                    self._broken = ("the call destroyed the process group "
                                    "(dist.destroy_process_group)")
                output = self._ranks[rank].output
                if message.get("drained"):   # the rank found its pipes already read
                    output.mark_complete(task_id)
                else:
                    output.drain()       # its end markers are in the pipes: read them now
            marks.check()
            if (errors or deaths) and grace_deadline is None:
                grace_deadline = time.monotonic() + GRACE_SECONDS

    def _diagnose_and_stop(self, targets, exited, finished=()):
        answers = diagnose.collect({r.rank: r.diagnostics for r in self._ranks
                                    if r.rank in targets and r.alive() and r.rank not in exited})
        self._broken = "the last call did not finish"    # stop first, parse the answers after
        self._stop_all(kill=True)
        return diagnose.report(answers, exited, finished)

    def _raise_failure(self, targets, errors, deaths, stuck):
        __tracebackhide__ = True   # IPython: show the diagnosis, not labkit's frames
        parts = []
        if stuck:
            exited = {r: (f"raised {errors[r]['type']}" if r in errors else
                          f"died (exit code {deaths[r]})") for r in list(errors) + list(deaths)}
            finished = set(targets) - set(stuck) - set(exited)
            parts.append(f"Ranks {stuck} were still running {GRACE_SECONDS:g} s after that and "
                         f"were stopped. Where they were:\n\n"
                         + self._diagnose_and_stop(list(stuck) + sorted(finished), exited,
                                                   finished)
                         + "\nThe world restarts on the next call.")
        elif deaths:
            self._broken = "a rank died"
            self._stop_all(kill=True)
            parts.append("The world restarts on the next call.")
        if deaths:
            rank = min(deaths)
            code = deaths[rank]
            how = (f"was killed by signal {-code}" if code is not None and code < 0
                   else f"exited with code {code}")
            raise RankDied(f"rank {rank} {how} without finishing the call (ranks that died: "
                           f"{sorted(deaths)}). " + "\n".join(parts), rank, code)
        if any(e.get("in_communication") for e in errors.values()) and not self._broken:
            # a collective failed part-way: the process group may hold half-done work
            self._broken = "a collective failed"
            parts.append("A collective failed, so the world restarts on the next call.")
        rank = next(iter(errors))   # the first rank whose error arrived
        first = errors[rank]
        headline = (diagnose.summarize_mismatch(first["message"])
                    or _first_line(first["message"]))
        others = [f"rank {r} raised too: {e['type']}: "
                  f"{diagnose.summarize_mismatch(e['message']) or _first_line(e['message'])}"
                  for r, e in errors.items() if r != rank]
        message = (f"rank {rank} raised {first['type']}: {headline}\n\n"
                   f"{first['traceback']}" + "".join(f"\n{o}" for o in others)
                   + "".join(f"\n\n{p}" for p in parts))
        raise RankError(message, rank, first["traceback"],
                        {r: e["traceback"] for r, e in errors.items()}, kind=first.get("type"),
                        module=first.get("module"))

    # -- tracing and faults -----------------------------------------------------------------
    def _control(self, rank, message, expect):
        self._restart_if_needed()
        r = self._ranks[rank]
        r.commands.send(message)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for got_rank, reply in self._pump(0.1):
                if got_rank != rank:
                    continue
                if reply is None:
                    raise RankDied(f"rank {rank} died while answering {message[0]!r}", rank,
                                   r.process.exitcode)
                if reply.get("kind") == expect:
                    return reply
        raise CallTimeout(f"rank {rank} did not answer {message[0]!r} within 30 s", "")

    def tracing(self):
        """Record every communication op of the calls made inside `with world.tracing() as t:`.
        The records come from inside the ranks (what their code called): good for explaining,
        never evidence for a grade (see `traffic`)."""
        from labkit.runtime.trace import Trace
        return Trace(self)

    def traffic(self):
        """Count the bytes the ranks send each other during the calls made inside
        `with world.traffic() as t:`, from the operating system's socket counters, outside the
        rank processes. `labkit.mark(label)` on the ranks adds a snapshot at that point."""
        from labkit.runtime.traffic import Traffic
        self._restart_if_needed()
        return Traffic(self)

    def rank_pids(self):
        """{rank: process id} of the live ranks."""
        return {r.rank: r.pid for r in self._ranks if r.pid is not None and r.alive()}

    def _traffic_snapshot(self):
        from labkit.runtime import traffic
        return traffic.snapshot(self.rank_pids(), **self._netns())

    def _netns(self):
        """Where the ranks' sockets live: this network namespace (a grader's world overrides)."""
        return {}

    def inject_fault(self, rank, at_collective, action="exit", seconds=0.0):
        """Make `rank` hard-exit (`action="exit"`) or sleep `seconds` (`"sleep"`) just before
        its `at_collective`-th communication op from now (1-based). Fires once."""
        self._targets([rank])
        if action not in ("exit", "sleep"):
            raise ValueError(f"action must be 'exit' or 'sleep', got {action!r}")
        if not isinstance(at_collective, int) or at_collective < 1:
            raise ValueError(f"at_collective counts from 1, got {at_collective!r}")
        if action == "sleep" and seconds <= 0:
            raise ValueError(f"a 'sleep' fault needs seconds > 0, got {seconds!r}")
        self._control(rank, ("fault", {"at": at_collective, "action": action,
                                       "seconds": float(seconds)}), "fault-set")


LOG_BYTES = 1 << 20       # the world-close debug log is rotated past this size (one old copy)


def log_path():
    """The world-close debug log: every close's exit codes, and the last stderr lines of a rank
    that did not exit 0 (`$LABKIT_LOG_DIR`, else `$TMPDIR/labkit-logs`)."""
    import tempfile
    folder = os.environ.get("LABKIT_LOG_DIR") or os.path.join(tempfile.gettempdir(),
                                                              "labkit-logs")
    return os.path.join(folder, "world-close.log")


def _log_close(world, stderr_lines):
    """Append one line per close (pid, world, each rank's exit code) to the debug log, and the
    last 20 stderr lines of every rank whose exit code was not 0, so the next abort leaves a
    trace. Never raises: a log that cannot be written must not break a close."""
    codes = world.last_exit
    lines = [f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} world of {world.size} "
             f"({world.backend}) closed; exit codes: "
             + ", ".join(f"rank {r}: {'still running, killed' if c is None else c}"
                         for r, c in sorted(codes.items()))]
    for rank, code in sorted(codes.items()):
        if code != 0:
            lines += [f"    rank {rank} stderr: {line[:500]}"
                      for line in stderr_lines.get(rank, [])[-20:]]
    try:
        path = log_path()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path) and os.path.getsize(path) > LOG_BYTES:
            os.replace(path, path + ".1")
        with open(path, "a") as log:
            log.write("\n".join(lines) + "\n")
    except OSError:
        pass


class _DeadlockWatch:
    """A deadlock found when it is certain, not at the timeout: every rank still in the call is
    blocked in a collective whose group holds a rank that has already returned from the call
    without issuing it (that rank will never join). Asked of the ranks' diagnostics threads
    (the same answers as the hang diagnosis), first FIRST_PROBE s after a rank finished, then
    every PROBE_EVERY s; the verdict needs two answers in a row that agree (the same op, the
    same stack), so an asynchronous op a rank is not waiting for yet is not taken for a hang."""

    FIRST_PROBE = 0.5
    PROBE_EVERY = 1.0

    def __init__(self, world):
        self.world = world
        self.next_probe = None
        self.previous = None         # what the last probe found, to be confirmed by the next

    def check(self, pending, finished):
        """None, or the verdict (text) once two probes in a row found the same deadlock."""
        now = time.monotonic()
        if self.next_probe is None:
            self.next_probe = now + self.FIRST_PROBE
        if now < self.next_probe:
            return None
        self.next_probe = now + self.PROBE_EVERY
        found = self._probe(pending, finished)
        confirmed = found is not None and found == self.previous
        self.previous = found
        if not confirmed:
            return None
        return "; ".join(f"rank{'s' if len(waiters) > 1 else ''} "
                         f"{', '.join(map(str, waiters))} wait{'' if len(waiters) > 1 else 's'} "
                         f"in {op} #{seq} on ranks {list(group)}, which rank"
                         f"{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} "
                         f"(finished this call) will never issue"
                         for (group, seq, op), (waiters, absent) in sorted(found[0].items()))

    def _probe(self, pending, finished):
        """({(group, seq, op): (waiting ranks, finished ranks that never issued it)}, stacks)
        if every pending rank waits in such a collective, else None."""
        ranks = {r.rank: r for r in self.world._ranks}
        connections = {}
        for rank in list(pending) + sorted(finished):
            connection = ranks[rank].diagnostics
            try:
                while connection.poll():       # a late answer to an earlier probe: drop it
                    connection.recv_bytes()
            except (EOFError, OSError):
                return None
            connections[rank] = connection
        answers = {rank: _parsed(raw)
                   for rank, raw in diagnose.collect(connections, seconds=1.0).items()}
        if any(answer is None for answer in answers.values()):
            return None                        # a rank that does not answer: not certain
        blocked, stacks = {}, {}
        for rank in pending:
            answer = answers[rank]
            current = [r for r in answer["current"] if not r["finished"]]
            newest = answer["recent"][-1] if answer["recent"] else None
            if len(current) != 1 or current[0]["peer"] is not None or newest is None \
                    or (newest["seq"], newest["op"]) != (current[0]["seq"], current[0]["op"]):
                return None                    # not (only) blocked in its newest collective
            record = current[0]
            group = tuple(record["group"])
            absent = [r for r in group if r in finished
                      and answers[r]["collective_counts"].get(str(list(group)), 0)
                      < record["seq"]]
            if not absent:
                return None
            key = (group, record["seq"], record["op"])
            blocked.setdefault(key, ([], absent))[0].append(rank)
            stacks[rank] = answer["stack"]
        return blocked, stacks


def _parsed(raw):
    """A rank's diagnosis as `diagnose` reads it (checked against the snapshot's shape when
    `diagnose.parse` exists); None if there is none."""
    parse = getattr(diagnose, "parse", None)
    if parse is not None:
        return parse(raw)
    if isinstance(raw, (bytes, bytearray)):
        try:
            return json.loads(raw)
        except ValueError:
            return None
    return raw


def _receive(connection):
    """A rank's message: a JSON header, and its payload bytes when it has one. Never unpickled."""
    header = json.loads(connection.recv_bytes())
    if header.get("payload"):
        header["data"] = connection.recv_bytes()
    return header


class _Marks:
    """labkit.mark(label) during a call: when every rank still running has reached the label (or
    MARK_WAIT seconds after the first did), each open `world.traffic()` takes a snapshot once the
    counters settle, then the waiting ranks are resumed."""

    def __init__(self, world, targets, results, errors, deaths):
        self.world, self.targets = world, targets
        self.results, self.errors, self.deaths = results, errors, deaths
        self.waiting = {}          # label -> {rank}
        self.first = {}            # label -> monotonic time of the first arrival

    def reached(self, rank, label):
        self.waiting.setdefault(label, set()).add(rank)
        self.first.setdefault(label, time.monotonic())

    def check(self):
        for label in list(self.waiting):
            waiting = self.waiting[label]
            running = [r for r in self.targets if r not in self.results
                       and r not in self.errors and r not in self.deaths]
            everyone = all(r in waiting for r in running)
            if not everyone and time.monotonic() - self.first[label] < self.world.MARK_WAIT:
                continue
            if self.world._measures:
                from labkit.runtime.traffic import settle
                snap = settle(self.world._traffic_snapshot)
                for measure in self.world._measures:
                    measure.record_mark(label, snap, sorted(waiting))
            for rank in waiting:
                try:
                    self.world._ranks[rank].commands.send(("resume",))
                except OSError:
                    pass
            del self.waiting[label]


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _without_labkit_frames(tb):
    """The traceback chain without the frames of labkit's own files (a student's cell frames and
    the error's message are what matter)."""
    kept = []
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_PACKAGE):
            kept.append(tb)
        tb = tb.tb_next
    for first, second in zip(kept, kept[1:]):
        first.tb_next = second
    if kept:
        kept[-1].tb_next = None
    return kept[0] if kept else None


def _hide_labkit_frames_in_ipython():
    """In a kernel: labkit's errors show the cell's lines and the diagnosis, no labkit frame
    (IPython's __tracebackhide__ still shows the frame that raised)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or getattr(shell, "_labkit_frames_hidden", False):
        return

    def show(self, etype, value, tb, tb_offset=None):
        self.showtraceback((etype, value, _without_labkit_frames(tb)), tb_offset=tb_offset)
    shell.set_custom_exc((LabkitError,), show)
    shell._labkit_frames_hidden = True


def _close_with_the_kernel():
    """In a Jupyter kernel: close the world when the kernel is asked to shut down, before
    ipykernel deals with the kernel's children.

    ipykernel 7's shutdown_request (kernelbase.py, `_progressively_terminate_all_children`) sends
    SIGTERM to every child in the kernel's process group, again and again for 14.4 s, then SIGKILL
    for as long, and only then lets the kernel exit. Two children never leave on SIGTERM: the
    resource tracker ignores it (multiprocessing/resource_tracker.py), and the forkserver, once
    dead, stays a zombie that ipykernel still counts, since nothing reaps it. jupyter_client does
    not wait that long: it SIGTERMs the kernel after half its `shutdown_wait_time` (2.5 s) and
    SIGKILLs it at the end, so every kernel that had a world cost 2.5 s to shut down and died
    without running atexit: the world was never closed (its ranks died with the forkserver) and
    multiprocessing's temporary folder (pymp-*, the forkserver's socket) stayed in TMPDIR, one per
    kernel. Here the kernel's `do_shutdown`, which ipykernel calls first, closes the world and
    stops both helpers (the forkserver SIGKILLed: asked, it would spend 1.2 s finalizing torch):
    ipykernel then finds no child, and the kernel exits normally, its atexit handlers run."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is None or getattr(kernel, "_labkit_closes_with_it", False):
        return
    original = kernel.do_shutdown

    def do_shutdown(restart):
        try:
            from labkit.common import kill_forkserver, stop_resource_tracker
            shutdown_all()
            kill_forkserver()
            stop_resource_tracker()
        except Exception as error:                # the kernel must still shut down
            print(f"labkit: closing the world at kernel shutdown failed: {error!r}",
                  file=sys.__stderr__, flush=True)
        return original(restart)

    kernel.do_shutdown = do_shutdown
    kernel._labkit_closes_with_it = True


def _first_line(text, limit=300):
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + " ..."


def _code_reduce_keeping_filename(code):
    """cloudpickle renames every shipped code object's file to "<dynamic-code>"; keep the real
    name, so a rank's traceback can show the cell's lines (sent along with the call)."""
    constructor, args = cloudpickle.cloudpickle._code_reduce(code)
    return constructor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = collections.ChainMap({types.CodeType: _code_reduce_keeping_filename},
                                          cloudpickle.Pickler.dispatch_table)


def _dumps(value):
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(value)
    return buffer.getvalue()


def _serialize(fn, args, kwargs):
    try:
        return _dumps((fn, args, kwargs))
    except Exception as error:  # noqa: BLE001 - find the culprit and say which it is
        named = [("the function", fn)] + [(f"argument {i + 1}", a) for i, a in enumerate(args)]
        named += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
        for name, value in named:
            try:
                _dumps(value)
            except Exception as inner:  # noqa: BLE001
                raise PicklingError(
                    f"{name} ({type(value).__name__}) cannot be sent to the ranks: "
                    f"{type(inner).__name__}: {inner}. Ranks are separate processes: pass plain "
                    f"data (tensors, numbers, lists, dicts) and build other objects (files, "
                    f"locks, generators, models with hooks) inside the function.") from None
        raise PicklingError(f"the call cannot be sent to the ranks: {error}") from None


def world(n, backend="auto", timeout=60.0, teaching=True):
    """The current world of `n` ranks; the same settings reuse it, other settings replace it.

    backend: "auto" (NCCL if there is a GPU per rank, else gloo), "gloo" or "nccl".
    timeout: seconds a call may take before it is diagnosed as a hang and the ranks stopped.
    teaching: check every collective for mismatched ops, sizes and dtypes across ranks (a few
        ms per collective; turn it off for bandwidth measurements).
    """
    global _CURRENT
    from labkit.runtime import worker as _worker
    if _worker.STATE.rank is not None:
        raise WorldError(
            f"labkit.world() was called on rank {_worker.STATE.rank}, inside a world: the ranks "
            f"already form a process group (use dist.* here). Call labkit.world in the notebook, "
            f"and pass the rank function to world.run.")
    if isinstance(n, bool) or not isinstance(n, int):
        raise WorldError(f"world size must be an int, got {n!r}")
    limit, cores, available = max_world_size()
    if n < 1 or n > limit:
        raise WorldError(f"world size must be between 1 and {limit} on this machine "
                         f"({cores} cores, {available / 2**30:.1f} GiB free, ~200 MiB per rank), "
                         f"got {n}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise WorldError(f"timeout must be a positive number of seconds, got {timeout!r}")
    settings = (n, backend, float(timeout), bool(teaching))
    if _CURRENT is not None and not _CURRENT._closed and _CURRENT.settings == settings:
        return _CURRENT
    if _CURRENT is not None:
        _CURRENT.close()
    _hide_labkit_frames_in_ipython()
    _close_with_the_kernel()
    # Under the grader (labkit grade), the kernel's world is only for the student's own cells:
    # graded calls run on ranks the grader starts. Its ranks start when a cell first uses it.
    lazy = os.environ.get("NBGRADER_EXECUTION") == "autograde"
    _CURRENT = World(n, backend, float(timeout), bool(teaching), lazy=lazy)
    return _CURRENT


def current():
    """The world `labkit.world` returned last, or None."""
    return _CURRENT if _CURRENT is not None and not _CURRENT._closed else None


def shutdown_all():
    """Close the current world and the rendezvous store: no rank, port or thread is left."""
    global _STORE
    if _CURRENT is not None:
        _CURRENT.close()
    _STORE = None


atexit.register(shutdown_all)
