"""The kernel template of a `labkit grade` run: what every kernel imports, imported once.

Started by the grader as root, on the host, once per isolated run (grading/kernel_template.py's
KernelTemplate), with a fixed environment, in an empty folder of the grader's:

    python -m labkit.grading._kernel_template LISTEN_FD

It imports ipykernel's machinery, torch and labkit's student-facing modules (KERNEL_IMPORTS;
never the grader's references: it refuses to serve if they were imported), then waits on a unix
socket that only the grader's uid may use (SO_PEERCRED). For each connection it forks; the fork
(the "starter", which plays `unshare`'s part) and not the template reads the request, so the
template's memory, which every kernel inherits, never holds any sandbox's spec, id or key. The
starter, root:
  1. takes the worker's kernel log as its stdout and stderr, /dev/null as stdin, answers its own
     pid with a pidfd of itself, and enters new mount, network, PID, IPC and UTS namespaces
     (unshare(2) with the flags `unshare --mount --net --pid --ipc --uts` uses);
  2. forks process 1 of the new PID namespace, which dies with it (PR_SET_PDEATHSIG: unshare's
     --kill-child) and runs `_nsinit`'s own steps: cgroups, loopback, hostname, the new root
     (`prepare`), the kernel's fork (`start_kernel`), reaping until the kernel exits (`reap_until`);
  3. stays outside, like unshare: kills process 1 when the worker closes the socket (the worker
     died or is done), and when process 1 ends, sends {"exit": wait status} and exits.
The kernel's process chroots and becomes the sandbox user exactly as `_nsinit.run_kernel` does
(`become_kernel_user`), closes every descriptor but 0, 1 and 2, takes the kernel's environment,
sys.path and argv as `python -m ipykernel_launcher -f CONN` would have them, and starts the
IPython kernel in-process instead of execve.
"""
import sys

# sys.path as `python -m ipykernel_launcher` has it once the launcher drops its first entry (the
# working folder); both interpreters start with the same flags and PYTHONPATH (kernel_env)
BASE_PATH = list(sys.path[1:])

import atexit  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402

from labkit.grading import _nsinit, _proc  # noqa: E402

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
UNSHARE_FLAGS = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
PR_SET_DUMPABLE = 4
MAX_REQUEST = 1 << 20            # bytes of one request (the grader's; a bound all the same)
KERNEL_IMPORTS = ("ipykernel.kernelapp", "ipykernel.ipkernel", "torch", "torch.distributed",
                  "labkit", "labkit.grading._kernel_side")


# sys.argv[0] of `python -m ipykernel_launcher`: the launcher's file
LAUNCHER = os.path.abspath(importlib.util.find_spec("ipykernel_launcher").origin)


def import_kernel_code():
    """What every kernel imports: once, in the process that forks them. Refuses when the grader's
    references came along, or when a thread was started (a fork keeps only the calling one)."""
    for name in KERNEL_IMPORTS:
        importlib.import_module(name)
    graders = sorted(name for name in sys.modules if name.startswith("labkit.grading.references"))
    if graders:                # a kernel's memory must never hold the grader's references
        raise RuntimeError(f"the kernel code imported the grader's references: {graders}")
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        raise RuntimeError(f"the kernel template has {len(threads)} threads after its imports")


def _reply(connection, message, fds=()):
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(connection, [data], list(fds))
    else:
        connection.sendall(data)


def _read_request(connection):
    data, fds = b"", []
    while b"\n" not in data:
        chunk, more, _, _ = socket.recv_fds(connection, 1 << 16, 4)
        fds += more
        if not chunk or len(data) > MAX_REQUEST:
            raise ValueError("an incomplete kernel request")
        data += chunk
    if len(fds) != 1:
        raise ValueError(f"a kernel request came with {len(fds)} descriptors, expected 1")
    return json.loads(data.split(b"\n", 1)[0]), fds[0]


def _close_inherited():
    """Close every descriptor but 0, 1 and 2 (the kernel's, as after Popen's close_fds)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.close(fd)
            except OSError:
                pass                 # the listing's own descriptor


def _as_launched(spec):
    """The kernel's process state as `python -m ipykernel_launcher -f CONN ...` has it."""
    os.environ.clear()
    os.environ.update(spec["env"])
    sys.path[:] = BASE_PATH
    sys.argv = [LAUNCHER] + list(spec["argv"][3:])
    sys.orig_argv = list(spec["argv"])
    import site
    import tempfile
    site.USER_BASE = site.USER_SITE = None           # read again from the kernel's HOME
    site.getusersitepackages()
    tempfile.tempdir = None                          # read again from the kernel's TMPDIR
    # torch and numpy seed their global generators at import, and every fork would share them
    sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    # the template's own steps are done: the kernel's modules are what the kernel imported
    import labkit.grading
    for name in ("_nsinit", "_proc"):
        sys.modules.pop(f"labkit.grading.{name}", None)
        labkit.grading.__dict__.pop(name, None)


def run_kernel(spec):
    """The kernel's process (pid 2 of the sandbox): `_nsinit.run_kernel`, without the execve."""
    _nsinit.become_kernel_user(spec)
    _close_inherited()
    # setuid() left the process not dumpable; execve would have made it dumpable again, and a
    # fork the kernel starts could not be seen in the sandbox's /proc (hidepid) without it
    _proc.check(_proc.libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    _as_launched(spec)
    # the spec (the sandbox's host paths, cgroups, the references' host path) is referenced by
    # the frames below this one, which never return: empty it, as execve would have dropped it
    spec.clear()
    from ipykernel import kernelapp
    code = 0
    try:
        kernelapp.launch_new_instance()
    except SystemExit as leaving:
        code = leaving.code if isinstance(leaving.code, int) else (0 if leaving.code is None
                                                                   else 1)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 (leaving anyway)
            pass
    os._exit(code & 0xFF)


def _process_one(spec):
    """Process 1 of the sandbox, root: `_nsinit.main`'s steps."""
    _nsinit.prepare(spec)
    _nsinit.reap_until(_nsinit.start_kernel(spec, run_kernel))


def _starter(connection):
    """The fork that plays unshare's part for one sandbox (see the module's docstring). It lives
    as long as its worker's socket, not as long as the template: a template that dies mid-run
    (the host's OOM killer, an operator) must not take the kernels in flight with it, which
    would be recorded as the students' crashes. The run's end kills it with the template's
    process group (TemplateProcess.close); a worker that dies closes the socket."""
    connection.settimeout(30.0)
    request, log = _read_request(connection)
    spec = request["spec"]
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    own = os.pidfd_open(os.getpid())
    try:
        _reply(connection, {"pid": os.getpid()}, [own])
    finally:
        os.close(own)
    _proc.check(_proc.libc.unshare(UNSHARE_FLAGS), "unshare")
    starter = os.pidfd_open(os.getpid())
    first = os.fork()
    if first == 0:
        try:
            connection.close()
            _proc.die_with_parent(parent_pidfd=starter)     # unshare's --kill-child
            _process_one(spec)
        except BaseException as error:  # noqa: BLE001 (report, then leave)
            _proc.say(f"labkit sandbox: cannot start the sandbox's first process: {error!r}")
        finally:
            os._exit(111)
    os.close(starter)
    connection.settimeout(None)
    first_fd = os.pidfd_open(first)
    while True:
        readable, _, _ = select.select([connection, first_fd], [], [])
        if first_fd in readable:
            _, status = os.waitpid(first, 0)
            try:
                _reply(connection, {"exit": status})
            except OSError:
                pass
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        if connection in readable:
            try:
                data = connection.recv(4096)
            except OSError:
                data = b""
            if not data:                                  # the worker is gone, or done
                signal.pidfd_send_signal(first_fd, signal.SIGKILL)
                os.waitpid(first, 0)
                os._exit(137)


def _peer_uid(connection) -> int:
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def serve(listener):
    """Fork one starter per connection from the grader's uid, until the grader is gone."""
    import_kernel_code()
    sys.stdout.flush()
    sys.stderr.flush()

    def start(connection):
        uid = _peer_uid(connection)
        if uid != os.getuid():
            _proc.say(f"labkit grading: refused a kernel request from uid {uid}, not the "
                      f"grader's ({os.getuid()})")
            return
        if os.fork() == 0:
            try:
                listener.close()
                _starter(connection)
            except BaseException as error:  # noqa: BLE001 (report, then leave)
                _proc.say(f"labkit grading: cannot start a sandbox's kernel: {error!r}")
            finally:
                os._exit(114)                   # never back into the template's loop

    _proc.serve_connections(listener, start, "a kernel request")


def main():
    _proc.die_with_parent(leave_if_orphan=True)
    serve(socket.socket(fileno=int(sys.argv[1])))


if __name__ == "__main__":
    main()
