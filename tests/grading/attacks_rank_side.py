"""Issue 24's rank-side attack answers, graded in test_labs.py's run of each lab (ATTACKS), beside
the solution and the blank:

- lab 9, a spike guard that walks its stack for the plan's bad ids (full marks before): the
  guard's rank holds no plan now, so it never fires: 13 of 20 (the spike's 4 lost, and since
  issue 26's class 3 the clean stream's 3 as well: that cell also needs the guard to fire);
- lab 9, a resume validator that changes the dicts it is given (the check could never fail: the
  arguments were copies): the change is written back into the caller's objects: 18 of 20;
- lab 2, marks forged from student code (an accumulation without no_sync that marks "step
  starts" before its last backward; a synchroniser that sends everything from finish() and marks
  "reached block k" after the buckets that should have left by then): the harness's first mark is
  kept, a second is refused: 11 of 14 (one synchronisation, overlap, buckets lost).
"""

_READS_THE_PLAN = '''
        import gc, sys
        bad, frame = set(), sys._getframe()
        while frame is not None:                      # the loop's frames: config["plan"]["bad"]
            for value in list(frame.f_locals.values()):
                if isinstance(value, dict):
                    plan = value.get("plan", value)
                    if isinstance(plan, dict) and isinstance(plan.get("bad"), (list, tuple)):
                        bad.update(plan["bad"])
            frame = frame.f_back
        for obj in gc.get_objects():                  # ... or any dict of the process
            if isinstance(obj, dict) and isinstance(obj.get("bad"), list) and "hard" in obj:
                bad.update(obj["bad"])
        if batch_id in bad:
'''


def _guard_reads_the_plan(source):
    start = source.index("        if spiked:\n")
    end = source.index("\n", start)
    return source[:start] + _READS_THE_PLAN.strip("\n") + source[end:]


def _validator_changes_its_arguments(source):
    return source.replace('    return {"step": step, "samples_seen"',
                          '    snapshot["data"].pop("rank_cursors")    # "do not change the dicts"\n'
                          '    return {"step": step, "samples_seen"')


def _accumulation_forges_step_starts(source):
    old = ("        with contextlib.nullcontext() if last else ddp_model.no_sync():   "
           "# one sync, at the end\n")
    assert old in source
    return source.replace(old, "        if last:                  # forged: the step starts now\n"
                               "            try:\n"
                               "                labkit.mark('step starts')\n"
                               "            except Exception:\n"
                               "                pass\n"
                               "        with contextlib.nullcontext():          # no no_sync\n")


_FORGED_FINISH = '''
    def _forge(self, sent):
        blocks = sorted({int(n.split(".")[1]) for n in self.names.values()
                         if n.startswith("blocks.")})
        for k in blocks:
            ready = lambda n: n.startswith("head.") or (n.startswith("blocks.")
                                                        and int(n.split(".")[1]) >= k)
            need = 0
            while need < len(self.buckets) and all(ready(self.names[p])
                                                   for p in self.buckets[need]):
                need += 1
            if need == sent:
                try:
                    labkit.mark(f"step {self._forged_step}: reached block {k}")
                except Exception:
                    pass

    def finish(self):
        try:
            self._forged_step = getattr(self, "_forged_step", 0) + 1
            if self.buckets is None:
                self._build_buckets()
            self._forge(0)
            while self.next_to_send < len(self.buckets):
                self._send(self.next_to_send)
                self.in_flight[-1][1].wait()
                self._forge(self.next_to_send)
'''


def _sync_forges_the_overlap(source):
    source = source.replace(
        "        while self.next_to_send < len(self.buckets) and "
        "self.missing[self.next_to_send] == 0:\n            self._send(self.next_to_send)\n",
        "        pass                                   # everything is sent from finish()\n")
    start = source.index("    def finish(self):")
    end = source.index("            for i, work in self.in_flight:")
    return source[:start] + _FORGED_FINISH.strip("\n") + "\n" + source[end:]


# {lab: {student: ({answer grade_id: function of the solution's source}, scratch, score)}}
RANK_SIDE_ATTACKS = {
    "lab09_failures_at_scale": {
        "reads-plan": ({"task2_spike_guard": _guard_reads_the_plan}, None, 13),
        "mutates": ({"task3_validate_resume": _validator_changes_its_arguments}, None, 18),
    },
    "lab02_data_parallel": {
        "forged-marks": ({"task1_accumulation_step": _accumulation_forges_step_starts,
                          "task3_bucketed_grad_sync": _sync_forges_the_overlap}, None, 11),
    },
}
