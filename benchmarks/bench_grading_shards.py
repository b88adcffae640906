"""Submissions graded per minute: one `labkit grade` process, and two shards at once, into one
PostgreSQL gradebook (docs/CLASS_SCALE.md).

    python benchmarks/bench_grading_shards.py                  # 8 submissions of the fixture lab
    python benchmarks/bench_grading_shards.py --n 12 --json out.json

Each row is a fresh database on a throwaway PostgreSQL server started here (Debian's, as the
tests start it: tests/grading/test_class_scale.py), the same submissions (correct, partly wrong,
blank answers of tests/grading/fixtures), `labkit grade --jobs 1` per process, as separate
processes: one process for all; then `--shard 0/2` and `--shard 1/2` started together. Wall time
counts everything a batch job would: start-up, the gradebook build, execution, nbgrader's
autograde and feedback. Needs root for the sandbox, as `labkit grade` does. Checks that both
rows give the same grades.

On one machine two shards share its cores: this measures what sharding costs and overlaps (the
serial bookkeeping of one shard runs while the other executes), not what N machines give (N
times one machine's rate, less the gradebook build each shard waits for: a few seconds).
"""
import argparse
import csv
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "grading"))
sys.path.insert(0, os.path.join(HERE, "..", "utils"))


def run_shards(count, course, subs, out, db_url, env):
    started = time.monotonic()
    processes = [subprocess.Popen(
        [sys.executable, "-m", "labkit.tools.cli", "grade", "labfx", subs, "--course", course,
         "--out", out, "--jobs", "1", "--db", db_url]
        + (["--shard", f"{i}/{count}"] if count > 1 else []),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for i in range(count)]
    logs = [p.communicate()[0] for p in processes]
    wall = time.monotonic() - started
    for p, log in zip(processes, logs):
        if p.returncode != 0:
            raise RuntimeError(f"labkit grade failed:\n{log[-3000:]}")
    scores, problems = {}, {}
    for path in glob.glob(os.path.join(out, "grades*.csv")):
        with open(path) as f:
            for r in csv.DictReader(f):
                scores[r["student_id"]] = float(r["score"])
                problems[r["student_id"]] = r["problems"]
    return wall, scores, problems


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=8, help="submissions (default 8)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from grading_helpers import LAB, make_class
    from test_class_scale import throwaway_postgres
    root = tempfile.mkdtemp(prefix="bench-shards-")
    course, subs = make_class(root, args.n)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ.get("PATH", ""))
    rows = {}
    try:
        with throwaway_postgres() as server:
            for count in (1, 2):
                db_url = server.url(f"bench_{count}")
                wall, scores, problems = run_shards(count, course, subs,
                                                    os.path.join(root, f"out{count}"), db_url, env)
                rows[count] = {"wall_s": round(wall, 1), "per_minute": round(
                    60 * len(scores) / wall, 2), "scores": scores, "problems": problems}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{LAB}: {args.n} submissions on {os.cpu_count()} cores, --jobs 1 per process, "
          "one PostgreSQL gradebook")
    print(f"{'processes':>10}  {'wall s':>7}  {'submissions/min':>15}")
    for count, row in rows.items():
        label = "1" if count == 1 else f"{count} shards"
        print(f"{label:>10}  {row['wall_s']:>7.1f}  {row['per_minute']:>15.2f}")
    same = rows[1]["scores"] == rows[2]["scores"] and len(rows[1]["scores"]) == args.n
    print(f"2 shards / 1: {rows[2]['per_minute'] / rows[1]['per_minute']:.2f}x; "
          f"identical grades: {same}")
    for student in sorted(set(rows[1]["scores"]) | set(rows[2]["scores"])):
        one, two = rows[1]["scores"].get(student), rows[2]["scores"].get(student)
        if one != two:
            print(f"  {student}: {one} (1 process) vs {two} (2 shards); problems: "
                  f"{rows[1]['problems'].get(student) or '-'} | "
                  f"{rows[2]['problems'].get(student) or '-'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
