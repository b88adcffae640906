"""A rank's private /tmp keeps the read-only install visible where it lives below /tmp (a course
cloned into /tmp: its .venv and labkit sit there, and a fresh /tmp over them hid them from every
graded rank: `git clone . /tmp/x && make test` graded the attack fixture wrong)."""
import ctypes
import os
import tempfile

import pytest

from grading_helpers import needs_root_sandbox
from labkit.grading import _rank_init

pytestmark = [needs_root_sandbox(), pytest.mark.timeout(60)]


def _in_child(check):
    """Runs check() in a forked child with a mount namespace of its own; its exit code back."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            if ctypes.CDLL(None, use_errno=True).unshare(_rank_init.CLONE_NEWNS) != 0:
                os._exit(98)
            code = check()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_private_tmp_keeps_the_install_below_tmp_read_only():
    with tempfile.TemporaryDirectory(dir="/tmp") as install, \
            tempfile.NamedTemporaryFile(dir="/tmp") as other, \
            tempfile.TemporaryDirectory(dir="/dev/shm") as root:   # the sandbox's root stands in
        with open(os.path.join(install, "module.py"), "w") as f:
            f.write("x = 1\n")

        def check():
            _rank_init.private_dirs({"root": root, "tmp_bytes": 1 << 20, "read_only": [install]})
            if os.path.exists(root + other.name) or os.listdir(root + "/var/tmp"):
                return 1                                  # not a fresh /tmp
            with open(root + install + "/module.py") as f:
                if f.read() != "x = 1\n":
                    return 2                              # the install is gone
            try:
                open(root + install + "/new.py", "w").close()
                return 3                                  # the install is writable
            except OSError:
                pass
            open(root + "/tmp/mine", "w").close()         # the private /tmp itself is writable
            return 0

        assert _in_child(check) == 0
        assert not os.path.exists(root + "/tmp/mine"), "the private /tmp outlived its namespace"
