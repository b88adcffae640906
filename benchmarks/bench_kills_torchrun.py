"""Chapter 8, section 7's real kills on an exponential clock, under torchrun and in labkit's world,
side by side in one run: the lost fraction at three checkpoint intervals tau against Daly's
T(tau)/W - 1, and what one restart costs in wall-clock time under each launcher.

    .venv/bin/python benchmarks/bench_kills_torchrun.py                 # 2 clocks per tau, 2 ranks
    .venv/bin/python benchmarks/bench_kills_torchrun.py --seeds 6 --nproc 3

Every job runs twice from the same clock (seed): in a labkit world (`killclock.run_job`, ranks
forked from a template) and under torchrun (`killclock.run_job_torchrun`, new interpreters per
restart, as a real job is restarted). The counts are virtual (a step is 1 unit, a save C, a
restart 0), so the two launchers must lose exactly the same; the lost fraction's band is 3
standard deviations of the mean of that many jobs (`killclock.spread_of_mean`). A job that fails
is reported and run again (up to 3 times), never the end of the benchmark. Timings depend on the
machine and its load: read the ratio of one run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_launcher import attempts, failure_note  # noqa: E402 (benchmarks/ is not a package)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2, help="clocks (jobs) per tau")
    parser.add_argument("--taus", type=int, nargs="+", default=[2, 5, 12])
    parser.add_argument("--nproc", type=int, default=2, help="ranks of each job")
    parser.add_argument("--work", type=int, default=60, help="steps of each job")
    parser.add_argument("--C", type=float, default=1.0, help="a save, in steps")
    parser.add_argument("--M", type=float, default=12.0, help="mean time between failures, steps")
    options = parser.parse_args()

    import labkit
    from labkit.checkpoint import interval, killclock
    W, C, M = options.work, options.C, options.M
    world = labkit.world(options.nproc, backend="gloo", teaching=False)   # as torchrun's ranks
    scratch = tempfile.mkdtemp(prefix="bench-kills-")
    results, notes, mismatches = {}, [], []
    try:
        for tau in options.taus:
            for seed in range(options.seeds):
                def in_world():
                    return killclock.run_job(world, tempfile.mkdtemp(dir=scratch), W, tau, C, M,
                                             seed)

                def under_torchrun():
                    return killclock.run_job_torchrun(tempfile.mkdtemp(dir=scratch), W, tau, C,
                                                      M, seed, nproc=options.nproc)

                def timed(function):
                    import time
                    started = time.perf_counter()
                    run = function()
                    return dict(run, elapsed=time.perf_counter() - started)

                pair = {}
                for name, function in (("world", in_world), ("torchrun", under_torchrun)):
                    runs, failures = attempts(f"tau={tau} seed={seed} {name}",
                                              lambda f=function: timed(f), 1)
                    notes.append(failure_note(f"tau={tau} seed={seed} {name}", runs, failures))
                    pair[name] = runs[0] if runs else None
                results[tau, seed] = pair
                if pair["world"] and pair["torchrun"] and any(
                        pair["world"][k] != pair["torchrun"][k]
                        for k in ("failures", "resumed_from", "wall")):
                    mismatches.append((tau, seed))
                kills = pair["torchrun"]["restarts"] if pair["torchrun"] else "?"
                print(f"tau={tau:<3} seed={seed}: {kills} kills", flush=True)
    finally:
        labkit.shutdown_all()
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"\n{options.nproc} ranks, {W} steps per job, C = {C:g}, M = {M:g} steps, "
          f"{options.seeds} clock(s) per tau")
    print(f"{'tau':>4}{'kills':>7}{'lost, torchrun':>16}{'lost, world':>13}{'Daly T/W-1':>12}"
          f"{'+- 3 sd':>9}{'inside':>8}")
    for tau in options.taus:
        pairs = [results[tau, s] for s in range(options.seeds)]
        done = [p["torchrun"] for p in pairs if p["torchrun"]]
        world_done = [p["world"] for p in pairs if p["world"]]
        daly = interval.daly_wall_time(tau, C, M, 0.0, W) / W - 1
        band = 3 * killclock.spread_of_mean(W, tau, C, M, max(len(done), 1))
        lost = statistics.mean(killclock.lost_fraction(r["wall"], W) for r in done) if done \
            else float("nan")
        lost_world = statistics.mean(killclock.lost_fraction(r["wall"], W)
                                     for r in world_done) if world_done else float("nan")
        print(f"{tau:>4}{sum(r['restarts'] for r in done):>7}{lost:>16.3f}{lost_world:>13.3f}"
              f"{daly:>12.3f}{band:>9.3f}{'yes' if abs(lost - daly) <= band else 'NO':>8}")
    every = [p for p in results.values() if p["world"] and p["torchrun"]]
    kills = sum(p["torchrun"]["restarts"] for p in every)
    restart = [s for p in every for s in p["torchrun"]["restart_seconds"]]
    if kills:
        per_kill = {name: sum(p[name]["elapsed"] for p in every) / kills
                    for name in ("world", "torchrun")}
        print(f"\nwall-clock per kill, whole jobs: torchrun {per_kill['torchrun']:.2f} s, "
              f"labkit's world {per_kill['world']:.2f} s "
              f"({per_kill['torchrun'] / per_kill['world']:.1f}x); under torchrun, from a kill "
              f"to the next attempt's load: median {statistics.median(restart):.2f} s, "
              f"max {max(restart):.2f} s")
    print(f"jobs whose failures, resume points or wall differ between the launchers: "
          f"{len(mismatches)} of {len(every)}" + (f" {mismatches}" if mismatches else ""))
    for note in filter(None, notes):
        print(note)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
