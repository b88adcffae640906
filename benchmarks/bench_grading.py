"""Grading time: one submission, and a folder of N submissions graded serially vs in parallel.

    python benchmarks/bench_grading.py                 # 20 submissions of the fixture lab
    python benchmarks/bench_grading.py --n 20 --jobs 2 --json out.json

Uses tests/grading/fixtures (3 tasks, one of them on 2 ranks): a mix of correct, partly wrong
and blank submissions. Needs root for the sandbox (as `labkit grade` does). Prints the seconds
per submission (time in its worker: kernel, ranks, trusted tests) and the wall time of the whole
run (gradebook check, execution, nbgrader autograde + feedback), serial and parallel, and checks
that both runs give the same grades.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "grading"))
sys.path.insert(0, os.path.join(HERE, "..", "utils"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from grading_helpers import LAB, make_class
    from labkit.grading import grade
    root = tempfile.mkdtemp(prefix="bench-grading-")
    course, subs = make_class(root, args.n)
    runs = {}
    for label, jobs in (("serial", 1), ("parallel", args.jobs)):
        started = time.monotonic()
        report = grade(LAB, subs, jobs=jobs, out=os.path.join(root, label), course=course,
                       log=lambda *a: None)
        wall = time.monotonic() - started
        per = [r.seconds for r in report.results]
        runs[label] = {"jobs": jobs, "wall_s": round(wall, 1),
                       "per_submission_s_mean": round(sum(per) / len(per), 2),
                       "per_submission_s_max": round(max(per), 2), "scores": report.scores}
        print(f"{label:>8} (jobs={jobs}): {wall:6.1f} s for {args.n} submissions; "
              f"{sum(per) / len(per):.1f} s per submission in its worker (max {max(per):.1f})")
    same = runs["serial"]["scores"] == runs["parallel"]["scores"]
    print(f"speed-up {runs['serial']['wall_s'] / runs['parallel']['wall_s']:.2f}x; "
          f"identical grades: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    shutil.rmtree(root, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
