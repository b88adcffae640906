"""Issue 24: student code on a grading rank reaches only what the task hands it. The attack
submissions (a guard reading its stack, a validator changing its arguments, forged marks) are in
attacks_rank_side.py and graded in test_labs.py's run of their lab at their exact scores; here,
the mark rules on real ranks.
"""
import pytest

import labkit


# ---- the mark rules on real ranks (no sandbox needed) -------------------------------------------

def _marks_twice(bypass):
    import labkit as kit
    from labkit.runtime import worker
    kit.mark("here")
    if bypass:         # the message itself, past labkit.mark's own count
        worker.send(worker.STATE.commands, {"kind": "mark", "task": worker.STATE.task_id,
                                            "label": "here"})
        while worker.STATE.commands.recv()[0] != "resume":
            pass
        return "not refused"
    try:
        kit.mark("here")
    except RuntimeError as error:
        return str(error)
    return "not refused"


def _many_labels(n):
    import labkit as kit
    for i in range(n):
        kit.mark(f"label {i}")
    return n


def test_a_second_mark_of_a_label_is_refused_and_the_first_entry_kept():
    world = labkit.world(2, backend="gloo", teaching=False)
    with world.traffic() as traffic:
        got = world.run(_marks_twice, False)
    assert all("labkit.mark('here') was called a second time" in g for g in got), got
    assert "here" in traffic.marks
    with pytest.raises(labkit.LabkitError, match=r"reached labkit.mark\('here'\) a second time"):
        with world.traffic():
            world.run(_marks_twice, True)
    assert world.run(_many_labels, 3) == [3, 3]        # the world restarted and works


def test_labels_per_call_are_capped():
    world = labkit.world(2, backend="gloo", teaching=False)
    with pytest.raises(labkit.RankError, match="more than 64 labkit.mark labels in one call"):
        world.run(_many_labels, 1000)
    assert world.run(_many_labels, 64) == [64, 64]
