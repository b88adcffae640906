"""Starts one rank of a graded call inside a submission's sandbox, as a user of its own.

Started by the trusted grader (grading/ranks.py) as root, on the host:

    python -I _rank_init.py SPEC.json        (file descriptors for the rank's channels inherited)

Standalone on purpose (standard library only): it runs as root before any student code.

What it does, in order:
  1. dies with the grader (PR_SET_PDEATHSIG) and joins the sandbox's cgroups (memory, pids);
  2. enters the sandbox's network, UTS, mount and PID namespaces (its loopback is the only network
     the rank will have; the grader counts what crosses it), then takes a mount and an IPC
     namespace of its own;
  3. forks: the child is a process of the sandbox's PID namespace. It mounts a fresh /tmp,
     /var/tmp and /dev/shm that no other rank sees, chroots into the sandbox's root, becomes the
     rank's own unprivileged user (no other rank, nor the student's kernel, can signal, trace or
     read it), forbids unix-domain sockets (seccomp: a rank cannot reach another process but over
     the counted network), sets resource limits and execs the rank;
  4. this process waits and leaves with the rank's status (a signal is passed on as a signal).
"""
import ctypes
import json
import os
import platform
import resource
import signal
import struct
import sys

CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
MS_REC, MS_PRIVATE = 16384, 1 << 18
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 38, 22
SECCOMP_MODE_FILTER = 2
AF_UNIX = 1
EPERM = 1
# seccomp: architecture tag and the number of socket(2)
ARCHES = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def _setns(pid, kind):
    fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
    try:
        _check(_libc.setns(fd, 0), f"setns {kind}")
    finally:
        os.close(fd)


def _no_unix_sockets():
    """A seccomp filter: socket(AF_UNIX, ...) fails with EPERM; every other call is allowed.

    Ranks share the sandbox's network namespace, where abstract unix sockets would let two ranks
    talk without touching the counted loopback. (Socket pairs, which connect nobody, stay.)"""
    machine = platform.machine()
    if machine not in ARCHES:
        raise OSError(f"no seccomp rule for this architecture ({machine})")
    arch, nr_socket = ARCHES[machine]
    ld, jeq, ret = 0x20, 0x15, 0x06           # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | EPERM
    program = [
        (ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, allow),      # other arch: allow
        (ld, 0, 0, 0), (jeq, 0, 3, nr_socket),                      # not socket(): allow
        (ld, 0, 0, 16), (jeq, 0, 1, AF_UNIX), (ret, 0, 0, deny),    # socket(AF_UNIX, ...)
        (ret, 0, 0, allow),
    ]
    data = b"".join(struct.pack("HBBI", *row) for row in program)
    buffer = ctypes.create_string_buffer(data)
    prog = struct.pack("HxxxxxxP", len(program), ctypes.addressof(buffer))
    prog_buffer = ctypes.create_string_buffer(prog)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER,
                       ctypes.c_ulong(ctypes.addressof(prog_buffer)), 0, 0),
           "seccomp")


def private_dirs(spec):
    """In a mount namespace of the rank's own: a fresh /tmp, /var/tmp and /dev/shm in the
    sandbox's root, and the read-only install bound into them again where it lives below one of
    them (a course cloned into /tmp: its .venv and labkit would be hidden by the fresh /tmp)."""
    root = spec["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for path in PRIVATE_DIRS:
        os.makedirs(root + path, exist_ok=True)
        _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV,
               f"mode=1777,size={spec['tmp_bytes']}")
    for path in spec.get("read_only", []):
        if any(path.startswith(d + "/") for d in PRIVATE_DIRS) and os.path.isdir(path):
            os.makedirs(root + path, mode=0o755, exist_ok=True)
            _mount(path, root + path, None, MS_BIND | MS_REC)
            _mount(None, root + path, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_RDONLY)


def _child(spec):
    root = spec["root"]
    private_dirs(spec)
    os.chroot(root)
    os.chdir("/tmp")
    os.setgroups([])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    # after the change of user, which clears it: die with this process
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    if spec.get("seccomp", True):
        _no_unix_sockets()
    else:
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for name, value in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    os.umask(0o077)
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def main():
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    if os.getppid() == 1:
        os._exit(1)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    for procs in spec["cgroups"]:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    target = spec["sandbox_pid"]
    for kind in ("net", "uts", "pid", "mnt"):      # mnt last: the /proc paths above are the host's
        _setns(target, kind)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC), "unshare")
    child = os.fork()
    if child == 0:
        try:
            _child(spec)
        except BaseException as error:  # noqa: BLE001 (report, then leave)
            os.write(2, f"labkit grading: cannot start the rank: {error!r}\n".encode())
        os._exit(111)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            os._exit(111)
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    main()
