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
        self._exported = None            # the student's task objects, as the kernel handed them
        self.task_names: list = []
        self._worlds: dict = {}          # size -> SandboxWorld (graded calls run there)
        self._zygote = None              # the sandbox's rank starter (torch imported once)
        self.timings: dict = {}          # phase -> seconds: kernel start, kernel cells, rank
                                         # start, each test cell, close (the result's "timings")

    def timed(self, phase: str, since: float):
        self.timings[phase] = round(self.timings.get(phase, 0.0) + time.monotonic() - since, 3)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def _new_box(self):
        since = time.monotonic()
        try:
            self._start_box()
        finally:
            self.timed("kernel start", since)

    def _start_box(self):
        self._close_worlds()
        self._exported = None
        if self.box is not None:
            self.box.close()
        self.box = Sandbox(self.job["run_dir"], None, self.limits,   # a slot of its own
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
                since = time.monotonic()
                result = self.box.execute(source, min(limit, self.remaining()))
                self.timed("kernel cells", since)
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

    # ---- the student's objects, on ranks this process starts ---------------------------------
    def exported(self) -> dict:
        """{name: {"kind": "callable" | "value" | "missing" | "unsendable", ...}} for the lab's
        task names, as the student's kernel handed them over (callables as bytes, unopened)."""
        if self._exported is None:
            self._exported = self.remote(f"__labkit_grading__.export({self.task_names!r})",
                                         what="export", raw=True)
        return self._exported

    def _blobs(self, names) -> dict:
        from labkit.errors import PicklingError
        exported, blobs = self.exported(), {}
        for name in names:
            entry = exported.get(name, {"kind": "missing"})
            if entry.get("kind") == "missing":
                raise NameError(f"name {name!r} is not defined (the task asks you to define it)")
            if entry.get("kind") == "unsendable":
                raise PicklingError(f"{name} cannot be sent to the ranks: {entry.get('why')}. "
                                    "Ranks are separate processes: your function may use only "
                                    "what it imports or what is defined in the notebook as plain "
                                    "code (not open files, worlds or locks).")
            if entry.get("kind") == "callable" and isinstance(entry.get("blob"), bytes):
                blobs[name] = entry["blob"]
        return blobs

    def install(self, world, names):
        """Load the student's objects `names` on every rank of `world` (before each call: a world
        that was restarted has lost them)."""
        import hashlib
        from labkit.grading import rankside
        blobs = self._blobs(names)
        # once per start of the world's ranks and per object: a test cell that calls a task a
        # thousand times pays one install, not one per call (half of every direct call's round
        # trips); a restarted world (new generation) or a new kernel export loads them again
        have = world.__dict__.setdefault("_labkit_installed", {})
        if not world.alive or have.get("generation") != getattr(world, "generation", None):
            have.clear()
        wanted = {name: hashlib.sha256(blob).hexdigest() for name, blob in blobs.items()}
        missing = {name: blobs[name] for name, digest in wanted.items()
                   if have.get(name) != digest}
        if missing:
            world.run(rankside.install, missing)
            if have.get("generation") != world.generation:
                have.clear()
                have["generation"] = world.generation
            have.update({name: wanted[name] for name in missing})

    def sandbox_world(self, size: int, teaching: bool = True, timeout: float = 60.0):
        """The sandbox's world of `size` ranks (kept for later calls; at most two sizes live)."""
        from labkit.grading.ranks import SandboxWorld
        if self.box is None or not self.box.alive:
            self._restart()
            if self.box is None:
                raise StudentCrashed("the student's kernel is gone (too many restarts or out of "
                                     "time)")
        key = (int(size), bool(teaching))
        world = self._worlds.pop(key, None)
        if world is None or world._closed or world.timeout != timeout:
            if world is not None:
                world.close()
            while len(self._worlds) >= 2:
                self._worlds.pop(next(iter(self._worlds))).close()
            since = time.monotonic()
            world = SandboxWorld(int(size), self.box, timeout=timeout, teaching=teaching,
                                 zygote=self._rank_starter())
            self.timed("rank start", since)
        self._worlds[key] = world              # most recently used last
        return world

    def call_student(self, name: str, args: list, kwargs: dict):
        """A direct call of a task function from a test cell, on a sandbox rank of its own."""
        from labkit.errors import RankError
        from labkit.grading import rankside
        from labkit.grading.trusted import StudentCodeError, rebuild, write_back
        world = self.sandbox_world(1, teaching=False, timeout=self.cell_timeout)
        self.install(world, [name])
        try:
            reply = world.run(rankside.call_named, name, args, kwargs)[0]
            if not (isinstance(reply, dict) and sorted(reply) == ["args", "kwargs", "value"]
                    and isinstance(reply["args"], (list, tuple)) and len(reply["args"]) == len(args)
                    and isinstance(reply["kwargs"], dict)):
                raise StudentCodeError({"type": "UnreadableResult",
                                        "message": f"{name}(): the rank's reply is not what a "
                                                   "call returns (was it changed?)"})
            # the arguments were copies: a change the function made to them reaches the
            # caller's objects, as in a local call (a test of "do not change them" can fail)
            for original, after in zip(args, reply["args"]):
                write_back(original, after)
            for key, original in kwargs.items():
                write_back(original, reply["kwargs"].get(str(key)))
            return reply["value"]
        except RankError as error:
            raise rebuild(error) from None
        except BaseException as error:
            self.note_failure(error, f"{name}()")
            raise
        finally:
            self.student_output(world)

    def note_failure(self, error, what: str):
        """A graded call that hung or lost a rank goes into the submission's problems."""
        from labkit.errors import CallTimeout, RankDied
        if isinstance(error, CallTimeout):
            self.events.append(f"timeout in {what}")
        elif isinstance(error, RankDied):
            self.events.append(f"a rank died in {what} ({error})"[:200])

    def student_output(self, world):
        """What the ranks printed in the last call, shown when the call came from a visible
        line of the test cell (a hidden test's inputs must not be printed back)."""
        if not self._caller_visible():
            return
        for rank, lines in sorted(world.last_output.items()):
            text = "".join(f"[rank {rank}] {line}\n" for _, line in lines)
            if text:
                self._cell_out.append(text)

    def _rank_starter(self):
        """The box's rank starter, started on first use (None without the namespace sandbox: then
        each rank is a process of its own)."""
        from labkit.grading.ranks import Zygote
        if self._zygote is None and self.box.isolated:
            self._zygote = Zygote(self.box, self.box.private_dir(),
                                  template=self.job.get("rank_template"))
        return self._zygote

    def _close_worlds(self):
        since = time.monotonic()
        for world in self._worlds.values():
            world.close()
        self._worlds = {}
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        self.timed("close: worlds", since)

    def remote(self, code: str, what: str, timeout: float | None = None, raw: bool = True):
        """Run a line of the grader's helper in the student's kernel; its plain-data reply (a
        dict), read with weights_only=True."""
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
        return value if isinstance(value, dict) else {}

    def close(self):
        self._close_worlds()
        if self.box is not None:
            since = time.monotonic()
            self.box.close()
            self.box = None
            self.timed("close: kernel", since)


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
        session.task_names = nbtools.task_names(source_nb)
        runner = TrustedRunner(session, session.task_names)
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
                        since = time.monotonic()
                        problem = runner.run_setup(setup.source, str(i))
                        session.timed("trusted setup", since)
                        if problem:
                            setup_errors.append(f"setup cell {i}: {problem}")
                if session.remaining() <= 0:
                    verdict = {"passed": False, "outputs": [
                        {"output_type": "error", "ename": "TimeLimit",
                         "evalue": "the submission's time limit was reached",
                         "traceback": ["TimeLimit: the submission's time limit was reached "
                                       "before this test ran"]}]}
                else:
                    since = time.monotonic()
                    verdict = runner.run_test(cell.source, grade_id)
                    session.timed(f"test {grade_id}", since)
                entry.update(verdict)
                if verdict["passed"]:
                    entry["nonce"] = job["nonce"]
            elif index in session.recorded:
                entry["outputs"] = session.recorded[index]
            cells[str(index)] = entry
    finally:
        since = time.monotonic()
        session.close()
        session.timed("close", since)
    return {"cells": cells, "events": session.events, "restarts": session.restarts,
            "timings": session.timings,
            "setup_errors": setup_errors if "setup_errors" in locals() else []}


def instructor_only(result: dict) -> list:
    """Take every test cell's record of a failed hidden test out of its cell entry: kept under
    the results' "instructor_only" key, which InjectVerdicts never reads (it copies a cell's
    outputs only), so it reaches the gradebook's labkit_hidden_failures and `labkit report`,
    never a notebook or a feedback file."""
    records = []
    for nb_id, graded in sorted(result.get("notebooks", {}).items()):
        for index, entry in sorted(graded.get("cells", {}).items(), key=lambda kv: int(kv[0])):
            record = entry.pop("hidden_failure", None)
            if isinstance(record, dict):
                records.append(dict(record, notebook=nb_id, cell=int(index)))
    return records


WORKER_MEMORY_FLOOR = 6 << 30     # see sandbox.join_worker_cgroup


def grade_submission(job: dict) -> dict:
    """Grade every notebook of one submission; write and return the result."""
    from labkit.grading.sandbox import (_die_with_parent, become_subreaper, join_worker_cgroup,
                                        kill_adopted)
    _die_with_parent()      # the grader stopped or killed: this worker (and its kernels) too
    become_subreaper()      # an unisolated kernel's daemons come back here, to be killed
    if "environ" in job:    # the grader's environment now, not the forkserver's (started by an
        os.environ.clear()  # earlier grade() of this process, maybe under other variables)
        os.environ.update(job["environ"])
        import tempfile
        tempfile.tempdir = None
    if job.get("limits", {}).get("isolate", True):   # a memory cgroup of its own (issue 33)
        run_id = os.path.basename(os.path.dirname(job["run_dir"].rstrip("/")))
        join_worker_cgroup(run_id, job.get("slot", 0),
                           max(WORKER_MEMORY_FLOOR, 2 * int(job.get("limits", {}).get(
                               "memory_bytes", 4 << 30))))
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
    kill_adopted()
    result["seconds"] = round(time.monotonic() - started, 2)
    result["instructor_only"] = {"hidden_failures": instructor_only(result)}
    tmp = job["result_path"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, job["result_path"])
    shutil.rmtree(job["run_dir"], ignore_errors=True)
    return result
