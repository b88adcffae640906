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
     read it), forbids unix-domain sockets and every syscall ABI but the native one (seccomp: a
     rank cannot reach another process but over the counted network), sets resource limits and
     execs the rank;
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

if __package__:
    from labkit.grading import _proc
else:       # run as a script (python -I): the standard library and this folder only
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _proc

CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
MS_RDONLY, MS_NOSUID, MS_REMOUNT, MS_BIND = 1, 2, 32, 4096
MS_REC, MS_PRIVATE = 16384, 1 << 18
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 38, 22
SECCOMP_MODE_FILTER = 2
AF_UNIX = 1
EPERM = 1
# seccomp: the native architecture's audit tag, the number of socket(2), whether it has an x32
# ABI (x86_64: the same arch tag, syscall numbers with bit 30 set)
ARCHES = {"x86_64": (0xC000003E, 41, True), "aarch64": (0xC00000B7, 198, False)}
X32_SYSCALL_BIT = 0x40000000
NR_IO_URING_SETUP = 425          # the same number on x86_64 and aarch64
SECCOMP_ALLOW, SECCOMP_DENY = 0x7FFF0000, 0x00050000 | EPERM   # RET_ALLOW, RET_ERRNO(EPERM)

_libc = _proc.libc
_check = _proc.check
_mount = _proc.mount
join_cgroups = _proc.join_cgroups


def _setns(pid, kind):
    fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
    try:
        _check(_libc.setns(fd, 0), f"setns {kind}")
    finally:
        os.close(fd)


def seccomp_program(machine):
    """The BPF program of `forbid_unix_sockets` for `machine`: [(code, jt, jf, k)].

    Refused with EPERM: every syscall made through another ABI than the native one (on x86_64 the
    32-bit `int 0x80` entry, whose socket() and socketcall() numbers the native rules would not
    recognise, and the x32 ABI, whose numbers carry bit 30), io_uring_setup (io_uring opens sockets
    without a syscall seccomp could see) and socket(AF_UNIX, ...). Everything else is allowed.
    socketpair() stays: its two ends connect nobody but this process and its children."""
    if machine not in ARCHES:
        raise OSError(f"no seccomp rule for this architecture ({machine}); ranks cannot be "
                      f"confined here (known: {', '.join(ARCHES)})")
    arch, nr_socket, has_x32 = ARCHES[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06   # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE|K, BPF_RET|K
    program = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, SECCOMP_DENY),   # foreign ABI
               (ld, 0, 0, 0)]                                                   # the number
    if has_x32:
        program += [(jge, 0, 1, X32_SYSCALL_BIT), (ret, 0, 0, SECCOMP_DENY)]   # x32
    program += [(jeq, 0, 1, NR_IO_URING_SETUP), (ret, 0, 0, SECCOMP_DENY),
                (jeq, 0, 3, nr_socket),                                         # not socket()
                (ld, 0, 0, 16), (jeq, 0, 1, AF_UNIX), (ret, 0, 0, SECCOMP_DENY),
                (ret, 0, 0, SECCOMP_ALLOW)]
    return program


def forbid_unix_sockets():
    """Install `seccomp_program` on this process (and, inherited, on everything it starts).

    Ranks share the sandbox's network namespace, where abstract unix sockets would let two ranks
    talk without touching the counted loopback."""
    program = seccomp_program(platform.machine())
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
        _proc.fresh_tmpfs(root + path, spec["tmp_bytes"])
    for path in spec.get("read_only", []):
        if any(path.startswith(d + "/") for d in PRIVATE_DIRS) and os.path.isdir(path):
            os.makedirs(root + path, mode=0o755, exist_ok=True)
            _mount(path, root + path, None, MS_BIND | MS_REC)
            _mount(None, root + path, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_RDONLY)
    for path in spec.get("hidden", []):  # masked again where a re-bind above brought it back
        if any(path.startswith(d + "/") for d in PRIVATE_DIRS):
            _proc.mask(root + path)


def become_rank(spec, uid, gid, seccomp=True):
    """The last steps before a rank's code, as root inside its private mounts: into the sandbox's
    root, the rank's own user, dying with the parent, the seccomp filter, resource limits."""
    os.chroot(spec["root"])
    os.chdir("/tmp")
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    _proc.die_with_parent()          # after the change of user, which clears it
    if seccomp:
        forbid_unix_sockets()
    else:
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for name, value in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    os.umask(0o077)


def _child(spec):
    private_dirs(spec)
    become_rank(spec, spec["uid"], spec["gid"], seccomp=spec.get("seccomp", True))
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def main():
    _proc.die_with_parent(leave_if_orphan=True)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    join_cgroups(spec["cgroups"])
    target = spec["sandbox_pid"]
    for kind in ("net", "uts", "pid", "mnt"):      # mnt last: the /proc paths above are the host's
        _setns(target, kind)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC), "unshare")
    child = os.fork()
    if child == 0:
        try:
            _child(spec)
        except BaseException as error:  # noqa: BLE001 (report, then leave)
            _proc.say(f"labkit grading: cannot start the rank: {error!r}")
        finally:
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
