"""Holes of the grading sandbox (issue 33), each tried on real sandbox ranks: a syscall through the
32-bit and x32 ABIs, another rank's /proc, replies too large or never finished, a forged hang
diagnosis, a rank's exit reported late, descriptors of a request split across reads.

One sandbox (its kernel and its rank zygote) serves the whole module, twice: with its kernel forked
from the run's kernel template (grading/kernel_template.py, what `labkit grade` does) and started
the old way (unshare + _nsinit.py, the fallback); ~10 s to start each on 2 cores.
"""
import json
import os
import platform
import select
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from grading_helpers import needs_root_sandbox
from labkit.errors import CallTimeout, RankError
from labkit.grading import _rank_init, ranks
from labkit.grading.ranks import SandboxWorld, Zygote
from labkit.grading.kernel_template import KernelTemplate
from labkit.grading.sandbox import Limits, Sandbox
from labkit.runtime import diagnose

pytestmark = [needs_root_sandbox(), pytest.mark.timeout(180)]
x86_64 = pytest.mark.skipif(platform.machine() != "x86_64",
                            reason="the int 0x80 and x32 probes are x86_64 machine code")

# socket(AF_UNIX, SOCK_STREAM, 0) and getpid through three entries: the native `syscall`, the
# 32-bit `int 0x80` (i386 numbers: socket 359, getpid 20) and x32 (native numbers | 1 << 30).
# Machine code in an executable page, called through ctypes: nothing but the kernel in between.
PROBE = r"""
import ctypes, mmap, os
def _stub(code):
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    kind = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                            ctypes.c_long)
    return page, kind(address)
# nr, a, b, c -> eax, ebx, ecx, edx; int 0x80; sign-extend eax
_int80_page, int80 = _stub(bytes([0x53, 0x89, 0xF8, 0x89, 0xF3, 0x49, 0x89, 0xC9, 0x89, 0xD1,
                                  0x44, 0x89, 0xCA, 0xCD, 0x80, 0x5B, 0x48, 0x63, 0xC0, 0xC3]))
# nr, a, b, c -> rax, rdi, rsi, rdx; syscall
_syscall_page, syscall = _stub(bytes([0x48, 0x89, 0xF8, 0x48, 0x89, 0xF7, 0x48, 0x89, 0xD6,
                                      0x48, 0x89, 0xCA, 0x0F, 0x05, 0xC3]))
def _closing(result):
    if result >= 0:
        os.close(result)
    return result
probe = {"native_unix": _closing(syscall(41, 1, 1, 0)),
         "native_inet": _closing(syscall(41, 2, 1, 0)),
         "int80_unix": _closing(int80(359, 1, 1, 0)),
         "int80_getpid": int80(20, 0, 0, 0),
         "x32_unix": _closing(syscall(0x40000000 | 41, 1, 1, 0))}
probe
"""
EPERM, ENOSYS = 1, 38


def _probe_here(seccomp):
    """The probe in a fresh child of this process, with or without the rank's seccomp filter."""
    code = PROBE.replace("\nprobe\n", "\nprint(json.dumps(probe))\n")
    if seccomp:
        code = "from labkit.grading import _rank_init\n_rank_init.forbid_unix_sockets()\n" + code
    out = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def template():
    """The run's rank starter template, as `labkit grade` starts it: every hole below is probed
    through a starter forked from it (the path every graded rank takes)."""
    with ranks.RankStarterTemplate() as started:
        yield started


@pytest.fixture(scope="module")
def kernel_template():
    """The run's kernel template (grading/kernel_template.py), as `labkit grade` starts it."""
    with KernelTemplate() as started:
        yield started


@pytest.fixture(scope="module", params=["forked kernel", "unshare kernel"])
def box(request, tmp_path_factory, template, kernel_template):
    """The sandbox every probe below runs in, once with its kernel forked from the run's kernel
    template (the path `labkit grade` takes) and once started the old way (its fallback)."""
    forked = request.param == "forked kernel"
    limits = Limits(kernel_template=kernel_template.path if forked else None)
    sandbox = Sandbox(str(tmp_path_factory.mktemp("holes") / "run"), limits=limits)
    sandbox.start()
    assert sandbox.forked == forked, sandbox._log_tail()
    zygote = Zygote(sandbox, sandbox.private_dir(), template=template.path)
    assert zygote.forked, zygote.log_tail()
    yield sandbox, zygote
    zygote.close()
    sandbox.close()


def test_a_starter_of_its_own_when_the_template_cannot_answer(tmp_path):
    """No template at the path given: the sandbox's starter is an interpreter of its own (the
    log says why), and its ranks run."""
    sandbox = Sandbox(str(tmp_path / "run"))
    sandbox.start()
    try:
        zygote = Zygote(sandbox, sandbox.private_dir(), template=str(tmp_path / "no-template"))
        try:
            assert not zygote.forked and "template did not answer" in zygote.log_tail()
            w = SandboxWorld(2, sandbox, timeout=30, zygote=zygote)
            try:
                assert w.run(lambda: dist.get_rank() + 10) == [10, 11]
            finally:
                w.close()
        finally:
            zygote.close()
    finally:
        sandbox.close()


def test_the_template_is_out_of_reach_of_other_users(template):
    """Its socket's folder is the grader's alone: a process of another uid cannot connect (and
    the template would refuse it by SO_PEERCRED if it could)."""
    assert os.stat(template.folder).st_mode & 0o777 == 0o700
    code = ("import os, socket, sys\nos.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(sys.argv[1])\n"
            "except PermissionError:\n    print('refused')\nelse:\n    print('connected')\n")
    out = subprocess.run([sys.executable, "-c", code, template.path], capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "refused", (out.stdout, out.stderr)


@pytest.fixture
def world(box):
    sandbox, zygote = box
    w = SandboxWorld(2, sandbox, timeout=30, zygote=zygote)
    yield w
    w.close()


@x86_64
def test_probe_reaches_the_kernel_without_the_filter():
    """Without the filter the probe's calls are real: the i386 socket() opens a unix socket."""
    probe = _probe_here(seccomp=False)
    assert probe["native_unix"] >= 0 and probe["int80_unix"] >= 0, probe
    assert probe["int80_getpid"] > 0, probe
    # x32: a socket where the kernel has the ABI, ENOSYS where it does not (this machine may not)
    assert probe["x32_unix"] >= 0 or probe["x32_unix"] == -ENOSYS, probe


@x86_64
def test_filter_refuses_every_foreign_abi():
    probe = _probe_here(seccomp=True)
    assert probe["native_unix"] == -EPERM, probe
    assert probe["native_inet"] >= 0, probe                  # the counted network stays open
    assert probe["int80_unix"] == -EPERM, probe               # i386 socket(): refused
    assert probe["int80_getpid"] == -EPERM, probe             # ... and every i386 call
    assert probe["x32_unix"] == -EPERM, probe                 # x32: the filter, not ENOSYS


@x86_64
def test_sandbox_ranks_cannot_open_unix_sockets_through_any_abi(world):
    for rank, probe in enumerate(world.run_source(PROBE)):
        assert probe["native_unix"] == -EPERM, (rank, probe)
        assert probe["int80_unix"] == -EPERM, (rank, probe)
        assert probe["int80_getpid"] == -EPERM, (rank, probe)
        assert probe["x32_unix"] == -EPERM, (rank, probe)
        assert probe["native_inet"] >= 0, (rank, probe)


def test_seccomp_program_denies_foreign_arch_first():
    program = _rank_init.seccomp_program("x86_64")
    assert program[:3] == [(0x20, 0, 0, 4), (0x15, 1, 0, 0xC000003E),
                           (0x06, 0, 0, _rank_init.SECCOMP_DENY)]
    with pytest.raises(OSError, match="no seccomp rule"):
        _rank_init.seccomp_program("sparc")


def test_the_graders_references_are_not_in_the_sandbox(box, world):
    """labkit.grading.references computes graded answers (lab 6's search, lab 8's simulator...):
    the student copy has no such package, and student code under labkit grade must not find it
    either, on a rank or (the same root) in the kernel."""
    from labkit.grading.sandbox import hidden_paths
    [references] = hidden_paths()
    assert os.path.isfile(os.path.join(references, "mesh.py"))          # here, on the host
    source = ("import os, importlib\n"
              f"listing = os.listdir({references!r})\n"
              "try:\n    importlib.import_module('labkit.grading.references.mesh')\n"
              "    imported = True\n"
              "except ImportError:\n    imported = False\n"
              "(listing, imported)")
    for rank, (listing, imported) in enumerate(world.run_source(source)):
        assert listing == [] and not imported, (rank, listing, imported)
    sandbox, _ = box
    result = sandbox.execute(source.replace("\n(listing, imported)", "\nprint(listing, imported)"),
                             timeout=60)
    assert result.status == "ok" and result.outputs[0]["text"] == "[] False\n", result.outputs


def test_the_kernel_cannot_see_the_ranks_processes(box, world):
    """hidepid=2 holds for the kernel too, whichever way it was started: it lists only its own
    user's processes (not process 1, not the ranks)."""
    sandbox, _ = box
    pids = world.run_source("import os\nos.getpid()")
    result = sandbox.execute("import os\nprint(sorted(int(p) for p in os.listdir('/proc') "
                             "if p.isdigit()))", timeout=60)
    visible = eval(result.outputs[0]["text"])  # noqa: S307 (a list of ints we printed)
    assert 2 in visible and 1 not in visible and not set(pids) & set(visible), (pids, visible)


def test_a_rank_cannot_see_another_ranks_processes(world):
    pids = world.run_source("import os\nos.getpid()")
    source = (f"import os\nvisible = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
              f"try:\n    open('/proc/{pids[1]}/cmdline', 'rb').read()\n    seen = True\n"
              f"except OSError:\n    seen = False\n(visible, seen)")
    (visible, seen), = world.run_source(source, ranks=[0])
    assert not seen, "rank 0 read rank 1's /proc/<pid>/cmdline"
    assert pids[1] not in visible and pids[0] in visible, (pids, visible)
    assert 1 not in visible, "rank 0 sees the sandbox's process 1 (root)"


class _SmallReplies(SandboxWorld):
    MAX_REPLY_BYTES = 1 << 20
    MAX_HEADER_BYTES = 1 << 20


@pytest.fixture
def small_world(box):
    sandbox, zygote = box
    w = _SmallReplies(2, sandbox, timeout=30, zygote=zygote)
    yield w
    w.close()


def _survives(world):
    assert world.run_source("rank * 10") == [0, 10], "the world did not come back after a refusal"


def test_an_oversized_result_fails_the_call_and_the_grader_goes_on(small_world):
    with pytest.raises(RankError, match=r"rank 1 .*over the grader's limit of 1048576 bytes"):
        small_world.run_source("torch.zeros(1 << 18 if rank == 1 else 1, dtype=torch.float64)")
    _survives(small_world)


def test_an_oversized_forged_header_fails_the_call(small_world):
    source = ("import labkit.runtime.worker as w\n"
              "if rank == 0:\n    w.STATE.commands.send_bytes(b'x' * (2 << 20))\nrank")
    with pytest.raises(RankError, match=r"rank 0 .*sent a message of 2097152 bytes"):
        small_world.run_source(source)
    _survives(small_world)


def test_a_reply_that_never_finishes_fails_the_call(small_world, monkeypatch):
    monkeypatch.setattr(ranks, "FRAME_SECONDS", 1.0)
    source = ("import os, struct, time, labkit.runtime.worker as w\n"
              "if rank == 1:\n"
              "    os.write(w.STATE.commands.fileno(), struct.pack('!i', 100) + b'{\"kind\"')\n"
              "    time.sleep(30)\nrank")
    started = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 .*did not finish it within 1 s"):
        small_world.run_source(source)
    assert time.monotonic() - started < 15
    _survives(small_world)


def test_a_forged_snapshot_helper_is_no_diagnosis_and_the_ranks_are_stopped(world):
    world.run_source("import labkit.runtime.hooks as h\nh.snapshot = lambda: {'forged': 1}",
                     ranks=[1])
    old = [r.process for r in world._ranks]
    with pytest.raises(CallTimeout) as caught:
        world.run_source("import time\ntime.sleep(60)", timeout=3)
    assert "rank 1: no diagnosis" in str(caught.value), str(caught.value)
    assert "rank 0: not in a collective" in str(caught.value), str(caught.value)
    assert not any(p.sentinel is not None and p.is_alive() for p in old), "hung ranks survived"
    assert world._broken, "the world was not marked to restart"
    _survives(world)


@pytest.mark.parametrize("answer", [
    b"not json", b"[1, 2]", b'{"now": 1}',
    json.dumps({"now": "1", "stack": "", "current": [], "recent": [],
                "collective_counts": {}}).encode(),
    json.dumps({"now": 1.0, "stack": "", "current": [{"op": "x"}], "recent": [],
                "collective_counts": {}}).encode()])
def test_report_reads_a_forged_answer_as_no_diagnosis(answer):
    assert diagnose.parse(answer) is None
    text = diagnose.report({0: answer, 1: None})
    assert "rank 0: no diagnosis" in text and "rank 1: did not answer" in text


def _dead_rank(zygote, sandbox, fds):
    """Ask the zygote for a rank whose settings are empty: it exits (111) right after setup."""
    uid = ranks.rank_uid(sandbox.slot, sandbox.ranks_started)
    sandbox.ranks_started += 1
    return zygote.spawn(0, uid, {}, {}, fds)


def test_the_zygote_reports_a_rank_exit_at_once(box):
    sandbox, zygote = box
    delays = []
    for _ in range(3):
        pipes = [os.pipe() for _ in range(4)]
        pid, pidfd = _dead_rank(zygote, sandbox, [w for _, w in pipes])
        assert select.select([pidfd], [], [], 30)[0], "the rank did not exit"
        for r, w in pipes:
            os.close(r)
            os.close(w)
        ended = time.monotonic()
        while pid not in zygote.exits and time.monotonic() - ended < 5:
            zygote._lines(0.01)
        delays.append(time.monotonic() - ended)
        os.close(pidfd)
        assert os.waitstatus_to_exitcode(zygote.exits[pid]) == 111
    assert max(delays) < 0.3, f"exits reported after {delays} s"


def test_a_request_split_across_reads_keeps_its_descriptors(box):
    sandbox, zygote = box
    pipes = [os.pipe() for _ in range(4)]
    uid = ranks.rank_uid(sandbox.slot, sandbox.ranks_started)
    sandbox.ranks_started += 1
    line = json.dumps({"rank": 0, "uid": uid, "settings": {}, "env": {}, "nfds": 4}).encode()
    socket.send_fds(zygote.sock, [line[:10]], [w for _, w in pipes])
    time.sleep(0.3)                          # the zygote reads the first part alone
    zygote.sock.sendall(line[10:] + b"\n")
    reply = zygote._expect("pid", 30)
    os.close(reply["pidfd"])
    for _, w in pipes:
        os.close(w)
    for r, _ in pipes:      # EOF: every copy of the write end closed (the rank got them, ended)
        deadline = time.monotonic() + 10
        while select.select([r], [], [], max(0.0, deadline - time.monotonic()))[0]:
            if not os.read(r, 1 << 16):
                break                                            # EOF
        else:
            pytest.fail("a descriptor of the request stayed open in the zygote")
        os.close(r)


def test_a_cell_keeps_a_bounded_number_of_outputs():
    from labkit.grading import sandbox
    outputs = sandbox._CellOutputs()
    for i in range(10_000):                   # stdout and stderr in turn: a new output each time
        sandbox._append_stream(outputs, i % 2 == 1, "x" * 100)
    assert len(outputs) == sandbox._MAX_CELL_OUTPUTS
    assert "9801 more outputs of this cell dropped" in outputs[-1]["text"], outputs[-1]
