"""Process 1 of a grading sandbox: builds its private file view, then runs the kernel unprivileged.

Started by `sandbox.py` as root, already inside new mount, network, PID, IPC and UTS namespaces:

    unshare --mount --net --pid --ipc --uts --fork --kill-child -- python -I _nsinit.py SPEC.json

Standalone on purpose (standard library only, no labkit import): it runs as root, before any
student code, and must not depend on anything a student could have touched.

What it does, in order:
  1. makes every mount private (nothing below leaks to the host), joins the sandbox's cgroups,
     brings the loopback interface up (ranks rendezvous over 127.0.0.1; nothing else is reachable);
  2. builds a new root on a tmpfs: the system directories and the Python install read-only, a
     fresh /tmp, /dev/shm and /proc (hidepid=2: each user sees only its own processes), the
     submission's working folder read-write; nothing else
     (no course repository, no gradebook, no other submission, no home directory);
  3. forks; the child chroots there, drops to the sandbox user (no groups, no capabilities,
     no_new_privs), sets resource limits and execs the kernel; this process stays root, reaps
     orphans and exits with the kernel, which ends the PID namespace and every process in it.

The kernel template (grading/_kernel_template.py) runs the same steps through `prepare`,
`start_kernel`, `become_kernel_user` and `reap_until`, and starts the kernel in its fork instead
of execve.
"""
import ctypes
import fcntl
import json
import os
import resource
import socket
import struct
import sys

if __package__:                 # imported by the kernel template (grading/_kernel_template.py)
    from labkit.grading import _proc
else:                           # python -I _nsinit.py: only this folder
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _proc  # noqa: E402  (standard library only, like this file)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
SYSTEM_DIRS = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"]
DEVICES = ["null", "zero", "full", "random", "urandom"]

_libc = _proc.libc
_mount = _proc.mount


def _bind(source, target, read_only):
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (MS_RDONLY if read_only else 0)
    _mount(None, target, None, flags)


def _loopback_up():
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = fcntl.ioctl(s, siocgifflags, struct.pack("16sH14s", b"lo", 0, b"\0" * 14))
        flags = struct.unpack("16sH14s", ifr)[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14s", b"lo", flags | iff_up, b"\0" * 14))


def build_root(spec):
    root = spec["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=16m")
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            _bind(path, root + path, read_only=True)
    # private /tmp and /var/tmp first: the read-only binds below may live under /tmp (a course
    # cloned into /tmp) and must land inside these mounts, not be hidden by them
    for tmp in ["/tmp", "/var/tmp"]:
        _proc.fresh_tmpfs(root + tmp, spec["tmp_bytes"])
    for path in spec["read_only"]:      # the Python install, the labkit package
        if os.path.exists(path) and not os.path.exists(root + path):
            _bind(path, root + path, read_only=True)
    for path in spec.get("hidden", []):  # the grader's references: an empty folder here
        _proc.mask(root + path)
    # /dev: a few harmless devices, a private /dev/shm
    os.makedirs(root + "/dev", exist_ok=True)
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for name in DEVICES:
        _bind("/dev/" + name, f"{root}/dev/{name}", read_only=False)
    for name, target in [("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")]:
        os.symlink(target, f"{root}/dev/{name}")
    _proc.fresh_tmpfs(root + "/dev/shm", spec["tmp_bytes"])
    # hidepid=2: a process sees only its own user's /proc/<pid> (a rank cannot read another
    # rank's cmdline, environment or status, nor the kernel's)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    if os.path.isdir("/sys"):
        _bind("/sys", root + "/sys", read_only=True)
    _bind(spec["workdir"], root + spec["workdir"], read_only=False)


def become_kernel_user(spec):
    """In the kernel's process: into the new root, as the sandbox user (no groups, no
    capabilities, no_new_privs), with the sandbox's resource limits and umask."""
    root = spec["root"]
    os.chroot(root)
    os.chdir(spec["workdir"])
    os.setgroups([])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    for name, value in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    os.umask(0o077)


def run_kernel(spec):
    become_kernel_user(spec)
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def prepare(spec):
    """Process 1's steps before the kernel's fork: cgroups, loopback, hostname, the new root."""
    _proc.join_cgroups(spec["cgroups"])      # our children inherit the cgroups
    if spec["loopback"]:
        _loopback_up()
        socket.sethostname("localhost")     # own UTS namespace; resolvable, so gloo stays quiet
    build_root(spec)


def start_kernel(spec, run):
    """Fork the kernel's process, which calls `run(spec)` (it never returns into this one)."""
    child = os.fork()
    if child == 0:
        try:
            run(spec)
        except BaseException as error:        # noqa: BLE001 (report anything, then leave)
            _proc.say(f"labkit sandbox: cannot start the kernel: {error!r}")
        finally:
            os._exit(111)
    return child


def reap_until(child):
    """PID 1: reap orphans until the kernel exits, then exit with its status."""
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        if pid == child:
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    prepare(spec)
    reap_until(start_kernel(spec, run_kernel))


if __name__ == "__main__":
    main()
