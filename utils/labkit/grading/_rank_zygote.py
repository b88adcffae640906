"""Starts the ranks of graded calls inside a submission's sandbox, each as a user of its own.

Started by the trusted grader (grading/ranks.py) as root, on the host, once per sandbox:

    python -I _rank_zygote.py SPEC.json CONTROL_FD

Importing torch takes a second or more; a sandbox needs a dozen ranks over a submission. So this
process enters the sandbox once, imports torch and labkit's rank worker (code of the read-only
install, before any student code exists anywhere near it), and then forks one child per rank on
request, as a forkserver does. Each child, before it runs anything else:
  1. takes a mount and an IPC namespace of its own with a fresh /tmp, /var/tmp and /dev/shm that
     no other rank sees, and chroots into the sandbox's root;
  2. joins the sandbox's cgroups (memory, pids);
  3. becomes the rank's own unprivileged user (no other rank, nor the student's kernel, can
     signal, trace or read it), dies with this process (PR_SET_PDEATHSIG), forbids unix-domain
     sockets and foreign syscall ABIs (seccomp: ranks talk only over the counted loopback), sets
     resource limits (grading/_rank_init.py's become_rank);
  4. runs the rank (labkit.runtime.worker.main) on the channels the grader passed.
The children live in the sandbox's network, UTS and PID namespaces (this process entered them).

Protocol on the control socket (a socket pair with the grader): the grader sends a JSON request
{"rank", "uid", "settings", "env", "nfds"} with the rank's `nfds` channel descriptors (SCM_RIGHTS;
they arrive with the request's first bytes, queued until its line is complete); this process
answers {"pid": host pid} with a pidfd of the rank (SCM_RIGHTS), and later
{"exit": pid, "status": waitstatus} for each rank that ends, as soon as it ends. It exits when the grader closes the socket (and dies with the grader).
"""
import json
import os
import select
import signal
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))     # labkit's parent folder
from labkit.grading import _proc  # noqa: E402
from labkit.grading import _rank_init as rank_init  # noqa: E402  (the same steps, as root)

MAX_REQUEST = 1 << 20          # bytes of one request line (the grader's; a bound all the same)


def _reply(control, message, fds=()):
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(control, [data], list(fds))
    else:
        control.sendall(data)


def _child(spec, request, fds):
    rank_init.private_dirs(spec)
    rank_init.join_cgroups(spec["cgroups"])
    uid = int(request["uid"])
    rank_init.become_rank(spec, uid, uid)
    os.environ.clear()
    os.environ.update(request["env"])
    from multiprocessing.connection import Connection
    from labkit.runtime import worker
    settings = dict(request["settings"], fds=fds)
    worker.main(settings, *(Connection(fd) for fd in fds))
    os._exit(0)


def _reap(control):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply(control, {"exit": pid, "status": status})


def _start_rank(spec, control, request, fds, own_fds):
    """Fork the rank; answer its pid with a pidfd of it (opened before this process could reap
    it, so the grader signals that process and never a later one that got the same pid)."""
    child = os.fork()
    if child == 0:
        try:
            control.close()
            signal.set_wakeup_fd(-1)                 # this process's wakeup pipe is not the rank's
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in own_fds:
                os.close(fd)
            rank_init._check(rank_init._libc.unshare(rank_init.CLONE_NEWNS), "unshare")
            _child(spec, request, fds)
        except BaseException as error:  # noqa: BLE001 (report, then leave)
            _proc.say(f"labkit grading: cannot start rank {request.get('rank')}: {error!r}")
        finally:
            os._exit(111)               # never back into this process's loop
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(child)
    try:
        _reply(control, {"pid": child, "rank": request.get("rank"), "pidfd": True}, [pidfd])
    finally:
        os.close(pidfd)


def main():
    _proc.die_with_parent(leave_if_orphan=True)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    control = socket.socket(fileno=int(sys.argv[2]))
    for kind in ("net", "uts", "pid", "mnt"):
        rank_init._setns(spec["sandbox_pid"], kind)
    rank_init._check(rank_init._libc.unshare(rank_init.CLONE_NEWIPC), "unshare ipc")
    import torch  # noqa: F401  (the point of this process: imported once, before any fork)
    import torch._dynamo  # noqa: F401  (an optimizer's first step would import it in each rank)
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401  (chapters 8 and 9)
    from labkit.runtime import worker  # noqa: F401
    # a rank's end wakes select() at once: the handler alone would not (PEP 475 retries select),
    # the byte the wakeup fd gets does
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _reply(control, {"ready": os.getpid()})
    buffer, fds = b"", []       # descriptors arrive with a request's first bytes: queue them
    while True:
        readable, _, _ = select.select([control, wake_read], [], [], 5.0)
        if wake_read in readable:
            try:
                while os.read(wake_read, 4096):
                    pass
            except BlockingIOError:
                pass
        _reap(control)
        if control not in readable:
            continue
        data, more_fds, _, _ = socket.recv_fds(control, 1 << 16, 16)
        fds += more_fds
        if not data:
            os._exit(0)                                  # the grader is gone
        buffer += data
        if len(buffer) > MAX_REQUEST and b"\n" not in buffer:
            _proc.say(f"labkit grading: a request over {MAX_REQUEST} bytes")
            os._exit(112)
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            wanted = int(request.get("nfds", 4))
            if len(fds) < wanted:
                _proc.say(f"labkit grading: rank {request.get('rank')}'s request came with "
                          f"{len(fds)} descriptors, expected {wanted}")
                os._exit(113)
            _start_rank(spec, control, request, fds[:wanted], (wake_read, wake_write))
            fds = fds[wanted:]


if __name__ == "__main__":
    main()
