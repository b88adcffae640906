"""The fault matrix of chapter 9, section 1: rank programs that cause each failure on purpose.

Collectives run on a process group of their own with a short timeout (`TIMEOUT` seconds), so a
rank left waiting gives up, reports what it saw, and the world stays usable. Every program
returns (or, if it dies, has printed) a report: what the rank did, how it ended, how long it
waited.

| row | program |
|---|---|
| a rank exits before / after a collective | `exit_around_collective` |
| collective count, dtype or order differ | `mismatched_collectives` |
| RNG differs across activation recomputation | `recompute_gradients` |
| an expert empty (DDP and unused parameters) | `ddp_with_empty_expert` |
| a process dies before its shard is written; a crash before / after the commit | `save_and_crash` |

The rows about resuming (another world size, a changed tokenizer, data mixture or data cursor)
use chapter 8's bench directly in the notebook.
"""
from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

TIMEOUT = 2.0


def _group(timeout: float = TIMEOUT):
    return dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=timeout))


def _run_ops(ops, group):
    """Run this rank's list of ops on `group`; returns (values of the last tensor, error text)."""
    tensor = None
    for op in ops:
        kind = op[0]
        if kind == "sleep":
            time.sleep(op[1])
            continue
        if kind == "exit":
            print(f"rank {dist.get_rank()} exits now (os._exit)", flush=True)
            os._exit(17)
        dtype = getattr(torch, op[2]) if len(op) > 2 else torch.float32
        tensor = torch.full((op[1],), float(dist.get_rank() + 1), dtype=dtype)
        if kind == "all_reduce":
            dist.all_reduce(tensor, group=group)
        elif kind == "broadcast":
            dist.broadcast(tensor, 0, group=group)
        else:
            raise ValueError(f"unknown op {kind!r}")
    return tensor


def mismatched_collectives(ops, timeout: float = TIMEOUT) -> dict:
    """Rank program for run_each: run `ops` (this rank's list of ("all_reduce", n, dtype),
    ("broadcast", n, dtype), ("sleep", s), ("exit",)) on a group of their own; report
    {"values": the last tensor's first values, "error": what was raised (None), "seconds"}."""
    group = _group(timeout)
    started, error, values = time.monotonic(), None, None
    try:
        tensor = _run_ops(ops, group)
        values = None if tensor is None else [float(v) for v in tensor[:3]]
    except RuntimeError as caught:       # DistBackendError and friends
        error = " ".join(str(caught).split())[:400]
    report = {"values": values, "error": error, "seconds": round(time.monotonic() - started, 3)}
    print("report " + json.dumps(report), flush=True)
    dist.barrier()                       # the default group outlives the broken one
    dist.destroy_process_group(group)
    return report


def exit_around_collective(ops, timeout: float = TIMEOUT) -> dict:
    """`mismatched_collectives` without the final barrier: a rank that exits never reaches it."""
    group = _group(timeout)
    started, error, values = time.monotonic(), None, None
    try:
        tensor = _run_ops(ops, group)
        values = None if tensor is None else [float(v) for v in tensor[:3]]
    except RuntimeError as caught:
        error = " ".join(str(caught).split())[:400]
    report = {"values": values, "error": error, "seconds": round(time.monotonic() - started, 3)}
    print("report " + json.dumps(report), flush=True)
    return report


def reports(last_output: dict) -> dict:
    """{rank: report} from the lines the programs above printed (`world.last_output`): what the
    ranks that survived saw, when another rank's death made the call raise."""
    found = {}
    for rank, lines in last_output.items():
        for _, line in lines:
            if line.startswith("report "):
                found[rank] = json.loads(line[len("report "):])
    return found


class DropoutMLP(nn.Module):
    """[N, H] -> [N, H]: Linear, GELU, Dropout, Linear: the block recomputed under checkpoint."""

    def __init__(self, hidden: int = 64, p: float = 0.5):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)                           # [N, H] -> [N, 4H]
        self.down = nn.Linear(4 * hidden, hidden)                         # [N, 4H] -> [N, H]
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.down(self.drop(nn.functional.gelu(self.up(x))))


def recompute_gradients(seed: int = 0, hidden: int = 64) -> dict:
    """Gradients of one dropout block three ways, from the same RNG state: no recomputation,
    torch.utils.checkpoint with preserve_rng_state=True, and with False. Returns the largest
    absolute difference of each checkpointed variant's weight gradients from the plain one."""
    from torch.utils.checkpoint import checkpoint

    def grads(mode):
        torch.manual_seed(seed)
        block = DropoutMLP(hidden)
        x = torch.randn(32, hidden, requires_grad=True)                  # x: [N, H]
        torch.manual_seed(seed + 1)                                       # the dropout stream
        if mode == "plain":
            y = block(x)
        else:
            y = checkpoint(block, x, use_reentrant=False, preserve_rng_state=mode == "preserve")
            torch.rand(1000)          # the RNG moves on between forward and backward, as it does
        y.square().mean().backward()
        return torch.cat([p.grad.reshape(-1) for p in block.parameters()])

    plain = grads("plain")
    return {mode: float((grads(mode) - plain).abs().max()) for mode in ("preserve", "forget")}


class TwoExperts(nn.Module):
    """x [N, H] -> [N, H]: a top-1 router over two experts; `route_all_to` forces every token to
    one expert (the other is then empty: its weights get no gradient)."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.router = nn.Linear(hidden, 2)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(2))

    def forward(self, x, route_all_to=None):
        choice = self.router(x).argmax(-1)                               # [N]
        if route_all_to is not None:
            choice = torch.full_like(choice, route_all_to)
        gate = self.router(x).softmax(-1)                                 # [N, 2]
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():
                out[mask] = gate[mask, e:e + 1] * expert(x[mask])
        return out


def ddp_with_empty_expert(steps: int = 3, find_unused: bool = False) -> dict:
    """Two DDP steps of `TwoExperts` with every token routed to expert 0. Returns
    {"steps_done", "error"}: with find_unused_parameters=False, DDP stops at the second step
    because expert 1's parameters never got a gradient."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(TwoExperts(), find_unused_parameters=find_unused)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    done, error = 0, None
    try:
        for _ in range(steps):
            x = torch.randn(16, 8)
            model(x, route_all_to=0).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            done += 1
    except RuntimeError as caught:
        error = " ".join(str(caught).split())[:600]
    return {"steps_done": done, "error": error}


def save_and_crash(root: str, step: int, crash: str | None, victim: int = 1) -> str:
    """Every rank writes its shard of snapshot `step` with chapter 8's store, the ranks gather
    the entries, rank 0 commits. `crash` kills rank `victim` with SIGKILL: "before_shard" (before
    it writes its shard), "before_commit" (rank 0, after the gather, before the commit),
    "after_commit" (rank 0, right after the commit). Returns the manifest path (rank 0)."""
    from labkit.checkpoint import snapshot_id, store
    rank, sid = dist.get_rank(), snapshot_id(step)

    def die_if(point, who):
        if crash == point and rank == who:
            os.kill(os.getpid(), signal.SIGKILL)

    die_if("before_shard", victim)
    entry = store.write_shard(root, sid, f"rank{rank}.bin", f"step {step} rank {rank}".encode())
    entries = [None] * dist.get_world_size()
    dist.all_gather_object(entries, entry)
    die_if("before_commit", 0)
    path = store.commit(root, sid, entries, {"step": step}) if rank == 0 else ""
    die_if("after_commit", 0)
    dist.barrier()
    return path
