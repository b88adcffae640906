"""Ranks for graded calls: started, fed and measured by the trusted grader, run in the sandbox.

    world = SandboxWorld(4, box)                # box: the submission's running Sandbox
    world.run_each(program, shares, task_fn)    # the same World API as in a notebook
    with world.traffic() as traffic: ...        # counted in the sandbox's own network

A `SandboxWorld` is a labkit World whose ranks the grader launches itself (not the student's
kernel): each rank is a process of the sandbox's PID namespace, in its network (a private
loopback), as a user of its own, with a private /tmp and /dev/shm, no unix-domain sockets, and the
sandbox's memory and process limits (grading/_rank_init.py does the entering). The grader writes
each rank's inputs into its channel and reads back only JSON and plain data
(`torch.load(weights_only=True)`): it never unpickles what a rank sends. It counts the bytes ranks
send each other from the operating system's counters of that network namespace
(labkit.runtime.traffic), so neither the student's kernel nor the ranks can change what is
counted; the loopback's own counters catch traffic that bypassed the ranks' connections.

Without the namespace sandbox (the grader is not root), ranks are plain child processes of the
grader, and traffic is counted in the host's network namespace (no `unaccounted`).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

from labkit.grading.sandbox import hidden_paths, read_only_paths
from labkit.runtime.launcher import World

_RANK_INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rank_init.py")
_RANK_ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rank_zygote.py")
_LABKIT_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK_UID_BASE = 210_000        # a slot's ranks run as uids RANK_UID_BASE + UIDS_PER_SLOT * slot + i
UIDS_PER_SLOT = 256            # ... i counting up over the slot's worlds (each rank its own uid)
RANK_MEMORY_BYTES = 3 << 30    # per rank without cgroups (RLIMIT_AS); the cgroup bounds the total
MAX_REPLY_BYTES = 256 << 20    # a result's bytes from one rank (larger: that call fails)
MAX_HEADER_BYTES = 8 << 20     # a reply's JSON header (records, traceback) or a diagnosis
FRAME_SECONDS = 10.0           # a message that started arriving must be complete within this


def _kill(pidfd):
    """SIGKILL the process a pidfd refers to (never a pid: it may belong to another by now)."""
    if pidfd is None:
        return
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass


_STORE_PORTS = (20_000, 32_768)   # [first, end): below Linux's default ephemeral ports


class ReplyRefused(Exception):
    """A rank sent something the grader does not read: too large, or never completed."""


class BoundedChannel:
    """A rank's end of a channel (a multiprocessing Connection), read with bounds: a message is
    at most `limit` bytes and must arrive whole within FRAME_SECONDS once it started, so that
    nothing a rank sends can make the grader allocate without bound or block for good. The frames
    are multiprocessing's (a 4-byte big-endian length, or -1 and an 8-byte one, then the bytes).

    A message over the bound is never read: the rank is killed through its pidfd (`kill`), the
    reason kept in `refused`, and the channel reads as closed from then on (EOFError)."""

    def __init__(self, connection, kill, what, header_limit, payload_limit):
        self.connection, self._kill, self.what = connection, kill, what
        self.header_limit, self.payload_limit = header_limit, payload_limit
        self._fd = connection.fileno()          # kept: a selector asks for it after a refusal
        self._payload_next = False
        self.refused = None

    def fileno(self):
        return self._fd

    def send(self, obj):
        self.connection.send(obj)

    def send_bytes(self, data):
        self.connection.send_bytes(data)

    def poll(self, timeout=0.0):
        return self.refused is None and self.connection.poll(timeout)

    def close(self):
        self.connection.close()

    def _refuse(self, why):
        self.refused = why
        self._kill()
        raise EOFError(why)

    def _read_exact(self, size, deadline):
        chunks, left = [], size
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([self._fd], [], [], wait)[0]:
                self._refuse(f"{self.what} started a message and did not finish it within "
                             f"{FRAME_SECONDS:g} s")
            chunk = os.read(self._fd, min(left, 1 << 20))
            if not chunk:
                raise EOFError(f"{self.what} closed its channel")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def recv_bytes(self, maxlength=None):
        if self.refused is not None:
            raise EOFError(self.refused)
        payload, self._payload_next = self._payload_next, False
        limit = self.payload_limit if payload else self.header_limit
        if maxlength is not None:
            limit = min(limit, maxlength)
        deadline = time.monotonic() + FRAME_SECONDS
        size, = struct.unpack("!i", self._read_exact(4, deadline))
        if size == -1:
            size, = struct.unpack("!Q", self._read_exact(8, deadline))
        if size < 0 or size > limit:
            self._refuse(f"{self.what} sent {'a result' if payload else 'a message'} of {size} "
                         f"bytes, over the grader's limit of {limit} bytes")
        data = self._read_exact(size, deadline)
        if not payload:
            try:      # a header announcing a payload: the next message is the (larger) payload
                self._payload_next = json.loads(data).get("payload") is True
            except (ValueError, AttributeError):
                pass  # not a header: the caller finds that out itself
        return data


class _Process:
    """A rank started with subprocess, looking like a multiprocessing.Process to the World."""

    def __init__(self, popen):
        self.popen = popen
        self.pid = popen.pid
        self.sentinel = os.pidfd_open(popen.pid)

    def is_alive(self):
        return self.popen.poll() is None

    @property
    def exitcode(self):
        return self.popen.poll()

    def kill(self):
        _kill(self.sentinel)

    def join(self, timeout=None):
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def close(self):
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


_STARTER_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
# one thread: after entering a PID namespace a process can start no thread


def _group_alive(group: int) -> bool:
    """Whether a process of process group `group` is alive (a zombie is not: only its parent's
    wait is left, and the subreaper or init that adopted it does that)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) == group:
            return True
    return False


class TemplateProcess:
    """What the run's two templates share (RankStarterTemplate here, kernel_template's
    KernelTemplate): `popen` (the template process) and `folder` (its socket and log), ended by
    close() or the with-block."""

    def close(self, timeout: float = 10.0):
        """Kill the template and its forks (one starter per sandbox, root, on the host), wait
        until none of them is alive, and remove its folder. The template runs in a process group
        of its own (start_new_session), which its forks share: they would die with it anyway
        (PR_SET_DEATHSIG), but a moment later, and the grader must not leave while a root process
        of its run is still dying (test_grade_run's SIGTERM test found one in state R)."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        group = self.popen.pid
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass                                          # no fork of the template is left
        deadline = time.monotonic() + timeout
        while _group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.01)
        import shutil
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


class RankStarterTemplate(TemplateProcess):
    """One process per `labkit grade` run that imports torch and the rank code once and forks
    each sandbox's rank starter (grading/_rank_zygote.py's `_template`): a submission's starter
    is then ready in milliseconds instead of the 3-5 CPU-seconds of an interpreter importing
    torch. It listens on a unix socket in a folder only the grader can open, answers only its
    own uid (SO_PEERCRED), and dies with the grader. `path` is what Zygote(template=...) takes."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="labkit-ranks-",
                                       dir="/tmp" if len(tempfile.gettempdir()) > 60 else None)
        self.path = os.path.join(self.folder, "starter")
        self.log_path = os.path.join(self.folder, "template.log")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(64)
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-I", _RANK_ZYGOTE, "--template", str(self.listener.fileno())],
                pass_fds=[self.listener.fileno()], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, close_fds=True, env=dict(_STARTER_ENV),
                start_new_session=True)                   # its forks in its group: close()
        # the template's alone now: once it is gone, a connection is refused at once (a copy
        # kept here would queue it, and each sandbox would wait 60 s for an answer)
        self.listener.close()


class Zygote:
    """The sandbox's rank starter (grading/_rank_zygote.py): torch imported once, one fork per
    rank. One per sandbox; it dies with the grader and with its socket. With `template` (a
    RankStarterTemplate's path) it is forked from the run's template; without one, or when the
    template cannot be reached, it is an interpreter of its own."""

    def __init__(self, box, spec_dir, start_timeout=120.0, template=None):
        self.box = box
        self.exits = {}                  # pid -> wait status of ranks that ended
        self.sock, child = socket.socketpair()
        spec = {"sandbox_pid": box.namespace_pid(), "root": box.root,
                "tmp_bytes": box.limits.tmp_bytes, "read_only": read_only_paths(),
                "hidden": hidden_paths(),
                "rlimits": {"RLIMIT_NOFILE": box.limits.open_files, "RLIMIT_CORE": 0,
                            "RLIMIT_FSIZE": box.limits.file_bytes,
                            **({} if box.rank_cgroups else {"RLIMIT_AS": RANK_MEMORY_BYTES})},
                "cgroups": [os.path.join(p, "cgroup.procs") for p in box.rank_cgroups]}
        self.log_path = os.path.join(spec_dir, "zygote.log")
        self.popen, self.pidfd, self.forked = None, None, False
        if template is not None:
            self.forked = self._from_template(template, spec, child)
        if not self.forked:
            spec_path = os.path.join(spec_dir, "zygote.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            with open(self.log_path, "ab") as log:      # after the template's line, if any
                self.popen = subprocess.Popen(
                    [sys.executable, "-I", _RANK_ZYGOTE, spec_path, str(child.fileno())],
                    pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, close_fds=True, env=dict(_STARTER_ENV))
        child.close()
        self._buffer = b""
        self._pidfds = []                # pidfds that came with "pid" messages, in order
        self._expect("ready", start_timeout)

    def _from_template(self, template, spec, child) -> bool:
        """Ask the run's template for this sandbox's starter; False (and a line in the log) when
        it cannot answer, so the caller starts one of its own."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.settimeout(60.0)
                connection.connect(template)
                request = {"spec": spec, "log": self.log_path}
                socket.send_fds(connection, [json.dumps(request).encode() + b"\n"],
                                [child.fileno()])
                data, fds = b"", []
                while b"\n" not in data:
                    chunk, more, _, _ = socket.recv_fds(connection, 4096, 1)
                    fds += more
                    if not chunk:
                        break
                    data += chunk
            if b"\n" not in data or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise RuntimeError(f"the template answered {data[:200]!r} with {len(fds)} "
                                   "descriptors")
            self.pid, self.pidfd = int(json.loads(data.split(b"\n", 1)[0])["pid"]), fds[0]
            return True
        except (OSError, RuntimeError, ValueError, KeyError) as error:
            with open(self.log_path, "a") as log:
                log.write(f"labkit grading: the run's rank starter template did not answer "
                          f"({error!r}); starting one for this sandbox\n")
            return False

    def _exited(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is not None
        return bool(select.select([self.pidfd], [], [], 0)[0])

    def _lines(self, timeout):
        """Messages that arrive within `timeout` seconds (exits are filed as they come)."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return []
        data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 8)
        self._pidfds += fds
        if not data:
            raise RuntimeError(f"the sandbox's rank starter stopped: {self.log_tail()}")
        self._buffer += data
        if len(self._buffer) > MAX_HEADER_BYTES:
            raise RuntimeError(f"the sandbox's rank starter sent a line over {MAX_HEADER_BYTES} "
                               f"bytes: {self.log_tail()}")
        messages = []
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "exit" in message:
                self.exits[int(message["exit"])] = int(message["status"])
                continue
            if message.get("pidfd"):
                if not self._pidfds:
                    raise RuntimeError(f"the rank starter's answer {message} came without a "
                                       f"pidfd: {self.log_tail()}")
                message["pidfd"] = self._pidfds.pop(0)
            messages.append(message)
        return messages

    def _expect(self, key, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._exited():
                raise RuntimeError(f"the sandbox's rank starter exited: {self.log_tail()}")
            for message in self._lines(0.2):
                if key in message:
                    return message
        raise RuntimeError(f"the sandbox's rank starter did not answer: {self.log_tail()}")

    def spawn(self, rank, uid, settings, env, fds) -> tuple[int, int]:
        """Start a rank: (its host pid, a pidfd of it)."""
        request = {"rank": rank, "uid": uid, "settings": settings, "env": env, "nfds": len(fds)}
        socket.send_fds(self.sock, [json.dumps(request).encode() + b"\n"], fds)
        reply = self._expect("pid", 60.0)
        return int(reply["pid"]), reply["pidfd"]

    def exitcode(self, pid, wait=1.0):
        deadline = time.monotonic() + wait
        while pid not in self.exits and time.monotonic() < deadline:
            try:
                self._lines(0.05)
            except RuntimeError:
                break
        status = self.exits.get(pid)
        return None if status is None else os.waitstatus_to_exitcode(status)

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def close(self):
        self.sock.close()
        for fd in self._pidfds:
            os.close(fd)
        self._pidfds = []
        if self.popen is not None:
            if self.popen.poll() is None:
                self.popen.kill()
            self.popen.wait()
        elif self.pidfd is not None:             # the template reaps it
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(self.pidfd)
            self.pidfd = None


class _ZygoteProcess:
    """A rank the zygote forked, looking like a multiprocessing.Process to the World."""

    def __init__(self, zygote, pid, pidfd):
        self.zygote, self.pid = zygote, pid
        self.sentinel = pidfd            # opened by the zygote before it could reap the rank
        self._code = None

    def _ended(self, timeout=0.0):
        if self.sentinel is None:
            return True
        return bool(select.select([self.sentinel], [], [], timeout)[0])

    def is_alive(self):
        return not self._ended()

    @property
    def exitcode(self):
        if self._code is None and self._ended():
            self._code = self.zygote.exitcode(self.pid)
        return self._code

    def kill(self):
        _kill(self.sentinel)

    def join(self, timeout=None):
        self._ended(timeout if timeout is not None else None)

    def close(self):
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


def rank_uid(slot: int, index: int) -> int:
    """The uid of the `index`-th rank a slot's sandbox starts (modulo UIDS_PER_SLOT): every live
    rank has a uid of its own, so closing one world never touches another's ranks."""
    return RANK_UID_BASE + UIDS_PER_SLOT * int(slot) + int(index) % UIDS_PER_SLOT


def slot_uids(slot: int) -> range:
    start = RANK_UID_BASE + UIDS_PER_SLOT * int(slot)
    return range(start, start + UIDS_PER_SLOT)


class SandboxWorld(World):
    plain = True               # replies are plain data, read with weights_only=True
    records_always = True      # every reply carries the call's records (hints for messages)
    MAX_REPLY_BYTES = MAX_REPLY_BYTES
    MAX_HEADER_BYTES = MAX_HEADER_BYTES

    def __init__(self, size, box, timeout=60.0, teaching=True, zygote=None):
        self.box = box
        first = box.ranks_started                       # uids of this world: its own block
        box.ranks_started = first + size
        self._uids = [rank_uid(box.slot, first + rank) for rank in range(size)]
        self.zygote = zygote     # the sandbox's rank starter; without one, a process per rank
        # the store's port, in the sandbox's own network: each world of the box its own, below
        # the kernel's ephemeral range (32768-60999), which gloo's sockets draw from. A random
        # port in 20000-39999 met a live gloo socket of another world of the box now and then
        # (EADDRINUSE: "The server socket has failed to listen", a 1-rank world in lab 7)
        self._store_port = _STORE_PORTS[0] + box.worlds_started % (_STORE_PORTS[1] -
                                                                   _STORE_PORTS[0])
        box.worlds_started += 1
        self._spec_dir = tempfile.mkdtemp(prefix="labkit-ranks-", dir=box.private_dir())
        super().__init__(size, backend="gloo", timeout=timeout, teaching=teaching)

    def __repr__(self):
        return f"SandboxWorld(size={self.size}, {'isolated' if self.box.isolated else 'plain'})"

    # ---- starting ranks ------------------------------------------------------------------------
    def _spawn(self, rank, settings):
        commands, commands_child = multiprocessing.Pipe(duplex=True)
        diagnostics, diagnostics_child = multiprocessing.Pipe(duplex=True)
        out_reader, out_writer = multiprocessing.Pipe(duplex=False)
        err_reader, err_writer = multiprocessing.Pipe(duplex=False)
        child_ends = (commands_child, diagnostics_child, out_writer, err_writer)
        fds = [end.fileno() for end in child_ends]
        settings = dict(settings, port=self._store_port, store_on_rank_0=True, fds=fds,
                        die_with_parent=False)   # its parent is _rank_init, which dies with us
        argv = [sys.executable, "-m", "labkit.runtime.worker", json.dumps(settings)]
        env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
               "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONPATH": _LABKIT_PARENT,
               "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "agg",
               "NBGRADER_EXECUTION": "autograde", "USER": f"rank{rank}",
               "TORCH_CPP_LOG_LEVEL": "ERROR",    # c10d's reverse-lookup warnings: noise here
               "LOGNAME": f"rank{rank}"}
        if self.box.isolated and self.zygote is not None:
            pid, pidfd = self.zygote.spawn(rank, self._uids[rank], settings, env, fds)
            for end in child_ends:
                end.close()
            return self._bounded(rank, _ZygoteProcess(self.zygote, pid, pidfd), commands,
                                 diagnostics, out_reader, err_reader)
        if self.box.isolated:
            uid = self._uids[rank]
            spec = {"sandbox_pid": self.box.namespace_pid(), "root": self.box.root,
                    "uid": uid, "gid": uid, "tmp_bytes": self.box.limits.tmp_bytes,
                    "read_only": read_only_paths(), "hidden": hidden_paths(),
                    "rlimits": {"RLIMIT_NOFILE": self.box.limits.open_files, "RLIMIT_CORE": 0,
                                "RLIMIT_FSIZE": self.box.limits.file_bytes,
                                **({} if self.box.rank_cgroups else
                                   {"RLIMIT_AS": RANK_MEMORY_BYTES})},
                    "cgroups": [os.path.join(p, "cgroup.procs") for p in self.box.rank_cgroups],
                    "argv": argv, "env": env, "seccomp": True}
            spec_path = os.path.join(self._spec_dir, f"rank{rank}.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            command = [sys.executable, "-I", _RANK_INIT, spec_path]
            popen = subprocess.Popen(command, pass_fds=fds, stdin=subprocess.DEVNULL,
                                     stdout=out_writer.fileno(), stderr=err_writer.fileno(),
                                     close_fds=True, env={})
        else:
            env["HOME"] = env["TMPDIR"] = self._spec_dir
            popen = subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL,
                                     stdout=out_writer.fileno(), stderr=err_writer.fileno(),
                                     close_fds=True, env=env, cwd=self._spec_dir,
                                     start_new_session=True)
        for end in child_ends:
            end.close()
        return self._bounded(rank, _Process(popen), commands, diagnostics, out_reader,
                             err_reader)

    def _bounded(self, rank, process, commands, diagnostics, out_reader, err_reader):
        """The rank's channels, read with bounds (BoundedChannel): the kernel's World reads them
        as it reads any rank's; a refused message kills the rank and fails the call."""
        kill = lambda: process.kill()  # noqa: E731
        commands = BoundedChannel(commands, kill, f"rank {rank}", self.MAX_HEADER_BYTES,
                                  self.MAX_REPLY_BYTES)
        diagnostics = BoundedChannel(diagnostics, kill, f"rank {rank}'s diagnosis",
                                     self.MAX_HEADER_BYTES, 0)
        return process, commands, diagnostics, out_reader, err_reader

    def _collect(self, targets, task_id, deadline):
        """As the World's, and a rank whose reply was refused (BoundedChannel) is a failure of
        this call that names the reason, not a death without one; the world then restarts."""
        results, errors, deaths, stuck = super()._collect(targets, task_id, deadline)
        for r in self._ranks:
            why = r.commands.refused
            if why is None or r.rank not in targets or r.rank in errors:
                continue
            deaths.pop(r.rank, None)
            results.pop(r.rank, None)
            errors[r.rank] = {"type": "ReplyRefused", "module": __name__, "in_communication": False,
                              "message": f"{why}; the grader did not read it. Return less data "
                                         f"(a summary, a smaller tensor) from the function.",
                              "traceback": f"ReplyRefused: {why}\n"}
            self._broken = f"rank {r.rank}'s reply was refused"
        return results, errors, deaths, stuck

    # ---- measuring ---------------------------------------------------------------------------
    def rank_pids(self):
        """{rank: host pid of the rank process} (under isolation, _rank_init's child)."""
        pids = {}
        for r in self._ranks:
            if not r.alive():
                continue
            if not self.box.isolated or isinstance(r.process, _ZygoteProcess):
                pids[r.rank] = r.process.pid
                continue
            try:
                with open(f"/proc/{r.process.pid}/task/{r.process.pid}/children") as f:
                    children = f.read().split()
            except OSError:
                children = []
            if children:
                pids[r.rank] = int(children[0])
        return pids

    def _netns(self):
        if not self.box.isolated:
            return {}
        return {"netns_pid": self.box.namespace_pid(), "private_network": True}

    def close(self):
        super().close()
        if self.box.isolated:
            from labkit.grading.sandbox import _wait_user_gone
            for uid in self._uids:
                _wait_user_gone(uid, timeout=5.0)
