"""Lab 9, task 3's reference: the plan of a compatible resume (what validate_resume returns).

It is the accepting half of the task's answer, so it stays with the grader;
`labkit.faults.checks_resume.check_accepts` calls it through `labkit.released.reference("faults")`.
"""
from __future__ import annotations

from labkit import checks as base
from labkit import released as _released

LAB = "lab09_failures_at_scale"
VISIBLE_SEED = 9003
VISIBLE_CASES = 6            # check_accepts' default


def expected_plan(snapshot: dict, run: dict) -> dict:
    B, P = snapshot["global_batch"], run["world_size"]
    return {"step": snapshot["step"], "samples_seen": snapshot["data"]["samples_seen"],
            "cursor": dict(snapshot["data"]["cursor"]), "per_rank_batch": B // P,
            "reshard": P != snapshot["world_size"]}


def released() -> dict:
    from labkit.faults import checks_resume
    case = base.Case(f"{checks_resume.TASK3}: compatible resumes", VISIBLE_SEED)
    plans = {_released.key(snap, run): expected_plan(snap, run)
             for snap, run in checks_resume.compatible(case, VISIBLE_CASES)}
    return {"plans": {"seed": VISIBLE_SEED, "cases": VISIBLE_CASES, "plans": plans}}
