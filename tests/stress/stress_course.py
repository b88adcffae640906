"""`make course` again and again, at each world size the README offers: how often each notebook
fails (issue 25: every notebook passes five times in a row at WORLD=2, 3 and 4 on a 2-core machine).

    .venv/bin/python tests/stress/stress_course.py --worlds 2 3 4 --runs 5
    .venv/bin/python tests/stress/stress_course.py --worlds 2 --runs 3 --only solutions/
    .venv/bin/python tests/stress/stress_course.py --worlds 3 --runs 5 --jobs 2   # as test_build

Each run is `labkit build --world W` (what `make course WORLD=W` runs) into a folder of its own
(build/stress/w<W>-r<i>), one at a time. Prints, per run, its time and the notebooks that failed
with their first error line, and at the end a table: per world size, per notebook, failures out
of runs. Exit status 1 when anything failed. Not collected by pytest (tests/stress/conftest.py).
"""
import argparse
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
LINE = re.compile(r"^\[(\d+)/(\d+)\] (\S+) \.\.\. (\w+) \(([\d.]+)s\)")


def one_run(world, out, only, jobs=1):
    command = [sys.executable, "-m", "labkit.tools.cli", "build", "--world", str(world),
               "--out", out, "--root", ROOT, "--jobs", str(jobs)] + (["--only", only] if only else [])
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    seconds = time.monotonic() - started
    statuses, errors, last = {}, {}, None
    for line in done.stdout.splitlines():
        match = LINE.match(line)
        if match:
            last = match.group(3)
            statuses[last] = (match.group(4), float(match.group(5)))
        elif last and line.startswith("      ") and last not in errors:
            errors[last] = line.strip()[:300]
    if done.returncode and not statuses:
        errors["(build)"] = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        statuses["(build)"] = ("error", seconds)
    return done.returncode, seconds, statuses, errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", default=None, help="as labkit build --only")
    parser.add_argument("--jobs", type=int, default=1, help="as labkit build --jobs (make course JOBS=)")
    args = parser.parse_args()
    table = {}                           # (world, notebook) -> [failures, runs]
    failed_any = False
    for world in args.worlds:
        for run in range(1, args.runs + 1):
            out = os.path.join(ROOT, "build", "stress", f"w{world}-r{run}")
            code, seconds, statuses, errors = one_run(world, out, args.only, args.jobs)
            bad = [n for n, (s, _) in statuses.items() if s != "ok"]
            failed_any |= bool(bad) or code != 0
            load = os.getloadavg()[0]
            print(f"WORLD={world} run {run}/{args.runs}: {len(statuses) - len(bad)} ok, "
                  f"{len(bad)} failed in {seconds:.0f} s (load {load:.1f})", flush=True)
            for name in bad:
                print(f"    {name}: {errors.get(name, statuses[name][0])}", flush=True)
            for name, (status, _) in statuses.items():
                entry = table.setdefault((world, name), [0, 0])
                entry[0] += status != "ok"
                entry[1] += 1
    print("\nfailures / runs, per world size and notebook")
    names = sorted({n for _, n in table})
    print("notebook".ljust(60) + "".join(f"W={w}".rjust(8) for w in args.worlds))
    for name in names:
        cells = [table.get((w, name)) for w in args.worlds]
        print(name.ljust(60) + "".join((f"{c[0]}/{c[1]}" if c else "-").rjust(8) for c in cells))
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
