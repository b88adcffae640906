"""A kernel that runs one submission's code, isolated from the grader and from other submissions.

    box = Sandbox(run_dir, limits=Limits())       # leases a slot no other grading run holds
    box.start()                                   # ~1-2 s: namespaces, user, kernel ready
    result = box.execute("x = 1 + 1", timeout=30) # ExecResult: status, outputs, payloads
    box.close()                                   # every process of the submission is gone

Isolation, when the grader runs as root on Linux (`isolation_report()` says what holds here):
  - its own unprivileged user per parallel slot (`labkit-grade<slot>`, created with useradd), so
    two submissions graded at once cannot signal, trace or read each other;
  - new mount/PID/network/IPC namespaces (`unshare`): a root of its own with only the system
    directories, the Python install and labkit read-only, its working folder read-write, a fresh
    /tmp; the course repository, the gradebook and every other submission are simply not there;
    only a loopback interface (no network); the kernel talks to the grader over unix sockets
    (jupyter's `ipc` transport), since TCP does not cross network namespaces;
  - cgroups (v1 memory + pids, or v2's memory.max + pids.max, when writable: cgroups.py) bound
    memory and processes of the whole submission,
    ranks included; rlimits bound processes per user, open files, file size, core dumps;
  - closing kills the PID namespace's first process, which takes every process in it (ranks,
    daemons, fork bombs) down with it; then the cgroup is checked empty and removed.
With `Limits(kernel_template=...)` (what `labkit grade` passes), the kernel is a fork of the run's
kernel template (grading/kernel_template.py), which builds the same namespaces and root with
_nsinit.py's functions and has torch and labkit imported already (~0.4 s instead of ~2.3 s to a
kernel past `import torch, labkit`); when the template does not answer, unshare as above.
Without root (or without `unshare`), the kernel runs as the grader's own user in a new session,
with rlimits only: `Limits.require_isolation=True` refuses that instead (`labkit grade` refuses
unless --no-isolation; its grading process is then the subreaper that kills a kernel's daemons).
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time

RESULT_MIME = "application/x-labkit-grading"
_NSINIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_nsinit.py")
_CGROUP_ROOT = "/sys/fs/cgroup"
_LABKIT_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MAX_MESSAGE = 64 << 20           # larger kernel messages are dropped by zmq (memory safety)
_MAX_TEXT = 20_000                # characters of output kept per cell
_MAX_CELL_OUTPUTS = 200           # outputs kept per cell (a stream switch or an image is one)
_MAX_CELL_PAYLOADS = 256 << 20    # bytes of handed-over values per cell (beyond: the cell fails)


@dataclasses.dataclass
class Limits:
    memory_bytes: int = 4 << 30       # whole submission (cgroup), else per process (RLIMIT_AS)
    processes: int = 512              # pids of the submission (cgroup) / of the slot user (rlimit)
    open_files: int = 4096
    file_bytes: int = 512 << 20       # largest file it may write
    tmp_bytes: int = 512 << 20        # size of its private /tmp and /dev/shm
    startup_timeout: float = 60.0
    require_isolation: bool = False
    isolate: bool = True              # False: the plain kernel even where the sandbox would work
    kernel_template: str | None = None  # a KernelTemplate's path: the kernel is forked from it
                                        # (grading/kernel_template.py); None: unshare + _nsinit


@dataclasses.dataclass
class ExecResult:
    status: str                       # "ok", "error", "timeout", "died"
    outputs: list                     # nbformat v4 outputs, sanitized (text, png, errors)
    payloads: list                    # decoded RESULT_MIME payloads (bytes), in order
    error: dict | None = None         # {"ename", "evalue", "traceback"} when status == "error"


def can_isolate() -> tuple[bool, str]:
    """Whether this machine allows the namespace sandbox, and if not, why not."""
    if os.environ.get("LABKIT_GRADING_NO_SANDBOX"):
        return False, "LABKIT_GRADING_NO_SANDBOX is set (this machine treated as one without it)"
    if sys.platform != "linux":
        return False, "not Linux"
    if os.geteuid() != 0:
        return False, "the grader is not root (cannot switch users or build namespaces)"
    if not shutil.which("unshare") or not shutil.which("useradd"):
        return False, "`unshare` or `useradd` is missing"
    return True, "root, unshare and useradd available"


def cgroup_dirs() -> dict[str, str]:
    """The cgroup controllers we can use here, {"memory": folder, "pids": folder}: v1's two
    hierarchies, or v2's one delegated folder under both names; {} without (see cgroups.py)."""
    from labkit.grading.cgroups import detect
    return detect().bases


def isolation_report() -> dict:
    ok, why = can_isolate()
    from labkit.grading.cgroups import detect
    found = detect() if ok else None
    cgroups = found.bases if found else {}
    return {"namespaces": ok, "why": why, "separate_user": ok, "network": ok,
            "cgroup_memory": "memory" in cgroups, "cgroup_pids": "pids" in cgroups,
            "cgroup_version": found.version if found else None}


MAX_SLOTS = 64


def lease_slot() -> tuple[int, int]:
    """A sandbox slot no other grading process on this machine holds: (slot, fd). The slot's
    users (`labkit-grade<slot>`, and its ranks' uids) are this process's until the fd is closed,
    so two grading runs at once never share a user (whose processes each one kills when done)."""
    import fcntl
    folder = slot_lock_folder()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for slot in range(MAX_SLOTS):
        fd = os.open(os.path.join(folder, f"{slot}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if not _slot_emptied(slot):
            os.close(fd)
            continue
        return slot, fd
    raise RuntimeError(f"all {MAX_SLOTS} grading slots of this machine are in use")


def _slot_emptied(slot: int, timeout: float = 10.0) -> bool:
    """Once its lock is ours: no process of the slot's users (its kernel user's and its ranks')
    is left. A lock is released when its holder's descriptor closes, and a grading worker that
    is killed (a stopped run, a worker past its limit) closes it as it dies, while its kernel and
    ranks are still dying after it (PR_SET_PDEATHSIG, then the PID namespace's end): so a slot
    can be leased again while a process of the last holder lives, and a new submission's kernel
    would share a uid with it (issue 25, seen under load with a second run grading). Whatever
    runs as those users now is a previous holder's: SIGKILLed, and waited for until gone.
    False (the caller tries the next slot) if it is not gone within `timeout` seconds."""
    from labkit.grading.ranks import slot_uids
    uids = set(slot_uids(slot))
    try:
        uids.add(pwd.getpwnam(f"labkit-grade{slot}").pw_uid)
    except KeyError:
        pass                                  # no kernel user yet (ensure_user makes it)
    deadline = time.monotonic() + timeout
    while True:
        pids = [int(entry) for entry in os.listdir("/proc")
                if entry.isdigit() and _owner(entry) in uids and not _zombie(entry)]
        if not pids:
            return True
        if time.monotonic() > deadline:
            return False
        _sigkill(pids, lambda pid: _owner(pid) in uids)
        time.sleep(0.05)


def slot_lock_folder() -> str:
    """Where slots are leased: one folder per machine, whatever TMPDIR a run has (two runs with
    different TMPDIRs once leased the same slot, and each killed the other's sandbox user)."""
    import tempfile
    if os.path.isdir("/run") and os.access("/run", os.W_OK):
        return "/run/labkit-grading-slots"
    return os.path.join(tempfile.gettempdir(), "labkit-grading-slots")


def ensure_user(slot: int) -> tuple[int, int]:
    """uid, gid of the sandbox user of a slot, created (no home, no login) when missing."""
    name = f"labkit-grade{slot}"
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--user-group",
                        "--shell", "/usr/sbin/nologin", name],
                       check=False, capture_output=True)
        entry = pwd.getpwnam(name)       # KeyError here: useradd failed (and said why above)
    return entry.pw_uid, entry.pw_gid


def read_only_paths() -> list[str]:
    """What the kernel needs to see: the Python install(s) and the labkit package."""
    import labkit
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)),
             os.path.dirname(os.path.abspath(labkit.__file__))}
    return sorted(p for p in paths if os.path.isdir(p))


def hidden_paths() -> list[str]:
    """Folders of the read-only install that student code must not see: the grader's references,
    which compute graded answers (labkit.grading.references; `labkit dist` leaves them out of the
    student copy, and the sandbox masks them with an empty folder)."""
    import labkit
    return [os.path.join(os.path.dirname(os.path.abspath(labkit.__file__)), "grading",
                         "references")]


def kernel_env(home: str) -> dict:
    """The kernel's environment, whose home (and IPython's and Jupyter's folders) is `home`: the
    sandbox's working folder, or the kernel template's own folder (grading/kernel_template.py)."""
    return {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
            "HOME": home, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
            "PYTHONPATH": _LABKIT_PARENT,
            "IPYTHONDIR": os.path.join(home, ".ipython"),
            "JUPYTER_RUNTIME_DIR": os.path.join(home, ".kernel"),
            "MPLBACKEND": "agg", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "NBGRADER_EXECUTION": "autograde", "PYDEVD_DISABLE_FILE_VALIDATION": "1",
            "TORCH_CPP_LOG_LEVEL": "ERROR"}   # c10d reverse-lookup warnings: no DNS here


def _die_with_parent():
    """In the child before exec: SIGKILL it when the grading process dies (so a killed worker
    never leaves a sandbox behind: unshare --kill-child then takes the whole namespace)."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)      # PR_SET_PDEATHSIG
    if os.getppid() == 1:            # the grading process died before prctl: too late for it
        os._exit(1)


def _clean_text(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + "\n... (output truncated)\n"


class Sandbox:
    def __init__(self, run_dir: str, slot: int | None = None, limits: Limits | None = None,
                 name: str = "s"):
        """slot: None leases a free one for this sandbox's lifetime (see lease_slot)."""
        self.limits = limits or Limits()
        self._slot_lock = None
        if slot is None:
            slot, self._slot_lock = lease_slot()
        self.run_dir, self.slot, self.name = run_dir, slot, name
        self.run_id = os.path.basename(os.path.dirname(run_dir.rstrip("/"))) or "run"
        self.isolated, self.why = can_isolate()
        if not self.limits.isolate:
            self.isolated, self.why = False, "isolation turned off (labkit grade --no-isolation)"
        if self.limits.require_isolation and not self.isolated:
            raise RuntimeError(f"grading sandbox unavailable: {self.why}")
        self.proc = None
        self.client = None
        self.cgroups: list[str] = []
        self.rank_cgroups: list[str] = []
        self.uid = self.gid = None
        self.log_path = None
        self.root = None
        self._namespace_pid = None
        self._kernel_dir_fd = None       # the kernel's socket folder, for the grader (start)
        self.forked = False              # the kernel is a fork of the run's kernel template
        self.ranks_started = 0           # ranks the grader started here (their uids: ranks.py)
        self.worlds_started = 0          # worlds started here (their store ports: ranks.py)

    # ---- start -------------------------------------------------------------------------------
    def start(self, seed_dir: str | None = None):
        """Start the kernel; `seed_dir`'s files (the lab's data files) are copied in first."""
        tag = f"{self.name}-{secrets.token_hex(4)}"
        self.workdir = os.path.join(self.run_dir, "w-" + tag)
        self.private = os.path.join(self.run_dir, "p-" + tag)        # root only: spec, log
        os.makedirs(self.private, mode=0o700)
        if seed_dir:
            shutil.copytree(seed_dir, self.workdir, symlinks=False)
            os.chmod(self.workdir, 0o700)
        else:
            os.makedirs(self.workdir, mode=0o700)
        kernel_dir = os.path.join(self.workdir, ".kernel")
        os.makedirs(kernel_dir, mode=0o700)
        # A unix socket's path holds at most 107 bytes, and workdir's grows with TMPDIR and the
        # student id (an e-mail address: the kernel never started). So the kernel binds its
        # sockets relative to its working folder (workdir, the same path inside the sandbox's
        # root), and the grader reaches the same folder through a descriptor of its own:
        # /proc/self/fd/N/k-1, short whatever TMPDIR and the id are.
        self._kernel_dir_fd = os.open(kernel_dir, os.O_RDONLY | os.O_DIRECTORY)
        conn = {"transport": "ipc", "ip": os.path.join(".kernel", "k"),
                "shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4,
                "hb_port": 5, "key": secrets.token_hex(16), "signature_scheme": "hmac-sha256",
                "kernel_name": "python3"}
        conn_path = os.path.join(kernel_dir, "connection.json")
        with open(conn_path, "w") as f:
            json.dump(conn, f)
        env = kernel_env(self.workdir)
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", conn_path,
                "--HistoryManager.enabled=False"]
        self.log_path = os.path.join(self.private, "kernel.log")
        log = open(self.log_path, "wb")
        rlimits = {"RLIMIT_NOFILE": self.limits.open_files, "RLIMIT_CORE": 0,
                   "RLIMIT_FSIZE": self.limits.file_bytes}
        if self.isolated:
            self.uid, self.gid = ensure_user(self.slot)
            rlimits["RLIMIT_NPROC"] = self.limits.processes
            from labkit.grading import cgroups
            found = cgroups.detect()
            # the kernel's cgroup, and one for the ranks the grader starts (grading/ranks.py): a
            # fork bomb or a memory hog in the kernel cannot starve the graded calls. v1: one
            # folder per controller; v2: one folder holding both limits.
            for name, into in ((tag, self.cgroups), (tag + "-ranks", self.rank_cgroups)):
                into += cgroups.make_group(found, f"labkit-grading/{self.run_id}/{name}",
                                           memory_bytes=self.limits.memory_bytes,
                                           processes=self.limits.processes)
            if "memory" not in found.bases:
                rlimits["RLIMIT_AS"] = self.limits.memory_bytes
            for dirpath, dirnames, filenames in os.walk(self.workdir):
                for entry in [dirpath] + [os.path.join(dirpath, n) for n in filenames]:
                    os.chown(entry, self.uid, self.gid)
            root = self.root = os.path.join(self.private, "root")
            os.makedirs(root, mode=0o700)
            spec = {"root": root, "workdir": self.workdir, "uid": self.uid, "gid": self.gid,
                    "read_only": read_only_paths(), "hidden": hidden_paths(),
                    "tmp_bytes": self.limits.tmp_bytes,
                    "rlimits": rlimits, "env": env, "argv": argv, "loopback": True,
                    "cgroups": [os.path.join(p, "cgroup.procs") for p in self.cgroups]}
            if self.limits.kernel_template:
                self.proc = self._fork_kernel(spec, log)
            if self.proc is None:
                spec_path = os.path.join(self.private, "spec.json")
                with open(spec_path, "w") as f:
                    json.dump(spec, f)
                cmd = ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork",
                       "--kill-child", "--", sys.executable, "-I", _NSINIT, spec_path]
                self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, close_fds=True, env={},
                                             preexec_fn=_die_with_parent)
        else:
            rlimits["RLIMIT_AS"] = self.limits.memory_bytes

            def limit():
                import resource
                _die_with_parent()             # a killed worker takes its kernel along
                for name, value in rlimits.items():
                    resource.setrlimit(getattr(resource, name), (value, value))
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=self.workdir,
                                         env=dict(env, HOME=self.workdir), close_fds=True,
                                         start_new_session=True, preexec_fn=limit)
        log.close()
        self._connect(dict(conn, ip=f"/proc/self/fd/{self._kernel_dir_fd}/k"), conn_path)

    def _fork_kernel(self, spec, log):
        """The kernel forked from the run's template (grading/kernel_template.py), or None, with
        the reason in the kernel's log, when the template does not answer."""
        from labkit.grading.kernel_template import start_forked
        try:
            kernel = start_forked(self.limits.kernel_template, spec, log,
                                  timeout=self.limits.startup_timeout)
        except (OSError, RuntimeError, ValueError, KeyError) as error:
            log.write(f"labkit sandbox: the run's kernel template did not answer ({error!r}); "
                      "starting the kernel with unshare\n".encode())
            log.flush()
            return None
        self.forked = True
        return kernel

    def _connect(self, conn, conn_path):
        import zmq
        from jupyter_client import BlockingKernelClient
        deadline = time.monotonic() + self.limits.startup_timeout
        sockets = [f"{conn['ip']}-{conn[p]}" for p in
                   ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")]
        while not all(os.path.exists(s) for s in sockets):   # bound before any student code
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sandbox kernel did not start: {self._log_tail()}")
            time.sleep(0.02)
        context = zmq.Context()
        context.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)
        context.setsockopt(zmq.RECONNECT_IVL, -1)   # never follow a socket the kernel replaced
        self.client = BlockingKernelClient(context=context)
        self.client.load_connection_info(conn)
        self.client.start_channels()
        try:
            self.client.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
        except RuntimeError as error:
            raise RuntimeError(f"sandbox kernel did not answer: {error}; {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def private_dir(self) -> str:
        """A folder of the grader's (root only), removed with the sandbox."""
        return self.private

    def namespace_pid(self) -> int:
        """Host pid of the sandbox's first process (its namespaces are the sandbox's)."""
        if self._namespace_pid is None:
            path = f"/proc/{self.proc.pid}/task/{self.proc.pid}/children"
            with open(path) as f:
                children = f.read().split()
            if not children:
                raise RuntimeError("the sandbox has no first process (did it exit?)")
            self._namespace_pid = int(children[0])
        return self._namespace_pid

    # ---- run code ------------------------------------------------------------------------------
    def execute(self, code: str, timeout: float) -> ExecResult:
        """Run code in the kernel; its outputs come back sanitized, never interpreted."""
        if not self.alive:
            return ExecResult("died", [], [])
        msg_id = self.client.execute(code, store_history=False, allow_stdin=False)
        deadline = time.monotonic() + timeout
        outputs, payloads, error, idle, reply = _CellOutputs(), [], None, False, None
        while not (idle and reply is not None):
            if time.monotonic() > deadline:
                return ExecResult("timeout", outputs, payloads)
            if not self.alive:
                return ExecResult("died", outputs, payloads)
            if reply is None:
                try:
                    shell = self.client.get_shell_msg(timeout=0.005)
                    if shell.get("parent_header", {}).get("msg_id") == msg_id:
                        reply = shell["content"]
                except Exception:  # noqa: BLE001 (queue.Empty)
                    pass
            try:
                msg = self.client.get_iopub_msg(timeout=0.05)
            except Exception:  # noqa: BLE001 (queue.Empty)
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content.get("execution_state") == "idle":
                idle = True
            elif kind == "stream":
                _append_stream(outputs, content.get("name") == "stderr", str(content.get("text")))
            elif kind in ("display_data", "execute_result"):
                data = content.get("data") or {}
                if RESULT_MIME in data:
                    try:
                        payloads.append(base64.b64decode(str(data[RESULT_MIME]), validate=True))
                    except ValueError:
                        pass
                    if sum(map(len, payloads)) > _MAX_CELL_PAYLOADS:
                        payloads.clear()
                        error = {"ename": "OutputTooLarge", "traceback": [],
                                 "evalue": f"the kernel handed over more than "
                                           f"{_MAX_CELL_PAYLOADS} bytes in one cell"}
                        outputs.add(dict(output_type="error", **error))
                    continue
                out = _clean_data(data)
                if out:
                    outputs.add({"output_type": "display_data", "data": out, "metadata": {}})
            elif kind == "error":
                error = {"ename": str(content.get("ename"))[:200],
                         "evalue": _clean_text(str(content.get("evalue"))),
                         "traceback": [_clean_text(str(t)) for t in
                                       (content.get("traceback") or [])][:50]}
                outputs.add(dict(output_type="error", **error))
        status = "ok" if reply.get("status") == "ok" and error is None else "error"
        return ExecResult(status, outputs, payloads, error)

    # ---- stop ----------------------------------------------------------------------------------
    def close(self):
        if self.client is not None:
            try:
                self.client.stop_channels()
                self.client.context.destroy(linger=0)
            except Exception:  # noqa: BLE001
                pass
            self.client = None
        if self.proc is not None:
            if self.proc.poll() is None:
                if self.isolated:
                    self.proc.kill()     # --kill-child: process 1 of the namespace dies, and all
                else:
                    try:
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            self.proc.wait()
            if self.forked:
                self.proc.release()
            if not self.isolated:
                kill_adopted()       # daemons of its own session (setsid) that escaped killpg
        for path in self.cgroups + self.rank_cgroups:
            _empty_and_remove(path)
        self.cgroups, self.rank_cgroups = [], []
        if self.uid is not None:
            _wait_user_gone(self.uid)
        if getattr(self, "_kernel_dir_fd", None) is not None:
            os.close(self._kernel_dir_fd)
            self._kernel_dir_fd = None
        shutil.rmtree(getattr(self, "workdir", ""), ignore_errors=True)
        shutil.rmtree(getattr(self, "private", ""), ignore_errors=True)
        if self._slot_lock is not None:
            os.close(self._slot_lock)
            self._slot_lock = None


class _CellOutputs(list):
    """One cell's outputs, at most _MAX_CELL_OUTPUTS of them (each text already capped at
    _MAX_TEXT characters, each image at 2 MB): what a cell prints beyond is dropped, with a note,
    so the grader's memory does not grow with what a student's kernel sends."""

    dropped = 0

    def add(self, entry):
        if len(self) < _MAX_CELL_OUTPUTS - 1:
            self.append(entry)
            return
        self.dropped += 1
        note = (f"... ({self.dropped} more outputs of this cell dropped: the grader keeps "
                f"{_MAX_CELL_OUTPUTS - 1} per cell)\n")
        if len(self) == _MAX_CELL_OUTPUTS:
            self[-1]["text"] = note
        else:
            self.append({"output_type": "stream", "name": "stderr", "text": note})


def _append_stream(outputs, stderr, text):
    name = "stderr" if stderr else "stdout"
    if (outputs and outputs[-1].get("output_type") == "stream" and outputs[-1]["name"] == name
            and not getattr(outputs, "dropped", 0)):
        outputs[-1]["text"] = _clean_text(outputs[-1]["text"] + text)
    elif hasattr(outputs, "add"):
        outputs.add({"output_type": "stream", "name": name, "text": _clean_text(text)})
    else:
        outputs.append({"output_type": "stream", "name": name, "text": _clean_text(text)})


def _clean_data(data: dict) -> dict:
    """Only plain text and PNG images reach the feedback (no HTML or script from a student)."""
    out = {}
    if isinstance(data.get("text/plain"), str):
        out["text/plain"] = _clean_text(data["text/plain"])
    png = data.get("image/png")
    if isinstance(png, str) and len(png) < 2_000_000:
        try:
            if base64.b64decode(png, validate=True)[:8] == b"\x89PNG\r\n\x1a\n":
                out["image/png"] = png
        except ValueError:
            pass
    return out


def _sigkill(pids, still_ours):
    """SIGKILL each pid through a pidfd, and only if `still_ours(pid)` holds once the pidfd is
    open: a pid read from /proc or cgroup.procs may have been reused since, and the check after
    opening tells whether the process the pidfd holds is the one that was listed."""
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            if still_ours(pid):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.close(pidfd)


def _cgroup_pids(path):
    with open(os.path.join(path, "cgroup.procs")) as f:
        return [int(p) for p in f.read().split()]


def _empty_and_remove(path):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            pids = _cgroup_pids(path)
        except FileNotFoundError:
            return

        def still_in_cgroup(pid):
            try:
                return pid in _cgroup_pids(path)
            except FileNotFoundError:
                return False
        _sigkill(pids, still_in_cgroup)
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.05)


def _zombie(pid) -> bool:
    """A process that has exited and waits to be reaped (it runs nothing any more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _owner(pid):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return None


WORKER_MEMORY_BYTES = 6 << 30      # a grading worker: nbgrader, the trusted test cells and the
                                   # reference ranks it starts on the host (not the submission's)


def join_worker_cgroup(run_id: str, slot: int, memory_bytes: int = WORKER_MEMORY_BYTES):
    """Move this process (a grading worker, root) into a memory cgroup of its own under the run's
    (`labkit-grading/<run_id>/worker-<slot>`): what it reads from a submission and the references
    it runs are bounded, so one submission cannot push its neighbours' workers into the OOM
    killer. The children it starts inherit it until they join their own (the sandbox's kernel
    and ranks do). Returns the cgroup's folder, or None without a memory controller. The run's
    cleanup removes it with the others (pipeline._remove_cgroups)."""
    from labkit.grading import cgroups
    found = cgroups.detect()
    if "memory" not in found.bases or os.geteuid() != 0:
        return None
    # memory only: v1 makes no pids group for it; v2's group has pids.max unset ("max")
    folders = cgroups.make_group(found, f"labkit-grading/{run_id}/worker-{slot}",
                                 memory_bytes=int(memory_bytes))
    cgroups.join(folders)
    return folders[0]


def become_subreaper() -> None:
    """This process adopts every orphan below it (PR_SET_CHILD_SUBREAPER), so that without the
    namespace sandbox a daemon a submission starts (setsid, double fork) becomes its child when
    the kernel dies, where kill_adopted() finds it. For a grading worker (a process per
    submission) only: a process that adopts orphans must reap them."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:                    # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _is_subreaper() -> bool:
    import ctypes
    flag = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(37, ctypes.byref(flag), 0, 0, 0)   # PR_GET_CHILD_SUBREAPER
    return bool(flag.value)


def _adopted(pid) -> bool:
    """A child of this process in another session than its own (the plain kernel starts one; a
    daemon, another): what a sandbox left, never the grader's own helpers."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return int(fields[1]) == os.getpid() and int(fields[3]) != os.getsid(0)   # ppid, session


def _children_elsewhere() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _adopted(entry)]


def kill_adopted(timeout: float = 10.0) -> None:
    """SIGKILL and reap, until none is left, the children of another session that this process
    adopted as a subreaper (become_subreaper); each kill hands their own children to us."""
    if not _is_subreaper():
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = _children_elsewhere()
        if not pids:
            return
        _sigkill(pids, _adopted)      # our children: their pids cannot be reused before we reap
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def user_processes(uid: int) -> list[int]:
    return [int(entry) for entry in os.listdir("/proc")
            if entry.isdigit() and _owner(entry) == uid]


def _wait_user_gone(uid, timeout=10.0):
    """The sandbox user owns no process any more (SIGKILL whatever survived the namespace)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = user_processes(uid)
        if not pids:
            return
        _sigkill(pids, lambda pid: _owner(pid) == uid)
        time.sleep(0.05)
