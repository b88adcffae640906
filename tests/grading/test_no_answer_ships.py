"""No function of the student copy's labkit answers a graded task (issue 24).

`labkit dist` builds the copy; `no_answer_walk.py` runs in it (its labkit only, no
labkit.grading), calls every function whose signature takes a task's visible-case arguments,
each with a time limit, and reports those whose results equal the task's answer on every visible
case. A planted copy of an answer must be found (the walk can fail).
"""
import json
import os
import subprocess
import sys

import pytest

from labkit.tools.dist import build

pytestmark = pytest.mark.timeout(240)
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WALK = os.path.join(os.path.dirname(__file__), "no_answer_walk.py")
PLANTED = '''
def schedule_for(p, m):
    from labkit.pipeline import Action
    out, f_end, i_end = [[] for _ in range(p)], {}, {}
    nf, ni, alive, waiting, t = [0] * p, [0] * p, [0] * p, [[] for _ in range(p)], 0
    while any(len(a) < 3 * m for a in out):
        ran = []
        for k in range(p):
            i, f = ni[k], nf[k]
            if i < f and f_end[(k, i)] <= t and (k == p - 1 or i_end.get((k + 1, i), 1e9) <= t):
                ran.append((k, Action("I", i)))
            elif f < m and alive[k] < min(m, 2 * p - 1) and (k == 0 or f_end.get((k - 1, f), 1e9) <= t):
                ran.append((k, Action("F", f)))
            elif waiting[k]:
                ran.append((k, Action("W", waiting[k][0])))
        for k, a in ran:
            out[k].append(a)
            if a.kind == "I":
                i_end[(k, a.microbatch)], ni[k] = t + 1, ni[k] + 1
                waiting[k].append(a.microbatch)
            elif a.kind == "F":
                f_end[(k, a.microbatch)], nf[k], alive[k] = t + 1, nf[k] + 1, alive[k] + 1
            else:
                waiting[k].pop(0)
                alive[k] -= 1
        t += 1
    return out
'''


def walk(copy: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.join(copy, "utils"), LABKIT_CASE_SEED="1")
    done = subprocess.run([sys.executable, WALK, os.path.join(REPO, "solutions")], cwd=copy,
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("NO_ANSWER_WALK ")]
    assert done.returncode == 0 and lines, f"the walk failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    out = json.loads(lines[-1][len("NO_ANSWER_WALK "):])
    assert out["labkit"].startswith(copy), f"the walk imported {out['labkit']}, not the copy's"
    assert not out["grading_present"], "the student copy has labkit.grading"
    assert out["functions"] > 300 and out["calls"] > 300, out   # the walk reached the package
    return out


def test_no_function_of_the_student_copy_answers_a_graded_task(tmp_path):
    copy = str(tmp_path / "dist")
    build(copy, REPO)
    with open(os.path.join(copy, "utils", "labkit", "pipeline", "extra.py"), "w") as f:
        f.write(PLANTED)             # a copy of lab 5's answer: the walk must find it
    out = walk(copy)
    planted = ("labkit.pipeline.extra.schedule_for answers lab05_pipeline_parallel's "
               "zb_h2 on its visible case")
    assert planted in out["leaks"], f"the walk missed a planted answer: {out['leaks']}"
    leaks = [leak for leak in out["leaks"] if leak != planted]
    assert not leaks, "the student copy answers graded tasks:\n  " + "\n  ".join(leaks)
