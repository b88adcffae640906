"""The grading run itself (issues 24 and 33): any student id under any TMPDIR, an exit status that
says when a submission could not be graded, SIGTERM as an orderly stop, and no silent fallback to
grading without the sandbox. `labkit grade` runs as a subprocess here, as an instructor or a
Slurm/Kubernetes shard runs it."""
import csv
import ctypes
import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from grading_helpers import LAB, insert_cell, make_submission, needs_root_sandbox

pytestmark = [needs_root_sandbox(), pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")]
LONG_ID = "Firstname.Middlename-Lastname+labs_2024@students.example-university.edu"
BLANK = {"task_add": "def add(a, b):\n    raise NotImplementedError('task 1')",
         "task_scale": "def scale(x, k):\n    raise NotImplementedError('task 2')",
         "task_rank_sum": "def rank_sum(x):\n    raise NotImplementedError('task 3')"}


def _labkit_grade(course, subs, out, *extra, env=None, **popen):
    command = [sys.executable, "-m", "labkit.tools.cli", "grade", LAB, str(subs), "--course",
               str(course), "--out", str(out), "--jobs", "2", "--cell-timeout", "20", *extra]
    return subprocess.Popen(command, env=dict(os.environ, **(env or {})), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)


def _grades(out):
    with open(os.path.join(out, "grades.csv")) as f:
        return {r["student_id"]: r for r in csv.DictReader(f)}


def test_any_student_id_under_any_tmpdir_is_graded(course, tmp_path):
    """A 70-character e-mail id under an 80-character TMPDIR scores what a short id scores (the
    kernel's socket path passed 107 bytes: it never started, 0 points); a blank submission is
    graded 0, which is a grade: exit status 0."""
    assert len(LONG_ID) >= 64
    tmpdir = tmp_path / ("t" * (80 - len(str(tmp_path)) - 1))
    tmpdir.mkdir()
    assert len(str(tmpdir)) >= 80
    subs = tmp_path / "subs"
    make_submission(str(course), str(subs), "short")
    make_submission(str(course), str(subs), LONG_ID)
    make_submission(str(course), str(subs), "blank", BLANK)
    run = _labkit_grade(course, subs, tmp_path / "out", env={"TMPDIR": str(tmpdir)})
    output = run.communicate(timeout=540)[0]
    grades = _grades(tmp_path / "out")
    assert (grades["short"]["score"], grades["short"]["problems"]) == ("6", ""), output
    assert (grades[LONG_ID]["score"], grades[LONG_ID]["problems"]) == ("6", ""), output
    assert grades["blank"]["score"] == "0", output
    assert glob.glob(str(tmp_path / "out" / "feedback" / LONG_ID / LAB / "*.html"))
    assert "could not be graded" not in output
    assert run.returncode == 0, output


def test_a_submission_that_cannot_be_graded_fails_the_run(course, tmp_path):
    """A kernel that cannot start (here: 16 MiB for the whole submission) is 'not graded', not a
    0: the summary says so and `labkit grade` exits 1."""
    subs = tmp_path / "subs"
    make_submission(str(course), str(subs), "starved")
    run = _labkit_grade(course, subs, tmp_path / "out", "--memory-gb", str(16 / 1024))
    output = run.communicate(timeout=300)[0]
    assert "1 submission(s) could not be graded: starved (" in output, output
    assert "sandbox kernel did not start" in _grades(tmp_path / "out")["starved"]["problems"]
    assert run.returncode == 1, output


def _proc_stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        comm, fields = f.read().rsplit(")", 1)
    fields = fields.split()
    return {"ppid": int(fields[1]), "state": fields[0], "start": int(fields[19]),
            "comm": comm.split("(", 1)[1]}


def _processes():
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found[int(entry)] = dict(_proc_stat(entry), uid=os.stat(f"/proc/{entry}").st_uid)
            except (OSError, IndexError):
                pass
    return found


def _descendants(root, processes):
    out, frontier = set(), {root}
    while frontier:
        frontier = {p for p, info in processes.items() if info["ppid"] in frontier} - out
        out |= frontier
    return out


def _grading_run_of(pid):
    """The run id of the labkit-grading cgroup a process is in ('' in none; None: it is gone).
    Every process of a sandbox user joins its run's cgroups before it becomes that user
    (_nsinit.main, _rank_zygote._child), so this tells this run's from another run's that
    leased the same slot since (issue 25: a slot's uids are reused as soon as it is released)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            found = re.search(r"/labkit-grading/([0-9a-f]+)/", f.read())
    except OSError:
        return None
    return found[1] if found else ""


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return None


def _children(processes):
    return {p for p, info in processes.items() if info["ppid"] == os.getpid()}


def test_sigterm_stops_the_run_and_leaves_nothing(course, tmp_path):
    """SIGTERM once the first sandbox runs: `labkit grade` exits 143 within seconds, saying what
    it stopped, and leaves no process (nothing adopted by this process, which is a subreaper
    meanwhile; no process of the sandbox users in a cgroup of this run, nor one in no grading
    cgroup that existed by then), no sandbox folder and no cgroup of its run. A process of
    another run that leased the same slot since is that run's (tests/stress/stress_sigterm.py
    counts them)."""
    from labkit.grading.sandbox import cgroup_dirs
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    subs = tmp_path / "subs"
    for i in range(4):
        make_submission(str(course), str(subs), f"student{i}")
    libc = ctypes.CDLL(None, use_errno=True)
    before = _children(_processes())
    assert libc.prctl(36, 1, 0, 0, 0) == 0              # PR_SET_CHILD_SUBREAPER
    try:
        run = _labkit_grade(course, subs, tmp_path / "out", env={"TMPDIR": str(tmpdir)})
        deadline, sandbox_uids, run_dirs = time.monotonic() + 300, set(), []
        while time.monotonic() < deadline and run.poll() is None:
            processes = _processes()
            sandbox_uids |= {processes[p]["uid"] for p in _descendants(run.pid, processes)
                             if p in processes and processes[p]["uid"] != 0}
            run_dirs = glob.glob(str(tmpdir / "labkit-grading-*" / "*"))
            if sandbox_uids and run_dirs:
                break
            time.sleep(0.2)
        assert sandbox_uids and run_dirs, f"no sandbox started: {run.communicate()[0]}"
        processes = _processes()                    # who is who, for a diagnosis of what is left
        tree = {p: dict(processes[p], cmd=_cmdline(p))
                for p in _descendants(run.pid, processes) if p in processes}
        stopped_at = time.monotonic()
        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=60)[0]
        seconds = time.monotonic() - stopped_at
        with open("/proc/uptime") as f:             # boot time now, in clock ticks
            ended_ticks = float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")
        processes = _processes()
        left = {p: dict(info, cmd=_cmdline(p), was=tree.get(p),
                        parent_was=tree.get((tree.get(p) or {}).get("ppid")))
                for p, info in processes.items()
                if p in _children(processes) - before and info["state"] != "Z"}
        run_id = os.path.basename(run_dirs[0])
        sandbox_left = {}
        for p, info in processes.items():
            if info["uid"] in sandbox_uids and info["state"] != "Z":
                owner = _grading_run_of(p)
                if owner == run_id or (owner == "" and info["start"] <= ended_ticks):
                    sandbox_left[p] = dict(info, run=owner)
    finally:
        libc.prctl(36, 0, 0, 0, 0)
        for pid in _children(_processes()) - before:   # reap what this process adopted
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ChildProcessError, ProcessLookupError):
                pass
    assert run.returncode == 128 + signal.SIGTERM, output
    assert "stopped by SIGTERM" in output and "grading process(es) killed" in output, output
    assert seconds < 30, f"{seconds:.1f} s to stop"
    assert not left, f"processes left behind (adopted by the test): {left}"
    assert not sandbox_left, f"processes of the sandbox users left: {sandbox_left}"
    assert not glob.glob(str(tmpdir / "labkit-grading-*")), "sandbox folder left"
    for base in cgroup_dirs().values():
        assert not os.path.exists(os.path.join(base, "labkit-grading", run_id)), base


def test_a_slot_just_leased_has_no_process_of_its_last_holder():
    """A slot's lock goes free when its holder dies, while that holder's kernel and ranks may
    still be dying (issue 25): lease_slot empties the slot it just locked. Here a process of the
    slot's kernel user and one of a rank uid are alive under the lock; _slot_emptied, the step
    lease_slot takes once the lock is its own, leaves neither."""
    import pwd
    from labkit.grading.ranks import rank_uid
    from labkit.grading.sandbox import _slot_emptied, ensure_user, lease_slot
    slot, fd = lease_slot()
    try:
        kernel_uid, _ = ensure_user(slot)
        assert pwd.getpwuid(kernel_uid).pw_name == f"labkit-grade{slot}"
        leftovers = [subprocess.Popen(["sleep", "120"], user=uid, group=uid if uid != kernel_uid
                                      else None) for uid in (kernel_uid, rank_uid(slot, 3))]
        try:
            started = time.monotonic()
            assert _slot_emptied(slot)
            assert [p.wait(timeout=10) for p in leftovers] == [-signal.SIGKILL] * 2
            assert time.monotonic() - started < 10
        finally:
            for p in leftovers:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    finally:
        os.close(fd)


def test_without_the_sandbox_grading_is_refused_unless_asked(course, tmp_path):
    """Where the sandbox cannot be built, `labkit grade` refuses (exit 2), naming the flag."""
    subs = tmp_path / "subs"
    make_submission(str(course), str(subs), "someone")
    run = _labkit_grade(course, subs, tmp_path / "out", env={"LABKIT_GRADING_NO_SANDBOX": "1"})
    output = run.communicate(timeout=120)[0]
    assert run.returncode == 2, output
    assert "cannot build the grading sandbox" in output and "--no-isolation" in output, output
    assert not os.path.exists(tmp_path / "out" / "grades.csv")


DAEMONS = '''import subprocess, sys
# a setsid daemon, and one that double-forks into a session of its own
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # {tag}-setsid"],
                 start_new_session=True)
subprocess.Popen([sys.executable, "-c", "import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n"
                  "    time.sleep(600)  # {tag}-double"]).wait()'''


def test_no_isolation_grades_warns_and_kills_daemons(course, tmp_path, monkeypatch):
    """--no-isolation's mode: graded as with the sandbox, what is not enforced is said, and the
    daemons a submission started do not outlive its grading."""
    from labkit.grading import grade
    monkeypatch.setenv("LABKIT_GRADING_NO_SANDBOX", "1")
    tag = f"labkit-daemon-{os.getpid()}-{time.monotonic_ns()}"
    subs = tmp_path / "subs"
    make_submission(str(course), str(subs), "daemonic",
                    edit=lambda nb: insert_cell(nb, "task_add", DAEMONS.format(tag=tag)))
    lines = []
    report = grade(LAB, str(subs), jobs=1, out=str(tmp_path / "out"), course=str(course),
                   cell_timeout=20, log=lines.append, no_isolation=True)
    log = "\n".join(lines)
    assert "WITHOUT ISOLATION" in log and "NOT enforced" in log, log
    assert report.scores == {"daemonic": 6.0}, log
    assert report.not_graded == []
    survivors = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if tag.encode() in f.read():
                    survivors.append(pid)
        except OSError:
            pass
    for pid in survivors:
        os.kill(int(pid), signal.SIGKILL)
    assert not survivors, f"daemons of the submission outlived its grading: {survivors}"


_TWO_RUNS = '''
import os, sys
from labkit.grading import grade
course, subs, out = sys.argv[1:4]
if __name__ == "__main__":
    os.environ["LABKIT_GRADING_NO_SANDBOX"] = "1"       # the first run starts the forkserver
    first = grade("{lab}", subs, jobs=1, out=out + "/a", course=course, no_isolation=True,
                  log=lambda line: None)
    del os.environ["LABKIT_GRADING_NO_SANDBOX"]
    second = grade("{lab}", subs, jobs=1, out=out + "/b", course=course,
                   log=lambda line: None)
    print("SCORES", first.scores, second.scores, second.not_graded)
'''


@needs_root_sandbox()
def test_a_second_run_in_one_process_sees_the_environment_of_its_own_time(course, tmp_path):
    """grade() twice in one Python process: the first without the sandbox (the variable set),
    the second with it. The workers are forked from a server the first run started; they used
    to see its environment (sandbox refused, every cell 0 and nbgrader's autograde failing on a
    plain-dict output); now each job carries the grader's environment of its own time."""
    subs = tmp_path / "subs"
    make_submission(str(course), str(subs), "twice")
    script = tmp_path / "two_runs.py"
    script.write_text(_TWO_RUNS.format(lab=LAB))
    done = subprocess.run([sys.executable, str(script), str(course), str(subs),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=900)
    line = next((l for l in done.stdout.splitlines() if l.startswith("SCORES")), "")
    assert done.returncode == 0 and line == "SCORES {'twice': 6.0} {'twice': 6.0} []", \
        (line, done.stdout[-2000:], done.stderr[-3000:])
