"""Grading one submission (runs in its own process, one per submission, several at once).

    result = grade_submission(job)     # job: see pipeline.py; result is written as JSON

Phase by phase, for each notebook of the lab:
  1. restore it as nbgrader does (test and locked cells from the gradebook, deleted ones re-added);
  2. run its answer, setup and scratch cells, in order, in a sandboxed kernel (sandbox.py); a cell
     that runs past its time limit or kills the kernel is recorded, the kernel is replaced by a
     fresh one that replays the cells before it, and grading goes on without that cell;
  3. run every test cell in this (trusted) process (trusted.py), which reaches the student's
     functions only through the sandbox, with plain data both ways;
  4. write, per cell, the outputs the feedback will show and, for test cells, whether they ran to
     completion here (with the run's nonce: the positive evidence that nbgrader's scores rest on).
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
import time

from labkit.grading import notebook as nbtools
from labkit.grading.sandbox import Limits, Sandbox
from labkit.grading.trusted import (StudentCodeError, StudentCrashed, StudentTimeout,
                                    TrustedRunner, loads_plain)

HELPER = "import labkit.grading._kernel_side as __labkit_grading__"


class Session:
    """The sandbox of one notebook: its kernel, replay after a restart, calls from test cells."""

    def __init__(self, job: dict, deadline: float, seed_dir: str | None):
        self.job, self.deadline, self.seed_dir = job, deadline, seed_dir
        self.limits = Limits(**job.get("limits", {}))
        self.cell_timeout = float(job["cell_timeout"])
        self.box = None
        self.cells: list = []
        self.setup_cells: set = set()
        self.recorded: dict = {}
        self.bad: set = set()
        self.restarts = 0
        self.events: list[str] = []
        self._cell_file = None
        self._hidden: set = set()
        self._cell_out: list[str] = []

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def _new_box(self):
        if self.box is not None:
            self.box.close()
        self.box = Sandbox(self.job["run_dir"], self.job["slot"], self.limits,
                           name=self.job["student"][:16])
        self.box.start(seed_dir=self.seed_dir)
        self.box.execute(HELPER, timeout=60)

    def run_cells(self, cells):
        """cells: [(index, source)] for the kernel, in notebook order."""
        self.cells = cells
        while True:
            self._new_box()
            failed = False
            for index, source in self.cells:
                if index in self.bad:
                    continue
                if self.remaining() <= 0:
                    self.recorded.setdefault(index, [_note("not run: the submission's time "
                                                           "limit was reached")])
                    continue
                # locked setup cells are the instructor's (starting a world under load takes
                # a while): they get at least a minute
                limit = self.cell_timeout if index not in self.setup_cells else \
                    max(self.cell_timeout, 60.0)
                result = self.box.execute(source, min(limit, self.remaining()))
                outputs = list(result.outputs)
                if result.status == "timeout":
                    outputs.append(_note(f"stopped: this cell ran past its time limit "
                                         f"({self.cell_timeout:.0f} s); grading went on "
                                         "without it"))
                    self.events.append(f"timeout in cell {index}")
                elif result.status == "died":
                    outputs.append(_note("stopped: the kernel died in this cell (exit, crash "
                                         "or memory limit); grading went on without it"))
                    self.events.append(f"kernel died in cell {index}")
                self.recorded.setdefault(index, outputs)
                if result.status in ("timeout", "died"):
                    self.bad.add(index)
                    failed = True
                    break
            if not failed:
                return
            self.restarts += 1
            if self.restarts > 3 or self.remaining() <= 0:
                self.box.close()
                self.box = None
                for index, _ in self.cells:
                    self.recorded.setdefault(index, [_note("not run: too many restarts")])
                return

    def _restart(self):
        """After a call that hung or crashed: a fresh kernel with the cells replayed."""
        self.restarts += 1
        if self.restarts > 3 or self.remaining() <= 0:
            if self.box is not None:
                self.box.close()
            self.box = None
            return
        self.run_cells(self.cells)

    # ---- calls from test cells ------------------------------------------------------------
    def begin_cell(self, hidden: set, filename: str):
        self._hidden, self._cell_file, self._cell_out = hidden, filename, []

    def end_cell(self) -> str:
        return "".join(self._cell_out)

    def _caller_visible(self) -> bool:
        for frame in inspect.stack(context=0):
            if frame.filename == self._cell_file:
                return frame.lineno not in self._hidden
        return not self._hidden

    def probe(self, names):
        return self.remote(f"__labkit_grading__.probe({list(names)!r})", what="probe",
                           raw=True)

    def remote(self, code: str, what: str, timeout: float | None = None, raw: bool = False):
        if self.box is None or not self.box.alive:
            self._restart()
            if self.box is None:
                raise StudentCrashed(f"{what}: the student's kernel is gone (too many restarts "
                                     "or out of time)")
        limit = min(timeout or self.cell_timeout, max(self.remaining(), 0.1))
        result = self.box.execute(code, limit)
        if self._caller_visible():
            for out in result.outputs:
                if out.get("output_type") == "stream":
                    self._cell_out.append(out["text"])
        if result.status == "timeout":
            self.events.append(f"timeout in {what}")
            self._restart()
            raise StudentTimeout(f"{what} ran past its time limit ({limit:.0f} s); "
                                 "it was stopped")
        if result.status == "died":
            self.events.append(f"kernel died in {what}")
            self._restart()
            raise StudentCrashed(f"the kernel died while running {what} (exit, crash or "
                                 "memory limit)")
        if not result.payloads:
            err = result.error or {}
            raise StudentCodeError({"type": err.get("ename", "NoResult"),
                                    "message": err.get("evalue", f"{what} returned nothing")})
        try:
            value = loads_plain(result.payloads[-1])
        except Exception as error:  # noqa: BLE001 (anything unreadable is the student's)
            raise StudentCodeError({"type": "UnreadableResult",
                                    "message": f"{what}: {type(error).__name__}"}) from None
        if raw:
            return value if isinstance(value, dict) else {}
        if not isinstance(value, dict) or not ("value" in value or "error" in value):
            raise StudentCodeError({"type": "UnreadableResult", "message": what})
        if "error" in value:
            from labkit.grading.trusted import rebuild_error
            raise rebuild_error(value["error"] if isinstance(value["error"], dict) else {})
        return value["value"]

    def close(self):
        if self.box is not None:
            self.box.close()
            self.box = None


def _note(text: str) -> dict:
    return {"output_type": "stream", "name": "stdout", "text": f"[grader] {text}\n"}


def grade_notebook(job: dict, nb_id: str, path: str, deadline: float) -> dict:
    import nbformat
    source_nb = nbformat.read(os.path.join(job["source_dir"], nb_id + ".ipynb"), as_version=4)
    submitted = nbformat.read(path, as_version=4)
    restored = nbtools.restore(submitted, job["db_url"], job["lab"], nb_id, job["student"])
    session = Session(job, deadline, job.get("seed_dir"))
    cells = {}
    try:
        kernel_cells = [(i, c.source) for i, c in enumerate(restored.cells)
                        if nbtools.role(c) in ("answer", "setup", "other")]
        session.setup_cells = {i for i, c in enumerate(restored.cells)
                               if nbtools.role(c) == "setup"}
        session.run_cells(kernel_cells)
        runner = TrustedRunner(session, nbtools.task_names(source_nb))
        source_index = {c.metadata.get("nbgrader", {}).get("grade_id"): i
                        for i, c in enumerate(source_nb.cells)}
        setups = [(i, c) for i, c in enumerate(source_nb.cells) if nbtools.role(c) == "setup"]
        setup_done, setup_errors = set(), []
        for index, cell in enumerate(restored.cells):
            kind = nbtools.role(cell)
            entry = {"sha": nbtools.sha(cell.source), "role": kind}
            if kind == "test":
                grade_id = cell.metadata.nbgrader.get("grade_id")
                upto = source_index.get(grade_id, len(source_nb.cells))
                for i, setup in setups:
                    if i < upto and i not in setup_done:
                        setup_done.add(i)
                        problem = runner.run_setup(setup.source, str(i))
                        if problem:
                            setup_errors.append(f"setup cell {i}: {problem}")
                if session.remaining() <= 0:
                    verdict = {"passed": False, "outputs": [
                        {"output_type": "error", "ename": "TimeLimit",
                         "evalue": "the submission's time limit was reached",
                         "traceback": ["TimeLimit: the submission's time limit was reached "
                                       "before this test ran"]}]}
                else:
                    verdict = runner.run_test(cell.source, grade_id)
                entry.update(verdict)
                if verdict["passed"]:
                    entry["nonce"] = job["nonce"]
            elif index in session.recorded:
                entry["outputs"] = session.recorded[index]
            cells[str(index)] = entry
    finally:
        session.close()
    return {"cells": cells, "events": session.events, "restarts": session.restarts,
            "setup_errors": setup_errors if "setup_errors" in locals() else []}


def grade_submission(job: dict) -> dict:
    """Grade every notebook of one submission; write and return the result."""
    started = time.monotonic()
    deadline = started + float(job["time_limit"])
    result = {"student": job["student"], "nonce": job["nonce"], "notebooks": {}, "events": [],
              "error": None}
    try:
        os.makedirs(job["run_dir"], mode=0o700, exist_ok=True)
        for nb_id, path in sorted(job["notebooks"].items()):
            graded = grade_notebook(job, nb_id, path, deadline)
            result["notebooks"][nb_id] = graded
            result["events"] += [f"{nb_id}: {e}" for e in graded["events"]]
    except Exception as error:  # noqa: BLE001 (reported, the submission gets what it earned)
        result["error"] = f"{type(error).__name__}: {error}"
    result["seconds"] = round(time.monotonic() - started, 2)
    tmp = job["result_path"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, job["result_path"])
    shutil.rmtree(job["run_dir"], ignore_errors=True)
    return result
