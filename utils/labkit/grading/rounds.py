"""The record of a regrade (`labkit regrade`, regrade.py): what changed in the fixed lab, each
student's scores before and after, and the table of whose score changed.

Two tables in the gradebook's database, beside nbgrader's and labkit_grading (report.py):
  labkit_regrade_round  lab, revision, changes, old_max, new_max, started_at: one row per round
                        (the revision hashes solutions/<LAB> and labkit's code; `changes` lists
                        the cells whose text or points changed, by name: never their text);
  labkit_regrade        lab, revision, student, old_score, old_cells, new_score, new_cells,
                        shard, snapshot_at, regraded_at: one row per student and round; the old
                        scores are written once (before the student is regraded the first time
                        in the round), the new ones after every regrade.
A cell's scores are nbgrader's pair [auto_score, manual_score]; its score is the manual one when
a grader gave one (nbgrader's Grade.score), else the autograder's.
"""
from __future__ import annotations

import copy
import glob
import hashlib
import json
import os
import tempfile
import time


class RegradeRefused(ValueError):
    """The fix cannot be regraded in place (cells added or removed, nothing graded yet)."""


def _tables(metadata):
    from sqlalchemy import Column, Float, String, Table, Text
    rounds = Table("labkit_regrade_round", metadata,
                   Column("lab", String(128), primary_key=True),
                   Column("revision", String(64), primary_key=True),
                   Column("changes", Text, nullable=False),      # JSON [[cell, what changed]]
                   Column("old_max", Float, nullable=False),
                   Column("new_max", Float, nullable=False),
                   Column("started_at", Float, nullable=False))
    students = Table("labkit_regrade", metadata,
                     Column("lab", String(128), primary_key=True),
                     Column("revision", String(64), primary_key=True),
                     Column("student", String(128), primary_key=True),
                     Column("old_score", Float, nullable=False),
                     Column("old_cells", Text, nullable=False),  # JSON {cell: [auto, manual]}
                     Column("new_score", Float),                 # NULL: not regraded yet
                     Column("new_cells", Text),
                     Column("shard", String(32), nullable=False),
                     Column("snapshot_at", Float, nullable=False),
                     Column("regraded_at", Float))
    return rounds, students


class RoundRecord:
    """labkit's two regrade tables (see the module docstring)."""

    def __init__(self, db_url: str):
        from sqlalchemy import MetaData, create_engine
        self.engine = create_engine(db_url, future=True)
        self.metadata = MetaData()
        self.rounds, self.students = _tables(self.metadata)

    def close(self) -> None:
        self.engine.dispose()

    def start(self, lab: str, rev: str, changes: list, old_max: float, new_max: float) -> list:
        """Record the round unless a shard did already; returns the round's changes as the
        first shard saw them (a later shard compares with a gradebook rebuilt already)."""
        from sqlalchemy import select
        self.metadata.create_all(self.engine)
        with self.engine.begin() as conn:
            row = conn.execute(select(self.rounds.c.changes).where(
                (self.rounds.c.lab == lab) & (self.rounds.c.revision == rev))).first()
            if row:
                return [tuple(c) for c in json.loads(row[0])]
            conn.execute(self.rounds.insert().values(
                lab=lab, revision=rev, changes=json.dumps(changes), old_max=old_max,
                new_max=new_max, started_at=time.time()))
        return changes

    def latest(self, lab: str) -> tuple[str, list] | None:
        """(revision, changes) of the lab's latest round; None when it was never regraded."""
        from sqlalchemy import inspect, select
        if not inspect(self.engine).has_table("labkit_regrade_round"):
            return None
        with self.engine.connect() as conn:
            row = conn.execute(select(self.rounds.c.revision, self.rounds.c.changes)
                               .where(self.rounds.c.lab == lab)
                               .order_by(self.rounds.c.started_at.desc())).first()
        return (row[0], [tuple(c) for c in json.loads(row[1])]) if row else None

    def snapshot(self, lab: str, rev: str, scores: dict, shard: str) -> None:
        """The scores before this round, for the students that have none in it yet."""
        from sqlalchemy import select
        with self.engine.begin() as conn:
            have = set(conn.execute(select(self.students.c.student).where(
                (self.students.c.lab == lab) & (self.students.c.revision == rev))).scalars())
            for student, (total, cells) in sorted(scores.items()):
                if student not in have:
                    conn.execute(self.students.insert().values(
                        lab=lab, revision=rev, student=student, old_score=total,
                        old_cells=json.dumps(cells, sort_keys=True), shard=shard,
                        snapshot_at=time.time()))

    def finish(self, lab: str, rev: str, scores: dict) -> None:
        """The scores after regrading, for the students of `scores` (snapshotted before)."""
        with self.engine.begin() as conn:
            for student, (total, cells) in sorted(scores.items()):
                conn.execute(self.students.update().where(
                    (self.students.c.lab == lab) & (self.students.c.revision == rev)
                    & (self.students.c.student == student)).values(
                    new_score=total, new_cells=json.dumps(cells, sort_keys=True),
                    regraded_at=time.time()))

    def rows(self, lab: str, rev: str, students=None) -> list:
        """[{student, old_score, new_score, changed, kept}] of the round (new_score None: not
        regraded yet), for `students` only when given."""
        from sqlalchemy import select
        with self.engine.connect() as conn:
            result = list(conn.execute(select(self.students).where(
                (self.students.c.lab == lab) & (self.students.c.revision == rev))
                .order_by(self.students.c.student)))
        rows = []
        for r in result:
            if students is not None and r.student not in students:
                continue
            old = json.loads(r.old_cells)
            new = json.loads(r.new_cells) if r.new_cells else None
            changed, kept = differences(old, new) if new is not None else ([], [])
            rows.append({"student": r.student, "old_score": r.old_score,
                         "new_score": r.new_score, "changed": changed, "kept": kept})
        return rows


# --- what the gradebook holds ----------------------------------------------------------------
def gradebook_cells(db_url: str, course_id: str, lab: str) -> dict | None:
    """{notebook: {kind: {cell: what}}} of `lab` in a gradebook (None: the lab is not in it):
    grade and task cells with their points, solution cells, source cells with their text."""
    from nbgrader.api import Gradebook, MissingEntry
    with Gradebook(db_url, course_id) as gb:
        try:
            assignment = gb.find_assignment(lab)
        except MissingEntry:
            return None
        return {nb.name: {
            "grade": {c.name: float(c.max_score) for c in nb.grade_cells},
            "task": {c.name: float(c.max_score) for c in nb.task_cells},
            "solution": {c.name: "" for c in nb.solution_cells},
            "source": {c.name: (c.cell_type, bool(c.locked), c.source) for c in nb.source_cells},
        } for nb in assignment.notebooks}


def new_cells(config, lab: str) -> dict:
    """The cells of solutions/<LAB> as nbgrader's generate_assignment stores them, built into a
    scratch gradebook and release folder (nothing shared is touched)."""
    from labkit.grading.pipeline import _generate
    local = copy.deepcopy(config)
    with tempfile.TemporaryDirectory(prefix="labkit-regrade-") as scratch:
        local.CourseDirectory.db_url = "sqlite:///" + os.path.join(scratch, "check.db")
        local.CourseDirectory.release_directory = os.path.join(scratch, "release")
        _generate(local, lab)
        return gradebook_cells(local.CourseDirectory.db_url, local.CourseDirectory.course_id, lab)


def compare(old: dict, new: dict, lab: str) -> list:
    """[(cell, what changed)] between the gradebook's cells and the fixed source's; raises
    RegradeRefused, naming every cell added or removed, when nbgrader would refuse the fix."""
    refused = []
    for nb in sorted(set(old) | set(new)):
        if nb not in new or nb not in old:
            refused.append(f"notebook {nb}.ipynb {'removed' if nb not in new else 'added'}")
            continue
        for kind in ("grade", "solution", "task", "source"):
            added = sorted(set(new[nb][kind]) - set(old[nb][kind]))
            removed = sorted(set(old[nb][kind]) - set(new[nb][kind]))
            label = {"grade": "graded", "source": "locked or graded"}.get(kind, kind)
            for names, verb in ((added, "added"), (removed, "removed")):
                if names:
                    refused.append(f"{nb}: {label} cells {verb}: {', '.join(names)}")
    if refused:
        raise RegradeRefused(
            f"labkit regrade {lab}: the fixed solutions/{lab} does not keep the graded cells: "
            + "; ".join(refused) + ". nbgrader keeps one grade per cell and student and refuses "
            "to add or remove cells once submissions exist. Keep every cell and its grade_id: "
            "put new assertions into the existing test cell of the task (its points may change); "
            "to drop a test, keep its cell and set its points to 0. Nothing was changed.")
    changes = []
    for nb in sorted(new):
        prefix = "" if len(new) == 1 else f"{nb}/"
        for name, (_, _, source) in sorted(new[nb]["source"].items()):
            if old[nb]["source"][name][2] != source:
                changes.append((prefix + name, "text"))
        for kind in ("grade", "task"):
            for name, points in sorted(new[nb][kind].items()):
                if old[nb][kind][name] != points:
                    changes.append((prefix + name, f"points {old[nb][kind][name]:g} -> {points:g}"))
    return changes


def class_scores(db_url: str, course_id: str, lab: str) -> dict:
    """{student: (total, {cell: [auto_score, manual_score]})} from nbgrader's gradebook."""
    from nbgrader.api import Gradebook
    found = {}
    with Gradebook(db_url, course_id) as gb:
        for submission in gb.assignment_submissions(lab):
            one = len(submission.notebooks) == 1
            cells = {(g.name if one else f"{nb.name}/{g.name}"): [g.auto_score, g.manual_score]
                     for nb in submission.notebooks for g in nb.grades}
            found[submission.student.id] = (float(submission.score), cells)
    return found


def revision(source_dir: str) -> str:
    """What the tests are: solutions/<LAB> and labkit's code (a checker fixed in labkit is a new
    revision too); bytecode caches left out, so every node of one commit agrees."""
    import labkit
    from labkit.grading.pipeline import _tree_hash
    digest = hashlib.sha256(_tree_hash(source_dir).encode())
    package = os.path.dirname(os.path.abspath(labkit.__file__))
    for name in sorted(glob.glob(os.path.join(package, "**", "*"), recursive=True)):
        if os.path.isfile(name) and "__pycache__" not in name and not name.endswith(".pyc"):
            digest.update(os.path.relpath(name, package).encode())
            with open(name, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


# --- the changes -----------------------------------------------------------------------------
def _score(cell) -> float:
    auto, manual = cell
    return float(manual if manual is not None else auto or 0.0)


def differences(old_cells: dict, new_cells: dict) -> tuple[list, list]:
    """(cells whose score changed, as "cell old -> new"; manual grades kept over a changed
    autograder score, as "cell: manual M kept, autograder A -> B")."""
    changed, kept = [], []
    for name in sorted(set(old_cells) | set(new_cells)):
        old, new = old_cells.get(name, [None, None]), new_cells.get(name, [None, None])
        if _score(old) != _score(new):
            changed.append(f"{name} {_score(old):g} -> {_score(new):g}")
        if new[1] is not None and (old[0] or 0.0) != (new[0] or 0.0):
            kept.append(f"{name}: manual {new[1]:g} kept, autograder {old[0] or 0:g} -> "
                        f"{new[0] or 0:g}")
    return changed, kept


def table(rows: list, lab: str, rev: str, changes: list) -> str:
    """The printed table of `rows` [{student, old_score, new_score, changed, kept}]: only the
    students with a change, and a closing count."""
    listed = [r for r in rows if r["new_score"] is not None and (r["changed"] or r["kept"])]
    waiting = [r["student"] for r in rows if r["new_score"] is None]
    what = ", ".join(f"{cell} ({how})" for cell, how in changes) or "none in solutions/"
    lines = [f"labkit regrade {lab}: revision {rev}; changed test cells: {what}"]
    if listed:
        width = max(7, *(len(r["student"]) for r in listed))
        lines.append(f"{'student':<{width}}  {'old':>6} -> {'new':>6}  what changed")
        for r in listed:
            detail = "; ".join(r["changed"] + [k + " (review it: the formgrader flags the cell)"
                                               for k in r["kept"]])
            lines.append(f"{r['student']:<{width}}  {r['old_score']:>6g} -> "
                         f"{r['new_score']:>6g}  {detail}")
    scored = sum(1 for r in listed if r["old_score"] != r["new_score"])
    lines.append(f"{len(rows) - len(waiting)} students regraded: {scored} total score(s) changed, "
                 f"{sum(len(r['kept']) for r in listed)} manual grade(s) kept over a changed "
                 f"autograder score" + (f"; {len(waiting)} not regraded yet: "
                                        f"{', '.join(waiting[:10])}"
                                        + (" ..." if len(waiting) > 10 else "") if waiting else ""))
    return "\n".join(lines)
