"""Lab 9, task 2's checkers: a spike guard judged by its rates on fresh streams, and by the exact
weights of every rollback it makes (`checks.check_guard_clean`, `checks.check_guard_spike`).

The student's class is built on every rank by the rank program `guarded_stream` (the loop of
`spikes.guarded_train`), which is handed only what a training loop has: its rows of the stream's
batches, as tokens. The plan (which ids are bad or hard) and every expected value stay in the
checker's process: no frame or global the guard can walk holds them. Every call trains several
streams, each from a seed of its own, in one launch of the ranks (`_guard_program`, with chapter
9's rules, labkit.faults.detect, refused for the call); the rank returns the guard's decisions
(rollbacks, quarantined ids) and the final weights of each as plain data. The references are the
same loop without a guard on the streams without their bad batches, run on ranks where no student
code runs.

- clean streams (hard batches, text read backwards, every 5-9 steps: the gradient norm up to ~2x
  the recent mean): at most MAX_FALSE_FIRES of them may see the guard fire; on every other one the
  weights must equal training without a guard (after_step changes nothing). And on streams with a
  bad batch the same guard must fire, missing at most MAX_MISSES (a guard that never fires is
  silent, not specific).
- streams with bad batches: a stream is caught when exactly its bad ids are quarantined, with a
  rollback each; at most MAX_MISSES streams missed, and on every caught stream the final weights
  equal the reference's (GUARD_TOLERANCE): no slack on exactness. Half the streams put their bad
  batches on the snapshot schedule on purpose (a guard that snapshots before checking saves the
  damaged state: it fails every such stream), the other half put one early, within 5 steps of
  `earliest` (a guard that waits for more history than the text allows misses those).
"""
from __future__ import annotations

import torch

from labkit import checks as base
from labkit.faults import rates, spikes

TASK2 = "Lab 9, task 2"
GUARD_TOLERANCE = 1e-4     # weights: float noise of the same steps ~1e-6; a wrong stream ~1e-2
MAX_FALSE_FIRES = 1        # clean streams a call may see the guard fire on
MAX_MISSES = 1             # streams with a bad batch a call may see the guard miss
STREAM_EXTRA = 8           # batch ids beyond `steps` a rank is given (a guard quarantines a few)


def stream_plan(case, steps, bad_count, snapshot_every=None, earliest=15, early=False):
    """Hard batches every 5-9 ids; `bad_count` bad ids from step `earliest` on, not adjacent.
    With `snapshot_every`, the bad batches fall on the snapshot schedule on purpose (issue 26,
    class 4): the first at a step s with (s + 1) % snapshot_every == 0 (the step after which a
    snapshot is due), the second at s % snapshot_every == 0, the two usual ways to write the
    schedule; the i-th bad batch is drawn at step id - i (each earlier one was quarantined).
    With `early`, the first bad id is within 5 steps of `earliest`, off the schedule."""
    hard, i = [], case.integer(3, 8)
    while i < steps + STREAM_EXTRA + 2:
        hard.append(i)
        i += case.integer(5, 9)
    bad, tries = [], 0
    while len(bad) < bad_count:
        tries += 1
        if tries % 50 == 0:                 # no room for the next one beside these: start over
            bad = []
        if tries > 5000:
            raise ValueError(f"{bad_count} bad batches from step {earliest} do not fit in "
                             f"{steps} steps (a snapshot every {snapshot_every}): give more steps")
        b = case.integer(earliest, steps - 8)
        if early and not bad:
            b = case.integer(earliest, earliest + 4)
        elif snapshot_every and len(bad) < 2:
            step = b - len(bad)
            residue = (snapshot_every - 1, 0)[len(bad)]
            b += (residue - step) % snapshot_every
            if b > steps - 4:
                continue
        if all(abs(b - other) > 4 for other in bad):
            bad.append(b)
    hard = [h for h in hard if h not in bad]
    return {"hard": hard, "bad": sorted(bad)}


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


def _guard_program(share_list, guard_class, guard_kwargs):
    """On a rank: every stream of this rank's list in turn, chapter 9's rules refused."""
    from labkit import refusal
    from labkit.faults import detect
    with refusal.refused(guard_class, detect, refusal.functions_of(detect), rates.REFUSED):
        return [guarded_stream(share, guard_class, guard_kwargs) for share in share_list]


def _references(configs):
    """On a rank: training without a guard, each stream without its bad batches."""
    return [spikes.guarded_train(config, None) for config in configs]


def _streams(world, SpikeGuard, case, plans, steps, snapshot_every, timeout, reference):
    """Train every stream of `plans` with the student's guard (one launch); with `reference`,
    also without a guard and without the bad ids (another launch, trusted ranks). Returns
    (seeds, results per stream [one per rank], references per stream or None)."""
    seeds = [case.integer(0, 10 ** 6) for _ in plans]
    per_stream = [stream_shares(seed, steps, plan, world.size) for seed, plan in zip(seeds, plans)]
    shares = [[stream[rank] for stream in per_stream] for rank in range(world.size)]
    got = world.run_each(_guard_program, shares, SpikeGuard, {"snapshot_every": snapshot_every},
                         timeout=timeout * len(plans))
    base.one_result_per_rank(got, world.size, case, "training with your SpikeGuard")
    for rank, results in enumerate(got):
        if not isinstance(results, list) or len(results) != len(plans) or not all(
                isinstance(r, dict) and isinstance(r.get("quarantined"), list)
                and isinstance(r.get("rollbacks"), list)
                and isinstance(r.get("weights"), torch.Tensor) for r in results):
            raise AssertionError(f"rank {rank}: the training loop's results are not what it "
                                 f"returns [{case}]")
    refs = None
    if reference:
        configs = [{"steps": steps, "seed": seed, "plan": plan, "removed": plan["bad"]}
                   for seed, plan in zip(seeds, plans)]
        refs = world.run(_references, configs)
    by_stream = [[got[rank][i] for rank in range(world.size)] for i in range(len(plans))]
    by_stream_refs = None if refs is None else [[refs[rank][i] for rank in range(world.size)]
                                                for i in range(len(plans))]
    return seeds, by_stream, by_stream_refs


def _weights_gap(results, references):
    gaps = []
    for mine, ref in zip(results, references):
        if not torch.isfinite(mine["weights"]).all() or mine["weights"].shape != \
                ref["weights"].shape:
            return float("inf")
        gaps.append(float((mine["weights"] - ref["weights"]).abs().max()))
    return max(gaps)


def _fired(results) -> bool:
    return any(r["rollbacks"] or r["quarantined"] for r in results)


def check_guard_clean(world, SpikeGuard, streams=2, steps=30, snapshot_every=5, spiked=2,
                      timeout=120, seed=None):
    """`streams` clean streams with hard batches: the guard fires on at most MAX_FALSE_FIRES,
    and every stream it leaves alone trains exactly as without a guard; `spiked` short streams
    with one bad batch each: it fires on all but at most MAX_MISSES."""
    case = base.Case(f"{TASK2}: {streams} clean streams of {steps} steps on {world.size} ranks",
                     seed)
    plans = [stream_plan(case, steps, 0) for _ in range(streams)]
    seeds, got, refs = _streams(world, SpikeGuard, case, plans, steps, snapshot_every, timeout,
                                reference=True)
    fired = [i for i, results in enumerate(got) if _fired(results)]
    for i, (results, ref) in enumerate(zip(got, refs)):
        gap = _weights_gap(results, ref)
        if i not in fired and gap > GUARD_TOLERANCE:
            raise AssertionError(f"a clean stream (seed {seeds[i]}) where your guard never fired "
                                 f"ended {gap:.2e} away from training without a guard (tolerance "
                                 f"{GUARD_TOLERANCE:g}) [{case}]; with no rollback, after_step "
                                 "must change nothing: did it alter the model or the optimizer?")
    short = 24
    spiky = [stream_plan(case, short, 1, earliest=15) for _ in range(spiked)]
    caught = _streams(world, SpikeGuard, case, spiky, short, snapshot_every, timeout,
                      reference=False)[1] if spiky else []
    silent = [i for i, results in enumerate(caught) if not _fired(results)]
    if len(fired) <= MAX_FALSE_FIRES and len(silent) <= MAX_MISSES:
        return [results[0] for results in got]
    lines = [f"your guard fired on {len(fired)} of {streams} clean streams (at most "
             f"{MAX_FALSE_FIRES} allowed) and stayed silent on {len(silent)} of {spiked} streams "
             f"with a bad batch (at most {MAX_MISSES} allowed) [{case}]"]
    lines += [f"  false fire: clean stream seed {seeds[i]} (hard batches at ids {plans[i]['hard']}"
              f"): rollbacks {got[i][0]['rollbacks']}, quarantined {got[i][0]['quarantined']}"
              for i in fired[:4]]
    lines += [f"  silent: a bad batch at id {spiky[i]['bad'][0]}, gradient norm tens of times the "
              "recent mean" for i in silent[:4]]
    raise AssertionError("\n".join(lines) + "\nhard batches raise the gradient norm up to ~2x the "
                         "mean of the recent accepted steps: a threshold that fires there fires "
                         "on ordinary noise; a guard that never fires has no false alarms and no "
                         "use: flag a step whose gradient norm is far above the recent accepted "
                         "ones")


def check_guard_spike(world, SpikeGuard, streams=2, steps=26, bad=1, snapshot_every=5,
                      earliest=15, timeout=120, seed=None):
    """`streams` streams with `bad` bad batches each (from step `earliest` on; even streams on
    the snapshot schedule, odd ones early): each must be caught (exactly its bad ids quarantined,
    a rollback each), at most MAX_MISSES missed, and every caught stream's final weights must
    equal training without its bad batches."""
    case = base.Case(f"{TASK2}: {bad} bad batch(es) in each of {streams} streams of {steps} "
                     f"steps on {world.size} ranks, a snapshot every {snapshot_every} steps",
                     seed)
    plans = [stream_plan(case, steps, bad, snapshot_every, earliest, early=i % 2 == 1)
             for i in range(streams)]
    seeds, got, refs = _streams(world, SpikeGuard, case, plans, steps, snapshot_every, timeout,
                                reference=True)
    missed = []
    for i, (plan, results, ref) in enumerate(zip(plans, got, refs)):
        mine = results[0]
        if any(r["quarantined"] != plan["bad"] for r in results) or \
                any(len(r["rollbacks"]) < bad for r in results):
            missed.append(f"  missed: stream seed {seeds[i]}, bad batches {plan['bad']}: your "
                          f"guard quarantined {mine['quarantined']} with rollbacks "
                          f"{mine['rollbacks']}")
            continue
        gap = _weights_gap(results, ref)
        if gap > GUARD_TOLERANCE:
            raise AssertionError(
                f"stream seed {seeds[i]}, bad batches {plan['bad']}, a snapshot every "
                f"{snapshot_every} steps: your guard quarantined them, and the final weights "
                f"differ from training without them by up to {gap:.2e} (tolerance "
                f"{GUARD_TOLERANCE:g}) [{case}]; a rollback must restore the model and the "
                "optimizer (AdamW's moments and step count too) exactly as they were before the "
                "bad step, from a snapshot taken after a step that passed the check, and "
                "training must go on from the step the snapshot follows")
    if len(missed) > MAX_MISSES:
        raise AssertionError(
            f"your guard caught {streams - len(missed)} of {streams} streams with bad batches "
            f"(at least {streams - MAX_MISSES} needed) [{case}]\n" + "\n".join(missed[:4]) +
            f"\na bad batch sends the gradient norm more than 8x above the mean of the recent "
            f"accepted steps, and can come as soon as {earliest} normal steps are known: "
            "quarantine exactly it, and return the step to go back to (its update is already "
            "applied when after_step sees it)")
    return [results[0] for results in got]
