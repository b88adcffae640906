"""The grading sandbox's rank starter, two ways side by side in one run (root, Linux):

    .venv/bin/python benchmarks/bench_rank_starter.py [--rounds 3]

Each round starts one sandbox and, in it, (a) a rank starter that is an interpreter of its own
(`python -I _rank_zygote.py`: imports torch in the sandbox) and (b) one forked from the run's
template (grading/ranks.py's RankStarterTemplate: torch imported once per `labkit grade` run),
in alternating order. Printed per way: seconds until the starter is ready, CPU seconds it used
(user + system, from /proc), and seconds until a 2-rank world it starts has answered one call.
The template's own start (one per run) is printed once.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "utils"))

from labkit.grading import ranks  # noqa: E402
from labkit.grading.sandbox import Sandbox, can_isolate  # noqa: E402


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rank_sum():
    import torch
    import torch.distributed as dist
    t = torch.ones(4)
    dist.all_reduce(t)
    return float(t[0])


def one(box, template):
    started = time.perf_counter()
    zygote = ranks.Zygote(box, box.private_dir(), template=template)
    ready = time.perf_counter() - started
    cpu = _cpu_seconds(zygote.pid if zygote.forked else zygote.popen.pid)
    world = ranks.SandboxWorld(2, box, timeout=60, zygote=zygote)
    try:
        assert world.run(_rank_sum) == [2.0, 2.0]
        answered = time.perf_counter() - started
    finally:
        world.close()
        zygote.close()
    return ready, cpu, answered


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    isolated, why = can_isolate()
    if not isolated:
        print(f"bench_rank_starter: needs the namespace sandbox ({why})")
        return 2
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    figures = {"own interpreter": [], "forked from the template": []}
    since = time.perf_counter()
    with ranks.RankStarterTemplate() as template, tempfile.TemporaryDirectory() as folder:
        print(f"template process started in {time.perf_counter() - since:.2f} s "
              "(it imports torch in the background; once per labkit grade run)")
        for round_ in range(args.rounds):
            box = Sandbox(os.path.join(folder, f"run{round_}"))
            box.start()
            try:
                ways = [("own interpreter", None), ("forked from the template", template.path)]
                for name, path in (ways if round_ % 2 == 0 else ways[::-1]):
                    figures[name].append(one(box, path))
            finally:
                box.close()
    print(f"{'rank starter':<26} {'ready s':>8} {'CPU s':>7} {'world answered s':>17}")
    for name, rows in figures.items():
        ready, cpu, answered = (statistics.median(column) for column in zip(*rows))
        print(f"{name:<26} {ready:8.2f} {cpu:7.2f} {answered:17.2f}")
    own, forked = (statistics.median(r[0] for r in rows) for rows in figures.values())
    print(f"ready: own / forked = {own / forked:.1f}x (medians of {args.rounds} rounds; "
          f"load average now {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
