"""`labkit report LAB`: the class report, read from the gradebook, and the record it is built from.

    labkit report lab00_first_collectives                     # grading/<LAB>/gradebook.db
    labkit report lab00_first_collectives --db postgresql://grader@db.example/course \\
        --out report.html

The record. nbgrader's gradebook keeps a score per test cell. `labkit grade` adds two tables of
its own to the same database (nbgrader and its formgrader never look at them):
  labkit_gradebook  lab, source_hash, built_at: which solutions/<LAB> the gradebook was built
                    from, so that shards started together build it once (pipeline.py);
  labkit_grading    lab, student, seconds, problems, failures, shard, graded_at: one row per
                    graded submission. `failures` maps each failed test cell to the kind of its
                    failure, the class name of the error only (AssertionError, HiddenTestFailed,
                    TimeLimit, NotGraded...): never a message, a traceback or a line of a test;
  labkit_hidden_failures  lab, student, notebook, grade_id, kind, message, seed, traceback,
                    graded_at: why each hidden test failed (instructors only; created when
                    missing, so gradebooks made before it gain it on their next grading).
The report: one HTML page, figures as PNG inside it (matplotlib): total scores, each test cell's
scores and pass rate, failures by kind, grading time; tables of the tasks that fail most and of
the submissions with problems. Every hidden-test line of the gradebook is searched for in the
page before it is written; text that quotes one is withheld. Why hidden tests failed goes to a
page of its own beside it (REPORT-hidden-failures.html, instructors only): it quotes hidden tests
on purpose, and the class report, which does not, can be shared with teaching assistants.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import html
import io
import json
import os
import re
import statistics
import time

_KIND = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$")


# --- the record (written by `labkit grade`) ------------------------------------------------
def _tables(metadata):
    from sqlalchemy import Column, Float, String, Table, Text
    built = Table("labkit_gradebook", metadata,
                  Column("lab", String(128), primary_key=True),
                  Column("source_hash", String(64), nullable=False),
                  Column("built_at", Float, nullable=False))
    graded = Table("labkit_grading", metadata,
                   Column("lab", String(128), primary_key=True),
                   Column("student", String(128), primary_key=True),
                   Column("seconds", Float, nullable=False),
                   Column("problems", Text, nullable=False),     # JSON list of strings
                   Column("failures", Text, nullable=False),     # JSON {grade_id: kind}
                   Column("shard", String(32), nullable=False),
                   Column("graded_at", Float, nullable=False))
    hidden = Table("labkit_hidden_failures", metadata,
                   Column("lab", String(128), primary_key=True),
                   Column("student", String(128), primary_key=True),
                   Column("notebook", String(128), primary_key=True),
                   Column("grade_id", String(128), primary_key=True),
                   Column("kind", String(128), nullable=False),
                   Column("message", Text, nullable=False),
                   Column("seed", String(32), nullable=False),       # "" when none was named
                   Column("traceback", Text, nullable=False),    # JSON list of "line N: source"
                   Column("graded_at", Float, nullable=False))
    return built, graded, hidden


class ClassRecord:
    """labkit's two tables in the gradebook's database (see the module docstring)."""

    def __init__(self, db_url: str):
        from sqlalchemy import MetaData, create_engine
        self.engine = create_engine(db_url, future=True)
        self.metadata = MetaData()
        self.built, self.graded, self.hidden = _tables(self.metadata)

    def create(self) -> None:
        """Create the tables if missing. Call it only after nbgrader has made its own (nbgrader
        takes a database with any table in it for one it has already set up), under the lock."""
        self.metadata.create_all(self.engine)

    def source_hash(self, lab: str) -> str | None:
        from sqlalchemy import select
        with self.engine.connect() as conn:
            row = conn.execute(select(self.built.c.source_hash)
                               .where(self.built.c.lab == lab)).first()
        return row[0] if row else None

    def set_source_hash(self, lab: str, source_hash: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(self.built.delete().where(self.built.c.lab == lab))
            conn.execute(self.built.insert().values(lab=lab, source_hash=source_hash,
                                                    built_at=time.time()))

    def save(self, lab: str, student: str, seconds: float, problems: list, failures: dict,
             shard: str, hidden_failures: list | None = None) -> None:
        """One row per (lab, student), replaced in one transaction: a re-run overwrites it; with
        it, one labkit_hidden_failures row per failed hidden test (instructors only; the table
        is created here when a gradebook made before it lacks it)."""
        self.hidden.create(self.engine, checkfirst=True)
        with self.engine.begin() as conn:
            conn.execute(self.hidden.delete().where((self.hidden.c.lab == lab)
                                                    & (self.hidden.c.student == student)))
            for h in hidden_failures or []:
                conn.execute(self.hidden.insert().values(
                    lab=lab, student=student, notebook=str(h.get("notebook", ""))[:128],
                    grade_id=str(h.get("grade_id", ""))[:128],
                    kind=str(h.get("type", ""))[:128], message=str(h.get("message", "")),
                    seed="" if h.get("seed") is None else str(h["seed"]),
                    traceback=json.dumps([str(t) for t in h.get("traceback", [])]),
                    graded_at=time.time()))
            conn.execute(self.graded.delete().where((self.graded.c.lab == lab)
                                                    & (self.graded.c.student == student)))
            conn.execute(self.graded.insert().values(
                lab=lab, student=student, seconds=float(seconds),
                problems=json.dumps([str(p) for p in problems]),
                failures=json.dumps(failures, sort_keys=True), shard=shard,
                graded_at=time.time()))

    def rows(self, lab: str) -> dict:
        from sqlalchemy import inspect, select
        if not inspect(self.engine).has_table("labkit_grading"):
            return {}
        with self.engine.connect() as conn:
            result = conn.execute(select(self.graded).where(self.graded.c.lab == lab))
            return {r.student: {"seconds": r.seconds, "problems": json.loads(r.problems),
                                "failures": json.loads(r.failures), "shard": r.shard}
                    for r in result}

    def hidden_failures(self, lab: str) -> list:
        """[{student, notebook, grade_id, kind, message, seed, traceback}] of `lab`, by test cell
        then student; [] for a gradebook without the table."""
        from sqlalchemy import inspect, select
        if not inspect(self.engine).has_table("labkit_hidden_failures"):
            return []
        with self.engine.connect() as conn:
            result = conn.execute(select(self.hidden).where(self.hidden.c.lab == lab))
            rows = [{"student": r.student, "notebook": r.notebook, "grade_id": r.grade_id,
                     "kind": r.kind, "message": r.message, "seed": r.seed or None,
                     "traceback": json.loads(r.traceback)} for r in result]
        return sorted(rows, key=lambda r: (r["notebook"], r["grade_id"], r["student"]))

    def close(self) -> None:
        self.engine.dispose()


def failure_kinds(notebook_paths: list) -> dict:
    """{grade_id: kind} for every test cell of these autograded notebooks that has an error
    output (what nbgrader scored 0); kind is the error's class name, or "Other"."""
    import nbformat
    from labkit.grading import notebook as nbtools
    failures = {}
    for path in notebook_paths:
        try:
            nb = nbformat.read(path, as_version=4)
        except Exception:  # noqa: BLE001 (no autograded notebook: nbgrader noted the problem)
            continue
        for cell in nb.cells:
            if nbtools.role(cell) != "test":
                continue
            errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
            if errors:
                kind = str(errors[0].get("ename", ""))
                failures[cell.metadata.nbgrader.get("grade_id", "?")] = \
                    kind if _KIND.match(kind) else "Other"
    return failures


# --- the report (`labkit report LAB`) ---------------------------------------------------------
@dataclasses.dataclass
class ClassData:
    lab: str
    tasks: list            # [(grade_id, notebook, max_score)], in notebook order
    scores: dict           # student -> (score, max_score)
    task_scores: dict      # student -> {grade_id: score}
    record: dict           # student -> labkit_grading row (seconds, problems, failures, shard)
    hidden: list           # every hidden-test line of the gradebook's test cells
    hidden_failures: list = dataclasses.field(default_factory=list)   # instructors only


def load(db_url: str, lab: str, course_id: str = "") -> ClassData:
    """Everything the report shows, from nbgrader's tables and labkit's."""
    from nbgrader.api import Gradebook, MissingEntry
    from labkit.grading import notebook as nbtools
    with Gradebook(db_url, course_id) as gb:
        try:
            assignment = gb.find_assignment(lab)
        except MissingEntry:
            raise LookupError(f"the gradebook {_safe_url(db_url)} has no lab {lab!r}: grade it "
                              f"first (labkit grade {lab} SUBMISSIONS --db ...)") from None
        tasks, hidden = [], []
        for notebook in assignment.notebooks:
            sources = {c.name: c.source for c in notebook.source_cells}
            for cell in sorted(notebook.grade_cells, key=lambda c: c.id):
                tasks.append((cell.name, notebook.name, float(cell.max_score)))
                hidden += nbtools.hidden_texts(sources.get(cell.name, ""))
        order = {}
        for notebook in assignment.notebooks:     # grade cells in the order of the source
            for index, cell in enumerate(notebook.source_cells):
                order[(notebook.name, cell.name)] = index
        tasks.sort(key=lambda t: (t[1], order.get((t[1], t[0]), 0)))
        scores, task_scores = {}, {}
        for submission in gb.assignment_submissions(lab):
            student = submission.student.id
            scores[student] = (float(submission.score), float(submission.max_score))
            task_scores[student] = {g.name: float(g.score) for nb in submission.notebooks
                                    for g in nb.grades}
    record = ClassRecord(db_url)
    try:
        rows = record.rows(lab)
        hidden_failures = record.hidden_failures(lab)
    finally:
        record.close()
    return ClassData(lab, tasks, scores, task_scores, rows, hidden, hidden_failures)


def _safe_url(db_url: str) -> str:
    return re.sub(r"://([^:@/]+):[^@/]*@", r"://\1:***@", db_url)


def task_table(data: ClassData) -> list:
    """Per test cell: passed, failed, pass rate, mean score, failures by kind; most failed first."""
    rows = []
    for grade_id, notebook, max_score in data.tasks:
        got = [s.get(grade_id, 0.0) for s in data.task_scores.values()]
        passed = sum(1 for g in got if g >= max_score)
        kinds = {}
        for student, s in data.task_scores.items():
            if s.get(grade_id, 0.0) < max_score:
                failures = data.record.get(student, {}).get("failures", {})
                kind = failures.get(grade_id, "not recorded")
                kinds[kind] = kinds.get(kind, 0) + 1
        rows.append({"task": grade_id, "notebook": notebook, "max": max_score,
                     "submissions": len(got), "passed": passed, "failed": len(got) - passed,
                     "pass_rate": passed / len(got) if got else 0.0,
                     "mean": statistics.fmean(got) if got else 0.0,
                     "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))})
    return sorted(rows, key=lambda r: (r["pass_rate"], r["task"]))


def _png(figure) -> str:
    import matplotlib.pyplot as plt
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def figures(data: ClassData, tasks: list) -> dict:
    """{title: base64 PNG}: total scores, per-task scores, failures by kind, grading time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    out = {}
    total_max = sum(t[2] for t in data.tasks) or 1.0
    fig, ax = plt.subplots(figsize=(7, 3.2))
    edges = ([i - 0.5 for i in range(int(total_max) + 2)] if total_max <= 30
             else [total_max * i / 20 for i in range(21)])          # one bar per point
    ax.hist([s for s, _ in data.scores.values()], bins=edges, color="#3b6ea8",
            edgecolor="white")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel=f"score (of {total_max:g})", ylabel="submissions",
           title=f"{data.lab}: total scores ({len(data.scores)} submissions)")
    out["Total scores"] = _png(fig)

    names = [t["task"] for t in reversed(tasks)]
    height = max(2.5, 0.45 * len(names) + 1)
    fig, ax = plt.subplots(figsize=(7, height))
    full = [t["passed"] for t in reversed(tasks)]
    partial = [sum(1 for s in data.task_scores.values() if 0 < s.get(t["task"], 0) < t["max"])
               for t in reversed(tasks)]
    zero = [t["submissions"] - f - p for t, f, p in zip(reversed(tasks), full, partial)]
    ax.barh(names, full, color="#4c9a5b", label="full points")
    ax.barh(names, partial, left=full, color="#e0b341", label="partial")
    ax.barh(names, zero, left=[f + p for f, p in zip(full, partial)], color="#c4504a",
            label="zero")
    for y, t in enumerate(reversed(tasks)):
        ax.text(t["submissions"], y, f" {100 * t['pass_rate']:.0f}% pass", va="center")
    ax.set(xlabel="submissions", title="Scores per test cell (most failed on top)",
           xlim=(0, max([t["submissions"] for t in tasks] + [1]) * 1.25))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    out["Scores and pass rate per test cell"] = _png(fig)

    kinds = sorted({k for t in tasks for k in t["kinds"]})
    fig, ax = plt.subplots(figsize=(7, height))
    left = [0] * len(names)
    colors = plt.get_cmap("tab10")
    for i, kind in enumerate(kinds):
        counts = [t["kinds"].get(kind, 0) for t in reversed(tasks)]
        ax.barh(names, counts, left=left, color=colors(i % 10), label=kind)
        left = [a + b for a, b in zip(left, counts)]
    ax.set(xlabel="failed submissions", title="Failures per test cell, by kind")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if kinds:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    out["Failures by kind"] = _png(fig)

    seconds = [r["seconds"] for r in data.record.values()]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.hist(seconds or [0.0], bins=20, color="#6b5ca5", edgecolor="white")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="seconds (sandbox and trusted run, per submission)", ylabel="submissions",
           title="Grading time per submission")
    out["Grading time per submission"] = _png(fig)
    return out


def _withheld(text: str, hidden: list) -> str:
    return "[withheld: it quoted a hidden test]" if any(h in text for h in hidden) else text


def render(data: ClassData) -> str:
    tasks = task_table(data)
    e = html.escape
    scores = [s for s, _ in data.scores.values()]
    seconds = sorted(r["seconds"] for r in data.record.values())
    shards = sorted({r["shard"] for r in data.record.values()} - {"-"})
    problems = [(s, data.scores.get(s, (0.0, 0.0))[0], r["seconds"], r["problems"])
                for s, r in sorted(data.record.items()) if r["problems"]]
    unrecorded = sorted(set(data.scores) - set(data.record))
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(data.lab)}: class "
             "report</title><style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em;"
             "text-align:left}img{max-width:100%}</style></head><body>",
             f"<h1>{e(data.lab)}: class report</h1>",
             f"<p>{len(data.scores)} graded submissions; mean score "
             f"{statistics.fmean(scores) if scores else 0:.2f}, median "
             f"{statistics.median(scores) if scores else 0:g} of "
             f"{sum(t[2] for t in data.tasks):g}; grading time median "
             f"{statistics.median(seconds) if seconds else 0:.1f} s, max "
             f"{max(seconds) if seconds else 0:.1f} s; shards: {e(', '.join(shards)) or 'none'}."
             "</p>"]
    for title, png in figures(data, tasks).items():
        parts.append(f"<h2>{e(title)}</h2><img alt='{e(title)}' "
                     f"src='data:image/png;base64,{png}'>")
    parts.append("<h2>Test cells, most failed first</h2><table><tr><th>test cell</th>"
                 "<th>notebook</th><th>points</th><th>pass rate</th><th>mean</th>"
                 "<th>failures by kind</th></tr>")
    for t in tasks:
        kinds = ", ".join(f"{k} &times;{n}" for k, n in ((e(k), n) for k, n in t["kinds"].items()))
        parts.append(f"<tr><td>{e(t['task'])}</td><td>{e(t['notebook'])}</td><td>{t['max']:g}"
                     f"</td><td>{100 * t['pass_rate']:.0f}% ({t['passed']}/{t['submissions']})"
                     f"</td><td>{t['mean']:.2f}</td><td>{kinds or '-'}</td></tr>")
    parts.append("</table><p>Kinds: the error class the test cell ended with. "
                 "<code>HiddenTestFailed</code>: a hidden line failed (what it checks is not "
                 "shown); <code>NotGraded</code>: the trusted run has no verdict for the cell "
                 "(a timeout, a dead kernel, a changed cell); <code>TimeLimit</code>: the "
                 "submission's time ran out first.</p>")
    parts.append(f"<h2>Submissions with problems ({len(problems)})</h2>")
    if problems:
        parts.append("<table><tr><th>student</th><th>score</th><th>seconds</th>"
                     "<th>problems</th></tr>")
        for student, score, secs, found in problems:
            text = "<br>".join(e(_withheld(p, data.hidden)) for p in found)
            parts.append(f"<tr><td>{e(student)}</td><td>{score:g}</td><td>{secs:.1f}</td>"
                         f"<td>{text}</td></tr>")
        parts.append("</table>")
    else:
        parts.append("<p>None.</p>")
    if unrecorded:
        parts.append(f"<p>In nbgrader's gradebook but not graded by labkit grade (no time, "
                     f"no problems recorded): {e(', '.join(unrecorded))}.</p>")
    parts.append("<p>Manual review: nbgrader's formgrader works on the same gradebook.</p>")
    page = "\n".join(parts)
    leaked = [h for h in data.hidden if h in page or e(h) in page]
    if leaked:
        raise RuntimeError(f"the report would quote {len(leaked)} hidden-test line(s); "
                           "not written")
    count = len(data.hidden_failures)
    note = (f"<p>Hidden failures: {count}, listed for instructors only in the page beside this "
            f"one (<code>{e(HIDDEN_SUFFIX)}</code>): it quotes hidden tests; this page does not, "
            "so it can go to teaching assistants.</p>")
    return page + "\n" + note + "\n</body></html>"


HIDDEN_SUFFIX = "-hidden-failures.html"


def hidden_failures_path(report_path: str) -> str:
    """Where the instructors' page of hidden failures goes, beside the class report."""
    stem = report_path[:-len(".html")] if report_path.endswith(".html") else report_path
    return stem + HIDDEN_SUFFIX


def render_hidden(data: ClassData) -> str:
    """The instructors-only page: why each hidden test failed (hidden_failures_section)."""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(data.lab)}: "
            "hidden failures (instructors only)</title></head><body>\n"
            + hidden_failures_section(data) + "\n</body></html>")


def hidden_failures_section(data: ClassData) -> str:
    """Why hidden tests failed, per test cell and per student: the exception, its message, the
    case seed, the hidden lines it went through. Instructors only: it quotes hidden tests (the
    rest of the page is checked not to); students' feedback never has it."""
    e = html.escape
    parts = [f"<h2 id='hidden-failures'>Hidden failures (instructors only): "
             f"{len(data.hidden_failures)}</h2>",
             "<p><strong>Instructors only.</strong> Quotes hidden tests: do not share this page "
             "or this section with students. A seed replays the case: "
             "<code>LABKIT_CASE_SEED=SEED</code> in the test cell's environment.</p>"]
    by_cell: dict = {}
    for h in data.hidden_failures:
        by_cell.setdefault((h["notebook"], h["grade_id"]), []).append(h)
    if not by_cell:
        parts.append("<p>None recorded.</p>")
    for (notebook, grade_id), found in sorted(by_cell.items()):
        parts.append(f"<h3>{e(grade_id)} ({e(notebook)}): {len(found)} submission(s)</h3>"
                     "<table><tr><th>student</th><th>kind</th><th>seed</th><th>message</th>"
                     "<th>hidden lines</th></tr>")
        for h in found:
            parts.append(f"<tr><td>{e(h['student'])}</td><td>{e(h['kind'])}</td>"
                         f"<td>{e(str(h['seed'] or '-'))}</td>"
                         f"<td><pre style='white-space:pre-wrap'>{e(h['message'])}</pre></td>"
                         f"<td><pre style='white-space:pre-wrap'>"
                         f"{e(chr(10).join(h['traceback']))}</pre></td></tr>")
        parts.append("</table>")
    return "\n".join(parts)


def _has_lab(path: str, lab: str) -> bool:
    import sqlite3
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            return db.execute("SELECT 1 FROM assignment WHERE name = ?", (lab,)).fetchone() \
                is not None
    except sqlite3.Error:
        return False


def find_gradebook(lab: str, db: str | None = None, grading: str | None = None,
                   course: str | None = None, command: str = "report") -> str:
    """The gradebook URL: `db` as given; else `grading`/gradebook.db (the --out DIR of `labkit
    grade`); else grading/<LAB>/gradebook.db of the course, or the one sqlite gradebook holding
    `lab` one or two folders below the course or the current folder. LookupError (one line,
    saying what to pass) when there is none or more than one."""
    if db:
        return db
    if grading:
        path = os.path.join(os.path.abspath(grading), "gradebook.db")
        if not os.path.exists(path):
            raise LookupError(f"no gradebook at {path}: pass the --out DIR that `labkit grade "
                              f"{lab}` was given, or --db URL")
        return "sqlite:///" + path
    import glob
    from labkit.common import find_course_root
    try:
        root = find_course_root(course)
    except FileNotFoundError:
        root = None
    default = os.path.join(root, "grading", lab, "gradebook.db") if root else None
    if default and os.path.exists(default):
        return "sqlite:///" + default
    candidates = sorted({os.path.abspath(p) for base in filter(None, [root, os.getcwd()])
                         for pattern in ("gradebook.db", "*/gradebook.db", "*/*/gradebook.db")
                         for p in glob.glob(os.path.join(base, pattern))})
    holding = [p for p in candidates if _has_lab(p, lab)]
    if len(holding) == 1:
        print(f"labkit {command}: gradebook {holding[0]}")
        return "sqlite:///" + holding[0]
    where = (f"{len(holding)} gradebooks hold it ({', '.join(holding)})" if holding else
             f"none in {default or 'grading/' + lab + '/'} or near it")
    raise LookupError(f"no gradebook for {lab}: {where}; pass --grading DIR (the --out DIR of "
                      f"`labkit grade`) or --db URL (postgresql://...), or grade it first")


def add_arguments(parser) -> None:
    parser.add_argument("lab", help="lab name, as graded (solutions/<LAB>/)")
    parser.add_argument("--db", default=None, help="gradebook URL (default: the sqlite "
                        "gradebook of `labkit grade`, grading/<LAB>/gradebook.db)")
    parser.add_argument("--grading", default=None, metavar="DIR", help="the --out DIR that "
                        "`labkit grade` was given (its gradebook.db; the report goes there too)")
    parser.add_argument("--out", default=None, help="HTML file to write (default: "
                        "report.html next to the gradebook, grading/<LAB>/report.html)")
    parser.add_argument("--course", default=None, help="course repository (default: here)")


def run(args) -> int:
    import sys
    try:
        db_url = find_gradebook(args.lab, args.db, args.grading, args.course)
        if args.out:
            out = os.path.abspath(args.out)
        elif db_url.startswith("sqlite:///"):
            out = os.path.join(os.path.dirname(db_url[len("sqlite:///"):]), "report.html")
        else:
            from labkit.common import find_course_root
            out = os.path.join(find_course_root(args.course), "grading", args.lab, "report.html")
        data = load(db_url, args.lab)
    except (LookupError, FileNotFoundError) as error:
        print(f"labkit report: {error}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(render(data))
    os.chmod(out, 0o600)
    hidden_out = hidden_failures_path(out)
    with open(hidden_out, "w", encoding="utf-8") as f:
        f.write(render_hidden(data))
    os.chmod(hidden_out, 0o600)
    print(f"labkit report {args.lab}: {len(data.scores)} submissions, {len(data.tasks)} test "
          f"cells -> {out}; {len(data.hidden_failures)} hidden failures (instructors only: it "
          f"quotes hidden tests) -> {hidden_out}")
    return 0
