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
                    TimeLimit, NotGraded...): never a message, a traceback or a line of a test.
The report: one HTML page, figures as PNG inside it (matplotlib): total scores, each test cell's
scores and pass rate, failures by kind, grading time; tables of the tasks that fail most and of
the submissions with problems. Every hidden-test line of the gradebook is searched for in the
page before it is written; text that quotes one is withheld.
"""
from __future__ import annotations

import base64
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
    return built, graded


class ClassRecord:
    """labkit's two tables in the gradebook's database (see the module docstring)."""

    def __init__(self, db_url: str):
        from sqlalchemy import MetaData, create_engine
        self.engine = create_engine(db_url, future=True)
        self.metadata = MetaData()
        self.built, self.graded = _tables(self.metadata)

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
             shard: str) -> None:
        """One row per (lab, student), replaced in one transaction: a re-run overwrites it."""
        with self.engine.begin() as conn:
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
