"""Lab 9's graded wrong answers (issue 26). Each function takes an answer cell's solution source and
returns the wrong one; tests/chapters/test_ch09_failures_at_scale.py runs each of them alone
(lab_notebooks.run_lab, WRONG_LAB9) and asserts the cells it loses, exactly:

    diagnose_never_fires   task 1  loses every task 1 cell (8), test_task1_no_alarm included:
                                   silence is not specificity (it earned that cell's 2 before);
                                   run by the chapter test only (it covers no cell on its own)
    busiest_is_hot         task 1  loses test_task1_no_alarm (2): the busiest expert called hot
                                   however even the routing
    straggler_by_step_time task 1  loses test_task1_straggler (2): the straggler rule applied to
                                   each rank's step time (start to end) instead of its compute
                                   time; in a synchronous step every rank waits for the slowest,
                                   so all step times look alike and no straggler is ever named
    missing_is_the_stuck   task 1  loses test_task1_missing (2): the rank named is one that hangs
                                   inside the collective (what a stack dump shows first), not
                                   the one that never entered it
    hot_over_half          task 1  loses test_task1_hot_expert (2): an expert is called hot only
                                   when it gets more than half the tokens (the text says 40-60%;
                                   a hidden case gives 40% on purpose)
    snapshot_before_check  task 2  loses test_task2_spike_rolled_back (4): the snapshot due after
                                   a step is taken before the step is checked, so a bad batch on
                                   the snapshot schedule is saved and rolled back to (the bad
                                   batches now fall on the schedule on purpose)
    guard_never_fires      task 2  loses both task 2 cells (7): it earned the clean stream's 3
    retries_moderate_rises task 2  loses test_task2_clean_stream (3): a step whose gradient norm
                                   is above 1.5x the recent mean (a hard batch) is rolled back
                                   and redone once, "in case it was transient": exact weights,
                                   the bad batches quarantined, but the guard fires on ordinary
                                   noise
    refuses_everything     task 3  loses both task 3 cells (5): it earned the refusal cell's 3
    tokenizer_by_name      task 3  loses test_task3_refuses (3): the tokenizer compared by name
                                   and vocabulary size, not by its hash

Four submissions of 20 points (one wrong answer per task each)."""
from wrong_answers import edit


POINTS = 20


_RETURN = '    return {"straggler": straggler, "missing": missing, "hot_expert": hot}'


def diagnose_never_fires(source: str) -> str:
    return edit(source, _RETURN,
                    '    return {"straggler": None, "missing": None, "hot_expert": None}')


def busiest_is_hot(source: str) -> str:
    return edit(source, "hot = detect.hot_expert(total)",
                    "hot = detect.hot_expert(total, ratio=1.0)")


def straggler_by_step_time(source: str) -> str:
    return edit(source, "        compute.append([entered[s] - start\n",
                "        compute.append([end - start                   # the step's time\n")


def missing_is_the_stuck(source: str) -> str:
    return edit(source,
                '        absent = [r["rank"] for r in ranks if all(c["seq"] != seq for c in '
                'r["collectives"])]\n'
                '        missing = absent[0] if len(absent) == 1 else None',
                '        hanging = [r["rank"] for r in ranks\n'
                '                   if any(c["seq"] == seq and c["leave"] is None '
                'for c in r["collectives"])]\n'
                '        missing = hanging[0] if hanging else None           # the rank stuck in it')


def hot_over_half(source: str) -> str:
    return edit(source, "        hot = detect.hot_expert(total)",
                "        busiest = max(range(len(total)), key=total.__getitem__)\n"
                "        hot = busiest if total[busiest] > sum(total) / 2 else None   # most tokens")


def retries_moderate_rises(source: str) -> str:
    return edit(source, '        norm = stats["grad_norm"]\n',
                '        norm = stats["grad_norm"]\n'
                "        self.retried = getattr(self, 'retried', set())\n"
                "        if batch_id not in self.retried and detect.window_spike(\n"
                "                self.history, norm, factor=1.5) and not detect.window_spike(\n"
                "                self.history, norm, factor=detect.SPIKE_FACTOR):\n"
                "            self.retried.add(batch_id)           # transient? redo it once\n"
                "            back, state, history = self.good\n"
                "            spikes.restore(self.model, self.optimizer, state)\n"
                "            self.history = list(history)\n"
                "            return back\n")


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
    "wrong_task1_step_time_task2_snapshot_first_task3_refuses_all": (
        {"task1_diagnose": straggler_by_step_time, "task2_spike_guard": snapshot_before_check,
         "task3_validate_resume": refuses_everything},
        None, POINTS - 2 - 4 - 5),
    "wrong_task1_busiest_hot_task2_silent_task3_tokenizer_name": (
        {"task1_diagnose": busiest_is_hot, "task2_spike_guard": guard_never_fires,
         "task3_validate_resume": tokenizer_by_name},
        None, POINTS - 2 - 7 - 3),
    "wrong_task1_stuck_rank_task2_retries": (
        {"task1_diagnose": missing_is_the_stuck, "task2_spike_guard": retries_moderate_rises},
        None, POINTS - 2 - 3),
    "wrong_task1_hot_over_half": ({"task1_diagnose": hot_over_half}, None, POINTS - 2),
}

# the test cells no graded wrong answer of this module fails yet (test_labs checks it exactly)
UNCOVERED = []
