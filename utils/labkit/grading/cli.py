"""`labkit grade LAB SUBMISSIONS_DIR [--jobs N] [--out DIR] [--db URL] [--shard I/N]
[--no-isolation]` (the table entry in labkit/tools/cli.py).

Exit status: 0 when every submission was graded (a score of 0 included); 1 when any could not
be graded at all (no kernel, no result, worker killed: the summary names them); 2 for bad
arguments or a machine that cannot build the sandbox (without --no-isolation); 128 + the signal
(143 for SIGTERM, 130 for SIGINT) when the run was stopped, after its workers, sandboxes and
cgroups are gone."""
from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("lab", help="lab name, as in solutions/<LAB>/")
    parser.add_argument("submissions", help="folder of <student_id>/ folders (nbgrader's "
                        "submitted layout <student_id>/<LAB>/ works too)")
    parser.add_argument("--jobs", "-j", type=int, default=None,
                        help="submissions graded at once (default: what this machine can run: half its "
                             "cores, fewer if memory is short; 1 on 2 cores)")
    parser.add_argument("--out", default=None,
                        help="where gradebook, grades.csv and feedback/ go "
                             "(default: grading/<LAB>)")
    parser.add_argument("--db", default=None, help="gradebook URL (default: sqlite in --out; "
                        "postgresql://... for several graders)")
    parser.add_argument("--course", default=None, help="course repository (default: the one "
                        "containing the current folder)")
    parser.add_argument("--time-limit", type=float, default=300.0,
                        help="seconds per submission, everything included (default 300)")
    parser.add_argument("--cell-timeout", type=float, default=60.0,
                        help="seconds per cell or per call of a student function (default 60)")
    parser.add_argument("--memory-gb", type=float, default=4.0,
                        help="memory per submission, ranks included (default 4)")
    parser.add_argument("--shard", default=None, metavar="I/N",
                        help="grade only shard I of N (0-based: 0/4 .. 3/4), the students whose "
                             "id hashes to I mod N; every shard writes into one --db "
                             "postgresql://... gradebook (docs/CLASS_SCALE.md)")
    parser.add_argument("--no-isolation", action="store_true",
                        help="grade even where the sandbox cannot be built (not root, no "
                             "unshare): student code then runs as your own user and can read "
                             "solutions/ and the gradebook; what is and is not enforced is "
                             "printed (docs/INSTRUCTORS.md)")


def run(args) -> int:
    import sys
    from labkit.grading.pipeline import GradingStopped, IsolationUnavailable, grade, parse_shard
    if args.shard is not None:
        try:
            parse_shard(args.shard)
            if not (args.db or "").startswith("postgresql") and parse_shard(args.shard)[1] > 1:
                raise ValueError(f"--shard {args.shard} needs --db postgresql://USER@HOST/DB: "
                                 "one gradebook that every shard writes into "
                                 "(docs/CLASS_SCALE.md)")
        except ValueError as error:
            print(f"labkit grade: {error}", file=sys.stderr)
            return 2
    try:
        report = grade(args.lab, args.submissions, jobs=args.jobs, out=args.out,
                       course=args.course, db_url=args.db, time_limit=args.time_limit,
                       cell_timeout=args.cell_timeout,
                       limits={"memory_bytes": int(args.memory_gb * (1 << 30))}, shard=args.shard,
                       no_isolation=args.no_isolation)
    except IsolationUnavailable as error:
        print(error, file=sys.stderr)
        return 2
    except GradingStopped as stop:           # grade() printed what was stopped
        _leave_now(128 + stop.signum)
    _stop_resource_tracker()
    return 1 if report.not_graded else 0


def _stop_resource_tracker() -> None:
    """The workers' forkserver started a resource tracker (a child of this process, root); left
    alone, it exits only after this process has, adopted by whoever reaps orphans: the process
    that ran `labkit grade` when it is a subreaper (a batch system's shim, test_grade_run's
    SIGTERM test: 6 of 40 rounds under load found it in state R). Stopped here, on the way out."""
    from labkit.common import stop_resource_tracker
    stop_resource_tracker()


def _leave_now(code: int) -> None:
    """The end of a stopped run: grade() has waited until no process, sandbox or cgroup of the
    run is left; what remains is this interpreter's finalization with torch, nbgrader and
    sqlalchemy imported, 1-10 s of wall time at load 10-30 on 2 cores
    (tests/stress/stress_sigterm.py), which a preempted shard's grace period should not pay.
    multiprocessing's exit handler still runs (it removes its temporary folder), then os._exit."""
    import multiprocessing.util
    import os
    import sys
    multiprocessing.util._exit_function()
    _stop_resource_tracker()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
