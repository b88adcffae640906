"""Chapter 8, section 3: torch.distributed.checkpoint (DCP) under the crash harness.

    dcp_trials.start_victims()                          # on every rank, once: the helpers import DCP
    status = dcp_trials.trial(stores, folder, step, victim=1, point="after its write", trial=3)
    steps = dcp_trials.load(folder)                     # on every rank: steps found, or one line
    dcp_trials.loaded(world.run(dcp_trials.load, folder))
    runner = dcp_trials.Trials(world, stores, base)     # the same from the kernel, numbered
    runner.trial(folder, step, victim, point); runner.load(folder); runner.refused

Each rank's save runs in its own victim process (`crash.shared`, forked from a helper that has
imported torch and DCP), with a process group of its own over a FileStore, so that a SIGKILL of
one victim is a crash of one rank of DCP's save while the course's ranks stay up. `KillingWriter`
is DCP's `FileSystemWriter` with a SIGKILL of rank `victim` at one of `POINTS`:

- "before its write" / "after its write": in `write_data` (planning is over; the others write);
- "before the metadata" / "after the metadata": in `finish` (rank 0 writes `.metadata`);
- "before the commit": with `commit_root`, rank 0 dies after every rank's save returned and
  before `store.commit_folder` publishes the folder (section 3's commit on top).

The expected refusals are quiet (`dcp_files.quiet`): a refused load comes back as one line.
"""
import os

from labkit.checkpoint import crash, dcp_files

POINTS = ("before its write", "after its write", "before the metadata", "after the metadata",
          "before the commit")
PRELOAD = ("torch", "torch.distributed.checkpoint", "labkit.checkpoint.store")
FLOATS = 1 << 16                                     # per rank: 256 KiB of float32


def _killing_writer():
    from torch.distributed.checkpoint import FileSystemWriter
    import torch.distributed as dist

    class KillingWriter(FileSystemWriter):
        """DCP's file writer, with a SIGKILL of rank `victim` at `point` (crash trials only)."""

        def __init__(self, path, victim=-1, point=None):
            super().__init__(path)
            self.victim, self.point = victim, point

        def _maybe_die(self, here):
            if self.point == here and dist.get_rank() == self.victim:
                os.kill(os.getpid(), 9)

        def write_data(self, plan, planner):
            self._maybe_die("before its write")
            future = super().write_data(plan, planner)
            future.wait()
            self._maybe_die("after its write")
            return future

        def finish(self, metadata, results):
            self._maybe_die("before the metadata")
            super().finish(metadata, results)
            self._maybe_die("after the metadata")

    return KillingWriter


def victim(folder, step, rank, world_size, store_path, victim_rank, point, commit_root=None,
           floats=FLOATS):
    """One rank's side of dcp.save in a victim process with its own process group. Each rank's
    tensor has its own key (plain tensors under one key would be taken as replicated)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from labkit.checkpoint import store
    if victim_rank >= 0 and point not in POINTS:
        raise ValueError(f"point must be one of {POINTS} when a rank is to die, got {point!r}")
    rendezvous = dist.FileStore(store_path, world_size)
    rendezvous.set_timeout(timedelta(seconds=30))
    dist.init_process_group("gloo", store=rendezvous, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=30))
    try:
        state = {f"w{rank}": torch.full((floats,), float(step))}
        with dcp_files.quiet():                         # DCP warns on every overwrite
            dcp.save(state, storage_writer=_killing_writer()(folder, victim_rank, point))
        if commit_root is not None:                     # section 3's fix: the commit on top
            dist.barrier()                              # every rank's save returned
            if rank == 0:
                if point == "before the commit" and rank == victim_rank:
                    os.kill(os.getpid(), 9)
                # one manifest entry (size, SHA-256) per file DCP wrote, then store.commit
                store.commit_folder(commit_root, os.path.basename(folder), {"step": step})
    finally:
        dist.destroy_process_group()


def start_victims():
    """Start this rank's helper (it imports torch and DCP once, seconds on a busy machine)."""
    crash.shared(preload=PRELOAD)


def trial(stores, folder, step, victim_rank, point, trial_number, commit_root=None):
    """Every rank runs its DCP victim (rank `victim_rank` dies at `point`); then the ranks wait.
    `stores`: a folder for the trials' rendezvous files. Returns this rank's victim's status."""
    import torch.distributed as dist
    store_path = os.path.join(stores, f"trial-{trial_number}")
    rank, world_size = dist.get_rank(), dist.get_world_size()      # raises outside a world
    victims = crash.shared(preload=PRELOAD)
    out = victims.run(victim, folder, step, rank, world_size, store_path, victim_rank, point,
                      commit_root, plan={"timeout": 60})
    dist.barrier()
    return out["status"]


def load(folder, floats=FLOATS):
    """The steps found in this rank's loaded tensor, or the refusal in one line. A refused load
    is expected in the trials: dcp_files.quiet() keeps DCP from logging two tracebacks per rank."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    state = {f"w{dist.get_rank()}": torch.zeros(floats)}
    try:
        with dcp_files.quiet():
            dcp.load(state, checkpoint_id=folder)
    except BaseException as error:          # DCP's CheckpointException is a BaseException
        return f"rank {dist.get_rank()}: {dcp_files.refusal(error, folder)}"
    return sorted(set(state[f"w{dist.get_rank()}"].tolist()))


def load_latest(root, floats=FLOATS):
    """`load` of the newest snapshot that `store.load_latest` verifies under `root` (every DCP
    file's SHA-256), or None when there is none."""
    from labkit.checkpoint import store
    found = store.load_latest(root)
    return None if found is None else load(os.path.join(root, found["snapshot_id"]), floats)


def loaded(per_rank):
    """What the ranks loaded together: an error name, or the sorted steps found on any rank."""
    errors = [r.split(": ")[1].split()[0] for r in per_rank if isinstance(r, str)]  # its name
    return errors[0] if errors else sorted({step for r in per_rank for step in r})


class Trials:
    """Section 3's trials driven from the kernel on `world`: every rank's helper started once,
    each trial numbered (its own rendezvous file under `stores`), and each refused load kept as
    one line (relative to `base`) in `refused`, for the summary under the table."""

    def __init__(self, world, stores, base):
        self.world, self.stores, self.base = world, stores, base
        self.count, self.refused = 0, []
        world.call(start_victims, timeout=300)        # every helper up before a rendezvous

    def trial(self, folder, step, victim_rank, point, commit_root=None):
        """One save of `step` into `folder` on every rank, rank `victim_rank` killed at `point`
        (-1: nobody). Returns each rank's victim's status."""
        self.count += 1
        return self.world.run(trial, self.stores, folder, step, victim_rank, point, self.count,
                              commit_root)

    def load(self, folder):
        """`load` on every rank; a refusal (the same on every rank) is kept in `refused`."""
        out = self.world.run(load, folder)
        lines = {line.split(": ", 1)[1] for line in out if isinstance(line, str)}
        self.refused.extend(f"{os.path.relpath(folder, self.base)}: {line}"
                            for line in sorted(lines))
        return out
