"""`labkit regrade LAB [SUBMISSIONS] --db URL [--shard I/N]`: grade a lab again after a test was
fixed, keep what graders entered by hand, and show whose score changed (docs/INSTRUCTORS.md,
"A wrong test found after grading began").

    labkit regrade lab03_memory_and_zero --db postgresql://grader@db/course --shard 3/10 \\
        --out /shared/grading/lab03_memory_and_zero
    labkit regrade lab03_memory_and_zero --db postgresql://grader@db/course --changes

What nbgrader allows (nbgrader 0.9.6, read in its source):
  - preprocessors/savecells.py: once a notebook has submissions, generate_assignment raises
    "Cannot add or remove cells" when the set of grade, solution, task or locked cells changes;
    a cell's text and points may change (update_or_create_source_cell / _grade_cell);
  - preprocessors/saveautogrades.py: autograde writes Grade.auto_score only; Grade.manual_score
    (which wins in Grade.score), Grade.extra_credit and Comment.manual_comment are left as the
    formgrader stored them, and a cell with a manual score is flagged needs_manual_grade again.
So a fix that keeps every cell (same grade_ids, same notebooks) can be regraded in place, and the
grades typed in the formgrader survive; a fix that adds or removes a cell cannot.

The steps, per shard (each shard regrades its own students, as `labkit grade --shard` does):
  1. the fixed solutions/<LAB> is built into a scratch gradebook and its cells compared with the
     shared gradebook's: a cell added or removed refuses the run before anything is written;
  2. a round is recorded (labkit_regrade_round: the revision = hash of solutions/<LAB> and of
     labkit's code, the cells that changed) and each student's current scores are snapshotted
     into labkit_regrade, once per round: a shard killed and re-run keeps the scores from
     before its first attempt;
  3. `labkit grade` grades the submissions again (the gradebook is rebuilt once, under its lock);
  4. the new scores are written next to the old ones; the students whose score or any cell's
     score changed, and the manual grades kept over a changed autograder score, are printed and
     written to OUT/regrade-<revision>[-shard-I-of-N].csv (mode 600: it names students).
`--changes` prints the whole class's table of the latest round from the gradebook, once every
shard has run (students not regraded yet are counted).
"""
from __future__ import annotations

import csv
import dataclasses
import os
import shutil
import sys
import tempfile

from labkit.grading import pipeline, rounds
from labkit.grading.rounds import RegradeRefused  # noqa: F401 (importable from here too)


@dataclasses.dataclass
class RegradeResult:
    lab: str
    revision: str
    changes: list            # [(cell, what changed)] in the fixed lab
    rows: list               # [{student, old_score, new_score, changed, kept}] of this shard
    not_regraded: list       # students with grades in the gradebook but no submission here
    report: object           # the GradeReport of the grading run
    csv_path: str


def _safe(db_url: str) -> str:
    from sqlalchemy.engine import make_url
    return make_url(db_url).render_as_string(hide_password=True)


def _copies(out: str, lab: str, shard) -> str:
    """The submissions `labkit grade` copied into OUT/work/submitted/<student>/<LAB>/, copied
    again into a private folder (grade() empties each student's copy before it refills it)."""
    submitted = os.path.join(out, "work", "submitted")
    students = [s for s in sorted(os.listdir(submitted)) if pipeline.in_shard(s, shard)
                and os.path.isdir(os.path.join(submitted, s, lab))] \
        if os.path.isdir(submitted) else []
    if not students:
        raise RegradeRefused(
            f"labkit regrade {lab}: no graded copies in {submitted} for this shard: pass "
            "SUBMISSIONS, the folder `labkit grade` was given (or --out, the folder it wrote)")
    folder = tempfile.mkdtemp(prefix="regrade-", dir=os.path.join(out, "work"))
    for student in students:
        shutil.copytree(os.path.join(submitted, student, lab), os.path.join(folder, student),
                        symlinks=True, ignore=shutil.ignore_patterns("timestamp.txt"))
    return folder


def regrade(lab: str, submissions_dir: str | None = None, db_url: str | None = None,
            out: str | None = None, course: str | None = None, shard=None,
            jobs: int | None = None, time_limit: float = 300.0, cell_timeout: float = 60.0,
            limits: dict | None = None, no_isolation: bool = False, log=print) -> RegradeResult:
    """Regrade `lab` (or shard (i, N) of its students) after its tests were fixed; see the
    module docstring. Raises RegradeRefused, before writing anything, when the fix adds or
    removes a cell or the gradebook holds no grades of the lab."""
    shard = pipeline.parse_shard(shard) if isinstance(shard, str) else shard
    shard = shard if shard and shard[1] > 1 else None
    if shard and not (db_url or "").startswith("postgresql"):
        raise ValueError(f"--shard {shard[0]}/{shard[1]} needs --db postgresql://USER@HOST/DB, "
                         "the one gradebook every shard wrote (docs/CLASS_SCALE.md)")
    shard_name = f"{shard[0]}/{shard[1]}" if shard else "-"
    course = pipeline.find_course_root(course)
    source_root = os.path.join(course, "solutions")
    source_dir = os.path.join(source_root, lab)
    if not os.path.isdir(source_dir):
        raise FileNotFoundError(f"no lab {lab!r}: {source_dir} does not exist")
    out = os.path.abspath(out or os.path.join(course, "grading", lab))
    db_url = db_url or "sqlite:///" + os.path.join(out, "gradebook.db")
    if db_url.startswith("sqlite:///") and not os.path.exists(db_url[len("sqlite:///"):]):
        raise RegradeRefused(f"labkit regrade {lab}: no gradebook at {db_url[10:]}: nothing was "
                             "graded there; pass the --out or --db that `labkit grade` used")
    config = pipeline._config(course, source_root, out, db_url, lab)
    pipeline._api(config)                        # alembic on PATH for nbgrader's Gradebook
    course_id = config.CourseDirectory.course_id
    old = rounds.gradebook_cells(db_url, course_id, lab)
    if old is None:
        raise RegradeRefused(f"labkit regrade {lab}: the gradebook {_safe(db_url)} holds no lab "
                             f"{lab}: nothing to regrade (grade it with `labkit grade` first)")
    new = rounds.new_cells(config, lab)
    changes = rounds.compare(old, new, lab)
    rev = rounds.revision(source_dir)
    points = lambda cells: sum(sum(nb["grade"].values()) for nb in cells.values())  # noqa: E731
    record = rounds.RoundRecord(db_url)
    copies = None
    try:
        with pipeline.gradebook_lock(db_url):
            changes = record.start(lab, rev, changes, points(old), points(new))
        before = {s: v for s, v in rounds.class_scores(db_url, course_id, lab).items()
                  if pipeline.in_shard(s, shard)}
        record.snapshot(lab, rev, before, shard_name)
        log(f"labkit regrade {lab}: revision {rev}, {len(before)} graded students in "
            f"{'shard ' + shard_name if shard else 'the gradebook'}; changed test cells: "
            + (", ".join(f"{c} ({w})" for c, w in changes) or "none in solutions/"))
        if submissions_dir is None:
            submissions_dir = copies = _copies(out, lab, shard)
        report = pipeline.grade(lab, submissions_dir, jobs=jobs, out=out, course=course,
                                db_url=db_url, time_limit=time_limit, cell_timeout=cell_timeout,
                                limits=limits, log=log, shard=shard, no_isolation=no_isolation,
                                _regrading=True)
        after = {s: v for s, v in rounds.class_scores(db_url, course_id, lab).items()
                 if s in report.scores}
        first = {s: (0.0, {}) for s in after if s not in before}      # graded for the first time
        record.snapshot(lab, rev, first, shard_name)
        record.finish(lab, rev, after)
        rows = record.rows(lab, rev, students=set(before) | set(after))
    finally:
        record.close()
        if copies:
            shutil.rmtree(copies, ignore_errors=True)
    missing = sorted(set(before) - set(after))
    log(rounds.table(rows, lab, rev, changes))
    if first:
        log(f"graded for the first time (no score before): {', '.join(sorted(first))}")
    if missing:
        log(f"NOT REGRADED: {len(missing)} student(s) graded before but without a submission in "
            f"{submissions_dir}: {', '.join(missing)}; their scores are still the old tests'")
    name = f"regrade-{rev}" + (f"-shard-{shard[0]}-of-{shard[1]}" if shard else "") + ".csv"
    csv_path = write_csv(os.path.join(out, name), rows)
    log(f"table of this run: {csv_path}")
    return RegradeResult(lab, rev, changes, rows, missing, report, csv_path)


def write_csv(path: str, rows: list) -> str:
    """student, old_score, new_score, changed cells, manual grades kept; mode 600 (names)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student_id", "old_score", "new_score", "changed_cells",
                         "manual_kept"])
        for r in rows:
            writer.writerow([r["student"], f"{r['old_score']:g}",
                             "" if r["new_score"] is None else f"{r['new_score']:g}",
                             "; ".join(r["changed"]), "; ".join(r["kept"])])
    return path


def changes_table(lab: str, db_url: str, csv_path: str | None = None) -> str:
    """The latest round's table for the whole class (every shard's students), from the
    gradebook; written to `csv_path` too when given."""
    record = rounds.RoundRecord(db_url)
    try:
        latest = record.latest(lab)
        if latest is None:
            raise RegradeRefused(f"labkit regrade {lab} --changes: {_safe(db_url)} records no "
                                 f"regrade of {lab}")
        rev, changes = latest
        rows = record.rows(lab, rev)
    finally:
        record.close()
    if csv_path:
        write_csv(csv_path, rows)
    return rounds.table(rows, lab, rev, changes)


def add_arguments(parser) -> None:
    from labkit.grading import cli
    cli.add_arguments(parser)
    for action in parser._actions:             # SUBMISSIONS is optional here
        if action.dest == "submissions":
            action.nargs, action.default = "?", None
            action.help = ("folder of <student_id>/ folders, as given to `labkit grade`, "
                           "right after LAB (default: the copies it kept in OUT/work/submitted)")
    parser.add_argument("--changes", action="store_true",
                        help="print the latest regrade's table of the whole class from the "
                             "gradebook (after every shard ran) and grade nothing")
    parser.add_argument("--csv", default=None, help="with --changes: write the table here too")


def run(args) -> int:
    from labkit.grading.pipeline import GradingStopped, IsolationUnavailable
    try:
        if args.changes:
            out = os.path.abspath(args.out or os.path.join(
                pipeline.find_course_root(args.course), "grading", args.lab))
            print(changes_table(args.lab, args.db or "sqlite:///" + os.path.join(
                out, "gradebook.db"), args.csv))
            return 0
        result = regrade(args.lab, args.submissions, db_url=args.db, out=args.out,
                         course=args.course, shard=args.shard, jobs=args.jobs,
                         time_limit=args.time_limit, cell_timeout=args.cell_timeout,
                         limits={"memory_bytes": int(args.memory_gb * (1 << 30))},
                         no_isolation=args.no_isolation)
    except (RegradeRefused, ValueError, FileNotFoundError, IsolationUnavailable) as error:
        print(error, file=sys.stderr)
        return 2
    except GradingStopped as stop:
        return 128 + stop.signum
    return 1 if result.report.not_graded or result.not_regraded else 0
