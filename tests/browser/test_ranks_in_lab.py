"""Scenarios 2-4 of the student's JupyterLab flow: `%%ranks` typed into a new cell, a deadlocked
cell diagnosed within its timeout, and the stop button during a long distributed call.

    .venv/bin/pytest tests/browser/test_ranks_in_lab.py -v

Each works on a small scratch notebook (written by the test), so it does not depend on the course's
chapters; scenarios 1 and 5 (test_chapter0.py) open the real chapter 0 files.
"""
import re
import time

import psutil
import pytest

from notebook_page import error_outputs

pytestmark = [pytest.mark.browser, pytest.mark.timeout(90)]

WORLD_SIZE = 2          # each rank imports torch: small worlds keep the suite under two minutes


def setup_cell(world_size: int = WORLD_SIZE) -> str:
    # The kernel does not import torch (labkit does not need it there, and it costs seconds of
    # CPU); code that runs on the ranks imports it there.
    return ("import labkit\n"
            f"world = labkit.world({world_size})\n"
            "%load_ext labkit")


def test_ranks_cell_typed_into_a_new_cell(nb, shot, scratch_notebook):
    """Scenario 2: a student types a %%ranks cell below the setup cell and runs it."""
    nb.open(scratch_notebook("ranks_typed", [setup_cell()]))
    nb.run_cell(0)
    nb.wait_executed(60, cells=[0])
    assert nb.errors() == [], f"the setup cell failed: {nb.errors()}"

    cell = nb.add_cell_and_run('%%ranks\nprint(f"hello from rank {rank} of {world_size}")')
    text = nb.text(cell)
    shot("output", nb.code_cell(cell))
    assert error_outputs(nb.outputs(cell)) == []
    expected = {r: [f"hello from rank {r} of {WORLD_SIZE}"] for r in range(WORLD_SIZE)}
    assert nb.rank_lines(cell) == expected, (
        f"expected one labelled line per rank, the cell shows:\n{text}")


def test_deadlock_is_diagnosed_within_the_timeout(nb, shot, note, scratch_notebook):
    """Scenario 3: in a world of 3, rank 1 skips an all_reduce that ranks 0 and 2 wait in; the
    cell's timeout is 3 s."""
    timeout_s, world_size = 3, 3
    deadlock = (f"%%ranks --timeout {timeout_s}\n"
                "x = torch.ones(1)\n"
                "if rank != 1:\n"
                "    dist.all_reduce(x)   # rank 1 skips it\n")
    after = "%%ranks\nprint('next cell on rank', rank)"
    nb.open(scratch_notebook("deadlock", [setup_cell(world_size), deadlock, after]))
    nb.run_cell(0)
    nb.wait_executed(60, cells=[0])

    nb.run_cell(1)
    nb.wait_running(1)
    started = time.monotonic()
    nb.wait_executed(timeout_s + 20, cells=[1])
    elapsed = time.monotonic() - started
    text = nb.text(1)
    shot("diagnosis", nb.code_cell(1), end=True)
    note(f"diagnosis shown {elapsed:.1f} s after the cell started (timeout {timeout_s} s)")
    assert elapsed < timeout_s + 8, f"diagnosed after {elapsed:.1f} s, for a {timeout_s} s timeout"
    assert "CallTimeout" in text, f"expected a CallTimeout in the cell, it shows:\n{text}"
    # the diagnosis ends with its verdict lines, "=> rank 1 never issued all_reduce #1 on ..."
    verdicts = [line for line in text.splitlines() if line.startswith("=>")]
    assert verdicts, f"the diagnosis has no verdict (a line starting with '=>'):\n{text}"
    named = set(re.findall(r"\branks? (\d+) never", verdicts[0]))
    assert named == {"1"}, (
        f"the verdict should name rank 1 (and only rank 1) as missing: {verdicts[0]!r}")

    nb.run_cell(2)
    nb.wait_executed(60, cells=[2])
    shot("next-cell", nb.code_cell(2))
    assert error_outputs(nb.outputs(2)) == [], f"the next cell failed:\n{nb.text(2)}"
    assert nb.rank_lines(2) == {r: [f"next cell on rank {r}"] for r in range(world_size)}


def rank_processes(nb) -> list[psutil.Process]:
    """The kernel's descendants except multiprocessing's helpers (its forkserver, from which the
    ranks are forked with the same command line, and its resource tracker): the rank processes."""
    kernel = nb.server.kernel_process(nb.kernel_id())
    helpers = [p for p in kernel.children() if re.search(
        r"multiprocessing\.(forkserver|resource_tracker) import", " ".join(p.cmdline()))]
    return [p for p in kernel.children(recursive=True) if p not in helpers]


def test_stop_button_ends_a_long_call(nb, shot, note, scratch_notebook):
    """Scenario 4: the stop button during a 60 s loop of all_reduces ends it within seconds, with
    the diagnosis, and leaves no rank process."""
    long_call = ("def long_step(seconds):\n"
                 "    import time\n"
                 "    import torch\n"
                 "    import torch.distributed as dist\n"
                 "    x = torch.ones(1)\n"
                 "    for _ in range(int(seconds * 10)):\n"
                 "        dist.all_reduce(x)\n"
                 "        time.sleep(0.1)\n"
                 "    return x.item()\n"
                 "\n"
                 "world.run(long_step, 60)")
    nb.open(scratch_notebook("interrupt", [setup_cell(), long_call]))
    nb.run_cell(0)
    nb.wait_executed(60, cells=[0])
    ranks_before = rank_processes(nb)

    nb.run_cell(1)
    nb.wait_running(1)
    time.sleep(1.0)                                   # inside the call (60 s long)
    ranks_during = rank_processes(nb)
    assert len(ranks_during) == WORLD_SIZE, f"expected {WORLD_SIZE} rank processes: {ranks_during}"
    nb.interrupt()
    pressed = time.monotonic()
    nb.wait_executed(20, cells=[1])
    elapsed = time.monotonic() - pressed
    text = nb.text(1)
    shot("diagnosis", nb.code_cell(1), end=True)
    note(f"the call ended {elapsed:.1f} s after the stop button")
    assert elapsed < 5, f"the call took {elapsed:.1f} s to end after the stop button"
    assert "CallInterrupted" in text, f"expected labkit's CallInterrupted, the cell shows:\n{text}"
    assert all(re.search(rf"^rank {r}: ", text, flags=re.M) for r in range(WORLD_SIZE)), (
        f"no per-rank diagnosis (where each rank was) in the cell:\n{text}")
    assert re.search(r"all_reduce #\d+ on ranks", text), (   # the diagnosis' words, not the source's
        f"the diagnosis does not name the all_reduces the ranks were in:\n{text}")

    deadline = time.monotonic() + 3.0                 # allow the kernel to reap them
    left = nb.server.alive(ranks_before + ranks_during)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = nb.server.alive(left)
    assert left == [], "rank processes still running after the stop button: " + "; ".join(
        f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left)
