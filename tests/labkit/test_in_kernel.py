"""The launcher inside a real Jupyter kernel: cell functions by value, %%ranks, interrupts,
kernel restarts and 100 create/run/close cycles."""
import os
import re
import time

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

pytestmark = pytest.mark.timeout(240)


class Kernel:
    def __init__(self, output="text", **environ):
        """output: LABKIT_OUTPUT for the kernel ("text": labelled lines; "auto": the live view
        in a frontend, which a kernel driven by jupyter_client counts as). environ: more
        variables for the kernel (TMPDIR, say)."""
        env = {k: v for k, v in os.environ.items() if k != "NBGRADER_EXECUTION"}  # grading
        env["LABKIT_OUTPUT"] = output   # tests earlier in the session may leave it behind
        env.update(environ)
        self.manager, self.client = start_new_kernel(kernel_name="python3", env=env)
        self.displays = {}   # display_id -> latest text/plain

    def run(self, code, timeout=60):
        """Execute `code`; return (stdout, stderr, error text or None)."""
        out, err, error = [], [], None
        msg_id = self.client.execute(code)
        deadline = time.monotonic() + timeout
        while True:
            msg = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                (out if content["name"] == "stdout" else err).append(content["text"])
            elif kind == "error":
                error = content["ename"] + ": " + content["evalue"]
                self.last_traceback = "\n".join(content.get("traceback", []))
            elif kind in ("execute_result", "display_data"):
                out.append(content["data"].get("text/plain", "") + "\n")
                display_id = content.get("transient", {}).get("display_id")
                if display_id:
                    self.displays[display_id] = content["data"].get("text/plain", "")
            elif kind == "update_display_data":
                display_id = content["transient"]["display_id"]
                self.displays[display_id] = content["data"].get("text/plain", "")
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(out), "".join(err), error

    def rank_pids(self):
        """Rank processes: the children of the kernel's forkserver."""
        kernel = psutil.Process(self.manager.provisioner.process.pid)
        servers = [p for p in kernel.children() if "forkserver" in " ".join(p.cmdline())]
        return [c.pid for server in servers for c in server.children()]

    def stop(self):
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.fixture
def kernel():
    k = Kernel()
    yield k
    k.stop()


def test_cell_functions_run_by_value_and_errors_show_the_cell_line(kernel):
    out, _, error = kernel.run(
        "import labkit, torch, torch.distributed as dist\n"
        "world = labkit.world(2, timeout=20)\n"
        "def work(x):\n"
        "    print('hello from', dist.get_rank())\n"
        "    return x * (dist.get_rank() + 1)\n"
        "print(world.run(work, 21))\n")
    assert error is None, error
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert "[21, 42]" in out
    out, _, error = kernel.run("%%ranks\nprint('magic on', rank)\n")   # no %load_ext labkit here
    assert error is None and "[rank 1] magic on 1" in out, (error, out)
    _, _, error = kernel.run(
        "def broken():\n"
        "    value = 1\n"
        "    return value / (dist.get_rank() - 1)   # rank 1 divides by zero\n"
        "world.run(broken)\n")
    assert error.startswith("RankError: rank 1 raised ZeroDivisionError")
    assert "return value / (dist.get_rank() - 1)   # rank 1 divides by zero" in error
    shown = re.sub(r"\x1b\[[0-9;]*m", "", kernel.last_traceback)     # without colours
    assert "world.run(broken)" in shown                              # the cell's own line
    assert "launcher.py" not in shown and "raise RankError" not in shown, shown


def test_ranks_magic_keeps_a_namespace_per_rank(kernel):
    out, _, error = kernel.run("import labkit\n%load_ext labkit\nworld = labkit.world(2)\n")
    assert error is None, error
    out, _, error = kernel.run("%%ranks\nx = torch.full((2,), float(rank + 1))\n"
                               "dist.all_reduce(x)\nprint('sum', x.tolist())\n")
    assert error is None, error
    assert "[rank 0] sum [3.0, 3.0]" in out and "[rank 1] sum [3.0, 3.0]" in out
    out, _, error = kernel.run("%%ranks --ranks 1\nx * rank\n")
    assert error is None, error
    assert "[rank 1] Out: tensor([3., 3.])" in out and "[rank 0]" not in out
    _, _, error = kernel.run("%%ranks\nundefined_name + 1\n")
    assert "NameError" in error and "undefined_name + 1" in error


def test_interrupt_during_a_collective_ends_with_a_diagnosis_and_no_orphans(kernel):
    kernel.run("import labkit, time, torch, torch.distributed as dist\n"
               "world = labkit.world(2, timeout=120)\n"
               "def stuck():\n"
               "    if dist.get_rank() == 0:\n"
               "        dist.all_reduce(torch.ones(1))\n"
               "    else:\n"
               "        time.sleep(300)\n")
    old = kernel.rank_pids()
    msg_id = kernel.client.execute("world.run(stuck)")
    time.sleep(2.0)
    started = time.monotonic()
    kernel.manager.interrupt_kernel()
    error, idle = None, False
    while not idle:   # read to the end of the cell: a cell sent sooner would be aborted
        msg = kernel.client.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            error = msg["content"]["ename"] + ": " + msg["content"]["evalue"]
            ended = time.monotonic()
        idle = msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"
    assert ended - started < 10
    assert error.startswith("CallInterrupted")
    assert re.search(r"rank 1 never issued all_reduce #\d+", error)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in old)
    out, _, error = kernel.run("print(world.run(lambda: dist.get_rank()))")
    assert error is None and "[0, 1]" in out, (out, _, error)


def test_kernel_restart_leaves_no_rank_behind(kernel):
    kernel.run("import labkit\nworld = labkit.world(3)\n")
    pids = kernel.rank_pids()
    assert len(pids) >= 3
    kernel.manager.restart_kernel(now=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_a_kernel_asked_to_shut_down_closes_its_world_and_exits_by_itself(tmp_path):
    """A shutdown_request (what JupyterLab's "Shut Down Kernel" and nbclient's graceful shutdown
    send): the kernel closes its world, exits with status 0 well before jupyter_client would
    SIGTERM it (half of its 5-s shutdown_wait_time), runs its atexit handlers, and leaves neither
    a rank nor multiprocessing's temporary folder (pymp-*) in TMPDIR. Before labkit closed the
    world in the kernel's do_shutdown, ipykernel spent 14 s SIGTERMing the resource tracker
    (which ignores SIGTERM) and counting the dead forkserver, and the kernel was killed."""
    kernel = Kernel(TMPDIR=str(tmp_path))
    try:
        marker = tmp_path / "atexit-ran"
        _, _, error = kernel.run(
            "import atexit, labkit, torch.distributed as dist\n"
            f"atexit.register(lambda: open({str(marker)!r}, 'w').close())\n"
            "world = labkit.world(2, teaching=False)\n"
            "assert world.run(dist.get_rank) == [0, 1]\n")
        assert error is None, error
        ranks = kernel.rank_pids()
        assert len(ranks) == 2 and list(tmp_path.glob("pymp-*")), "the world made no forkserver"
        process = kernel.manager.provisioner.process
        started = time.monotonic()
        kernel.client.shutdown()
        code = process.wait(timeout=20)
        seconds = time.monotonic() - started
    finally:
        kernel.stop()
    assert code == 0, f"the kernel did not exit by itself: status {code} after {seconds:.1f} s"
    assert seconds < 2.5, f"the kernel took {seconds:.1f} s (jupyter_client SIGTERMs at 2.5 s)"
    assert marker.exists(), "the kernel's atexit handlers did not run"
    assert not list(tmp_path.glob("pymp-*")), "multiprocessing's folder was left in TMPDIR"
    assert not [p for p in ranks if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_a_hundred_cycles_leave_processes_fds_and_threads_where_they_were(kernel):
    code = (
        "import os, threading, psutil, labkit, torch.distributed as dist\n"
        "def counts():\n"
        "    me = psutil.Process()\n"
        "    return (len(me.children(recursive=True)), me.num_fds(), threading.active_count(),\n"
        "            me.num_threads())\n"
        "labkit.world(2, teaching=False).close()   # one-time: forkserver and store\n"
        "before = counts()\n"
        "for i in range(100):\n"
        "    w = labkit.world(2, teaching=False)\n"
        "    assert w.run(lambda: dist.get_rank()) == [0, 1]\n"
        "    w.close()\n"
        "print('before', before, 'after', counts())\n")
    out, _, error = kernel.run(code, timeout=200)
    assert error is None, error
    before, after = re.search(r"before (\(.*?\)) after (\(.*?\))", out).groups()
    assert before == after, out


def test_in_a_frontend_the_output_is_one_live_view_grouped_by_rank():
    kernel = Kernel(output="auto")
    try:
        _, _, error = kernel.run(
            "import labkit, torch.distributed as dist\n"
            "world = labkit.world(2)\n"
            "def talk():\n"
            "    for i in range(3):\n"
            "        print('step', i)\n"
            "world.run(talk)\n")
        assert error is None, error
        (final,) = kernel.displays.values()
        assert final.splitlines() == [f"[rank {r}] step {i}" for r in (0, 1) for i in range(3)]
    finally:
        kernel.stop()
