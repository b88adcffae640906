"""Starts the ranks of graded calls inside a submission's sandbox, each as a user of its own.

Started by the trusted grader (grading/ranks.py) as root, on the host, once per sandbox:

    python -I _rank_zygote.py SPEC.json CONTROL_FD

or forked, once per sandbox, from the run's template (`python -I _rank_zygote.py --template
LISTEN_FD`, one per `labkit grade` run; see `_template`), which saves each submission the import.

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
import struct
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


def _enter(spec):
    """Into the sandbox's network, UTS, PID (for the children) and mount namespaces, with an IPC
    namespace of this process's own. A process can join a mount namespace only while it shares
    its filesystem attributes with no other (one thread: true here, and in a fresh fork)."""
    for kind in ("net", "uts", "pid", "mnt"):
        rank_init._setns(spec["sandbox_pid"], kind)
    rank_init._check(rank_init._libc.unshare(rank_init.CLONE_NEWIPC), "unshare ipc")


def _import_rank_code():
    """What every rank imports: once, in the process that forks them."""
    import torch  # noqa: F401  (the point of this process: imported once, before any fork)
    import torch._dynamo  # noqa: F401  (an optimizer's first step would import it in each rank)
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401  (chapters 8 and 9)
    from labkit.runtime import worker  # noqa: F401
    graders = sorted(name for name in sys.modules if name.startswith("labkit.grading.references"))
    if graders:                 # the ranks' memory must never hold the grader's references
        raise RuntimeError(f"the rank code imported the grader's references: {graders}")


def _serve(spec, control):
    """Fork one rank per request on `control` until the grader closes it."""
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


def _template(listener):
    """The rank starter of a whole `labkit grade` run: torch imported once for every submission.
    Each connection (from a worker of the same run: same uid, checked) brings one sandbox's spec
    and the control socket of that sandbox's rank starter; a fork of this process enters that
    sandbox and serves it exactly as `python -I _rank_zygote.py SPEC CONTROL_FD` would, and the
    worker gets its pid with a pidfd. This process never enters a sandbox and runs no code of a
    submission; what its forks inherit is the rank code and nothing else."""
    _import_rank_code()
    _proc.serve_connections(listener, lambda connection: _start_starter(listener, connection),
                            "a rank starter request")


def _start_starter(listener, connection):
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise PermissionError(f"a connection from uid {uid}, not the grader's ({os.getuid()})")
    connection.settimeout(30.0)
    data, fds = b"", []
    while b"\n" not in data:
        chunk, more, _, _ = socket.recv_fds(connection, 1 << 16, 4)
        fds += more
        if not chunk or len(data) > MAX_REQUEST:
            for fd in fds:
                os.close(fd)
            raise ValueError("an incomplete starter request")
        data += chunk
    request = json.loads(data.split(b"\n", 1)[0])
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a starter request came with {len(fds)} descriptors, expected 1")
    child = os.fork()
    if child == 0:
        try:
            listener.close()
            connection.close()
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
            # no PR_SET_PDEATHSIG: it lives as long as its control socket (a template that dies
            # mid-run must not take the ranks in flight with it); the run's end kills it with the
            # template's process group (TemplateProcess.close)
            control = socket.socket(fileno=fds[0])
            _enter(request["spec"])
            _serve(request["spec"], control)
        except BaseException as error:  # noqa: BLE001 (report, then leave)
            _proc.say(f"labkit grading: cannot start a sandbox's rank starter: {error!r}")
        finally:
            os._exit(114)               # never back into the template's loop
    os.close(fds[0])
    pidfd = os.pidfd_open(child)
    try:
        _reply(connection, {"pid": child}, [pidfd])
    finally:
        os.close(pidfd)


def main():
    _proc.die_with_parent(leave_if_orphan=True)
    if sys.argv[1] == "--template":
        _template(socket.socket(fileno=int(sys.argv[2])))
        return
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    control = socket.socket(fileno=int(sys.argv[2]))
    _enter(spec)
    _import_rank_code()
    _serve(spec, control)


if __name__ == "__main__":
    main()
