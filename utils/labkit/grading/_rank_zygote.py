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
     sockets (seccomp: ranks talk only over the counted loopback), sets resource limits;
  4. runs the rank (labkit.runtime.worker.main) on the channels the grader passed.
The children live in the sandbox's network, UTS and PID namespaces (this process entered them).

Protocol on the control socket (a socket pair with the grader): the grader sends a JSON request
{"rank", "uid", "settings", "env"} with the rank's four channel descriptors (SCM_RIGHTS); this
process answers {"pid": host pid}, and later {"exit": pid, "status": waitstatus} for each rank
that ends. It exits when the grader closes the socket (and dies with the grader).
"""
import json
import os
import select
import signal
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))     # labkit's parent folder
from labkit.grading import _rank_init as rank_init  # noqa: E402  (the same steps, as root)


def _reply(control, message):
    control.sendall(json.dumps(message).encode() + b"\n")


def _child(spec, request, fds):
    root = spec["root"]
    rank_init.private_dirs(spec)
    for procs in spec["cgroups"]:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    os.chroot(root)
    os.chdir("/tmp")
    os.setgroups([])
    uid = int(request["uid"])
    os.setgid(uid)
    os.setuid(uid)
    rank_init._check(rank_init._libc.prctl(rank_init.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0),
                     "pdeathsig")
    rank_init._no_unix_sockets()
    import resource
    for name, value in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    os.umask(0o077)
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


def main():
    rank_init._check(rank_init._libc.prctl(rank_init.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0),
                     "pdeathsig")
    if os.getppid() == 1:
        os._exit(1)
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
    signal.signal(signal.SIGCHLD, lambda *_: None)       # wake select() when a rank ends
    _reply(control, {"ready": os.getpid()})
    buffer = b""
    while True:
        try:
            readable, _, _ = select.select([control], [], [], 1.0)
        except InterruptedError:
            readable = []
        _reap(control)
        if not readable:
            continue
        data, fds, _, _ = socket.recv_fds(control, 1 << 16, 8)
        if not data:
            os._exit(0)                                  # the grader is gone
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            child = os.fork()
            if child == 0:
                try:
                    control.close()
                    rank_init._check(rank_init._libc.unshare(rank_init.CLONE_NEWNS), "unshare")
                    _child(spec, request, fds)
                except BaseException as error:  # noqa: BLE001 (report, then leave)
                    os.write(2, f"labkit grading: cannot start rank {request.get('rank')}: "
                                f"{error!r}\n".encode())
                os._exit(111)
            for fd in fds:
                os.close(fd)
            fds = []
            _reply(control, {"pid": child, "rank": request.get("rank")})


if __name__ == "__main__":
    main()
