"""Young's and Daly's intervals against real kills: ranks SIGKILLed on an exponential clock
(chapter 8, section 7).

    run = killclock.run_job(world, root, work=60, tau=5, C=1.0, M=12.0, seed=0)
    run["wall"]              # the job's clock when it finished: work + what was lost
    run["resumed_from"]      # after each kill, the step the restarted ranks loaded (from the store)
    killclock.replay(60, 5, 1.0, run["failures"])       # the same, in arithmetic

The clock is virtual so that the check is in counts, not in this machine's timings: a step costs
1 unit, a save C units, a restart R = 0. Failures come from an exponential clock of mean M units
(`failure_times`). What is real: every attempt is a world of real ranks that builds chapter 8's
bench trainer, restores the newest snapshot that `store.load_latest` verifies, trains and
publishes a snapshot every `tau` steps (each rank's shard, the agreement, rank 0's commit); when
the clock passes the next failure, a rank SIGKILLs itself, during a step or between its shard and
the agreement of a save, and labkit restarts the world. Where the next attempt resumes is what the
store kept, not what the clock says.

`replay` is the same schedule in arithmetic (interval.simulate's model, with the failure times
given): the wall time the job should have if each restart resumed from the newest save that
finished before its failure. Daly's T(tau) with R = 0 is its expectation.
"""
from __future__ import annotations

import math
import os
import signal

import numpy as np


def failure_times(M: float, horizon: float, seed: int) -> list[float]:
    """Times of failures on an exponential clock of mean M (units), up to `horizon`, and one
    beyond it (the job cannot outrun the clock)."""
    if not (M > 0 and horizon > 0):
        raise ValueError(f"M and horizon must be positive, got M={M}, horizon={horizon}")
    rng = np.random.default_rng(seed)
    times, t = [], 0.0
    while t <= horizon:
        t += float(rng.exponential(M))
        times.append(t)
    return times


def replay(work: int, tau: int, C: float, failures: list[float]) -> dict:
    """The schedule in arithmetic: segments of tau steps (the last may be shorter), each followed
    by a save of C; a failure loses everything since the last save that finished; R = 0.
    Returns {"wall", "resumed_from": [the step each attempt after a failure starts from]}."""
    _check(work, tau, C)
    t, done, resumed, pending = 0.0, 0, [], list(failures)
    while done < work:
        segment = min(tau, work - done)
        finish = t + segment + C
        if pending and finish > pending[0]:
            t = pending.pop(0)                # the segment in progress, or its save, is lost
            resumed.append(done)
            continue
        t, done = finish, done + segment
    return {"wall": t, "resumed_from": resumed}


def _check(work, tau, C):
    if not (isinstance(work, int) and isinstance(tau, int) and work >= 1 and tau >= 1):
        raise ValueError(f"work and tau are whole steps >= 1, got work={work!r}, tau={tau!r}")
    if not C >= 0:
        raise ValueError(f"C must be >= 0, got {C!r}")


def _save(root, trainer, steps):
    import torch.distributed as dist
    from labkit.checkpoint import resume, snapshot_id, store
    rank = dist.get_rank()
    sid = snapshot_id(steps)
    entry = store.write_shard(root, sid, f"rank{rank}.pt", resume.to_bytes(resume.capture(trainer)))
    return sid, entry


def attempt(root: str, work: int, tau: int, C: float, start: float, failure: float | None,
            victim: int = 1, started=None, dying=None) -> dict:
    """One attempt of the job, as every rank runs it (see the module docstring). `start`: the
    clock when this attempt begins; `failure`: when the next failure strikes (None: never).
    Returns {"resumed_from", "wall"} when the job finishes; rank `victim` SIGKILLs itself when
    the clock passes `failure`. `started(step)`, if given, is called with the step loaded, and
    `dying()` on the victim just before it kills itself."""
    import torch.distributed as dist
    from labkit.checkpoint import bench, resume, store
    _check(work, tau, C)
    rank, size = dist.get_rank(), dist.get_world_size()
    victim = min(victim, size - 1)
    trainer = bench.Trainer(bench.CONFIG)
    found = store.load_latest(root)
    if found is not None:
        resume.restore(trainer, resume.from_bytes(found["shards"][f"rank{rank}.pt"]))
    resumed_from, clock = trainer.steps, start
    if started is not None:
        started(resumed_from)

    def die_if(cost):
        if failure is not None and clock + cost > failure and rank == victim:
            if dying is not None:
                dying()
            os.kill(os.getpid(), signal.SIGKILL)

    while trainer.steps < work:
        segment = min(tau, work - trainer.steps)
        for _ in range(segment):
            die_if(1.0)                                     # the failure strikes during this step
            trainer.step()
            clock += 1.0
        sid, entry = _save(root, trainer, trainer.steps)
        die_if(C)                                           # during the save: shard written, no commit
        entries = [None] * size
        dist.all_gather_object(entries, entry)
        if rank == 0:
            store.commit(root, sid, entries, {"step": trainer.steps, "world_size": size})
        dist.barrier()
        clock += C
    return {"resumed_from": resumed_from, "wall": clock}


def _horizon(work, tau, C, M):
    return 20.0 * (work + C * math.ceil(work / tau)) + 10 * M


def run_job(world, root: str, work: int, tau: int, C: float, M: float, seed: int,
            timeout: float = 120.0) -> dict:
    """Run the job to the end on `world`, one attempt per failure of the clock; returns
    {"wall", "failures" (the times that struck), "resumed_from" (per attempt after a failure, the
    step read from the store before it started: what the ranks loaded), "restarts"}. labkit's
    "restarting the world" line, printed once per kill, is counted instead of printed."""
    import labkit
    from labkit.checkpoint import crash, store
    _check(work, tau, C)
    clock_times = failure_times(M, _horizon(work, tau, C, M), seed)
    start, resumed, struck, count = 0.0, [], [], crash.RestartCount()
    for failure in clock_times:
        found = store.load_latest(root)
        step = 0 if found is None else found["metadata"]["step"]
        if struck:
            resumed.append(step)
        try:
            with count.quiet():
                result = world.call(attempt, (root, work, tau, C, start, failure), timeout=timeout)
        except labkit.RankDied:
            struck.append(failure)
            start = failure                                 # R = 0: the next attempt starts now
            continue
        if any(r["resumed_from"] != step for r in result):
            raise RuntimeError(f"the ranks resumed from {[r['resumed_from'] for r in result]}, "
                               f"the store's newest verified snapshot is step {step}")
        return {"wall": result[0]["wall"], "failures": struck, "resumed_from": resumed,
                "restarts": count.restarts}
    raise RuntimeError(f"the job did not finish before {len(clock_times)} failures (M={M} too "
                       f"small for work={work}, tau={tau}, C={C}?)")


def torchrun_attempt(folder: str, work: int, tau: int, C: float, M: float, seed: int,
                     victim: int = 1) -> float:
    """`attempt` as torchrun runs it (`run_job_torchrun`): the attempt's number is torchrun's
    TORCHELASTIC_RESTART_COUNT, a, so it begins at failure a - 1 of the clock (0 for the first)
    and rank `victim` dies at failure a, as in `run_job`, where one attempt also ends per failure.
    Every rank appends what it loaded, and at the end its clock, to FOLDER/rank<k>.jsonl."""
    import json
    import time
    import torch.distributed as dist
    number = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    times = failure_times(M, _horizon(work, tau, C, M), seed)
    start = 0.0 if number == 0 else times[number - 1]
    failure = times[number] if number < len(times) else None
    path = os.path.join(folder, f"rank{dist.get_rank()}.jsonl")

    def log(**event):
        with open(path, "a") as stream:
            stream.write(json.dumps(dict(event, attempt=number, t=time.time())) + "\n")

    result = attempt(os.path.join(folder, "checkpoints"), work, tau, C, start, failure, victim,
                     started=lambda step: log(event="start", resumed_from=step),
                     dying=lambda: log(event="kill"))
    log(event="finished", wall=result["wall"])
    return result["wall"]


def run_job_torchrun(folder: str, work: int, tau: int, C: float, M: float, seed: int,
                     nproc: int = 2, victim: int = 1, timeout: float = 600.0) -> dict:
    """`run_job` under torchrun: the same job and clock, each attempt a new set of `nproc`
    interpreters that torchrun's agent starts when the victim dies (`--max-restarts` one per
    failure the clock can strike; labkit.runtime.torchrun.job). Returns run_job's keys, where
    "resumed_from" is what the victim rank loaded in each attempt after a failure (every rank that
    logged agrees, or this raises), and "seconds" (the job's wall-clock time) and "restart_seconds"
    (per failure: from the kill to the next attempt's load)."""
    import glob
    import json
    from labkit.runtime import torchrun
    _check(work, tau, C)
    times = failure_times(M, _horizon(work, tau, C, M), seed)
    os.makedirs(os.path.join(folder, "checkpoints"), exist_ok=True)
    run = torchrun.job("labkit.checkpoint.killclock:torchrun_attempt",
                       [folder, work, tau, float(C), float(M), seed, victim], nproc=nproc,
                       max_restarts=len(times), timeout=timeout)
    if run["returncode"] != 0:
        raise RuntimeError(f"the torchrun job (tau={tau}, seed={seed}) failed with exit status "
                           f"{run['returncode']}; its output ends:\n{run['output'][-2000:]}")
    events = {}
    for path in glob.glob(os.path.join(folder, "rank*.jsonl")):
        rank = int(os.path.basename(path)[4:-6])
        with open(path) as stream:
            for line in stream:
                event = json.loads(line)
                events.setdefault(event["attempt"], {}).setdefault(event["event"], {})[rank] = event
    victim = min(victim, nproc - 1)
    count = max(events) + 1
    if sorted(events) != list(range(count)) or any(victim not in events[a].get("start", {})
                                                   for a in range(count)):
        raise RuntimeError(f"the victim rank {victim} logged no start for some attempt of "
                           f"{count}: {sorted(events)}")
    resumed = []
    for a in range(count):
        loaded = {e["resumed_from"] for e in events[a]["start"].values()}
        if len(loaded) != 1:
            raise RuntimeError(f"attempt {a}: the ranks loaded different steps: "
                               f"{ {r: e['resumed_from'] for r, e in events[a]['start'].items()} }")
        if a:
            resumed.append(loaded.pop())
    finished = events[count - 1].get("finished", {})
    if len(finished) != nproc:
        raise RuntimeError(f"the last attempt ({count - 1}) finished on ranks {sorted(finished)} "
                           f"of {nproc}")
    if any(victim not in events[a].get("kill", {}) for a in range(count - 1)):
        raise RuntimeError(f"an attempt of {count} ended with no kill logged by rank {victim}")
    restart = [events[a + 1]["start"][victim]["t"] - events[a]["kill"][victim]["t"]
               for a in range(count - 1)]
    return {"wall": finished[0]["wall"], "failures": times[:count - 1], "resumed_from": resumed,
            "restarts": count - 1, "seconds": run["seconds"], "restart_seconds": restart}


def lost_fraction(wall: float, work: int) -> float:
    """(wall - work) / work: the time lost to saves and failures, as a fraction of the work."""
    return wall / work - 1


def spread_of_mean(work: int, tau: int, C: float, M: float, runs: int, trials: int = 20000,
                   seed: int = 0) -> float:
    """The standard deviation of the mean lost fraction of `runs` jobs of this size, from
    interval.simulate (Daly's model, R = 0): the resolution a handful of kills allows."""
    from labkit.checkpoint import interval
    draw = interval.failure_sampler("exponential", M)
    walls = interval.simulate(work, tau, C, 0.0, draw, trials, seed=seed)
    return float(np.std(walls / work - 1) / math.sqrt(runs))
