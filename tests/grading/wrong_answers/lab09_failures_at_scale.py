"""Lab 9's graded wrong answers (issue 26). Each function takes an answer cell's solution source and
returns the wrong one; tests/chapters/test_ch09_failures_at_scale.py runs each of them alone
(lab_notebooks.run_lab, WRONG_LAB9) and asserts the cells it loses, exactly:

    diagnose_never_fires   task 1  loses every task 1 cell (8), test_task1_no_alarm included:
                                   silence is not specificity (it earned that cell's 2 before)
    busiest_is_hot         task 1  loses test_task1_no_alarm (2): the busiest expert called hot
                                   however even the routing
    snapshot_before_check  task 2  loses test_task2_spike_rolled_back (4): the snapshot due after
                                   a step is taken before the step is checked, so a bad batch on
                                   the snapshot schedule is saved and rolled back to (the bad
                                   batches now fall on the schedule on purpose)
    guard_never_fires      task 2  loses both task 2 cells (7): it earned the clean stream's 3
    refuses_everything     task 3  loses both task 3 cells (5): it earned the refusal cell's 3
    tokenizer_by_name      task 3  loses test_task3_refuses (3): the tokenizer compared by name
                                   and vocabulary size, not by its hash

Two submissions of 20 points (one wrong answer per task each)."""
from wrong_answers import edit


POINTS = 20


_RETURN = '    return {"straggler": straggler, "missing": missing, "hot_expert": hot}'


def diagnose_never_fires(source: str) -> str:
    return edit(source, _RETURN,
                    '    return {"straggler": None, "missing": None, "hot_expert": None}')


def busiest_is_hot(source: str) -> str:
    return edit(source, "hot = detect.hot_expert(total)",
                    "hot = detect.hot_expert(total, ratio=1.0)")


def snapshot_before_check(source: str) -> str:
    source = edit(source, '        norm = stats["grad_norm"]\n',
                      '        norm = stats["grad_norm"]\n'
                      '        if (step + 1) % self.snapshot_every == 0:   # snapshot first\n'
                      '            self.good = (step + 1, spikes.snapshot(self.model, '
                      'self.optimizer), list(self.history))\n')
    return edit(source, "        if (step + 1) % self.snapshot_every == 0:     # the state "
                            "after a normal step\n", "        if False:\n")


def guard_never_fires(source: str) -> str:
    return edit(source, '        norm = stats["grad_norm"]\n', "        return None\n")


def refuses_everything(source: str) -> str:
    return edit(source, '    step, B, old_size = snapshot["step"]',
                    '    raise ValueError("tokenizer, data mixture, seed, cursor, global batch and '
                    'world size checked")\n    step, B, old_size = snapshot["step"]')


def tokenizer_by_name(source: str) -> str:
    return edit(source, 'if run["tokenizer"] != snapshot["tokenizer"]:',
                    'if (run["tokenizer"]["name"], run["tokenizer"]["vocab_size"]) != '
                    '(snapshot["tokenizer"]["name"], snapshot["tokenizer"]["vocab_size"]):')


WRONG = {
    "wrong_task1_silent_task2_snapshot_first_task3_refuses_all": (
        {"task1_diagnose": diagnose_never_fires, "task2_spike_guard": snapshot_before_check,
         "task3_validate_resume": refuses_everything},
        None, POINTS - 8 - 4 - 5),
    "wrong_task1_busiest_hot_task2_silent_task3_tokenizer_name": (
        {"task1_diagnose": busiest_is_hot, "task2_spike_guard": guard_never_fires,
         "task3_validate_resume": tokenizer_by_name},
        None, POINTS - 2 - 7 - 3),
}

# the test cells no graded wrong answer of this module fails yet (test_labs checks it exactly)
UNCOVERED = [
    'test_task1_straggler',
    'test_task1_missing',
    'test_task1_hot_expert',
    'test_task2_clean_stream',
]
