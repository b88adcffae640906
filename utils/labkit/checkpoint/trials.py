"""Chapter 8, sections 1-2: crash trials of a save, the truth they are judged by, the table.

The chapter keeps the save under test, the kill plan and the table; this module runs the trials:
kill at a point, restart, check what survived, count.

    names, rows = trials.every_point(victims, naive_save, naive_load, ranks=2, size=SIZE,
                                     base=WORK, when=("before", "after"))   # s. 1, one process
    per_rank = world.call(trials.distributed, (distributed_save, load, root, SIZE, kill_plan,
                                               1))                           # s. 2, on the ranks
    rows = trials.phase_table(per_rank)
    rows, restarts = trials.real_ranks(world, distributed_save, load, root, 4, SIZE, kill_plan, 3)
    trials.commit_race(victims, store.commit, base=WORK, races=20)   # s. 1: {winners: races}

A save under test is `save(root, step, ranks)` in section 1 (one process plays every rank) and
`save(run, root, step)` on the ranks in section 2, where `run(role, fn, *args)` does a role's file
work ("writer", "committer", ...) and returns its value, or None when the harness killed it: in
`distributed` each role runs in a victim process (`crash.shared`) that may be SIGKILLed, so that
a trial costs milliseconds and the rank survives to say it has nothing; in `real_ranks` the rank
process itself dies (`crash.install`) and the world restarts. A loader is `load(root, ranks)`:
(step, {rank: bytes}) or None (`load_store` reads `store.load_latest`).

A kill plan is `kill_plan(victims, rng) -> [(victim, plan), ...]`, one trial each: victims maps
each victim (role, rank) that a clean save ran to (its file-system calls, its seconds; a rank
process of `real_ranks` reports 0 seconds), plan is a `crash` plan. It is called on every rank
with the same seed, so every rank holds the same list. The truth is worked out without the save's
code: shard r of step s holds `payload(s, r, size)`, and a snapshot is complete when its manifest
exists and every shard is exact (`complete`).

A record (`distributed`, per trial and rank): the victim, its number of events in the clean run
(a writer that creates the step's folder also fsyncs the root, and which rank gets there first
varies, so a call of the plan can lie past the calls a save made: the victim then finishes),
whether a timer was drawn, its status ("ok", "killed", ..., or "not reached" when it never ran,
e.g. a committer after a writer died), where it was killed (`(k, "before"|"after", call name)` or
"timer"), the step loaded afterwards, the newest complete step and whether the load was torn.
"""
import collections
import os
import random
import tempfile

from labkit.checkpoint import crash, layout


def payload(step, rank, size):
    """The bytes rank `rank` saves at `step`: different for every (step, rank), reproducible."""
    return random.Random(step * 1000 + rank).randbytes(size)


def torn(found, ranks, size):
    """A loaded snapshot (step, {rank: bytes}) is torn when any shard differs from what its step
    saved. Nothing loaded (None) is not torn."""
    if found is None:
        return False
    step, shards = found
    return any(shards.get(r) != payload(step, r, size) for r in range(ranks))


def complete(root, step, ranks, size):
    """The truth, checked without the store's code: manifest present, every shard exact."""
    sid = layout.snapshot_id(step)
    if not os.path.exists(layout.manifest_path(root, sid)):
        return False
    for rank in range(ranks):
        try:
            with open(os.path.join(root, sid, f"rank{rank}.bin"), "rb") as stream:
                if stream.read() != payload(step, rank, size):
                    return False
        except FileNotFoundError:
            return False
    return True


def load_store(root, ranks):
    """`store.load_latest` as a loader: (step, {rank: bytes}) of the newest verified snapshot."""
    from labkit.checkpoint import store
    found = store.load_latest(root)
    if found is None:
        return None
    return found["metadata"]["step"], {r: found["shards"].get(f"rank{r}.bin")
                                       for r in range(ranks)}


# ---- section 1: one process plays every rank --------------------------------------------------

def clean_events(victims, save, ranks, base):
    """The file-system calls of a clean save of step 1, [(k, name, info)], in a fresh folder."""
    return victims.run(save, tempfile.mkdtemp(dir=base), 1, ranks)["events"]


def kill_at(victims, save, load, ranks, size, base, plan):
    """A fresh folder, a complete step 1, step 2 killed by `plan`, then the loader as a restarted
    job runs it: (step loaded, torn)."""
    root = tempfile.mkdtemp(dir=base)
    save(root, 1, ranks)                                         # step 1: complete
    victims.run(save, root, 2, ranks, plan=plan)                 # step 2: killed
    found = load(root, ranks)
    return (None if found is None else found[0]), torn(found, ranks, size)


def every_point(victims, save, load, ranks, size, base, when=("before", "after")):
    """kill_at just before and/or just after every file-system call of a clean save (`when`).
    Returns the calls' names and rows ((k, when, name), step loaded, torn)."""
    if not when or set(when) - {"before", "after"}:
        raise ValueError(f"when must name 'before' and/or 'after', got {when!r}")
    events = clean_events(victims, save, ranks, base)
    rows = [((k, w, name),) + kill_at(victims, save, load, ranks, size, base, {f"kill_{w}": k})
            for k, name, _ in events for w in when]
    return [name for _, name, _ in events], rows


# ---- section 2: real ranks, each role's file work in a victim ---------------------------------

def distributed(save, load, root, size, kill_plan, seed):
    """On every rank: step 0 saved cleanly, then one save per (victim, plan) of `kill_plan`
    (the same list on every rank). One record per trial (module doc)."""
    import torch.distributed as dist
    rank, world_size = dist.get_rank(), dist.get_world_size()
    victims = crash.shared()

    def runner(kill, done):
        def run(role, fn, *args):
            plan = kill[1] if kill and kill[0] == (role, rank) else {}
            out = done[role] = victims.run(fn, *args, plan=plan)
            return out["value"] if out["status"] == "ok" else None
        return run

    clean = {}
    save(runner(None, clean), root, 0)
    mine = {(role, rank): (len(out["events"]), out["seconds"]) for role, out in clean.items()}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)                 # what each victim did in a clean run
    roles = {victim: counts for part in gathered for victim, counts in part.items()}
    records, complete_steps = [], {0}
    plans = kill_plan(roles, random.Random(seed))          # the same list on every rank
    for trial, (victim, plan) in enumerate(plans, start=1):
        if victim not in roles:
            raise ValueError(f"kill_plan named victim {victim!r}; the clean save ran "
                             f"{sorted(roles)}")
        done = {}
        save(runner((victim, plan), done), root, trial)
        if complete(root, trial, world_size, size):
            complete_steps.add(trial)
        found = load(root, world_size)                     # what a restarted rank would load
        dist.barrier()                                     # every rank loaded before the next save
        killed = done.get(victim[0]) if victim[1] == rank else None
        records.append({"victim": victim, "n_events": roles[victim][0],
                        "mine": victim[1] == rank, "timer": "kill_after_seconds" in plan,
                        "killed_at": killed["killed_at"] if killed else None,
                        "status": killed["status"] if killed else "not reached",
                        "loaded": None if found is None else found[0],
                        "newest_complete": max(complete_steps),
                        "torn": torn(found, world_size, size)})
    return records


def totals(per_rank):
    """Over every rank and trial: torn loads, loads that missed the newest complete snapshot, and
    whether all ranks loaded the same step in every trial."""
    flat = [record for records in per_rank for record in records]
    agree = all(len({records[t]["loaded"] for records in per_rank}) == 1
                for t in range(len(per_rank[0])))
    return {"torn": sum(r["torn"] for r in flat),
            "missed": sum(r["loaded"] != r["newest_complete"] for r in flat), "agree": agree}


# ---- section 2, the end: the rank processes themselves die ------------------------------------

def _count_events(save, root, step):
    """A clean save with this rank's calls counted: {("rank", r): (events, 0)}."""
    import torch.distributed as dist
    events = []
    undo = crash.install({}, emit=events.append)
    try:
        save(lambda role, fn, *args: fn(*args), root, step)
    finally:
        undo()
    return {("rank", dist.get_rank()): (len(events), 0.0)}


def _save_or_die(save, root, step, victim, plan):
    """The save run in the rank processes themselves; rank `victim` dies by `plan`."""
    import torch.distributed as dist
    undo = crash.install(plan) if dist.get_rank() == victim else (lambda: None)
    try:
        save(lambda role, fn, *args: fn(*args), root, step)
    finally:
        undo()


def real_ranks(world, save, load, root, steps, size, kill_plan, seed=0, timeout=120):
    """Step 0 saved cleanly, then steps 1..`steps`, each with a rank that SIGKILLs itself at a
    (victim, plan) drawn from `kill_plan` (victims ("rank", r): a rank's whole save, 0 seconds,
    so no timer: `crash.install` has none). labkit stops the
    others and restarts the world for the next call; this process loads as a restarted job would.
    Rows (step, outcome, loaded, newest complete, torn), and the world restarts counted (labkit's
    "restarting the world" line is counted instead of printed, like killclock.run_job)."""
    import labkit
    victims = {}
    for part in world.call(_count_events, (save, root, 0), timeout=timeout):
        victims.update(part)
    rng, rows, count = random.Random(seed), [], crash.RestartCount()
    plans = [(victim, plan) for victim, plan in kill_plan(victims, rng)
             if "kill_after_seconds" not in plan]
    for step, ((_, victim), plan) in enumerate(rng.sample(plans, min(steps, len(plans))), 1):
        try:
            with count.quiet():
                world.call(_save_or_die, (save, root, step, victim, plan), timeout=timeout)
            outcome = "no kill (the save had fewer calls)"
        except labkit.RankDied as died:
            outcome = f"rank {died.rank} killed"
        found = load(root, world.size)
        newest = max(s for s in range(step + 1) if complete(root, s, world.size, size))
        rows.append((step, outcome, None if found is None else found[0], newest,
                     torn(found, world.size, size)))
    with count.quiet():
        world.call(len, ((),))                          # the last kill's restart, counted too
    return rows, count.restarts


# ---- the table --------------------------------------------------------------------------------

def kill_phase(record):
    """A readable name for where a trial's kill landed (from the record of the rank that ran the
    victim)."""
    if record["status"] == "not reached":
        return "committer: never started (a writer died)"
    who = "writer" if record["victim"][0] == "writer" else "committer"
    if record["status"] == "ok":                # a call drawn past the calls this save made
        return (f"{who}: finished before its timer" if record.get("timer", True) else
                f"{who}: finished (fewer calls than drawn)")
    if record["killed_at"] == "timer":
        return f"{who}: killed by a timer"
    k, when, name = record["killed_at"]
    if who == "writer":
        if name == "write":
            return "writer: while writing its shard"
        if k == record["n_events"] and when == "after":
            return "writer: shard durable, before the agreement"
        return f"writer: {when} an fsync of its shard or folder"
    if name == "write":
        return "committer: while writing the temp manifest"
    if name == "link":
        return f"committer: {when} the link (the commit point)"
    if name == "unlink":
        return f"committer: {when} removing the temp name"
    return f"committer: {when} an fsync (manifest or folder)"


def owner(victim):
    """The rank that ran the victim: (role, rank), or ("committer",) for rank 0's committer."""
    return victim[1] if len(victim) > 1 else 0


def phase_table(per_rank):
    """{phase: [trials, torn loads, newest complete loaded]}, each trial read from the rank that
    ran its victim. per_rank: one list of records per rank, trial t at index t."""
    if not per_rank or any(len(records) != len(per_rank[0]) for records in per_rank):
        raise ValueError(f"every rank must return one record per trial; got "
                         f"{[len(records) for records in per_rank]} records per rank")
    rows = collections.defaultdict(lambda: [0, 0, 0])
    for t in range(len(per_rank[0])):
        record = per_rank[owner(per_rank[0][t]["victim"])][t]
        row = rows[kill_phase(record)]
        row[0] += 1
        row[1] += record["torn"]
        row[2] += record["loaded"] == record["newest_complete"]
    return dict(rows)


def commit_race(victims, commit, base, races=20, size=64):
    """Two committers of one snapshot id, each paused right before it publishes (the worst
    interleaving: both have already found the id free), then both released, `races` times.
    `commit(root, sid, shards, metadata)` is `store.commit` or a variant under test; `victims` a
    `crash.Victims`, which pauses a call at `pause_before_dst` (its publication's target).
    Returns {number of committers that returned without an error: races}."""
    from labkit import checkpoint
    from labkit.checkpoint import store
    winners = collections.Counter()
    for i in range(races):
        root = tempfile.mkdtemp(dir=base)
        sid = checkpoint.snapshot_id(i)
        shards = [store.write_shard(root, sid, "rank0.bin", payload(i, 0, size))]
        target = checkpoint.manifest_path(root, sid)
        jobs = [(commit, (root, sid, shards, {"committer": who}), {"pause_before_dst": target})
                for who in ("A", "B")]
        out = victims.run_group(jobs, [("start", 0), ("until_paused", 0), ("start", 1),
                                       ("until_paused", 1), ("release", 0), ("release", 1),
                                       ("finish", 0), ("finish", 1)])
        winners[sum(o["status"] == "ok" for o in out)] += 1
    return dict(winners)
