"""Lab 9's checkers: the diagnoser (task 1), the spike guard (task 2), the resume validator
(task 3, in checks_resume.py).

    checks.check_no_alarm(world, diagnose)           # healthy runs with ordinary hiccups
    checks.check_straggler(world, diagnose)          # one rank sleeps in every step
    checks.check_missing(world, diagnose)            # one rank never joins a collective
    checks.check_hot_expert(world, diagnose)         # one expert gets about half the tokens
    checks.check_guard_clean(world, SpikeGuard)      # a clean stream with hard batches
    checks.check_guard_spike(world, SpikeGuard)      # one bad batch (or two) in the stream

Task 1: the traces are runs of real ranks with the faults each case draws (traces.record_run:
the ranks sleep, skip a collective or route their tokens, at the points the case chose); only the
trace, as plain data, reaches `diagnose`. The clocks of the ranks are skewed by up to a second
(as on machines of a cluster), so only differences of times within one rank mean anything.
Each sensitivity check (straggler, missing rank, hot expert) also judges its real trace renamed
so that every rank (expert) is the faulty one once (`relabel_ranks`, `relabel_experts`): a
detector that names a constant rank or never reads one rank's record would pass one random draw
with probability 1/P (three draws at P = 2: 1/8); renamed, it fails with probability 1. The
healthy runs (specificity) each hold 2-4 pauses of 0.15-0.3 s, longer than a straggler's 0.15 s
sleep, on ranks the case draws.
Task 2: the student's class is built on every rank by the rank program `guarded_stream` (the loop
of `spikes.guarded_train`), which is handed only what a training loop has: its rows of the stream's
batches, as tokens. The plan (which ids are bad or hard) and every expected value stay in the
checker's process: no frame or global the guard can walk holds them. The rank returns the guard's
decisions (rollbacks, quarantined ids) and the final weights as plain data; which steps were bad
is judged here. The reference is the same loop without a guard on a stream without the bad
batches, run on ranks where no student code runs; the final weights are compared.
"""
from __future__ import annotations

import torch

from labkit import checks as base
from labkit.faults import spikes, traces

TASK1, TASK2 = "Lab 9, task 1", "Lab 9, task 2"
KEYS = ("straggler", "missing", "hot_expert")
CLOCK_SKEW = 1.0


def _verdict(diagnose, trace, case, what):
    """Call the student's diagnose on a trace; check the shape of the answer."""
    got = diagnose(trace)
    if not isinstance(got, dict) or sorted(got) != sorted(KEYS):
        raise AssertionError(f"{what}: diagnose returned {got!r}; expected a dict with exactly "
                             f"the keys {list(KEYS)} [{case}]")
    for key in KEYS:
        value = got[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise AssertionError(f"{what}: diagnose(...)[{key!r}] is {value!r}; expected an int "
                                 f"or None [{case}]")
    return got


def _expect(got, expected, case, what, hints):
    for key in KEYS:
        if got[key] != expected[key]:
            raise AssertionError(f"{what}: diagnose says {key} = {got[key]!r}, expected "
                                 f"{expected[key]!r} [{case}]; {hints.get(key, '')}")


HINTS = {
    "straggler": "a straggler is slow in its compute (the time from a step's start to its "
                 "entering the step's collective), not in its step time: every rank of a "
                 "synchronous step waits for the slowest, so all step times look alike. Use each "
                 "rank's median over the steps (one long pause of a healthy rank is not a "
                 "straggler) and compare ranks with a rule that allows for noise (course, "
                 "section 3); compare times within a rank only (the clocks are skewed)",
    "missing": "the rank that never joined is the one that never issued the collective (the same "
               "seq) that the others entered and never left",
    "hot_expert": "sum the tokens per expert over the steps; call one expert hot when its load is "
                  "far above the mean (e.g. twice: labkit.faults.detect.hot_expert), and say None "
                  "when routing is merely noisy",
}


def _hiccups(case, size, steps, count):
    """One-off pauses of healthy ranks: (rank, step, seconds)."""
    return [(case.integer(0, size - 1), case.integer(0, steps - 1),
             0.15 + 0.05 * case.integer(0, 3)) for _ in range(count)]


def check_no_alarm(world, diagnose, steps=12, hiccups=2, experts=0, seed=None):
    """A healthy run, with `hiccups` one-off pauses of 0.15-0.3 s: no straggler, no missing rank,
    no hot expert; and the same trace with a fault written into it (a rank cut off before a
    step's all-reduce, an expert given half the tokens) must raise some alarm."""
    case = base.Case(f"{TASK1}: a healthy run of {steps} steps on {world.size} ranks with "
                     f"{hiccups} hiccups", seed)
    trace = traces.record_run(world, steps=steps,
                              hiccups=_hiccups(case, world.size, steps, hiccups),
                              experts=experts, seed=case.integer(0, 10 ** 6),
                              clock_skew=CLOCK_SKEW)
    got = _verdict(diagnose, trace, case, "a healthy run")
    _expect(got, dict.fromkeys(KEYS), case, "a healthy run (nothing is wrong in it)",
            dict(HINTS, straggler="this run has no straggler, only a few one-off pauses: the "
                 "slowest rank of a healthy run is not a straggler. " + HINTS["straggler"]))
    # Silence is not specificity (issue 26, class 3): the same run with a fault written into its
    # trace (a rank that stops before a step's all-reduce; one expert given half the tokens) must
    # raise some alarm. Any key counts, so a detector that misses one kind of fault loses only
    # that kind's cell, and one that never fires loses this one too.
    rank, step = case.integer(0, world.size - 1), case.integer(steps // 2, steps - 1)
    hot = case.integer(0, 7)
    alarms = {}
    for what, faulty in ((f"rank {rank} stops before step {step}'s all-reduce",
                          with_missing_rank(trace, rank, step)),
                         (f"expert {hot} gets half the tokens", with_hot_expert(trace, hot))):
        verdict = _verdict(diagnose, faulty, case, f"the same run where {what}")
        alarms[what] = {k: v for k, v in verdict.items() if v is not None}
    if not any(alarms.values()):
        raise AssertionError(f"diagnose raised no alarm on the same healthy run with a fault "
                             f"written into its trace ({'; '.join(alarms)}) [{case}]; a detector "
                             "that never fires has no false alarms and no use: "
                             + HINTS["missing"])
    return got


def with_missing_rank(trace, rank, step):
    """The trace as if `rank` had stopped before step `step`'s gradient all-reduce: every rank's
    record ends in that step, the others inside its collective (never left), the rank without
    it. Plain data from a real run, cut; the clocks stay as they were."""
    ranks = []
    for r in trace["ranks"]:
        kept = [dict(c) for c in r["collectives"] if c["step"] < step]
        if r["rank"] != rank:
            entered = [dict(c, leave=None) for c in r["collectives"]
                       if c["step"] == step and c["what"] == "grads"]
            kept += entered[:1]
        loads = r.get("expert_tokens")
        ranks.append(dict(r, step_start=list(r["step_start"][:step + 1]),
                          step_end=list(r["step_end"][:step]) + [None], collectives=kept,
                          expert_tokens=None if loads is None else [list(x) for x in loads[:step]]))
    return dict(trace, ranks=ranks)


def with_hot_expert(trace, hot, experts=8):
    """The trace with expert `hot` given half of every step's tokens (the others share the rest
    evenly); a run without experts gets `experts` of them."""
    ranks = []
    for r in trace["ranks"]:
        loads = r.get("expert_tokens") or [[traces.TOKENS_PER_RANK * trace["world_size"]
                                            // experts] * experts for _ in r["step_end"]]
        rows = []
        for counts in loads:
            n, total = len(counts), sum(counts)
            row = [(total - total // 2) // max(n - 1, 1)] * n
            row[hot % n] = total // 2
            rows.append(row)
        ranks.append(dict(r, expert_tokens=rows))
    return dict(trace, ranks=ranks)


def relabel_ranks(trace, shift):
    """The same trace with rank r renamed (r + shift) mod P (its record, clock and all, moved to
    that place in `ranks`): the run where the other rank had the fault. A diagnosis that looks
    at the data, not at the rank numbers, is the same up to the renaming."""
    size = trace["world_size"]
    ranks = sorted((dict(r, rank=(r["rank"] + shift) % size) for r in trace["ranks"]),
                   key=lambda r: r["rank"])
    return dict(trace, ranks=ranks)


def relabel_experts(trace, shift):
    """The same trace with expert e renamed (e + shift) mod E in every step's loads."""
    ranks = []
    for r in trace["ranks"]:
        loads = r.get("expert_tokens")
        if loads is not None:
            loads = [[row[(e - shift) % len(row)] for e in range(len(row))] for row in loads]
        ranks.append(dict(r, expert_tokens=loads))
    return dict(trace, ranks=ranks)


def _every_renaming(diagnose, trace, key, faulty, count, relabel, case, what, hints):
    """Sensitivity over every rank (or expert), on the same real run (issue 26, class 4): the
    trace renamed so that each of the `count` ranks (experts) in turn is the faulty one. One real
    run with a random faulty rank would let a detector that names a constant rank, or ignores
    one, pass with probability 1/P per run (1/8 at P = 2 over three runs); renamed, it fails
    with probability 1."""
    kind = "expert" if key == "hot_expert" else "rank"
    for shift in range(1, count):
        expected = dict.fromkeys(KEYS)
        expected[key] = (faulty + shift) % count
        renamed = (f"{what}, the same trace with every {kind} i renamed (i + {shift}) mod "
                   f"{count}: the fault is now {kind} {expected[key]}'s")
        _expect(_verdict(diagnose, relabel(trace, shift), case, renamed), expected, case,
                renamed, hints)


def check_straggler(world, diagnose, steps=12, delay=0.2, hiccups=1, seed=None):
    """One rank sleeps `delay` s in every step from a step the case draws (in the first third);
    a few hiccups elsewhere. Expected: that rank, nothing else; and the same trace with its ranks
    renamed, P times, so that every rank is the straggler once (a constant answer, or one that
    never looks at some rank, fails with probability 1, not 1 - 1/P)."""
    case = base.Case(f"{TASK1}: a straggler among {world.size} ranks", seed)
    slow, start = case.integer(0, world.size - 1), case.integer(0, steps // 3)
    trace = traces.record_run(world, steps=steps, straggler=slow, delay=delay, delay_from=start,
                              hiccups=_hiccups(case, world.size, steps, hiccups),
                              seed=case.integer(0, 10 ** 6), clock_skew=CLOCK_SKEW)
    what = f"rank {slow} sleeps {delay} s before its collective in steps {start}..{steps - 1}"
    got = _verdict(diagnose, trace, case, f"a run where rank {slow} is slow")
    _expect(got, {"straggler": slow, "missing": None, "hot_expert": None}, case, what, HINTS)
    _every_renaming(diagnose, trace, "straggler", slow, world.size, relabel_ranks, case, what,
                    HINTS)
    return got


def check_missing(world, diagnose, steps=10, timeout=3.0, seed=None):
    """One rank stops before the collective of a step the case draws; the others wait in it and
    give up after `timeout` s. Expected: that rank is missing, nobody is a straggler; and so for
    the same trace with its ranks renamed so that every rank is the missing one once (a check
    that leaves out rank 0, or names a constant rank, fails with probability 1)."""
    case = base.Case(f"{TASK1}: a rank that never joins a collective, {world.size} ranks", seed)
    rank, step = case.integer(0, world.size - 1), case.integer(steps // 2, steps - 1)
    trace = traces.record_run(world, steps=steps, skip=(rank, step), timeout=timeout,
                              seed=case.integer(0, 10 ** 6), clock_skew=CLOCK_SKEW)
    got = _verdict(diagnose, trace, case, f"a run where rank {rank} skips step {step}'s "
                                          "collective")
    what = f"rank {rank} never joins step {step}'s all-reduce (the others time out in it)"
    hints = dict(HINTS, straggler="the ranks that waited in the last collective and the rank "
                 "that never came are not stragglers: leave out steps that did not finish. "
                 + HINTS["straggler"])
    _expect(got, {"straggler": None, "missing": rank, "hot_expert": None}, case, what, hints)
    _every_renaming(diagnose, trace, "missing", rank, world.size, relabel_ranks, case, what,
                    hints)
    return got


def check_hot_expert(world, diagnose, steps=6, experts=8, share=None, seed=None):
    """About `share` (drawn from 40-60% unless given: the lab's text says 40-60%, so a test
    gives 0.4 on purpose, where "more than half the tokens" is wrong) of every rank's tokens go to
    one expert the case draws (top-1 routing over `experts`). Expected: that expert, nothing
    else; and so for the same trace with its experts renamed so that each of them is the hot one
    once (a constant answer fails with probability 1, not 1 - 1/E)."""
    case = base.Case(f"{TASK1}: a hot expert among {experts}, {world.size} ranks", seed)
    hot = case.integer(0, experts - 1)
    share = 0.4 + 0.05 * case.integer(0, 4) if share is None else share
    trace = traces.record_run(world, steps=steps, experts=experts, hot_expert=hot, share=share,
                              seed=case.integer(0, 10 ** 6), clock_skew=CLOCK_SKEW)
    got = _verdict(diagnose, trace, case, f"a run where expert {hot} gets {share:.0%} of tokens")
    what = f"expert {hot} receives about {share:.0%} of the tokens"
    _expect(got, {"straggler": None, "missing": None, "hot_expert": hot}, case, what, HINTS)
    _every_renaming(diagnose, trace, "hot_expert", hot, experts, relabel_experts, case, what,
                    HINTS)
    return got


# ---- task 2: the spike guard ---------------------------------------------------------------------

GUARD_TOLERANCE = 1e-4     # weights: float noise of the same steps ~1e-6; a wrong stream ~1e-2


def _stream_plan(case, steps, bad_count, snapshot_every=None):
    """Hard batches (text read backwards) every 5-9 ids; `bad_count` bad ids after the first 15
    steps, not adjacent. With `snapshot_every`, the bad batches fall on the snapshot schedule on
    purpose (issue 26, class 4): the first is drawn at a step s with (s + 1) % snapshot_every == 0
    (the step after which a snapshot is due), the second at s % snapshot_every == 0, the two
    usual ways to write the schedule; the i-th bad batch is drawn at step id - i (each earlier one
    was quarantined). A guard that takes its snapshot before checking the step then saves the
    damaged state and rolls back to it: a random draw caught that on 1 case in snapshot_every."""
    hard, i = [], case.integer(3, 8)
    while i < steps + 10:
        hard.append(i)
        i += case.integer(5, 9)
    bad = []
    while len(bad) < bad_count:
        b = case.integer(15, steps - 8)
        if snapshot_every and len(bad) < 2:
            step = b - len(bad)
            residue = (snapshot_every - 1, 0)[len(bad)]
            b += (residue - step) % snapshot_every
            if b > steps - 4:
                continue
        if all(abs(b - other) > 4 for other in bad):
            bad.append(b)
    hard = [h for h in hard if h not in bad]
    return {"hard": hard, "bad": sorted(bad)}


STREAM_EXTRA = 8           # batch ids beyond `steps` a rank is given (a guard quarantines a few)


def stream_shares(seed, steps, plan, size):
    """Each rank's rows of the stream's batches 0 .. steps + STREAM_EXTRA - 1, as tokens
    [ids, B/P, T + 1] (uint8): what a data loader hands a rank, nothing of the plan."""
    shares = []
    for rank in range(size):
        rows = []
        for batch_id in range(steps + STREAM_EXTRA):
            x, y = spikes.batch(seed, batch_id, plan, rank, size)      # x, y: [B/P, T]
            rows.append(torch.cat([x, y[:, -1:]], dim=1))              # [B/P, T + 1]
        shares.append({"steps": steps, "seed": seed,
                       "tokens": torch.stack(rows).to(torch.uint8)})   # [ids, B/P, T + 1]
    return shares


def guarded_stream(share, guard_class, guard_kwargs=None) -> dict:
    """Rank program of lab 9, task 2: the loop of `spikes.guarded_train`, on the batches of
    `share["tokens"]` (batch id -> this rank's rows). Returns the guard's decisions and the final
    weights: {"weights", "losses", "rollbacks": [(from step, to step)], "quarantined": sorted ids,
    "iterations"}."""
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, steps = share["tokens"], share["steps"]
    model = spikes.make_model(share["seed"])
    optimizer = spikes.make_optimizer(model)
    guard = guard_class(model, optimizer, **(guard_kwargs or {}))
    step, cursor, started_at = 0, 0, {0: 0}
    losses, rollbacks, iterations = [], [], 0
    while step < steps and iterations < 4 * steps:
        iterations += 1
        skip = set(getattr(guard, "quarantined", ()) or ())
        while cursor in skip:
            cursor += 1
        if cursor >= len(tokens):
            raise ValueError(f"rank {rank}: the stream ran out at batch id {cursor} (it has "
                             f"{len(tokens)} batches for {steps} steps; quarantined: "
                             f"{sorted(skip)}); quarantine only the batches that spike")
        batch_id = cursor
        cursor += 1
        rows = tokens[batch_id].long()                                  # [B/P, T + 1]
        x, y = rows[:, :-1], rows[:, 1:]
        optimizer.zero_grad(set_to_none=True)
        stats = spikes.sync(model, spikes.forward_backward(model, x, y))
        optimizer.step()
        losses.append(stats["loss"])
        back = guard.after_step(step, batch_id, dict(stats))
        if back is None:
            step += 1
            started_at[step] = cursor
            continue
        spikes.check_resume_step(back, step, f"rank {rank}: ")
        rollbacks.append((step, back))
        step, cursor = back, started_at[back]
    return spikes.guarded_result(model, losses, rollbacks, guard, iterations)


def _run_guard(world, SpikeGuard, case, steps, plan, snapshot_every, timeout):
    """The reference (no guard, the bad ids removed) on ranks that run no student code; the
    student's guard on ranks given only their batches (`guarded_stream`)."""
    seed = case.integer(0, 10 ** 6)
    config = {"steps": steps, "seed": seed, "plan": plan}
    reference = world.call(spikes.guarded_train, args=(dict(config, removed=plan["bad"]), None),
                           timeout=timeout)
    got = world.run_each(guarded_stream, stream_shares(seed, steps, plan, world.size),
                         SpikeGuard, {"snapshot_every": snapshot_every}, timeout=timeout)
    base.one_result_per_rank(got, world.size, case, "training with your SpikeGuard")
    for rank, result in enumerate(got):
        if not isinstance(result, dict) or not isinstance(result.get("quarantined"), list) \
                or not isinstance(result.get("rollbacks"), list) \
                or not isinstance(result.get("weights"), torch.Tensor):
            raise AssertionError(f"rank {rank}: the training loop's result is not what it "
                                 f"returns (got {type(result).__name__}) [{case}]")
    return reference, got


def _compare_weights(got, reference, case, what, hint):
    for rank, (mine, ref) in enumerate(zip(got, reference)):
        gap = float((mine["weights"] - ref["weights"]).abs().max())
        if not torch.isfinite(mine["weights"]).all() or gap > GUARD_TOLERANCE:
            raise AssertionError(f"{what}: rank {rank}'s final weights differ from the reference "
                                 f"by up to {gap:.2e} (tolerance {GUARD_TOLERANCE:g}) [{case}]; "
                                 f"{hint}")


def check_guard_clean(world, SpikeGuard, steps=40, snapshot_every=5, timeout=120, seed=None):
    """A stream of clean batches, with hard ones every 5-9 steps (text read backwards: the
    gradient norm up to ~2x the mean of the recent steps): the guard must never fire, and
    training must equal training without a guard; and on a short stream with one bad batch the
    same guard must fire (a guard that never fires is not specific, it is silent)."""
    case = base.Case(f"{TASK2}: a clean stream of {steps} steps on {world.size} ranks", seed)
    plan = _stream_plan(case, steps, 0)
    reference, got = _run_guard(world, SpikeGuard, case, steps, plan, snapshot_every, timeout)
    for rank, result in enumerate(got):
        if result["rollbacks"] or result["quarantined"]:
            raise AssertionError(
                f"rank {rank}: on a clean stream your guard rolled back {result['rollbacks']} "
                f"and quarantined batches {result['quarantined']} (hard batches at ids "
                f"{plan['hard']}) [{case}]; hard batches raise the gradient norm up to ~2x the "
                "mean of the recent accepted steps: a threshold that fires there fires on "
                "ordinary noise")
    _compare_weights(got, reference, case, "a clean stream", "with no rollback, after_step must "
                     "change nothing: did it alter the model or the optimizer?")
    # Silence is not specificity (issue 26, class 3): the same guard, on a short stream with one
    # bad batch, must fire (quarantine something or roll back). Whether it undoes the update
    # exactly is the next cell's; a guard that never fires loses this one too.
    short = 24
    spiked = _stream_plan(case, short, 1)
    fired = world.run_each(guarded_stream, stream_shares(case.integer(0, 10 ** 6), short, spiked,
                                                         world.size),
                           SpikeGuard, {"snapshot_every": snapshot_every}, timeout=timeout)
    base.one_result_per_rank(fired, world.size, case, "training with your SpikeGuard")
    for rank, result in enumerate(fired):
        if not isinstance(result, dict) or not (result.get("rollbacks") or
                                                result.get("quarantined")):
            raise AssertionError(
                f"rank {rank}: your guard never fired on a stream with a bad batch (id "
                f"{spiked['bad'][0]}, gradient norm tens of times the recent mean) [{case}]; a "
                "guard that never fires has no false alarms and no use: flag a step whose "
                "gradient norm is far above the recent accepted ones")
    return got


def check_guard_spike(world, SpikeGuard, steps=40, bad=1, snapshot_every=5, timeout=120,
                      seed=None):
    """`bad` batches of extreme tokens in the stream (gradient norm tens of times the recent
    mean): each must be quarantined, and the final weights must equal training on the stream
    without them (the rollback undid every update they caused)."""
    case = base.Case(f"{TASK2}: {bad} bad batch(es) in {steps} steps on {world.size} ranks, "
                     f"a snapshot every {snapshot_every} steps", seed)
    plan = _stream_plan(case, steps, bad, snapshot_every)
    reference, got = _run_guard(world, SpikeGuard, case, steps, plan, snapshot_every, timeout)
    for rank, result in enumerate(got):
        if result["quarantined"] != plan["bad"]:
            raise AssertionError(
                f"rank {rank}: your guard quarantined {result['quarantined']}, the bad batches "
                f"were {plan['bad']} [{case}]; a bad batch sends the gradient norm more than 8x "
                "above the mean of the recent accepted steps: quarantine exactly it")
        if len(result["rollbacks"]) < bad:
            raise AssertionError(f"rank {rank}: {len(result['rollbacks'])} rollback(s) for {bad} "
                                 f"bad batch(es) [{case}]; the update of a bad batch is already "
                                 "applied when after_step sees it: return the step to go back to")
    _compare_weights(got, reference, case, "after the spike",
                     "a rollback must restore the model and the optimizer (AdamW's moments and "
                     "step count too) exactly as they were before the bad step, from a snapshot "
                     "taken after a step that passed the check, and training must go on from "
                     "the step the snapshot follows")
    return got
