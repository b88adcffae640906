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
    out = []
    for k in range(p):
        warm = min(p - 1 - k, m)
        actions = [Action("F", i) for i in range(warm)]
        for i in range(m - warm):
            actions += [Action("F", warm + i), Action("B", i)]
        out.append(actions + [Action("B", i) for i in range(m - warm, m)])
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
               "one_f_one_b on its visible case")
    assert planted in out["leaks"], f"the walk missed a planted answer: {out['leaks']}"
    leaks = [leak for leak in out["leaks"] if leak != planted]
    assert not leaks, "the student copy answers graded tasks:\n  " + "\n  ".join(leaks)
