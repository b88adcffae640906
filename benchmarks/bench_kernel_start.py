"""A sandbox kernel's start, two ways side by side in one run (root, Linux):

    .venv/bin/python benchmarks/bench_kernel_start.py [--rounds 5] [--grade 4]

Each round starts one sandbox each way, in alternating order: (a) the old way, `unshare ...
python -I _nsinit.py` and then `python -m ipykernel_launcher` (a fresh interpreter importing
ipykernel, zmq, tornado, IPython), and (b) forked from the run's kernel template
(grading/kernel_template.py: those and torch and labkit imported once per `labkit grade` run).
Printed per way: seconds until the kernel answers (Sandbox.start), seconds of the setup cell
`import torch, labkit` in it, their sum, and CPU seconds the kernel's process used by then (user +
system, from /proc); medians over the rounds with min and max. The load average is printed at the
start and at the end (2 cores shared: a figure under load is longer, not wrong). The template's
own start (once per run) is printed once; the first forked kernel waits for its imports, so
round 0 is left out of the medians for both ways (the other rounds alternate the order).

--grade N: then the same through `labkit grade` (the Python API, --jobs 1): the fixture lab of
tests/grading with N solved submissions, graded once with the run's kernel template and once
with its path pointing nowhere (every kernel the old way, the reason in its log), in alternating
order; printed: the run's wall seconds, per submission, and the scores (equal, or it says so).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "utils"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "grading"))

from labkit.grading.kernel_template import KernelTemplate  # noqa: E402
from labkit.grading.sandbox import Limits, Sandbox, can_isolate  # noqa: E402

SETUP = "import torch, labkit"


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _kernel_pid(box) -> int:
    first = box.namespace_pid()
    with open(f"/proc/{first}/task/{first}/children") as f:
        return int(f.read().split()[0])


def one(folder, template_path):
    box = Sandbox(folder, limits=Limits(kernel_template=template_path))
    try:
        started = time.perf_counter()
        box.start()
        ready = time.perf_counter() - started
        assert box.forked == (template_path is not None), box._log_tail()
        since = time.perf_counter()
        result = box.execute(SETUP, timeout=120)
        setup = time.perf_counter() - since
        assert result.status == "ok", (result.outputs, result.error)
        return ready, setup, ready + setup, _cpu_seconds(_kernel_pid(box))
    finally:
        box.close()


class _Nowhere:
    """A stand-in for KernelTemplate whose path no template listens on: the old way, each time."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="labkit-no-kernels-")
        self.path = os.path.join(self.folder, "nobody")

    def __enter__(self):
        return self

    def __exit__(self, *_):
        os.rmdir(self.folder)


def grade_runs(n):
    """Wall seconds of `labkit grade` over n solved fixture submissions, both ways."""
    import shutil
    import warnings
    warnings.filterwarnings("ignore", module="nbgrader")      # its SQLAlchemy session notes
    from grading_helpers import FIXTURES, LAB, make_submission
    from labkit.grading import grade, kernel_template
    real = kernel_template.KernelTemplate
    seconds, scores = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        course = os.path.join(folder, "course")
        shutil.copytree(os.path.join(FIXTURES, "solutions"), os.path.join(course, "solutions"))
        for i in range(n):
            make_submission(course, os.path.join(folder, "subs"), f"student{i}")
        for order, (name, kind) in enumerate([("forked from the template", real),
                                              ("unshare + ipykernel_launcher", _Nowhere),
                                              ("forked from the template ", real),
                                              ("unshare + ipykernel_launcher ", _Nowhere)]):
            kernel_template.KernelTemplate = kind
            try:
                since = time.perf_counter()
                report = grade(LAB, os.path.join(folder, "subs"), jobs=1,
                               out=os.path.join(folder, f"out{order}"), course=course,
                               log=lambda line: None)
                seconds.setdefault(name.strip(), []).append(time.perf_counter() - since)
                scores.setdefault(name.strip(), []).append(report.scores)
            finally:
                kernel_template.KernelTemplate = real
    print(f"\nlabkit grade, {n} solved submissions of the fixture lab, --jobs 1 (two runs each):")
    for name, runs in seconds.items():
        print(f"{name:<30} {' '.join(f'{r:7.1f}' for r in runs)} s   "
              f"{statistics.mean(runs) / n:6.2f} s/submission")
    same = all(s == scores[next(iter(scores))][0] for runs in scores.values() for s in runs)
    print("scores: " + ("the same every run" if same else f"DIFFERENT: {scores}"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--grade", type=int, default=0, metavar="N")
    args = parser.parse_args()
    isolated, why = can_isolate()
    if not isolated:
        print(f"bench_kernel_start: needs the namespace sandbox ({why})")
        return 2
    print(f"load average at start: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    names = {None: "unshare + ipykernel_launcher", "template": "forked from the template"}
    figures = {name: [] for name in names.values()}
    since = time.perf_counter()
    with KernelTemplate() as template, tempfile.TemporaryDirectory() as folder:
        print(f"template process started in {time.perf_counter() - since:.2f} s "
              "(it imports ipykernel, torch and labkit in the background; once per run)")
        for round_ in range(args.rounds + 1):
            ways = [None, template.path] if round_ % 2 else [template.path, None]
            for path in ways:
                row = one(os.path.join(folder, f"r{round_}-{bool(path)}", "s"), path)
                if round_ == 0:
                    if path:
                        print(f"first forked kernel (waits for the template's imports): "
                              f"ready {row[0]:.2f} s, setup {row[1]:.2f} s")
                    continue
                figures[names["template" if path else None]].append(row)
    columns = ["ready s", "setup cell s", "ready + setup s", "kernel CPU s"]
    print(f"\n{'kernel':<30}" + "".join(f"{c:>24}" for c in columns))
    for name, rows in figures.items():
        cells = []
        for column in zip(*rows):
            cells.append(f"{statistics.median(column):.2f} [{min(column):.2f}-{max(column):.2f}]")
        print(f"{name:<30}" + "".join(f"{c:>24}" for c in cells))
    old, new = (statistics.median(r[2] for r in rows) for rows in figures.values())
    print(f"\nready + setup: {old:.2f} s -> {new:.2f} s, {old - new:.2f} s saved per kernel "
          f"({old / new:.1f}x; medians of {args.rounds} rounds, [min-max]); "
          f"load average now {os.getloadavg()[0]:.1f}")
    if args.grade:
        grade_runs(args.grade)
        print(f"load average now {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
