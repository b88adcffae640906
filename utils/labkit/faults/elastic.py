"""Elastic recovery with torchrun: a rank SIGKILLed mid-training, the job restarted by torchrun's
agent, resumed from chapter 8's newest checkpoint (chapter 9, section 4).

    run = elastic.launch(nproc=2, steps=12, every=4, kill_at=7, folder=tmp)
    run["returncode"]        # 0: the job finished after the restart
    run["events"]            # every rank's log: starts, steps (with losses), saves, the kill

What each rank runs (`train`, under `labkit.runtime.torchrun`'s entry, which joins the process
group from torchrun's environment):

1. build chapter 8's bench trainer; if the checkpoint folder holds a snapshot that verifies
   (`labkit.checkpoint.store.load_latest`), restore it strictly (`resume.restore`);
2. train until `steps`, logging every step's loss to its own JSON-lines file, and every `every`
   steps publish a snapshot (every rank writes its shard, rank 0 commits the manifest);
3. on the first attempt only, rank `kill_rank` sends itself SIGKILL as step `kill_at` begins
   (`kill_at` a list: on attempt a, as step kill_at[a] begins, one kill per attempt).

torchrun's agent sees a worker die, stops the others, and (with `--max-restarts 1`) starts all of
them again with TORCHELASTIC_RESTART_COUNT=1; they rendezvous again and resume. The command:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 --max-restarts 1 --monitor-interval 0.1 \\
        -m labkit.runtime.torchrun --entry labkit.faults.elastic:train \\
        FOLDER STEPS EVERY KILL_AT KILL_RANK

The environment and flags are those of `labkit.runtime.torchrun.job`, which says why.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import time


def _log(stream, **event):
    stream.write(json.dumps(dict(event, t=time.time())) + "\n")
    stream.flush()


def _kills(kill_at) -> list[int]:
    """kill_at as a list, one step per attempt: 7, "5,6,7" or [5, 6, 7]."""
    if isinstance(kill_at, str):
        return [int(k) for k in kill_at.split(",") if k.strip()]
    if isinstance(kill_at, int):
        return [kill_at]
    return [int(k) for k in kill_at]


def train(folder: str, steps: int, every: int, kill_at, kill_rank: int = 1):
    """The rank program (see the module docstring); returns the steps done."""
    import torch.distributed as dist
    kills = _kills(kill_at)
    from labkit.checkpoint import bench, resume, snapshot_id, store
    rank, size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    root = os.path.join(folder, "checkpoints")
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(folder, f"rank{rank}.jsonl"), "a") as log:
        trainer = bench.Trainer(bench.CONFIG)
        found = store.load_latest(root)
        if found is not None:
            resume.restore(trainer, resume.from_bytes(found["shards"][f"rank{rank}.pt"]))
        _log(log, event="start", rank=rank, attempt=attempt, world_size=size,
             resumed_from=trainer.steps, snapshot=found and found["snapshot_id"])
        while trainer.steps < steps:
            if attempt < len(kills) and rank == kill_rank and trainer.steps + 1 == kills[attempt]:
                _log(log, event="kill", rank=rank, attempt=attempt, step=kills[attempt])
                os.kill(os.getpid(), signal.SIGKILL)
            loss = trainer.step()
            _log(log, event="step", rank=rank, attempt=attempt, step=trainer.steps, loss=loss)
            if trainer.steps % every == 0:
                sid = snapshot_id(trainer.steps)
                entry = store.write_shard(root, sid, f"rank{rank}.pt",
                                          resume.to_bytes(resume.capture(trainer)))
                entries = [None] * size
                dist.all_gather_object(entries, entry)
                if rank == 0:
                    store.commit(root, sid, entries, {"step": trainer.steps, "world_size": size})
                dist.barrier()
                _log(log, event="saved", rank=rank, attempt=attempt, step=trainer.steps)
    return trainer.steps


def _arguments(folder: str, steps: int, every: int, kill_at, kill_rank: int) -> list[str]:
    """`train`'s arguments, as torchrun passes them to every rank."""
    return [folder, str(steps), str(every), ",".join(map(str, _kills(kill_at))), str(kill_rank)]


def command(nproc: int, folder: str, steps: int, every: int, kill_at, kill_rank: int = 1,
            max_restarts: int | None = None) -> list[str]:
    """The torchrun command line that `launch` runs (one restart per kill unless told)."""
    from labkit.runtime import torchrun
    if max_restarts is None:
        max_restarts = len(_kills(kill_at))
    return torchrun.job_command("labkit.faults.elastic:train",
                                _arguments(folder, steps, every, kill_at, kill_rank),
                                nproc=nproc, max_restarts=max_restarts)


def launch(nproc: int, steps: int, every: int, kill_at, folder: str, kill_rank: int = 1,
           max_restarts: int | None = None, timeout: float = 300.0) -> dict:
    """Run the job under torchrun; return {"returncode", "seconds", "output" (its last 4000
    characters), "events" (every rank's log, sorted by time)}. `kill_at`: a step, or one step
    per attempt (a list); `max_restarts` defaults to one restart per kill."""
    from labkit.runtime import torchrun
    kills = _kills(kill_at)
    if not kills or not all(1 <= k <= steps for k in kills):
        raise ValueError(f"kill_at must be a step of the run (1..{steps}), or a list of them, "
                         f"got {kill_at}")
    if max_restarts is None:
        max_restarts = len(kills)
    if not 0 <= kill_rank < nproc:
        raise ValueError(f"kill_rank must be a rank (0..{nproc - 1}), got {kill_rank}")
    os.makedirs(folder, exist_ok=True)
    run = torchrun.job("labkit.faults.elastic:train",
                       _arguments(folder, steps, every, kill_at, kill_rank),
                       nproc=nproc, max_restarts=max_restarts, timeout=timeout)
    return dict(run, events=read_events(folder))


def read_events(folder: str) -> list[dict]:
    events = []
    for path in sorted(glob.glob(os.path.join(folder, "rank*.jsonl"))):
        with open(path) as stream:
            events += [json.loads(line) for line in stream if line.strip()]
    return sorted(events, key=lambda e: e["t"])


def summary(events: list[dict], rank: int = 0) -> dict:
    """What one rank's log says: the losses of each attempt by step, where the second attempt
    resumed, the steps done twice (the work lost), the seconds from the kill to the first step
    after the restart."""
    mine = [e for e in events if e.get("rank") == rank]
    losses = {}
    for e in mine:
        if e["event"] == "step":
            losses.setdefault(e["attempt"], {})[e["step"]] = e["loss"]
    starts = {e["attempt"]: e for e in mine if e["event"] == "start"}
    resumed = starts[1]["resumed_from"] if 1 in starts else None
    redone = sorted(set(losses.get(0, {})) & set(losses.get(1, {})))
    kill = next((e for e in events if e["event"] == "kill"), None)
    first_after = min((e["t"] for e in mine if e["event"] == "step" and e["attempt"] == 1),
                      default=None)
    return {"losses": losses, "resumed_from": resumed, "redone": redone,
            "attempts": sorted(starts), "kill_step": kill and kill["step"],
            "restart_seconds": None if kill is None or first_after is None
            else first_after - kill["t"]}


def redone_per_attempt(events: list[dict], rank: int = 0) -> dict:
    """{attempt a: the steps attempt a completed after the snapshot that attempt a + 1 resumed
    from}, for every attempt that has a successor: the work each failure cost, read from one
    rank's log (what a later attempt must do again). Read the killed rank's: it logs every
    attempt's start before it kills itself, while the agent may stop another rank of an attempt
    that dies at once before that rank has logged anything."""
    mine = [e for e in events if e.get("rank") == rank]
    starts = {e["attempt"]: e["resumed_from"] for e in mine if e["event"] == "start"}
    done = {}
    for e in mine:
        if e["event"] == "step":
            done.setdefault(e["attempt"], set()).add(e["step"])
    return {a: sorted(s for s in done.get(a, ()) if s > starts[a + 1])
            for a in sorted(starts) if a + 1 in starts}


def lost_steps(kill_at: int, every: int) -> int:
    """Steps completed since the last snapshot when step `kill_at` begins: (kill_at - 1) mod
    every. Averaged over a failure time drawn uniformly, (every - 1) / 2 steps plus the half step
    in progress: the tau / 2 of Young's formula (chapter 8, section 7) in steps."""
    if every < 1 or kill_at < 1:
        raise ValueError(f"every and kill_at must be >= 1, got every={every}, kill_at={kill_at}")
    return (kill_at - 1) % every
