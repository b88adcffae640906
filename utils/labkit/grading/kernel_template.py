"""Sandbox kernels forked from one template per `labkit grade` run (the grader's side).

    with KernelTemplate() as template:        # once per run: imports torch, ipykernel, labkit
        box = Sandbox(run_dir, limits=Limits(kernel_template=template.path))
        box.start()                           # the kernel is a fork of the template

A kernel started with `unshare ... python _nsinit.py` pays a fresh interpreter (ipykernel, zmq,
tornado, IPython) and then the setup cell's `import torch, labkit`, ~2 s of CPU per submission.
The template (grading/_kernel_template.py) imports both once; each sandbox's kernel is a fork of
it that enters fresh namespaces and builds the sandbox's root with `_nsinit`'s own functions.
The template listens on a unix socket in a folder only the grader can open, answers only its own
uid (SO_PEERCRED), runs no submission's code, and dies with the grader. When it cannot answer,
the sandbox starts its kernel the old way and says why in the kernel's log.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from labkit.grading.ranks import TemplateProcess

_LABKIT_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class KernelTemplate(TemplateProcess):
    """The template process of a run; `path` is what Limits(kernel_template=...) takes."""

    def __init__(self):
        from labkit.grading.sandbox import kernel_env
        self.folder = tempfile.mkdtemp(prefix="labkit-kernels-",
                                       dir="/tmp" if len(tempfile.gettempdir()) > 60 else None)
        self.path = os.path.join(self.folder, "kernels")
        self.log_path = os.path.join(self.folder, "template.log")
        home = os.path.join(self.folder, "home")      # empty, the grader's: no user site there
        os.makedirs(home, mode=0o700)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(64)
        try:
            with open(self.log_path, "wb") as log:
                # the kernel's own interpreter flags and variables (kernel_env), so what an
                # import reads from them at start is what the kernel would read; not -I, whose
                # flag the kernel would inherit (and multiprocessing would pass on to children)
                self.popen = subprocess.Popen(
                    [sys.executable, "-m", "labkit.grading._kernel_template",
                     str(self.listener.fileno())],
                    pass_fds=[self.listener.fileno()], stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, close_fds=True, cwd=home, env=kernel_env(home),
                    start_new_session=True)               # its forks in its group: close()
        except BaseException:
            self.listener.close()                      # nothing of a template that never ran
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        # the template's alone now: once it is gone, a connection is refused at once (a copy
        # kept here would queue it, and each sandbox would wait its whole startup timeout)
        self.listener_inode = os.fstat(self.listener.fileno()).st_ino
        self.listener.close()

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def close(self):
        if self.popen.poll() is not None:   # it ended on its own: kernels since started the old way
            print(f"labkit grade: the run's kernel template exited ({self.popen.returncode}); "
                  f"kernels were started with unshare instead: {self.log_tail()}",
                  file=sys.stderr)
        super().close()


class ForkedKernel:
    """A sandbox's kernel starter forked from the template, looking like the Popen of `unshare`
    to the Sandbox (pid, poll, kill, wait, returncode). It ends its namespace when killed, and
    when the grader's end of its socket closes."""

    def __init__(self, sock, pid, pidfd):
        self.sock, self.pid, self.pidfd = sock, pid, pidfd
        self.returncode = None
        self._buffer = b""

    def poll(self):
        if self.returncode is None and self.pidfd is not None and self._readable(0):
            self._ended()
        return self.returncode

    def _readable(self, timeout) -> bool:
        """Whether the starter has exited (its pidfd readable) within `timeout` s (None: wait).
        poll(), not select(): a worker may hold more than 1024 descriptors."""
        waiter = select.poll()
        waiter.register(self.pidfd, select.POLLIN)
        return bool(waiter.poll(None if timeout is None else int(timeout * 1000)))

    def _ended(self):
        """The starter exited: its last line says how process 1 ended (none: it was killed)."""
        status = None
        try:
            self.sock.setblocking(False)
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    break
                self._buffer += data
        except (BlockingIOError, OSError):
            pass
        for line in self._buffer.split(b"\n"):
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict) and "exit" in message:
                status = int(message["exit"])
        self.returncode = -signal.SIGKILL if status is None else os.waitstatus_to_exitcode(status)
        self.release()

    def kill(self):
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout=None):
        if self.returncode is None and self.pidfd is not None:
            if not self._readable(timeout):
                raise subprocess.TimeoutExpired("kernel starter", timeout)
            self._ended()
        return self.returncode

    def release(self):
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def start_forked(template: str, spec: dict, log, timeout: float) -> ForkedKernel:
    """Ask the template at `template` for a kernel on `spec` (the dict _nsinit.py reads), its
    output going to the open file `log`. Raises OSError/RuntimeError/ValueError when the template
    does not answer with the starter's pid and a pidfd of it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(template)
        socket.send_fds(sock, [json.dumps({"spec": spec}).encode() + b"\n"], [log.fileno()])
        data, fds = b"", []
        while b"\n" not in data:
            chunk, more, _, _ = socket.recv_fds(sock, 4096, 1)
            fds += more
            if not chunk:
                break
            data += chunk
        if b"\n" not in data or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise RuntimeError(f"the template answered {data[:200]!r} with {len(fds)} "
                               "descriptors")
        line, rest = data.split(b"\n", 1)
        kernel = ForkedKernel(sock, int(json.loads(line)["pid"]), fds[0])
        kernel._buffer = rest
        sock.settimeout(None)
        return kernel
    except BaseException:
        sock.close()
        raise
