"""Grading time per lab: how many machine-hours a class costs, to size `labkit grade --shard`.

    python benchmarks/bench_grading_labs.py                       # every lab, solution + 2 wrong
    python benchmarks/bench_grading_labs.py --labs lab00_first_collectives lab03_memory_and_zero
    python benchmarks/bench_grading_labs.py --wrong 1 --json grading-labs.json

For each lab of solutions/: its solution as a student hands it in and the first `--wrong` graded
wrong answers of tests/grading/wrong_answers/<lab>.py, both built by test_labs.py's
`as_submitted` (imported, not copied), graded by `labkit grade --jobs 1` (the Python API, one
submission at a time) into a throwaway sqlite gradebook. The gradebook is built first and timed
on its own: a shard pays it once, not per student. Needs root for the sandbox, as `labkit
grade` does.

Printed per lab:
  build s        nbgrader generate_assignment of the gradebook (once per shard);
  worker s       each submission's time in its grading worker (kernel, ranks, trusted tests),
                 the solution's and the mean of the wrong answers';
  s/submission   the run's wall time after the build divided by its submissions: worker time
                 plus nbgrader's autograde and feedback, what one more student costs;
  h/100          machine-hours per 100 students at --jobs 1 (s/submission x 100 / 3600);
  load           the 1-minute load average before and after the lab: the figures are only as
                 good as the machine was quiet (a shared machine at load 8 grades slower).
A score that differs from the one the lab's tests expect is printed too (the run still times it).
A submission keeps about two cores busy (its kernel, then the ranks of each graded call), so
--jobs J on a machine of 2J cores grades about J times as fast: h/100 / J per such machine.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "grading"))
sys.path.insert(0, str(ROOT / "utils"))


def submissions_of(lab: str, wrong: int) -> dict:
    """{student: (notebook, expected score or None)}: the solution and `wrong` wrong answers."""
    import wrong_answers
    from test_labs import as_submitted
    source = next((ROOT / "solutions" / lab).glob("*.ipynb"))
    found = {"solution": (as_submitted(source), None)}
    module_wrong = wrong_answers.load().get(lab, {})
    for student in list(module_wrong)[:wrong]:
        answers, scratch, score = module_wrong[student]
        found[student] = (as_submitted(source, answers, scratch), float(score))
    return found


def bench_lab(lab: str, wrong: int, root: str) -> dict:
    import nbformat
    from labkit.grading import grade
    from labkit.grading.pipeline import _config, build_gradebook
    subs = os.path.join(root, lab, "subs")
    out = os.path.join(root, lab, "out")
    expected = {}
    for student, (nb, score) in submissions_of(lab, wrong).items():
        os.makedirs(os.path.join(subs, student))
        nbformat.write(nb, os.path.join(subs, student, f"{lab}.ipynb"))
        expected[student] = score
    load_before = os.getloadavg()[0]
    # the gradebook first, as grade() builds it (the same folders), so that the run below only
    # checks its stamp: a shard pays this once
    os.makedirs(os.path.join(out, "work", "release"), exist_ok=True)
    db_url = "sqlite:///" + os.path.join(out, "gradebook.db")
    config = _config(str(ROOT), str(ROOT / "solutions"), out, db_url, lab)
    started = time.monotonic()
    build_gradebook(config, str(ROOT / "solutions"), lab, out)
    build = time.monotonic() - started
    started = time.monotonic()
    report = grade(lab, subs, jobs=1, out=out, course=str(ROOT), log=lambda *a: None)
    wall = time.monotonic() - started
    load_after = os.getloadavg()[0]
    results = {r.student: r for r in report.results}
    solution = results["solution"]
    wrongs = [r for s, r in results.items() if s != "solution"]
    mismatches = {s: (r.score, expected[s] if expected[s] is not None else r.max_score,
                      r.problems) for s, r in results.items()
                  if r.score != (expected[s] if expected[s] is not None else r.max_score)}
    per = wall / len(results)
    return {"lab": lab, "submissions": len(results), "build_s": round(build, 1),
            "solution_worker_s": round(solution.seconds, 1),
            "wrong_worker_s": round(sum(r.seconds for r in wrongs) / len(wrongs), 1)
            if wrongs else None,
            "wall_s": round(wall, 1), "per_submission_s": round(per, 1),
            "hours_per_100": round(per * 100 / 3600, 2),
            "load_before": round(load_before, 1), "load_after": round(load_after, 1),
            "mismatches": mismatches}


def main():
    import warnings
    from sqlalchemy.exc import SAWarning
    from labkit.tools import release
    warnings.filterwarnings("ignore", category=SAWarning)   # nbgrader's autoflush notes
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labs", nargs="*", default=None, help="labs to grade (default: all)")
    parser.add_argument("--wrong", type=int, default=2,
                        help="wrong answers per lab from tests/grading/wrong_answers (default 2)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    labs = release.lab_sources(ROOT)
    chosen = args.labs or labs
    unknown = [lab for lab in chosen if lab not in labs]
    if unknown:
        parser.error(f"no such lab: {', '.join(unknown)} (labs: {', '.join(labs)})")
    root = tempfile.mkdtemp(prefix="bench-grading-labs-")
    print(f"{os.cpu_count()} cores, --jobs 1, solution + up to {args.wrong} wrong answers per "
          f"lab; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    header = (f"{'lab':<26} {'n':>2} {'build s':>7} {'worker s sol/wrong':>18} "
              f"{'s/submission':>12} {'h/100':>6} {'load':>9}")
    print(header, flush=True)
    rows = []
    try:
        for lab in chosen:
            row = bench_lab(lab, args.wrong, root)
            rows.append(row)
            wrong = "-" if row["wrong_worker_s"] is None else f"{row['wrong_worker_s']:.1f}"
            print(f"{lab:<26} {row['submissions']:>2} {row['build_s']:>7.1f} "
                  f"{row['solution_worker_s']:>9.1f} / {wrong:>6} {row['per_submission_s']:>12.1f}"
                  f" {row['hours_per_100']:>6.2f} "
                  f"{row['load_before']:>4.1f}-{row['load_after']:<4.1f}",
                  flush=True)
            for student, (got, want, problems) in row["mismatches"].items():
                print(f"  {student}: scored {got:g}, the lab's tests expect {want:g} "
                      f"({'; '.join(problems) or 'no problem recorded'})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if rows:
        total = sum(r["per_submission_s"] for r in rows)
        print(f"all {len(rows)} labs: {total:.0f} s per student, {total * 100 / 3600:.1f} "
              "machine-hours per 100 students at --jobs 1")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["mismatches"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
