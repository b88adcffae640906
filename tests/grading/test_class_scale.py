"""Class scale (issue 21): `labkit grade --shard` into one real PostgreSQL gradebook, `labkit
report`, `labkit doctor`, and the student copy installed by its own README's steps.

The PostgreSQL server is Debian's (.ci/install-postgres installs it): initdb and pg_ctl into a
private temporary folder, run as the unprivileged `postgres` user (the server refuses root), on a
free port of 127.0.0.1, stopped and removed afterwards. Without it these tests skip, except under
CI=true, where they fail: the suite must not pass there without them.
"""
import contextlib
import csv
import glob
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import nbformat
import pytest

from grading_helpers import (HIDDEN_SENTINELS, KINDS, LAB, cli_env as _env,
                             grade_command as _grade_command, needs_root_sandbox)

pytestmark = [pytest.mark.timeout(1200)]
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _missing(what):
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI must run these tests: .ci/install-postgres installs it)")
    pytest.skip(what)


def _pg_bin():
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(os.path.join(folder, "pg_ctl"), os.X_OK):
            return folder
    found = shutil.which("pg_ctl")
    return os.path.dirname(found) if found and shutil.which("initdb") else None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Postgres:
    """A throwaway server: url(db) for a database created on it."""

    def __init__(self, folder, port):
        self.folder, self.port = folder, port

    def url(self, database):
        from sqlalchemy import create_engine, text
        engine = create_engine(f"postgresql://labkit@127.0.0.1:{self.port}/postgres",
                               isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{database}"'))
        engine.dispose()
        return f"postgresql://labkit@127.0.0.1:{self.port}/{database}"


@pytest.fixture(scope="module")
def postgres():
    try:
        import psycopg  # noqa: F401 (SQLAlchemy 2.1's driver for postgresql:// URLs)
    except ImportError:
        _missing("psycopg is not installed (pip install 'psycopg[binary]')")
    if not _pg_bin():
        _missing("no PostgreSQL server here (initdb, pg_ctl)")
    with throwaway_postgres() as server:
        yield server


@contextlib.contextmanager
def throwaway_postgres():
    """A PostgreSQL server in a private temporary folder, on a free port of 127.0.0.1, as an
    unprivileged user when run as root; stopped and removed on exit (benchmarks use it too)."""
    bindir = _pg_bin()
    folder = tempfile.mkdtemp(prefix="labkit-pg-")
    as_user = {}
    if os.geteuid() == 0:                       # postgres refuses to run as root
        name = "postgres" if _has_user("postgres") else "nobody"
        entry = pwd.getpwnam(name)
        os.chown(folder, entry.pw_uid, entry.pw_gid)
        as_user = {"user": entry.pw_uid, "group": entry.pw_gid}
    data, port = os.path.join(folder, "data"), _free_port()
    run = dict(capture_output=True, text=True, timeout=120, cwd=folder, **as_user)
    options = (f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off "
               "-c full_page_writes=off -c max_connections=200")
    try:
        done = subprocess.run([f"{bindir}/initdb", "-D", data, "-U", "labkit", "--auth=trust",
                               "-E", "UTF8", "--no-sync"], **run)
        assert done.returncode == 0, done.stdout + done.stderr
        done = subprocess.run([f"{bindir}/pg_ctl", "-D", data, "-l", os.path.join(folder, "log"),
                               "-w", "-t", "90", "-o", options, "start"], **run)
        assert done.returncode == 0, done.stdout + done.stderr + _read(f"{folder}/log")
        yield Postgres(folder, port)
    finally:
        if os.path.exists(os.path.join(data, "postmaster.pid")):
            subprocess.run([f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "stop"], **run)
        shutil.rmtree(folder, ignore_errors=True)


def _has_user(name):
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _read(path):
    try:
        return open(path).read()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def course(fixture_class):
    """The course the reference run graded (conftest.py): the shards grade the same one."""
    return fixture_class[0]


@pytest.fixture(scope="module")
def submissions(fixture_class):
    _, subs, names = fixture_class
    return subs, names


def _cell_scores(db_url):
    """{student: {test cell: score}} and {student: total} from an nbgrader gradebook."""
    from nbgrader.api import Gradebook
    with Gradebook(db_url, "") as gb:
        cells = {s.student.id: {g.name: g.score for nb in s.notebooks for g in nb.grades}
                 for s in gb.assignment_submissions(LAB)}
    return cells


def _csv_scores(*paths):
    scores = {}
    for path in paths:
        with open(path) as f:
            for row in csv.DictReader(f):
                assert row["student_id"] not in scores, f"{row['student_id']} graded twice"
                scores[row["student_id"]] = float(row["score"])
    return scores


def _records(db_url):
    from labkit.grading.report import ClassRecord
    record = ClassRecord(db_url)
    try:
        return record.rows(LAB)
    finally:
        record.close()


@pytest.fixture(scope="module")
def reference(graded_one_at_a_time, submissions):
    """One single-process run of every submission (its own sqlite gradebook): the session's
    `labkit grade --jobs 1` of the class (conftest.py), which test_parallel compares with too."""
    _, names = submissions
    out, log = graded_one_at_a_time
    db_url = f"sqlite:///{out}/gradebook.db"
    cells = _cell_scores(db_url)
    totals = {names[k]: score for k, (_, _, score) in KINDS.items()}
    assert {s: sum(c.values()) for s, c in cells.items()} == totals, log[-3000:]
    return cells, _csv_scores(out / "grades.csv"), _row_counts(db_url)


def _row_counts(db_url):
    from sqlalchemy import create_engine, text
    engine = create_engine(db_url)
    with engine.connect() as conn:
        count = {table: conn.execute(text(f"SELECT count(*) FROM {table}")).scalar()
                 for table in ("assignment", "notebook", "base_cell", "grade_cells", "source_cell",
                               "solution_cells", "student", "submitted_assignment",
                               "submitted_notebook", "grade", "comment", "labkit_gradebook",
                               "labkit_grading")}
    engine.dispose()
    return count


@pytest.fixture(scope="module")
def sharded(course, submissions, postgres, tmp_path_factory):
    """Shards 0/2 and 1/2 as two processes at once, one --out folder, one PostgreSQL gradebook."""
    subs, _ = submissions
    out = tmp_path_factory.mktemp("sharded") / "out"
    db_url = postgres.url("two_shards")
    started = time.monotonic()
    shards = [subprocess.Popen(_grade_command(course, subs, out, "--shard", f"{i}/2", "--db",
                                              db_url), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=_env())
              for i in range(2)]
    logs = [p.communicate(timeout=900)[0] for p in shards]
    for p, log in zip(shards, logs):
        assert p.returncode == 0, log[-4000:]
    return {"db": db_url, "out": out, "seconds": time.monotonic() - started, "logs": logs}


@needs_root_sandbox()
def test_two_shards_at_once_grade_as_one_run(reference, sharded, submissions):
    _, names = submissions
    ref_cells, ref_csv, ref_counts = reference
    assert _cell_scores(sharded["db"]) == ref_cells
    out = sharded["out"]
    assert _csv_scores(out / "grades-shard-0-of-2.csv", out / "grades-shard-1-of-2.csv") \
        == ref_csv
    records = _records(sharded["db"])
    assert {s: r["shard"] for s, r in records.items()} == \
        {names[k]: f"{shard}/2" for k, (_, shard, _) in KINDS.items()}
    # built once (one assignment, its cells once, one stamp), nothing twice, nothing missing
    assert _row_counts(sharded["db"]) == ref_counts
    assert ref_counts["assignment"] == ref_counts["labkit_gradebook"] == 1
    for log in sharded["logs"]:
        assert "2 submissions, 1 at a time (shard" in log


@needs_root_sandbox()
def test_a_killed_shard_rerun_alone_loses_nothing(reference, submissions, postgres, course,
                                                  tmp_path):
    subs, names = submissions
    ref_cells = reference[0]
    mine = {names[k] for k, (_, shard, _) in KINDS.items() if shard == 1}
    db_url = postgres.url("killed_shard")
    out = tmp_path / "out"
    command = _grade_command(course, subs, out, "--shard", "1/2", "--db", db_url)
    # killed as its first record is written: the grader says so on stdout, read through a pipe,
    # and the next record is one autograde and feedback away (1-3 s). Polling the gradebook for
    # the first record instead (a new connection each time) missed that window under load: the
    # shard had written both its records before the kill (1 run in a few at load average 25)
    shard = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             env=dict(_env(), PYTHONUNBUFFERED="1"), start_new_session=True,
                             text=True)
    seen = []
    try:
        for line in shard.stdout:
            seen.append(line)
            if ": recorded " in line:
                os.killpg(shard.pid, signal.SIGKILL)   # as a batch system does: the whole group
                break
    finally:
        if shard.poll() is None:
            os.killpg(shard.pid, signal.SIGKILL)
        shard.wait(timeout=60)
        shard.stdout.close()
    recorded = _records(db_url) if _has_table(db_url) else {}
    assert shard.returncode == -signal.SIGKILL, \
        "the shard ended before it could be killed: " + "".join(seen[-20:])
    assert 0 < len(recorded) < len(mine), recorded
    time.sleep(1)
    assert len(_records(db_url)) < len(mine), "killed after its last submission: not mid-run"

    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _cell_scores(db_url) == {s: c for s, c in ref_cells.items() if s in mine}
    assert set(_records(db_url)) == mine
    assert set(_csv_scores(out / "grades-shard-1-of-2.csv")) == mine


def _has_table(db_url):
    from sqlalchemy import create_engine, inspect
    engine = create_engine(db_url)
    try:
        return inspect(engine).has_table("labkit_grading")
    finally:
        engine.dispose()


@needs_root_sandbox()
def test_class_report_and_formgrader(sharded, submissions, course, tmp_path):
    _, names = submissions
    page = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "labkit.tools.cli", "report", LAB, "--db",
                           sharded["db"], "--out", str(page), "--course", str(course)],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    text = page.read_text()
    assert text.count("src='data:image/png;base64,") == 4          # the four figures
    for cell in ("test_add", "test_scale", "test_rank_sum"):
        assert cell in text
    assert "75% (3/4)" in text                        # test_add: wrong_add fails it
    assert "AssertionError" in text
    assert names["slow"] in text and "timeout" in text      # submissions with problems
    assert "shards: 0/2, 1/2" in text
    from labkit.grading import notebook as nbtools
    source = nbformat.read(os.path.join(course, "solutions", LAB, f"{LAB}.ipynb"), 4)
    hidden = [t for c in source.cells if nbtools.role(c) == "test"
              for t in nbtools.hidden_texts(c.source)]
    assert hidden and not [t for t in hidden + HIDDEN_SENTINELS if t in text]
    assert "HIDDEN" not in text

    # nbgrader's formgrader reads the same gradebook: its API (what its pages call) answers
    from labkit.grading.pipeline import _api, _config
    config = _config(str(course), os.path.join(course, "solutions"), str(sharded["out"]),
                     sharded["db"], LAB)
    api = _api(config)
    listed = {s["student"]: s["score"] for s in api.get_submissions(LAB)}
    assert listed == {names[k]: score for k, (_, _, score) in KINDS.items()}
    assert len(api.get_notebook_submissions(LAB, LAB)) == 4

    from labkit.tools.doctor import check_db
    found = check_db(sharded["db"])
    assert found.verdict == "ok" and "PostgreSQL" in found.found, found.line()


def test_shard_selection_is_a_partition():
    from labkit.grading.pipeline import in_shard, parse_shard
    students = [f"student{i}" for i in range(300)]
    for count in (1, 2, 3, 7):
        owners = [[i for i in range(count) if in_shard(s, (i, count))] for s in students]
        assert all(len(o) == 1 for o in owners)
    sizes = [sum(in_shard(s, (i, 4)) for s in students) for i in range(4)]
    assert min(sizes) > 50, sizes
    assert parse_shard(" 3/4 ") == (3, 4)
    for bad in ("4/4", "-1/2", "1", "a/b"):
        with pytest.raises(ValueError, match="0 <= i < N"):
            parse_shard(bad)


def test_shards_refuse_an_sqlite_gradebook(course, tmp_path):
    from labkit.grading import grade
    with pytest.raises(ValueError, match="postgresql://"):
        grade(LAB, str(tmp_path), out=str(tmp_path / "out"), course=str(course), shard="0/2")


# --- labkit doctor ------------------------------------------------------------------------------
def test_doctor_on_this_machine():
    import torch
    from labkit.grading.sandbox import can_isolate, cgroup_dirs
    done = subprocess.run([sys.executable, "-m", "labkit.tools.cli", "doctor"],
                          capture_output=True, text=True, timeout=300, env=_env())
    lines = [l for l in done.stdout.splitlines() if l and not l.startswith((" ", "verdict"))]
    verdicts = {l.split()[1]: l.split()[0] for l in lines}
    print(done.stdout)
    assert verdicts["python"] == verdicts["torch"] == verdicts["gloo"] == "ok", done.stdout
    assert "2 ranks started, all_reduce correct" in done.stdout
    assert verdicts["nccl"] == ("skip" if not torch.cuda.is_available() else "ok")
    assert verdicts["memory"] in ("ok", "warn") and verdicts["ss"] == "ok"
    isolates = can_isolate()[0] and bool(shutil.which("nsenter"))
    sandbox = [verdicts[k] for k in ("root", "unshare", "useradd", "nsenter")]
    assert (set(sandbox) == {"ok"}) == isolates
    capped = isolates and set(cgroup_dirs()) == {"memory", "pids"}
    assert verdicts["cgroups"] == ("ok" if capped else "warn")
    assert verdicts["chromium"] == ("ok" if os.access("/usr/lib/chromium/chromium", os.X_OK)
                                    else "warn")
    assert done.returncode == (0 if isolates else 2), done.stdout
    assert done.stdout.splitlines()[-1] == (
        "verdict: this machine can run the course and grade it" if isolates else
        "verdict: the course runs here; `labkit grade` cannot isolate submissions "
        "(see FAIL lines)")


def test_doctor_says_what_to_fix():
    from labkit.tools import doctor
    old = doctor.check_python((3, 9, 1))
    assert old.verdict == "FAIL" and old.needed_for == "course" and "Python 3.11" in old.fix
    assert doctor.check_torch("2.5.1+cpu", "2.13.0").verdict == "warn"
    assert doctor.check_torch("2.13.0+cu128", "2.13.0").verdict == "ok"
    no_sandbox = doctor.check_sandbox(euid=1000, which=lambda tool: None, cgroups={})
    assert [c.verdict for c in no_sandbox] == ["FAIL"] * 4 + ["warn"]
    assert all(c.needed_for == "grade" and c.fix for c in no_sandbox[:4])
    assert no_sandbox[4].fix and "per process" in no_sandbox[4].found
    assert "apt-get install -y util-linux" in no_sandbox[1].line()
    assert doctor.check_memory(8, available=2 << 30, cores=2).verdict == "FAIL"
    assert doctor.check_memory(2, available=16 << 30, cores=2).verdict == "ok"
    assert doctor.check_memory(4, available=16 << 30, cores=2).verdict == "warn"
    unreachable = doctor.check_db(f"postgresql://nobody@127.0.0.1:{_free_port()}/x")
    assert unreachable.verdict == "FAIL" and "pg_hba.conf" in unreachable.fix
    assert doctor.check_chromium("/nonexistent/chromium").verdict == "warn"
    ok = doctor.Check("ok", "x", "fine")
    assert doctor.exit_code([ok]) == 0
    assert doctor.exit_code([ok, *no_sandbox]) == 2
    assert doctor.exit_code([old, *no_sandbox]) == 1


# --- the student copy, as handed out --------------------------------------------------------
def _solved_copy(lab_path, solution_path):
    """The released lab with each answer cell replaced by the solution's (markers dropped)."""
    released = nbformat.read(lab_path, 4)
    solution = nbformat.read(solution_path, 4)
    answers = {c.metadata["nbgrader"]["grade_id"]: c.source for c in solution.cells
               if c.metadata.get("nbgrader", {}).get("solution")}
    for cell in released.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell.source = "\n".join(line for line in answers[grade_id].splitlines()
                                    if "### BEGIN SOLUTION" not in line
                                    and "### END SOLUTION" not in line)
    nbformat.write(released, lab_path)


@pytest.mark.timeout(1800)
def test_student_copy_works_as_handed_out(tmp_path):
    """README: `pip install -e .`, then `jupyter lab`: in a fresh virtual environment (pip's own
    wheel cache and indexes, not this environment's site-packages) the kernel the notebooks
    name exists there, and runs lab 0 (answers filled in) headless, end to end."""
    from labkit.tools.dist import build
    dist = tmp_path / "dist"
    build(str(dist), REPO)
    readme = (dist / "README.md").read_text()
    assert "pip install -e ." in readme and "jupyter lab" in readme
    assert "[test]" not in (dist / "environment.yml").read_text()
    assert "- -e ." in (dist / "environment.yml").read_text()

    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    started = time.monotonic()
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
    # the README's `pip install -e .`, without byte-compiling the ~10,000 installed .py files
    # (most of them torch's, never imported here; those the lab imports compile once, as they
    # first load): the same packages, resolved and installed the same way
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-compile", "-e", "."],
                          cwd=dist, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seconds = time.monotonic() - started
    print(f"fresh student environment: pip install -e . in {seconds:.0f} s")

    # a student's shell: no PYTHONDONTWRITEBYTECODE either, so the first process to import a
    # module writes its bytecode and the later ones (kernel, papermill, doctor) reuse it
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "VIRTUAL_ENV",
                                                                    "PYTHONPATH",
                                                                    "PYTHONDONTWRITEBYTECODE"))}
    env["PATH"] = str(venv / "bin") + os.pathsep + env.get("PATH", "")
    specs = subprocess.run([str(venv / "bin" / "jupyter"), "kernelspec", "list", "--json"],
                           capture_output=True, text=True, timeout=120, env=env, check=True)
    # only what students need: no instructor extra (psycopg), no test packages; nbgrader's
    # instructor panels off by the README's `labkit student-setup`, as JupyterLab reports them
    absent = subprocess.run([str(venv / "bin" / "python"), "-c", "import psycopg"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert absent.returncode != 0 and "No module named 'psycopg'" in absent.stderr
    assert "labkit student-setup" in readme
    setup = subprocess.run([str(venv / "bin" / "labkit"), "student-setup"], capture_output=True,
                           text=True, timeout=300, env=env, cwd=dist)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    plain = dict(env, NO_COLOR="1", TERM="dumb")
    lab_list = subprocess.run([str(venv / "bin" / "jupyter"), "labextension", "list"],
                              capture_output=True, text=True, timeout=120, env=plain, cwd=dist)
    listed = lab_list.stdout + lab_list.stderr
    disabled = listed.split("Disabled extensions:")[-1].split("Config dir")[0].split()
    assert "Disabled extensions:" in listed, listed
    assert {"@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment",
            "@jupyter/nbgrader:course-list", "@jupyter/nbgrader:menu"} <= set(disabled), listed
    assert "@jupyter/nbgrader:validate-assignment" not in disabled, listed
    server_list = subprocess.run([str(venv / "bin" / "jupyter"), "server", "extension", "list"],
                                 capture_output=True, text=True, timeout=120, env=plain, cwd=dist)
    state = {}
    for line in re.sub(r"\x1b\[[0-9;]*m", "", server_list.stdout + server_list.stderr).splitlines():
        words = line.split()
        if len(words) == 2 and words[1] in ("enabled", "disabled"):
            state[words[0]] = words[1]        # only the venv's config dir names nbgrader
    for name in ["formgrader", "course_list", "assignment_list"]:
        assert state.get(f"nbgrader.server_extensions.{name}") == "disabled", state
    assert state.get("nbgrader.server_extensions.validate_assignment") == "enabled", state
    nb_kernels = {nbformat.read(p, 4).metadata.kernelspec.name
                  for p in glob.glob(str(dist / "*" / "**" / "*.ipynb"), recursive=True)}
    assert nb_kernels == {"python3"}
    kernel = json.loads(specs.stdout)["kernelspecs"]["python3"]
    assert kernel["resource_dir"].startswith(str(venv)), kernel

    lab = "lab00_first_collectives"
    notebook = dist / "labs" / lab / f"{lab}.ipynb"
    _solved_copy(str(notebook), os.path.join(REPO, "solutions", lab, f"{lab}.ipynb"))
    executed = tmp_path / "executed.ipynb"
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "papermill", str(notebook),
                           str(executed), "--cwd", str(notebook.parent), "--log-level",
                           "WARNING"], capture_output=True, text=True, timeout=900, env=env,
                          cwd=dist)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doctor = subprocess.run([str(venv / "bin" / "labkit"), "doctor", "--no-gpu"],
                            capture_output=True, text=True, timeout=300, env=env, cwd=dist)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "skip  sandbox" in doctor.stdout and "ok    kernel    python3" in doctor.stdout
    assert doctor.stdout.splitlines()[-1] == ("verdict: this machine can run the course (a "
                                              "student copy: grading not checked)")
    ran = nbformat.read(str(executed), 4)
    assert ran.metadata.papermill.get("exception") is not True
    assert ran.metadata.kernelspec.name == "python3"
    assert not [o for c in ran.cells for o in c.get("outputs", [])
                if o.get("output_type") == "error"]
