"""`labkit grade LAB SUBMISSIONS_DIR`: the whole run, from submissions to grades.csv and feedback.

    from labkit.grading import grade
    report = grade("lab00_first_collectives", "incoming/", jobs=2, out="grading/lab00")

  1. gradebook: built from solutions/<LAB>/ with nbgrader's generate_assignment (into a private
     release folder, never labs/), again whenever solutions/<LAB>/ changed;
  2. submissions: SUBMISSIONS_DIR/<student>/[<LAB>/]<notebook>.ipynb, copied (no symlinks,
     size-capped) into nbgrader's submitted layout under OUT/work/;
  3. execution, in parallel: one process per submission (worker.py), each with its own sandbox
     user and kernel; each writes OUT/work/results/<student>.json;
  4. bookkeeping, in order: nbgrader autograde (InjectVerdicts instead of Execute) writes the
     scores to the gradebook; nbgrader generate_feedback (ClearHiddenTests + ScrubHidden) writes
     OUT/feedback/<student>/<LAB>/<notebook>.html, then every feedback file is checked for
     hidden-test text; OUT/grades.csv and a printed summary close the run.
OUT (default grading/<LAB>) is made private to the grader (mode 700): gradebook, copies, results.

At class scale (docs/CLASS_SCALE.md): `shard=(i, N)` grades the students whose id hashes to i
modulo N (sha256, so every machine picks the same ones), N shards writing into one PostgreSQL
gradebook. The gradebook is built once, under a lock held in the database (pg_advisory_lock),
and stamped there with the hash of solutions/<LAB>; each shard keeps its release copy in
OUT/work/shard-i-of-N/ and writes OUT/grades-shard-i-of-N.csv; per-student folders are shared.
Every graded submission is also recorded in labkit's own table of the gradebook (report.py), from
which `labkit report` draws. A shard that dies is re-run alone: it regrades its own students.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import glob
import hashlib
import json
import multiprocessing
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time

from labkit.common import find_course_root  # noqa: F401 (labkit.grading.pipeline.find_course_root)

_STUDENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,99}$")
MAX_NOTEBOOK_BYTES = 20 << 20


@dataclasses.dataclass
class StudentResult:
    student: str
    score: float
    max_score: float
    seconds: float
    problems: list
    graded: bool = True      # False: never graded (no kernel, no result, worker killed): not a 0


class GradingStopped(BaseException):
    """SIGTERM or SIGINT reached the grading run (a preempted Slurm or Kubernetes shard, Ctrl-C).

    Raised from the signal handler, as torch elastic's agent raises its SignalException, so the
    run unwinds through its `finally` blocks: workers killed (their kernels and ranks die with
    them), sandboxes and cgroups removed. A BaseException: no `except Exception` on the way (in
    nbgrader, say) swallows it. `what` says what was stopped."""

    def __init__(self, signum: int, what: str = ""):
        self.signum, self.what = signum, what
        self.phases, self._mark = [], time.monotonic()    # the stop's steps, timed (phase())
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name}" + (f": {what}" if what else ""))


def _stop_phase(name: str) -> None:
    """In a `finally` of the stop path: how long its step took, kept on the GradingStopped in
    flight (if one is) for the stop line."""
    stop = sys.exc_info()[1]
    if isinstance(stop, GradingStopped):
        now = time.monotonic()
        stop.phases.append(f"{name} {now - stop._mark:.1f} s")
        stop._mark = now


class IsolationUnavailable(RuntimeError):
    """This machine cannot build the grading sandbox and the run did not allow grading without."""


@dataclasses.dataclass
class GradeReport:
    lab: str
    out: str
    results: list
    seconds: float
    jobs: int
    grades_csv: str = ""
    sandbox: str = ""        # the run's sandbox folder (removed at the end; its path names it)

    @property
    def scores(self) -> dict:
        return {r.student: r.score for r in self.results}

    @property
    def not_graded(self) -> list:
        """The results of submissions that could not be graded at all (`labkit grade` exits 1)."""
        return [r for r in self.results if not r.graded]


def default_jobs(limits: dict | None = None) -> int:
    """Submissions graded at once when `--jobs` is not given: what the machine can run, not its
    core count. A submission keeps about two cores busy (its kernel, then the 2-8 ranks of each
    graded call) and holds up to its memory limit plus ~2 GiB for its grading worker: so
    min(cores // 2, available memory // (limit + 2 GiB)), at least 1 (1 on a 2-core laptop)."""
    import psutil
    memory = int((limits or {}).get("memory_bytes", 4 << 30)) + (2 << 30)
    by_cores = (os.cpu_count() or 1) // 2
    by_memory = psutil.virtual_memory().available // memory
    return max(1, min(by_cores, by_memory))


def parse_shard(text: str) -> tuple[int, int]:
    """"i/N" -> (i, N), 0 <= i < N (0-based, like a Slurm array index or a Kubernetes
    JOB_COMPLETION_INDEX)."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not match or not 0 <= int(match[1]) < int(match[2]):
        raise ValueError(f"--shard {text!r}: expected i/N with 0 <= i < N, e.g. 0/4 .. 3/4")
    return int(match[1]), int(match[2])


def in_shard(student: str, shard: tuple[int, int] | None) -> bool:
    """Whether `student` belongs to shard (i, N): sha256 of the id modulo N, the same on
    every machine and Python (never the salted built-in hash)."""
    if shard is None:
        return True
    index, count = shard
    return int(hashlib.sha256(student.encode()).hexdigest()[:16], 16) % count == index


@contextlib.contextmanager
def gradebook_lock(db_url: str):
    """Held while the gradebook is created or rebuilt: a PostgreSQL advisory lock (released by
    the server if this process dies), a file lock next to an sqlite gradebook."""
    if db_url.startswith("postgresql"):
        from sqlalchemy import create_engine, text
        engine = create_engine(db_url, future=True, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _LOCK_KEY})
                try:
                    yield
                finally:
                    conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _LOCK_KEY})
        finally:
            engine.dispose()
    elif db_url.startswith("sqlite:///"):
        import fcntl
        with open(db_url[len("sqlite:///"):] + ".lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield
    else:
        yield


_LOCK_KEY = int(hashlib.sha256(b"labkit grade: gradebook").hexdigest()[:15], 16)


def _config(course: str, source_root: str, out: str, db_url: str, lab: str,
            private: str | None = None):
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader
    config = Config()
    course_config = os.path.join(course, "nbgrader_config.py")
    if os.path.isfile(course_config):       # the course's own settings (e.g. code stubs)
        config.merge(PyFileConfigLoader("nbgrader_config.py", path=course).load_config())
    work = os.path.join(out, "work")
    config.CourseDirectory.root = course
    config.CourseDirectory.source_directory = source_root
    config.CourseDirectory.release_directory = os.path.join(private or work, "release")
    config.CourseDirectory.submitted_directory = os.path.join(work, "submitted")
    config.CourseDirectory.autograded_directory = os.path.join(work, "autograded")
    config.CourseDirectory.feedback_directory = os.path.join(out, "feedback")
    config.CourseDirectory.db_url = db_url
    config.CourseDirectory.course_id = config.CourseDirectory.get("course_id", "")
    if not db_url.startswith("sqlite") and not config.CourseDirectory.course_id:
        # nbgrader's default "" names no row of its `course` table: sqlite lets that pass,
        # PostgreSQL's foreign key does not
        config.CourseDirectory.course_id = "default_course"
    config.OverwriteCells.add_missing_cells = True
    config.Autograde.sanitize_preprocessors = [
        "nbgrader.preprocessors.ClearOutput",
        "nbgrader.preprocessors.DeduplicateIds",
        "nbgrader.preprocessors.OverwriteKernelspec",
        "nbgrader.preprocessors.OverwriteCells",
        "labkit.grading.nbhooks.Renode",
        "nbgrader.preprocessors.CheckCellMetadata"]
    config.Autograde.autograde_preprocessors = [
        "labkit.grading.nbhooks.InjectVerdicts",
        "nbgrader.preprocessors.IgnorePattern",
        "nbconvert.preprocessors.ClearMetadataPreprocessor",
        "nbgrader.preprocessors.LimitOutput",
        "nbgrader.preprocessors.SaveAutoGrades",
        "nbgrader.preprocessors.AssignLatePenalties",
        "nbgrader.preprocessors.CheckCellMetadata"]
    config.GenerateFeedback.preprocessors = [
        "nbgrader.preprocessors.GetGrades",
        "nbgrader.preprocessors.ClearHiddenTests",
        "labkit.grading.nbhooks.ScrubHidden",
        "labkit.grading.nbhooks.FeedbackCSS"]
    config.InjectVerdicts.results_dir = os.path.join(work, "results")
    return config


def alembic_head_in_process() -> str:
    """The revision nbgrader stamps a new gradebook with, read in this process.

    nbgrader's `Gradebook()` on an empty database asks a subprocess (`alembic heads`: a second
    interpreter that imports alembic, then nbgrader's migration environment and with it nbgrader
    and nbformat) for the head revision of its migration scripts, 2-6 s on 2 cores, at every new
    gradebook. The same question asked of the same scripts (nbgrader.dbutil.ALEMBIC_DIR) through
    alembic's own API answers in milliseconds; `use_alembic_head_in_process` puts it in
    nbgrader's place. tests/grading/test_units.py compares the two."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory
    from nbgrader import dbutil
    config = Config()
    config.set_main_option("script_location", dbutil.ALEMBIC_DIR)
    heads = ScriptDirectory.from_config(config).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"nbgrader's migrations in {dbutil.ALEMBIC_DIR} have {len(heads)} "
                           f"heads ({heads}); nbgrader's own `alembic heads` would be ambiguous")
    return heads[0]


@functools.lru_cache(maxsize=None)
def use_alembic_head_in_process() -> None:
    import nbgrader.api
    head = alembic_head_in_process()
    nbgrader.api.get_alembic_version = lambda: head


def _api(config):
    import logging
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    use_alembic_head_in_process()
    # nbgrader runs `alembic` from PATH: make this interpreter's scripts findable (venvs)
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)
    api.log.setLevel(logging.WARNING)
    return api


def _tree_hash(path: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True)):
        if os.path.isfile(name):
            digest.update(os.path.relpath(name, path).encode())
            with open(name, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def build_gradebook(config, source_root: str, lab: str, out: str,
                    private: str | None = None) -> None:
    """nbgrader generate_assignment, when solutions/<LAB> changed: into the gradebook (once for
    all shards: under gradebook_lock, stamped in the database) and into this run's private
    release folder (from a throwaway gradebook when the shared one is already up to date).
    Returns whether it replaced an earlier version of the lab in the gradebook."""
    import copy
    from labkit.grading.report import ClassRecord
    from nbgrader.api import Gradebook
    private = private or os.path.join(out, "work")
    stamp_path = os.path.join(private, f"release-{lab}.stamp")
    source_hash = _tree_hash(os.path.join(source_root, lab))
    db_url = config.CourseDirectory.db_url
    _api(config)                                  # puts alembic on PATH for Gradebook()
    record = ClassRecord(db_url)
    try:
        with gradebook_lock(db_url):
            Gradebook(db_url, config.CourseDirectory.course_id).close()   # nbgrader's tables
            record.create()                                                # then labkit's
            earlier = record.source_hash(lab)
            if earlier != source_hash:
                _generate(config, lab)
                record.set_source_hash(lab, source_hash)
                with open(stamp_path, "w") as f:
                    f.write(source_hash)
                return earlier is not None
    finally:
        record.close()
    release = os.path.join(config.CourseDirectory.release_directory, lab)
    if os.path.isdir(release) and os.path.exists(stamp_path) and \
            open(stamp_path).read() == source_hash:
        return False
    with tempfile.TemporaryDirectory(prefix="labkit-release-") as scratch:
        local = copy.deepcopy(config)                 # same release, a gradebook of its own
        local.CourseDirectory.db_url = "sqlite:///" + os.path.join(scratch, "release.db")
        _generate(local, lab)
    with open(stamp_path, "w") as f:
        f.write(source_hash)
    return False


def _graded_count(db_url: str, course_id: str, lab: str) -> int:
    """How many submissions of `lab` the gradebook holds (0 when it cannot tell)."""
    from nbgrader.api import Gradebook, MissingEntry
    try:
        with Gradebook(db_url, course_id) as gb:
            return len(gb.find_assignment(lab).submissions)
    except (MissingEntry, Exception):  # noqa: BLE001 - a hint only
        return 0


def _generate(config, lab: str) -> None:
    result = _api(config).generate_assignment(lab, force=True, create=True)
    if not result["success"]:
        raise RuntimeError(f"nbgrader generate_assignment {lab} failed:\n"
                           f"{result.get('error') or result.get('log')}")


def find_submissions(submissions_dir: str, lab: str, notebook_ids: list) -> dict:
    """{student: {notebook_id: path}} from SUBMISSIONS_DIR/<student>/[<lab>/]*.ipynb."""
    found = {}
    for student in sorted(os.listdir(submissions_dir)):
        folder = os.path.join(submissions_dir, student)
        if not os.path.isdir(folder) or os.path.islink(folder) or student.startswith("."):
            continue
        if not _STUDENT_ID.match(student):
            print(f"labkit grade: skipping {student!r}: not a valid student id", file=sys.stderr)
            continue
        if os.path.isdir(os.path.join(folder, lab)) and not os.path.islink(
                os.path.join(folder, lab)):
            folder = os.path.join(folder, lab)
        notebooks = {}
        candidates = sorted(n for n in os.listdir(folder) if n.endswith(".ipynb"))
        for nb_id in notebook_ids:
            if f"{nb_id}.ipynb" in candidates:
                notebooks[nb_id] = os.path.join(folder, f"{nb_id}.ipynb")
        if not notebooks and len(notebook_ids) == 1 and len(candidates) == 1:
            notebooks[notebook_ids[0]] = os.path.join(folder, candidates[0])   # renamed
        found[student] = notebooks
    return found


def normalise_metadata(data: bytes, source_nb) -> bytes:
    """nbgrader metadata as the source has it: a cell whose grade_id the source knows gets the
    source's flags and points back (a test cell turned into a non-graded or solution cell, or
    given more points, is a test cell again); an unknown grade_id loses its nbgrader metadata."""
    import nbformat
    nb = nbformat.reads(data.decode("utf-8", errors="replace"), as_version=4)
    known = {c.metadata["nbgrader"]["grade_id"]: c.metadata["nbgrader"]
             for c in source_nb.cells if "grade_id" in c.metadata.get("nbgrader", {})}
    kinds = {c.metadata["nbgrader"]["grade_id"]: c.cell_type
             for c in source_nb.cells if "grade_id" in c.metadata.get("nbgrader", {})}
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader")
        if not isinstance(meta, dict):
            cell.metadata.pop("nbgrader", None)
            continue
        grade_id = meta.get("grade_id")
        if grade_id in known and kinds[grade_id] == cell.cell_type:
            cell.metadata["nbgrader"] = {k: v for k, v in known[grade_id].items()
                                         if k != "checksum"}
            if "checksum" in meta:
                cell.metadata["nbgrader"]["checksum"] = meta["checksum"]
        else:
            cell.metadata.pop("nbgrader", None)
    return nbformat.writes(nb).encode()


def _copy_submission(notebooks: dict, dest: str, source_dir: str) -> list:
    """Copy without following links, refusing oversized files; return problems."""
    import nbformat
    problems = []
    os.makedirs(dest, exist_ok=True)
    for nb_id, path in notebooks.items():
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as error:
            problems.append(f"{nb_id}: cannot read ({error.strerror}; links are refused)")
            continue
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_NOTEBOOK_BYTES + 1)
        if len(data) > MAX_NOTEBOOK_BYTES:
            problems.append(f"{nb_id}: larger than {MAX_NOTEBOOK_BYTES >> 20} MiB, not graded")
            continue
        try:
            source_nb = nbformat.read(os.path.join(source_dir, f"{nb_id}.ipynb"), as_version=4)
            data = normalise_metadata(data, source_nb)
        except Exception:  # noqa: BLE001 (whatever is wrong with it, it is not a notebook)
            problems.append(f"{nb_id}: not a readable notebook")
            data = json.dumps({"cells": [], "metadata": {}, "nbformat": 4,
                               "nbformat_minor": 5}).encode()
        with open(os.path.join(dest, f"{nb_id}.ipynb"), "wb") as f:
            f.write(data)
    return problems


def _hidden_texts(source_dir: str, notebook_ids: list, release_dir: str | None = None) -> dict:
    """{grade_id: hidden lines the student's copy does not hold} (feedback.secret_texts)."""
    from labkit.grading.feedback import secret_texts
    return secret_texts(source_dir, release_dir, notebook_ids)


def _short_multiprocessing_tempdir() -> None:
    """The forkserver listens on a unix socket in multiprocessing's temporary folder, under TMPDIR;
    a unix socket's path holds 107 bytes, so a long TMPDIR (a batch job's) broke every run. That
    folder is made under /tmp then (it is made once per process and removed at its exit)."""
    from multiprocessing import process, util
    if process.current_process()._config.get("tempdir") is not None:
        return                                     # made already (a forkserver runs, or ran)
    if len(os.path.join(tempfile.gettempdir(), "pymp-12345678", "listener-12345678")) < 100:
        return
    saved = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        util.get_temp_dir()
    finally:
        tempfile.tempdir = saved


def _run_workers(jobs: list, parallel: int, time_limit: float, log) -> dict:
    """Each job in a fresh process (forked from a server that preloaded torch and nbgrader), at
    most `parallel` at a time; a worker that outlives its limit is killed (its sandbox with it).
    Returns {student: why} for the workers killed. However it ends (GradingStopped, any error),
    no worker outlives it: each is killed and waited for, and PR_SET_PDEATHSIG takes its kernel,
    ranks and rank starter with it (the caller then removes sandboxes and cgroups)."""
    from labkit.grading.worker import grade_submission
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "nbformat", "nbgrader.preprocessors",
                                    "labkit.grading.worker", "labkit.checks"])
    _short_multiprocessing_tempdir()
    pending, running, free_slots = list(jobs), {}, list(range(parallel))
    killed, stopped = {}, False
    stopping = {signal.SIGTERM, signal.SIGINT}
    try:
        while pending or running:
            while pending and free_slots:
                job = pending.pop(0)
                job["slot"] = free_slots.pop(0)
                process = context.Process(target=grade_submission, args=(job,), daemon=False)
                # no stop between the fork and `running` knowing the worker (it would be missed)
                blocked = _block(stopping)
                try:
                    process.start()
                    running[process] = (job, time.monotonic())
                finally:
                    _unblock(stopping, blocked)
            for process, (job, started) in list(running.items()):
                if process.exitcode is None and time.monotonic() - started > time_limit + 120:
                    process.kill()
                    killed[job["student"]] = (f"the grading process was killed after "
                                              f"{time_limit + 120:.0f} s")
                    log(f"  {job['student']}: grading process killed after "
                        f"{time_limit + 120:.0f} s")
                if process.exitcode is not None:
                    process.join()
                    del running[process]
                    free_slots.append(job["slot"])
                    free_slots.sort()
            time.sleep(0.05)
    except GradingStopped as stop:
        stop.what = (f"{len(running)} grading process(es) killed "
                     f"({', '.join(job['student'] for job, _ in running.values()) or '-'}), "
                     f"{len(pending)} submission(s) not started, "
                     f"{len(jobs) - len(pending) - len(running)} executed")
        stopped = True
        raise
    finally:
        for process in running:
            if process.exitcode is None:
                process.kill()
        for process in running:
            process.join()
        _stop_phase("workers")
        if stopped:
            _kill_forkserver()
            _stop_phase("forkserver")
    return killed


def _kill_forkserver() -> None:
    """On a stop (SIGTERM, SIGINT), the workers' forkserver is SIGKILLed, not asked to leave: it
    holds torch and nbgrader, and its finalization held the grader's stdout for 3-51 s after the
    grader had exited, at load 10-30 (labkit.common.kill_forkserver says why that is safe)."""
    from labkit.common import kill_forkserver
    kill_forkserver()


def _block(signals: set):
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, signals)


def _unblock(signals: set, before):
    if before is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM and SIGINT raise GradingStopped for as long as this lasts (main thread only; the
    previous handlers come back after). A second signal while the run is stopping is ignored:
    the cleanup it would interrupt is what the first one asked for."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []

    def handler(signum, frame):
        if not received:
            received.append(signum)
            raise GradingStopped(signum)

    saved = {number: signal.signal(number, handler) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for number, previous in saved.items():
            signal.signal(number, previous)


NO_ISOLATION_WARNING = """labkit grade: WITHOUT ISOLATION ({why}): every student's kernel runs as
  {user}, the grader's own user.
  enforced:     per-cell and per-submission time limits; test cells, hidden tests and expected
                values stay in the grader's process; rlimits (memory per process, open files,
                file size); every process a submission leaves (daemons included) is killed
                when it is graded
  NOT enforced: student code can read and write whatever {user} can (solutions/, the gradebook,
                other submissions, this machine's files), reach the network, and signal or trace
                the grader and other submissions; no cgroup (memory and processes are per
                process only); traffic is counted in the host's network"""


def grade(lab: str, submissions_dir: str, jobs: int | None = None, out: str | None = None,
          course: str | None = None, db_url: str | None = None, time_limit: float = 300.0,
          cell_timeout: float = 60.0, limits: dict | None = None, log=print,
          shard: tuple[int, int] | str | None = None, no_isolation: bool = False,
          _regrading: bool = False) -> GradeReport:
    """Grade every submission of `lab` in `submissions_dir` (or shard (i, N) of them, see
    in_shard); see the module docstring.

    Raises IsolationUnavailable where the sandbox cannot be built (not root, no `unshare`) unless
    `no_isolation=True` (`--no-isolation`), which grades anyway and logs what that mode does not
    enforce. SIGTERM and SIGINT stop the run in order (GradingStopped, after every worker, sandbox
    and cgroup of the run is gone); `report.not_graded` lists the submissions it could not grade."""
    with stop_on_signals():
        try:
            return _grade(lab, submissions_dir, jobs, out, course, db_url, time_limit,
                          cell_timeout, limits, log, shard, no_isolation, _regrading)
        except GradingStopped as stop:
            log(f"labkit grade {lab}: stopped by {signal.Signals(stop.signum).name}: "
                f"{stop.what or 'no grading process was running (gradebook build or bookkeeping)'}"
                "; no process, sandbox or cgroup of this run is left; grades.csv not written"
                + (f" (stop took {', '.join(stop.phases)})" if stop.phases else ""))
            raise


def _user_name() -> str:
    import pwd
    try:
        return f"{pwd.getpwuid(os.geteuid()).pw_name} (uid {os.geteuid()})"
    except KeyError:
        return f"uid {os.geteuid()}"


def _grade(lab, submissions_dir, jobs, out, course, db_url, time_limit, cell_timeout, limits,
           log, shard, no_isolation, regrading=False) -> GradeReport:
    from labkit.grading.sandbox import can_isolate
    started = time.monotonic()
    shard = parse_shard(shard) if isinstance(shard, str) else shard
    shard = shard if shard and shard[1] > 1 else None
    if shard and not (db_url or "").startswith("postgresql"):
        raise ValueError(f"--shard {shard[0]}/{shard[1]} needs a gradebook every shard can "
                         f"write to at once: pass --db postgresql://USER@HOST/DATABASE "
                         f"(got {db_url or 'the default sqlite file'}); see docs/CLASS_SCALE.md")
    shard_name = f"{shard[0]}/{shard[1]}" if shard else "-"
    course = find_course_root(course)
    source_root = os.path.join(course, "solutions")
    source_dir = os.path.join(source_root, lab)
    if not os.path.isdir(source_dir):
        raise FileNotFoundError(f"no lab {lab!r}: {source_dir} does not exist")
    isolated, why = can_isolate()
    user = _user_name()
    if not isolated and not no_isolation:
        raise IsolationUnavailable(
            f"labkit grade: this machine cannot build the grading sandbox ({why}): student code "
            f"would run as {user}, able to read solutions/, the gradebook and every other "
            "submission. Grade as root on Linux with `unshare` and `useradd` (`labkit doctor` "
            "checks), or pass --no-isolation (Python: grade(..., no_isolation=True)) to grade "
            "without it, knowing what that mode does not enforce (docs/INSTRUCTORS.md)")
    if not isolated:
        log(NO_ISOLATION_WARNING.format(why=why, user=user))
    # the workers' sandboxes do as this process decided (a worker never falls back on its own)
    limits = dict(limits or {}, isolate=isolated, require_isolation=isolated)
    out = os.path.abspath(out or os.path.join(course, "grading", lab))
    os.makedirs(out, exist_ok=True)
    os.chmod(out, 0o700)
    work = os.path.join(out, "work")
    private = os.path.join(work, f"shard-{shard[0]}-of-{shard[1]}") if shard else work
    for sub in ("submitted", "autograded", "results"):
        os.makedirs(os.path.join(work, sub), exist_ok=True)
    os.makedirs(os.path.join(private, "release"), exist_ok=True)
    db_url = db_url or "sqlite:///" + os.path.join(out, "gradebook.db")
    config = _config(course, source_root, out, db_url, lab, private)
    replaced = build_gradebook(config, source_root, lab, out, private)
    if replaced and not regrading:
        graded = _graded_count(db_url, config.CourseDirectory.course_id, lab)
        if graded:
            log(f"labkit grade {lab}: solutions/{lab} changed since {graded} submission(s) were "
                f"graded; their new scores replace the old ones without a record of what "
                f"changed. `labkit regrade {lab} --db ...` keeps manual grades and lists whose "
                f"score changed (docs/INSTRUCTORS.md, 'A wrong test found after grading began')")
    if db_url.startswith("sqlite:///") and os.path.exists(db_url[len("sqlite:///"):]):
        os.chmod(db_url[len("sqlite:///"):], 0o600)
    notebook_ids = sorted(os.path.splitext(os.path.basename(p))[0]
                          for p in glob.glob(os.path.join(source_dir, "*.ipynb")))
    submissions = {student: notebooks for student, notebooks in
                   find_submissions(os.path.abspath(submissions_dir), lab, notebook_ids).items()
                   if in_shard(student, shard)}
    jobs = max(1, min(int(jobs or default_jobs(limits)), max(1, len(submissions))))

    # data files the lab ships next to its notebooks (labs/<lab>/ minus notebooks)
    release = os.path.join(private, "release", lab)
    seed = os.path.join(private, "seed")
    shutil.rmtree(seed, ignore_errors=True)
    shutil.copytree(release, seed, symlinks=False,
                    ignore=shutil.ignore_patterns("*.ipynb", ".ipynb_checkpoints"))

    run_id = secrets.token_hex(6)
    # this run's results in a folder of its own: a grading process left over from a killed run
    # of the same students can never overwrite them
    results_dir = os.path.join(work, "results", f"run-{run_id}")
    os.makedirs(results_dir)
    sandbox_base = tempfile.mkdtemp(prefix="labkit-grading-")
    copy_problems, job_list, nonces = {}, [], {}
    for student, notebooks in submissions.items():
        dest = os.path.join(work, "submitted", student, lab)
        shutil.rmtree(dest, ignore_errors=True)
        copy_problems[student] = _copy_submission(notebooks, dest, source_dir)
        nonces[student] = secrets.token_hex(16)
        result_path = os.path.join(results_dir, f"{student}.json")
        job_list.append({
            "student": student, "lab": lab, "source_dir": source_dir, "db_url": db_url,
            "notebooks": {nb: os.path.join(dest, f"{nb}.ipynb") for nb in notebooks
                          if os.path.exists(os.path.join(dest, f"{nb}.ipynb"))},
            "run_dir": os.path.join(sandbox_base, run_id, student), "seed_dir": seed,
            "nonce": nonces[student], "result_path": result_path, "time_limit": time_limit,
            "cell_timeout": cell_timeout, "limits": dict(limits or {}),
            "environ": dict(os.environ)})
    log(f"labkit grade {lab}: {len(job_list)} submissions, {jobs} at a time"
        + (f" (shard {shard_name})" if shard else ""))
    try:
        with contextlib.ExitStack() as stack:
            if isolated and job_list:        # one interpreter imports torch for every sandbox
                from labkit.grading.kernel_template import KernelTemplate
                from labkit.grading.ranks import RankStarterTemplate
                template = stack.enter_context(RankStarterTemplate())
                try:                                                  # ... and for every kernel
                    kernels = stack.enter_context(KernelTemplate())
                except Exception as error:  # noqa: BLE001 (the old way still works)
                    kernels = None
                    log(f"labkit grade: no kernel template ({error!r}); each kernel starts an "
                        f"interpreter of its own")
                for job in job_list:
                    job["rank_template"] = template.path
                    if kernels is not None:
                        job["limits"]["kernel_template"] = kernels.path
            killed = _run_workers(job_list, jobs, time_limit, log)
    finally:
        _stop_phase("templates")
        # the workers are gone (_run_workers waited for them); what they left: first every
        # process in the run's cgroups (dying with them), then their folders
        _remove_cgroups(run_id)
        _stop_phase("cgroups")
        shutil.rmtree(sandbox_base, ignore_errors=True)
        _stop_phase("folders")
    executed = time.monotonic()

    config.InjectVerdicts.nonces = nonces
    config.InjectVerdicts.results_dir = results_dir
    config.ScrubHidden.hidden = _hidden_texts(source_dir, notebook_ids, release)
    api = _api(config)
    from labkit.grading.report import ClassRecord, failure_kinds
    record = ClassRecord(db_url)
    results = []
    for job in job_list:
        student = job["student"]
        problems = list(copy_problems.get(student, []))
        executed_ok = True           # False: no verdict of it exists (not graded, not a 0)
        try:
            with open(job["result_path"]) as f:
                worker_result = json.load(f)
        except (OSError, ValueError):
            worker_result = {"error": killed.get(student, "the grading process produced no "
                                                          "result"), "events": []}
        if worker_result.get("error"):     # no kernel, an error of the grader's, no result
            problems.append(worker_result["error"])
            executed_ok = False
        problems += worker_result.get("events", [])
        if not job["notebooks"]:
            problems.append("no notebook found")
        graded = api.autograde(lab, student, force=True, create=True)
        if not graded["success"]:
            problems.append("nbgrader autograde failed: " + _last_line(graded))
            executed_ok = False
        feedback = api.generate_feedback(lab, student, force=True)
        if not feedback["success"]:
            problems.append("nbgrader generate_feedback failed: " + _last_line(feedback))
        leaks = check_feedback(os.path.join(out, "feedback", student), config.ScrubHidden.hidden)
        if leaks:
            problems.append("feedback withheld: it quoted hidden tests of "
                            + ", ".join(sorted({g for _, g in leaks})) + f" ({leaks[0][0]})")
        score, max_score = _score(api, lab, student)
        seconds = float(worker_result.get("seconds", 0.0))
        results.append(StudentResult(student, score, max_score, seconds, problems, executed_ok))
        autograded = glob.glob(os.path.join(work, "autograded", student, lab, "*.ipynb"))
        record.save(lab, student, seconds, problems, failure_kinds(autograded), shard_name,
                    hidden_failures=worker_result.get("instructor_only", {}).get("hidden_failures"))
        if os.path.exists(job["result_path"]):         # kept where the guide says
            os.replace(job["result_path"], os.path.join(work, "results", f"{student}.json"))
        # progress at class scale; also the moment a crash test kills a shard mid-run
        log(f"labkit grade {lab}: recorded {student} ({len(results)} of {len(job_list)})")
    record.close()
    shutil.rmtree(results_dir, ignore_errors=True)
    grades_csv = os.path.join(out, f"grades-shard-{shard[0]}-of-{shard[1]}.csv" if shard
                              else "grades.csv")
    _write_csv(grades_csv, results)
    report = GradeReport(lab, out, results, time.monotonic() - started, jobs, grades_csv,
                         os.path.join(sandbox_base, run_id))
    log(summary(report, executed - started))
    return report


def check_feedback(folder: str, hidden: dict) -> list:
    """[(path, grade_id)] of feedback files that quote a secret hidden line; they are deleted
    (feedback.check_feedback)."""
    from labkit.grading import feedback
    return feedback.check_feedback(folder, hidden)


def _score(api, lab, student):
    from nbgrader.api import Gradebook, MissingEntry
    with Gradebook(api.coursedir.db_url, api.coursedir.course_id) as gb:
        try:
            submission = gb.find_submission(lab, student)
            return float(submission.score), float(submission.max_score)
        except MissingEntry:
            return 0.0, float(gb.find_assignment(lab).max_score)


def _last_line(result: dict) -> str:
    text = (result.get("error") or result.get("log") or "").strip().splitlines()
    return text[-1] if text else "unknown error"


def _write_csv(path, results):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student_id", "score", "max_score", "seconds", "problems"])
        for r in results:
            writer.writerow([r.student, f"{r.score:g}", f"{r.max_score:g}", f"{r.seconds:.1f}",
                             "; ".join(r.problems)])


def summary(report: GradeReport, execute_seconds: float) -> str:
    width = max([7] + [len(r.student) for r in report.results])
    lines = [f"{'student':<{width}}  {'score':>6}  {'max':>5}  {'time s':>6}  problems"]
    for r in report.results:
        lines.append(f"{r.student:<{width}}  {r.score:>6g}  {r.max_score:>5g}  "
                     f"{r.seconds:>6.1f}  {'; '.join(r.problems) or '-'}")
    lines.append(f"{len(report.results)} submissions in {report.seconds:.1f} s "
                 f"({execute_seconds:.1f} s executing, {report.jobs} at a time); "
                 f"grades: {report.grades_csv or os.path.join(report.out, 'grades.csv')}, "
                 f"feedback: "
                 f"{os.path.join(report.out, 'feedback')}/")
    if report.not_graded:
        lines.append(f"{len(report.not_graded)} submission(s) could not be graded: " + "; ".join(
            f"{r.student} ({_shorten(r.problems[0]) if r.problems else '-'})"
            for r in report.not_graded) + "; their 0 is not a grade: fix the cause, grade again")
    return "\n".join(lines)


def _shorten(text: str, head: int = 120, tail: int = 200) -> str:
    """One line: the start (what failed) and the end (a kernel log's last error) of `text`."""
    text = " ".join(text.split())
    return text if len(text) <= head + tail + 5 else f"{text[:head]} ... {text[-tail:]}"


def _remove_cgroups(run_id: str):
    """The run's cgroups, once every process in them is killed and gone (a killed worker's
    kernel and ranks may still be dying when the worker has been reaped)."""
    from labkit.grading.sandbox import _empty_and_remove, cgroup_dirs
    for base in cgroup_dirs().values():
        path = os.path.join(base, "labkit-grading", run_id)
        for sub in sorted(glob.glob(os.path.join(path, "*")), reverse=True):
            if os.path.isdir(sub):
                _empty_and_remove(sub)
        try:
            os.rmdir(path)
        except OSError:
            pass
