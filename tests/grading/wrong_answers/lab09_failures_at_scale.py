"""Lab 9's graded wrong answers (issues 26, 29). Each function takes an answer cell's solution
source and returns the wrong one; tests/chapters/test_ch09_failures_at_scale.py runs each of them
alone (lab_notebooks.run_lab, WRONG_LAB9) and asserts the cells it loses, exactly. Tasks 1 and 2
are graded by rates (at most one miss and one false alarm per call, labkit.faults.checks), so
every wrong answer here fails by a margin its batch is built to show, not by a lucky draw:

    straggler_by_mean        task 1  loses test_task1_no_alarm (2): each rank's mean compute time
                                     instead of its median: the healthy runs 0 and 1 of that
                                     cell pause one rank twice for 0.2 s (9x a step's work on
                                     the mean), two false alarms; the fault cells' runs have no
                                     pauses
    straggler_by_step_time   task 1  loses test_task1_straggler (2): the straggler rule applied to
                                     each rank's step time (start to end) instead of its compute
                                     time; in a synchronous step every rank waits for the slowest,
                                     so all step times look alike and no straggler is ever named
    straggler_over_seconds   task 1  loses test_task1_straggler (2): tuned to the visible test
                                     (stragglers sleep 0.13-0.15 s there): a rank is a straggler
                                     when its median compute time is above 0.125 s; the hidden
                                     test's sleeps span 0.05-0.15 s, stratified over 5 runs, and
                                     the two below 0.09 s are missed (26 ms or more below the
                                     threshold, with a step's 9 ms of work); run by the chapter test
                                     only (test_task1_straggler has its graded wrong answer, and
                                     a submission that passes every visible test grades in full)
    missing_is_the_stuck     task 1  loses test_task1_missing (2): the rank named is one that hangs
                                     inside the collective (what a stack dump shows first), not
                                     the one that never entered it
    hot_over_half            task 1  loses test_task1_hot_expert (2): an expert is called hot only
                                     when it gets more than half the tokens (the text says 30-60%;
                                     the hidden test's 6 runs are stratified over it: 4 below 50%)
    diagnose_never_fires     task 1  loses every task 1 cell (8): silence is not specificity
    diagnose_always_fires    task 1  loses every task 1 cell (8): the slowest rank is always the
                                     straggler and the busiest expert always hot (every call
                                     holds runs without its fault)
    chapter_detectors        task 1  loses every task 1 cell (8): chapter 9's detect.stragglers
                                     and detect.hot_expert called anyway: refused inside diagnose
    snapshot_before_check    task 2  loses test_task2_spike_rolled_back (4): the snapshot due after
                                     a step is taken before the step is checked, so a bad batch on
                                     the snapshot schedule (half the streams, on purpose) is saved
                                     and rolled back to
    guard_judges_late        task 2  loses test_task2_spike_rolled_back (4): tuned to the visible
                                     test (bad batches after 15 steps there): nothing judged before
                                     15 accepted steps; the hidden test puts a bad batch within 5
                                     steps of step 10 in 2 of its 4 streams, and those are missed
    guard_never_fires        task 2  loses both task 2 cells (7)
    guard_always_fires       task 2  loses both task 2 cells (7): every step after the first 10
                                     is a spike (the stream runs out of batches)
    chapter_window_spike     task 2  loses both task 2 cells (7): detect.window_spike called
                                     anyway: refused inside SpikeGuard
    retries_moderate_rises   task 2  loses test_task2_clean_stream (3): a step whose gradient norm
                                     is above 1.2x the recent mean (a hard batch) is rolled back
                                     and redone once, "in case it was transient": exact weights,
                                     the bad batches quarantined, but the guard fires on ordinary
                                     noise (measured: every one of 40 clean streams of 30 steps
                                     has a step at 1.26x or more after step 10; at 1.5x, 25 of
                                     40 would: a threshold there fires by chance)
    refuses_everything       task 3  loses both task 3 cells (5): it earned the refusal cell's 3
    tokenizer_by_name        task 3  loses test_task3_refuses (3): the tokenizer compared by name
                                     and vocabulary size, not by its hash

Seven submissions of 20 points (one wrong answer per task each)."""
from wrong_answers import edit, swap


POINTS = 20


_RETURN = '    return {"straggler": straggler, "missing": missing, "hot_expert": hot}'


def straggler_by_mean(source: str) -> str:
    return edit(source, "statistics.median(compute) if compute",
                "statistics.mean(compute) if compute")


def straggler_by_step_time(source: str) -> str:
    return edit(source, "        compute = [entered[s] - start\n",
                "        compute = [end - start                    # the step's time\n")


def straggler_over_seconds(source: str) -> str:
    return edit(source, "                if m > 3 * statistics.median(medians[:r] + medians[r + 1:])]",
                "                if m > 0.125]          # the visible stragglers sleep 0.13 s+")


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
    return edit(source,
                "        hot = busiest if total[busiest] > 2 * sum(total) / len(total) else None",
                "        hot = busiest if total[busiest] > sum(total) / 2 else None   # most tokens")


def diagnose_never_fires(source: str) -> str:
    return edit(source, _RETURN,
                '    return {"straggler": None, "missing": None, "hot_expert": None}')


def diagnose_always_fires(source: str) -> str:
    return swap(
        ("        straggler = slow[0] if len(slow) == 1 else None",
         "        straggler = max(range(len(medians)), key=medians.__getitem__)   # the slowest"),
        ("        hot = busiest if total[busiest] > 2 * sum(total) / len(total) else None",
         "        hot = busiest                                   # the busiest"))(source)


def chapter_detectors(source: str) -> str:
    return swap(
        ('    ranks = trace["ranks"]\n',
         '    from labkit.faults import detect          # chapter 9\'s rules\n'
         '    ranks = trace["ranks"]\n'),
        ("        medians.append(statistics.median(compute) if compute else None)",
         "        medians.append(compute)                       # every rank's compute times"),
        ("    straggler = None\n    if None not in medians:\n"
         "        slow = [r for r, m in enumerate(medians)\n"
         "                if m > 3 * statistics.median(medians[:r] + medians[r + 1:])]\n"
         "        straggler = slow[0] if len(slow) == 1 else None\n",
         "    slow = detect.stragglers(medians)\n"
         "    straggler = slow[0] if slow else None\n"),
        ("        hot = busiest if total[busiest] > 2 * sum(total) / len(total) else None",
         "        hot = detect.hot_expert(total)"))(source)


def snapshot_before_check(source: str) -> str:
    source = edit(source, '        norm = stats["grad_norm"]\n',
                  '        norm = stats["grad_norm"]\n'
                  '        if (step + 1) % self.snapshot_every == 0:   # snapshot first\n'
                  '            self.good = (step + 1, spikes.snapshot(self.model, '
                  'self.optimizer), list(self.history))\n')
    return edit(source, "        if (step + 1) % self.snapshot_every == 0:     # the state "
                        "after a normal step\n", "        if False:\n")


def guard_judges_late(source: str) -> str:
    return edit(source, "            len(recent) >= 10 and norm > 5 * sum(recent) / len(recent))",
                "            len(recent) >= 15 and norm > 5 * sum(recent) / len(recent))")


def guard_never_fires(source: str) -> str:
    return edit(source, '        norm = stats["grad_norm"]\n', "        return None\n")


def guard_always_fires(source: str) -> str:
    return edit(source, "            len(recent) >= 10 and norm > 5 * sum(recent) / len(recent))",
                "            len(recent) >= 10)                  # anything after 10 steps")


def chapter_window_spike(source: str) -> str:
    return edit(source, "        spiked = not math.isfinite(norm) or (\n"
                        "            len(recent) >= 10 and norm > 5 * sum(recent) / len(recent))",
                "        from labkit.faults import detect\n"
                "        spiked = detect.window_spike(self.history, norm, factor=5.0)")


def retries_moderate_rises(source: str) -> str:
    return edit(source, "        if spiked:\n",
                "        self.retried = getattr(self, 'retried', set())\n"
                "        mean = sum(recent) / max(len(recent), 1)\n"
                "        if not spiked and batch_id not in self.retried and len(recent) >= 10 \\\n"
                "                and norm > 1.2 * mean:\n"
                "            self.retried.add(batch_id)           # transient? redo it once\n"
                "            back, state, history = self.good\n"
                "            spikes.restore(self.model, self.optimizer, state)\n"
                "            self.history = list(history)\n"
                "            return back\n"
                "        if spiked:\n")


def refuses_everything(source: str) -> str:
    return edit(source, '    step, B, old_size = snapshot["step"]',
                '    raise ValueError("tokenizer, data mixture, seed, cursor, global batch and '
                'world size checked")\n    step, B, old_size = snapshot["step"]')


def tokenizer_by_name(source: str) -> str:
    return edit(source, 'if run["tokenizer"] != snapshot["tokenizer"]:',
                'if (run["tokenizer"]["name"], run["tokenizer"]["vocab_size"]) != '
                '(snapshot["tokenizer"]["name"], snapshot["tokenizer"]["vocab_size"]):')


T1, T2, T3 = "task1_diagnose", "task2_spike_guard", "task3_validate_resume"
WRONG = {
    "wrong_task1_step_time_task2_snapshot_first_task3_refuses_all": (
        {T1: straggler_by_step_time, T2: snapshot_before_check, T3: refuses_everything},
        None, POINTS - 2 - 4 - 5),
    "wrong_task1_mean_task2_silent_task3_tokenizer_name": (
        {T1: straggler_by_mean, T2: guard_never_fires, T3: tokenizer_by_name},
        None, POINTS - 2 - 7 - 3),
    "wrong_task1_stuck_rank_task2_retries": (
        {T1: missing_is_the_stuck, T2: retries_moderate_rises}, None, POINTS - 2 - 3),
    "wrong_task1_hot_over_half_task2_always_fires": (
        {T1: hot_over_half, T2: guard_always_fires}, None, POINTS - 2 - 7),
    "wrong_task1_never_fires_task2_judges_late": (
        {T1: diagnose_never_fires, T2: guard_judges_late}, None, POINTS - 8 - 4),
    "wrong_task1_always_fires_task2_chapter_rule": (
        {T1: diagnose_always_fires, T2: chapter_window_spike}, None, POINTS - 8 - 7),
    "wrong_task1_chapter_rules": ({T1: chapter_detectors}, None, POINTS - 8),
}

# the test cells no graded wrong answer of this module fails yet (test_labs checks it exactly)
UNCOVERED = []
