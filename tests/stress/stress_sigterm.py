"""Stress of `labkit grade`'s SIGTERM stop (issue 25): how long a stop takes, and whether a process
of the stopped run outlives it or shares a sandbox user with another run's.

    .venv/bin/python tests/stress/stress_sigterm.py --rounds 100
    .venv/bin/python tests/stress/stress_sigterm.py --rounds 100 --other
    .venv/bin/python tests/stress/stress_sigterm.py --rounds 40 --other --burn 20 --delay 3

Each round is tests/grading/test_grade_run.py's SIGTERM test: `labkit grade` of the fixture lab
(four solved submissions, --jobs 2) starts; once a process of a sandbox user is below it, the
script waits a random 0..`--delay` s (0: SIGTERM at once, as the test does) and sends SIGTERM.
Until the run has exited (and its stdout is closed) the script reads /proc every 20 ms; a process
belongs to our run when /proc/<pid>/cgroup names a cgroup under labkit-grading/<our run id>/
(every process of a sandbox user joins its cgroup before it takes that user: _nsinit.main,
_rank_zygote._child), to another run when it names another run's, and to nobody known when it
names none. `--other` keeps a second `labkit grade` (six submissions, --jobs 2) running the
whole time, so that its sandboxes lease slots as ours release them; `--burn K` adds K busy loops
(`--nice N` for them; default 0, the load of eight graders that the flakes were seen under).

Printed: the stop-time distribution (median, p95, max) and the grader's own stop phases (the
'stop took' part of its last line); per round, processes of ours alive after the exit ("leftovers
of our run"), processes of another run with one of our sandbox uids ("attributed to the other
run": what the test's old filter by uid and start time counted as ours), rounds in which another
run leased one of our slots before our run had exited ("slot reuse seen"), and the moments when a
process of ours and one of another run had the same uid at once ("uid shared": a slot released
while our sandbox still had a process, the bug of issue 25's second flake).
Not collected by pytest (tests/stress/conftest.py).
"""
import argparse
import os
import pwd
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "utils"))
sys.path.insert(0, os.path.join(HERE, "..", "grading"))

BURNER = "while True:\n    pass\n"


def _stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return {"ppid": int(fields[1]), "state": fields[0]}


def _run_of(pid):
    """The run id of the labkit-grading cgroup the process is in ('' if none), or None (gone)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            text = f.read()
    except OSError:
        return None
    found = re.search(r"/labkit-grading/([0-9a-f]+)/", text)
    return found[1] if found else ""


def processes():
    """{pid: {"ppid", "state", "uid"}} of every process now."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found[int(entry)] = dict(_stat(entry), uid=os.stat(f"/proc/{entry}").st_uid)
            except (OSError, IndexError):
                pass
    return found


def descendants(root, procs):
    out, frontier = set(), {root}
    while frontier:
        frontier = {p for p, info in procs.items() if info["ppid"] in frontier} - out
        out |= frontier
    return out


def slot_uids_of(uid):
    """Every uid of the sandbox slot that `uid` belongs to (its kernel user and its ranks')."""
    from labkit.grading.ranks import RANK_UID_BASE, UIDS_PER_SLOT, slot_uids
    if uid >= RANK_UID_BASE:
        slot = (uid - RANK_UID_BASE) // UIDS_PER_SLOT
    else:
        match = re.fullmatch(r"labkit-grade(\d+)", pwd.getpwuid(uid).pw_name)
        if not match:
            return {uid}
        slot = int(match[1])
    return {pwd.getpwnam(f"labkit-grade{slot}").pw_uid, *slot_uids(slot)}


def grade_command(course, subs, out):
    from grading_helpers import LAB
    return [sys.executable, "-m", "labkit.tools.cli", "grade", LAB, str(subs), "--course",
            str(course), "--out", str(out), "--jobs", "2", "--cell-timeout", "20"]


class OtherRun(threading.Thread):
    """A second `labkit grade`, started again each time it ends, until stop()."""

    def __init__(self, course, subs, out, tmpdir):
        super().__init__(daemon=True)
        self.command, self.tmpdir = grade_command(course, subs, out), tmpdir
        self.done, self.failed, self.proc, self.why = 0, 0, None, []
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            self.proc = subprocess.Popen(self.command, env=dict(os.environ, TMPDIR=self.tmpdir),
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True)
            output = self.proc.communicate()[0]
            code = self.proc.returncode
            self.done += code == 0
            if code not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
                self.failed += 1
                self.why.append(f"exit {code}: {output[-600:]}")

    def stop(self):
        self._halt.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.join(120)


def one_round(course, subs, out, tmpdir, delay, rng):
    """One SIGTERM mid-run: a dict of what was seen (see the module docstring)."""
    run = subprocess.Popen(grade_command(course, subs, out), env=dict(os.environ, TMPDIR=tmpdir),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, uids, run_id = time.monotonic() + 300, set(), None
    try:
        while time.monotonic() < deadline and run.poll() is None:
            procs = processes()
            uids |= {procs[p]["uid"] for p in descendants(run.pid, procs)
                     if p in procs and procs[p]["uid"] != 0}
            dirs = [d for d in os.listdir(tmpdir) if d.startswith("labkit-grading-")]
            for d in dirs:
                inner = os.listdir(os.path.join(tmpdir, d))
                run_id = inner[0] if inner else run_id
            if uids and run_id:
                break
            time.sleep(0.05)
        if not (uids and run_id):
            output = run.communicate(timeout=300)[0]
            return {"error": f"no sandbox started: {output[-1500:]}"}
        if delay:
            time.sleep(rng.uniform(0, delay))
        ours_uids = set().union(*(slot_uids_of(u) for u in uids))
        stopped = time.monotonic()
        run.send_signal(signal.SIGTERM)
        reused, shared, lines, marks = set(), 0, [], {}

        def read():                      # each line with its time; then the end of stdout
            for line in run.stdout:
                lines.append(line)
                if "stopped by SIGTERM" in line:
                    marks["stop line"] = time.monotonic()
            marks["stdout closed"] = time.monotonic()
        reader = threading.Thread(target=read)
        reader.start()
        while reader.is_alive() or run.poll() is None:
            if run.poll() is not None and "exit" not in marks:
                marks["exit"] = time.monotonic()
            mine, theirs = set(), set()
            for pid, info in processes().items():
                if info["uid"] in ours_uids and info["state"] != "Z":
                    owner = _run_of(pid)
                    if owner == run_id:
                        mine.add(info["uid"])
                    elif owner:
                        theirs.add(info["uid"])
            reused |= theirs
            shared += bool(mine & theirs)
            time.sleep(0.02)
        reader.join()
        marks.setdefault("exit", time.monotonic())
        seconds = max(marks.values()) - stopped
        output = "".join(lines)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    leftovers, others = {}, {}
    for pid, info in processes().items():
        if info["uid"] in ours_uids and info["state"] != "Z":
            owner = _run_of(pid)
            if owner == run_id:
                leftovers[pid] = info
            elif owner is not None:
                others[pid] = dict(info, run=owner)
    phases = re.search(r"stop took ([^)]*)", output)
    phases = phases[1] if phases else ""
    phases += "; signal to " + ", ".join(f"{name} {when - stopped:.1f} s" for name, when in
                                         sorted(marks.items(), key=lambda kv: kv[1]))
    return {"seconds": seconds, "code": run.returncode, "leftovers": leftovers, "others": others,
            "reused": bool(reused), "shared": shared, "phases": phases,
            "clean": "stopped by SIGTERM" in output and run.returncode == 143,
            "output": output[-1500:]}


def burn(count, nice):
    burners = []
    for _ in range(count):
        burners.append(subprocess.Popen([sys.executable, "-c", BURNER],
                                        preexec_fn=(lambda: os.nice(nice)) if nice else None))
    return burners


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--other", action="store_true", help="a second labkit grade meanwhile")
    parser.add_argument("--burn", type=int, default=0, help="busy loops on the CPUs meanwhile")
    parser.add_argument("--nice", type=int, default=0, help="nice value of the busy loops")
    parser.add_argument("--delay", type=float, default=0.0,
                        help="SIGTERM a random 0..DELAY s after the first sandbox (0: at once)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from grading_helpers import FIXTURES, make_submission
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="stress-sigterm-")
    course = os.path.join(root, "course")
    shutil.copytree(os.path.join(FIXTURES, "solutions"), os.path.join(course, "solutions"))
    for i in range(4):
        make_submission(course, os.path.join(root, "subs"), f"student{i}")
    for i in range(6):
        make_submission(course, os.path.join(root, "other-subs"), f"other{i}")
    other, burners, rounds = None, [], []
    try:
        if args.other:
            os.makedirs(os.path.join(root, "other-tmp"))
            other = OtherRun(course, os.path.join(root, "other-subs"),
                             os.path.join(root, "other-out"), os.path.join(root, "other-tmp"))
            other.start()
        burners = burn(args.burn, args.nice)
        for index in range(args.rounds):
            tmpdir = os.path.join(root, f"tmp-{index}")
            os.makedirs(tmpdir)
            result = one_round(course, os.path.join(root, "subs"), os.path.join(root, "out"),
                               tmpdir, args.delay, rng)
            rounds.append(result)
            with open("/proc/loadavg") as f:
                load = f.read().split()[0]
            if "error" in result:
                print(f"round {index}: {result['error']}", flush=True)
                continue
            print(f"round {index}: {result['seconds']:.1f} s (load {load}), exit "
                  f"{result['code']}, ours left {len(result['leftovers'])}, other run's "
                  f"{len(result['others'])}, slot reused {result['reused']}, uid shared "
                  f"{result['shared']}; {result['phases']}", flush=True)
            if result["leftovers"] or not result["clean"] or result["shared"]:
                print(f"   {result['leftovers']}\n   {result['output']}", flush=True)
            shutil.rmtree(tmpdir, ignore_errors=True)
    finally:
        for proc in burners:
            proc.kill()
        for proc in burners:
            proc.wait()
        if other is not None:
            other.stop()
    done = [r for r in rounds if "error" not in r]
    times = sorted(r["seconds"] for r in done)
    if times:
        p95 = times[min(len(times) - 1, int(round(0.95 * (len(times) - 1))))]
        print(f"\n{len(done)} rounds (--other {args.other}, --burn {args.burn} at nice "
              f"{args.nice}, --delay {args.delay}): stop time median {statistics.median(times):.1f}"
              f" s, p95 {p95:.1f} s, max {times[-1]:.1f} s; over 30 s: "
              f"{sum(t >= 30 for t in times)}")
    print(f"not a clean stop (exit 143 and the stop line): {sum(not r['clean'] for r in done)}; "
          f"rounds with leftovers of our run: {sum(bool(r['leftovers']) for r in done)}; "
          f"with processes of another run on our sandbox uids after the stop: "
          f"{sum(bool(r['others']) for r in done)}; slot reuse seen during the stop: "
          f"{sum(r['reused'] for r in done)}; uid shared by our process and another run's: "
          f"{sum(bool(r['shared']) for r in done)} rounds; no sandbox: "
          f"{len(rounds) - len(done)}")
    if other is not None:
        print(f"the other run: {other.done} runs completed, {other.failed} failed")
        for why in other.why:
            print("   ", why.replace("\n", "\n    "))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
