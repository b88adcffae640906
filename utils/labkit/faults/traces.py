"""Traces of real runs with faults the run injects into itself (chapter 9, sections 2-3; lab 9).

    trace = traces.record_run(world, steps=12, straggler=1, delay=0.2)    # rank 1 is slow
    trace = traces.record_run(world, steps=8, skip=(1, 5))                # rank 1 skips step 5
    trace = traces.record_run(world, steps=6, hot_expert=3, share=0.5)    # expert 3 is popular

Each rank runs a small synchronous training loop: in every step it computes (a little matrix
work, then GPU_SECONDS of waiting that stands for the GPU's kernels: a training process's CPU
thread mostly waits for its GPU, so a busy CPU barely stretches it; plus whatever delay the run
asks of it), then enters the step's gradient all-reduce; with experts, it also routes its
tokens and all-reduces the tokens per expert. The run uses a process group of its own with a
short timeout, so a rank that never joins a collective makes the others give up after `timeout`
seconds instead of hanging the world.

What comes back (plain data, one entry per rank; times in seconds from `time.time()`, each rank
reading its own clock):

    {"world_size": P, "steps": S,
     "ranks": [{"rank": r,
                "step_start": [t, ...],          # one per step the rank began
                "step_end": [t or None, ...],    # None: the step never finished
                "collectives": [{"seq": k, "op": "all_reduce", "step": s, "what": "grads",
                                 "enter": t, "leave": t or None}, ...],   # None: never returned
                "expert_tokens": [[n_e, ...] per step] or None}, ...]}   # summed over ranks

`seq` counts the run group's collectives from 1, as torch's flight recorder and labkit's hang
diagnosis do. With `clock_skew` > 0, every timestamp of rank r is shifted by a constant drawn
for that rank (clocks of different machines disagree by milliseconds or more): compare times
within a rank, never across ranks.
"""
from __future__ import annotations

import random
import time
from datetime import timedelta

import torch
import torch.distributed as dist

COMPUTE_SIZE = 128         # the CPU work of a step: 4 [128 x 128] products (~1 ms)
COMPUTE_ROUNDS = 4
GPU_SECONDS = 0.008        # the rest of a step's compute: waiting for "the GPU" (a sleep)
GRAD_ELEMENTS = 4096       # the gradient all-reduced each step (16 KiB of float32)
TOKENS_PER_RANK = 512      # routed tokens per rank per step (expert runs)


def _compute(weights, x):
    for _ in range(COMPUTE_ROUNDS):
        x = torch.tanh(x @ weights)                  # [128, 128]
    time.sleep(GPU_SECONDS)
    return x


def _rank_program(share, steps, experts, timeout, seed):
    """Runs on every rank: the loop described in the module docstring. `share` holds this rank's
    faults: {"delay": [seconds per step], "skip_at": step or None, "hot": expert or None,
    "hot_share": float}."""
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)), timeout=timedelta(seconds=timeout))
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    weights = torch.randn(COMPUTE_SIZE, COMPUTE_SIZE, generator=generator) / COMPUTE_SIZE ** 0.5
    x = torch.randn(COMPUTE_SIZE, COMPUTE_SIZE, generator=generator)
    grads = torch.zeros(GRAD_ELEMENTS)
    starts, ends, records, loads = [], [], [], [] if experts else None
    seq = 0

    def collective(tensor, step, what):
        nonlocal seq
        seq += 1
        record = {"seq": seq, "op": "all_reduce", "step": step, "what": what,
                  "enter": time.time(), "leave": None}
        records.append(record)
        try:
            dist.all_reduce(tensor, group=group)
        except RuntimeError:             # the others gave up waiting: the group is dead
            return False
        record["leave"] = time.time()
        return True

    for step in range(steps):
        starts.append(time.time())
        ends.append(None)
        x = _compute(weights, x)
        if share["delay"][step] > 0:
            time.sleep(share["delay"][step])
        if share["skip_at"] == step:     # this rank never joins this step's collective
            break
        grads.copy_(x.reshape(-1)[:GRAD_ELEMENTS])
        if not collective(grads, step, "grads"):
            break
        if experts:
            logits = _router_logits(share, experts, seed, step, rank)
            chosen = logits.argmax(dim=-1)                                    # top-1: [N]
            counts = torch.bincount(chosen, minlength=experts).to(torch.float64)   # [E]
            if not collective(counts, step, "expert tokens"):
                break
            loads.append([int(v) for v in counts.tolist()])
        ends[-1] = time.time()
    dist.barrier()                       # the default group: everyone is done with the run group
    dist.destroy_process_group(group)
    return {"rank": rank, "step_start": starts, "step_end": ends, "collectives": records,
            "expert_tokens": loads}


def _router_logits(share, experts, seed, step, rank):
    """[N, E] router logits of this rank's tokens: random (every expert equally likely), or with
    about `hot_share` of the tokens sent to expert `hot` (labkit.moe.hot_logits)."""
    from labkit.moe import ep
    draw = seed * 100003 + step * 101 + rank
    if share.get("hot") is None:
        generator = torch.Generator().manual_seed(draw)
        return torch.randn(TOKENS_PER_RANK, experts, generator=generator, dtype=torch.float64)
    return ep.hot_logits(TOKENS_PER_RANK, experts, share["hot"], share["hot_share"], seed=draw)


def plan(size: int, steps: int, straggler=None, delay: float = 0.0, delay_from: int = 0,
         hiccups=(), skip=None, hot_expert=None, share: float = 0.5) -> list[dict]:
    """Per-rank fault settings for `_rank_program`.

    straggler, delay: that rank sleeps `delay` s in every step from `delay_from` on.
    hiccups: (rank, step, seconds) triples: one-off pauses (a descheduled process, a page fault
    storm): noise a detector must not call a straggler. skip: (rank, step): that rank stops
    before the step's collective. hot_expert, share: about `share` of every rank's tokens go to
    that expert."""
    shares = [{"delay": [0.0] * steps, "skip_at": None, "hot": hot_expert, "hot_share": share}
              for _ in range(size)]
    if straggler is not None:
        for step in range(delay_from, steps):
            shares[straggler]["delay"][step] += delay
    for rank, step, seconds in hiccups:
        shares[rank]["delay"][step] += seconds
    if skip is not None:
        shares[skip[0]]["skip_at"] = skip[1]
    return shares


def record_run(world, steps: int = 12, straggler=None, delay: float = 0.0, delay_from: int = 0,
               hiccups=(), skip=None, hot_expert=None, share: float = 0.5, experts: int = 0,
               timeout: float = 4.0, seed: int = 0, clock_skew: float = 0.0) -> dict:
    """Run the loop on every rank of `world` with these faults and return the trace (module
    docstring). The call takes about steps x (compute + delay), plus `timeout` when a rank
    skips a collective."""
    if hot_expert is not None and not experts:
        raise ValueError(f"hot_expert={hot_expert} needs experts > 0 (how many experts route)")
    if skip is not None and not 0 <= skip[1] < steps:
        raise ValueError(f"skip step {skip[1]} is outside the run's {steps} steps")
    shares = plan(world.size, steps, straggler, delay, delay_from, hiccups, skip, hot_expert,
                  share)
    ranks = world.run_each(_rank_program, shares, steps, experts, timeout, seed,
                           timeout=steps * (1.0 + delay) + 3 * timeout + 30)
    trace = {"world_size": world.size, "steps": steps, "ranks": list(ranks)}
    return skew_clocks(trace, clock_skew, seed) if clock_skew > 0 else trace


def skew_clocks(trace: dict, skew: float, seed: int = 0) -> dict:
    """The same trace with every timestamp of rank r shifted by one offset drawn in
    [-skew, skew] for that rank (as if each rank ran on its own machine)."""
    rng = random.Random(seed)
    out = dict(trace, ranks=[])
    for rank in trace["ranks"]:
        offset = rng.uniform(-skew, skew)

        def shift(t):
            return None if t is None else t + offset
        out["ranks"].append(dict(
            rank, step_start=[shift(t) for t in rank["step_start"]],
            step_end=[shift(t) for t in rank["step_end"]],
            collectives=[dict(c, enter=shift(c["enter"]), leave=shift(c["leave"]))
                         for c in rank["collectives"]]))
    return out


def compute_times(trace: dict) -> list[list]:
    """c[r][s]: seconds from rank r's start of step s to its entering that step's first
    collective (None when it never entered one). Within-rank differences: clock offsets cancel."""
    table = []
    for rank in trace["ranks"]:
        entered = {}
        for record in rank["collectives"]:
            entered.setdefault(record["step"], record["enter"])
        table.append([entered[s] - start if s in entered else None
                      for s, start in enumerate(rank["step_start"])])
    return table


def wait_times(trace: dict) -> list[list]:
    """w[r][s]: seconds rank r spent inside step s's gradient collective (None if it never
    returned)."""
    table = []
    for rank in trace["ranks"]:
        row = [None] * len(rank["step_start"])
        for record in rank["collectives"]:
            if record["what"] == "grads" and record["leave"] is not None:
                row[record["step"]] = record["leave"] - record["enter"]
        table.append(row)
    return table


def step_times(trace: dict) -> list[list]:
    """Seconds from the start to the end of each step, per rank (None: unfinished)."""
    return [[None if end is None else end - start
             for start, end in zip(rank["step_start"], rank["step_end"])]
            for rank in trace["ranks"]]
