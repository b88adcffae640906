"""The process steps the sandbox's root helpers share: dying with the parent, mounting, a fresh
tmpfs. Standard library only: imported by _nsinit.py and _rank_init.py (run as root with
`python -I`, before any student code, so they import nothing a student could have touched) and by
the rank zygote.
"""
import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4

libc = ctypes.CDLL(None, use_errno=True)


def check(result, what):
    """Raise OSError (with errno's text) when a libc call returned non-zero."""
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def die_with_parent(leave_if_orphan=False, parent_pidfd=None):
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG). The setting is cleared by a
    change of user, so a process that switches users calls this again afterwards.
    leave_if_orphan: exit at once if the parent already died before the call took effect.
    parent_pidfd: a pidfd of the parent, opened before the fork (closed here): exit at once if
    it has exited by now. That tells a fork whose parent died between fork and prctl where
    getppid() cannot: it reads 0 in a new PID namespace, and the subreaper's pid (not 1) under a
    subreaper."""
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if leave_if_orphan and os.getppid() == 1:
        os._exit(1)
    if parent_pidfd is not None:
        import select
        waiter = select.poll()
        waiter.register(parent_pidfd, select.POLLIN)
        gone = bool(waiter.poll(0))
        os.close(parent_pidfd)
        if gone:
            os._exit(1)


def say(line):
    """A line on stderr, from a process about to leave: a closed stderr is no reason to raise."""
    try:
        os.write(2, line.encode(errors="replace") + b"\n")
    except OSError:
        pass


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount {source} -> {target} ({fstype})")


def fresh_tmpfs(target, size_bytes):
    """An empty, world-writable (sticky) tmpfs of `size_bytes` at `target`: a private /tmp,
    /var/tmp or /dev/shm that nothing outside this mount namespace sees."""
    os.makedirs(target, exist_ok=True)
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={int(size_bytes)}")


def mask(target):
    """An empty, read-only tmpfs over the folder `target`: what it holds is not there for anything
    in this mount namespace (the grader's references inside the sandbox)."""
    if os.path.isdir(target):
        mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "mode=555,size=4k")


def join_cgroups(procs_files):
    """Move this process into each cgroup whose `cgroup.procs` file is listed."""
    for procs in procs_files:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))


def serve_connections(listener, handle, what):
    """A template's loop (grading/_rank_zygote.py, _kernel_template.py): reap the starters that
    ended, accept the next connection on `listener`, `handle(connection)` it, close it. One bad
    request is reported (`what` names it) and never stops the loop."""
    import select
    while True:
        while True:                                       # reap the ended starters
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        connection, _ = listener.accept()
        try:
            handle(connection)
        except Exception as error:  # noqa: BLE001 (one bad request must not stop the template)
            say(f"labkit grading: {what} failed: {error!r}")
        finally:
            connection.close()
