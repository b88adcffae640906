"""Cost model and measurement tools for the collectives (chapter 1, `course/01_collectives.ipynb`).

Notation (the course's): P ranks, a message of n bytes, alpha = seconds of latency per message,
beta = seconds per byte (1/beta is the link bandwidth). "n" is always the size of the *whole*
tensor: the input of all_reduce and reduce_scatter, the output of all_gather.

    ring reduce-scatter   (P-1) * (alpha + n/P * beta)
    ring all-gather       (P-1) * (alpha + n/P * beta)
    ring all-reduce       2(P-1) * (alpha + n/P * beta)     = reduce-scatter + all-gather
    recursive doubling    steps * (alpha + n * beta),  steps = log2 P for a power of two,
                          floor(log2 P) + 2 otherwise (fold the extra ranks in, hand back)
    Rabenseifner          2 log2(P) * alpha + 2(P-1)/P * n * beta   (P a power of two):
                          reduce-scatter by recursive halving, all-gather by recursive doubling
                          (Thakur, Rabenseifner and Gropp 2005; MPICH's long-message all-reduce)

Broadcast bytes are per rank (`broadcast_bytes_sent`): in a binomial tree (gloo's) the root sends
ceil(log2 P) copies of n and the last half of the ranks send none.

Bus bandwidth (nccl-tests, PERFORMANCE.md): algbw = n / t; busbw = algbw * factor, where the
factor is 2(P-1)/P for all_reduce, (P-1)/P for all_gather, reduce_scatter and all_to_all, and 1 for
broadcast and reduce. busbw is what a link must carry, so it is comparable across P.

Nothing here implements a collective: the timing helpers call torch's own ones, or a function you
pass in. The answers of lab 1 are not in this module.
"""
from __future__ import annotations

import math
import statistics

import cloudpickle

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")

# gloo's framing, measured once on real gloo ranks (torch 2.13, TCP over loopback): rank 0
# dist.send()s a float32 tensor of n bytes to rank 1, and the kernel's socket counters
# (world.traffic(), the way chapter 1 counts) give sent[0] = n + 96 and sent[1] = 48, for n =
# 4 KiB and 1 MiB, 1 and 10 messages alike: a 96-byte header travels with every message and the
# receiver answers each with a 48-byte notice. A collective in which every rank sends and
# receives k messages therefore counts k x 144 bytes of framing per rank on top of its payload
# (a 2-rank gloo all_reduce: 4 messages, 576 B). measure_gloo_framing below re-measures all three,
# in chapter 1 (section 4) and tests/test_formulas.py.
GLOO_HEADER_BYTES = 96      # on the sender's socket, per message
GLOO_NOTICE_BYTES = 48      # on the receiver's socket, per message received
GLOO_FRAMING_BYTES = GLOO_HEADER_BYTES + GLOO_NOTICE_BYTES   # per message sent and one received


def send_messages(n_bytes, messages=1):
    """Run on every rank: rank 0 dist.send()s `messages` float32 tensors of n_bytes each to rank 1,
    which dist.recv()s them; other ranks do nothing. The probe behind `measure_gloo_framing`."""
    import torch
    import torch.distributed as dist
    x = torch.zeros(n_bytes // 4)
    for _ in range(messages):
        if dist.get_rank() == 0:
            dist.send(x, 1)
        elif dist.get_rank() == 1:
            dist.recv(x, 0)


def measure_gloo_framing(world, n_bytes, messages=1):
    """gloo's framing per message, counted by the kernel's socket counters (`world.traffic()`).

    world: gloo ranks with teaching mode off (its checks send messages of their own). One message
    of 1 KiB first makes the connection and pays first-call costs; then rank 0 sends `messages`
    messages of n_bytes to rank 1 inside `world.traffic()`. Returns {"header": (sent[0] -
    messages * n_bytes) / messages, "notice": sent[1] / messages, "framing": their sum, "traffic":
    the counts}: bytes per message, which GLOO_HEADER_BYTES, GLOO_NOTICE_BYTES and
    GLOO_FRAMING_BYTES state. Used by chapter 1 (section 4) and tests/test_formulas.py."""
    world.run(send_messages, 1024)
    with world.traffic() as traffic:
        world.run(send_messages, n_bytes, messages)
    header = (traffic.sent[0] - messages * n_bytes) / messages
    notice = traffic.sent[1] / messages
    return {"header": header, "notice": notice, "framing": header + notice, "traffic": traffic}


def _check(n_bytes, world_size):
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if n_bytes < 0:
        raise ValueError(f"n_bytes must be >= 0, got {n_bytes}")


# ---- the alpha-beta model: each time is  steps * alpha + bytes_on_the_critical_path * beta ----

def ring_reduce_scatter_time(n_bytes, world_size, alpha, beta):
    """(P-1) * (alpha + n/P * beta): P-1 steps, each moving one chunk of n/P bytes."""
    _check(n_bytes, world_size)
    return (world_size - 1) * (alpha + n_bytes / world_size * beta)


def ring_all_gather_time(n_bytes, world_size, alpha, beta):
    """(P-1) * (alpha + n/P * beta): the same steps as reduce-scatter, copying instead of adding."""
    return ring_reduce_scatter_time(n_bytes, world_size, alpha, beta)


def ring_all_reduce_time(n_bytes, world_size, alpha, beta):
    """2(P-1) * (alpha + n/P * beta): a ring reduce-scatter followed by a ring all-gather."""
    return 2 * ring_reduce_scatter_time(n_bytes, world_size, alpha, beta)


def recursive_doubling_steps(world_size):
    """log2 P exchanges for a power of two; floor(log2 P) + 2 (fold in, hand back) otherwise."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    below = 1 << (world_size.bit_length() - 1)          # the largest power of two <= P
    return int(math.log2(below)) + (0 if below == world_size else 2)


def recursive_doubling_all_reduce_time(n_bytes, world_size, alpha, beta):
    """steps * (alpha + n * beta): every step exchanges the whole message with one partner."""
    _check(n_bytes, world_size)
    return recursive_doubling_steps(world_size) * (alpha + n_bytes * beta)


def rabenseifner_all_reduce_time(n_bytes, world_size, alpha, beta):
    """2 log2(P) * alpha + 2(P-1)/P * n * beta, for P a power of two (chapter 1, section 7).

    Reduce-scatter by recursive halving (log2 P steps sending n/2, n/4, ..., n/P bytes), then
    all-gather by recursive doubling (the same steps backwards): the ring's bytes with log2 P
    latencies per half (Thakur, Rabenseifner and Gropp 2005, MPICH). Other P raise: their
    extra fold-in steps are not modelled here.
    """
    _check(n_bytes, world_size)
    if world_size & (world_size - 1):
        raise ValueError(f"Rabenseifner's formula here is for P a power of two, got P = {world_size}; "
                         f"use the largest power of two below it ({1 << (world_size.bit_length() - 1)}) "
                         "plus the fold-in steps, or the ring")
    steps = int(math.log2(world_size))
    return 2 * steps * alpha + 2 * (world_size - 1) / world_size * n_bytes * beta


ALL_REDUCE_ALGORITHMS = {"ring": ring_all_reduce_time,
                         "recursive doubling": recursive_doubling_all_reduce_time}


def model_time(collective, n_bytes, world_size, alpha, beta):
    """The ring-model time of a torch collective (all_reduce, reduce_scatter or all_gather)."""
    formulas = {"all_reduce": ring_all_reduce_time, "reduce_scatter": ring_reduce_scatter_time,
                "all_gather": ring_all_gather_time}
    if collective not in formulas:
        raise ValueError(f"no ring formula for {collective!r}; known: {sorted(formulas)}")
    return formulas[collective](n_bytes, world_size, alpha, beta)


# ---- bytes and bandwidths ----

def bus_factor(collective, world_size):
    """nccl-tests' busbw / algbw for a collective over P ranks."""
    P = world_size
    if P < 1:
        raise ValueError(f"world_size must be >= 1, got {P}")
    factors = {"all_reduce": 2 * (P - 1) / P, "reduce_scatter": (P - 1) / P,
               "all_gather": (P - 1) / P, "all_to_all": (P - 1) / P, "broadcast": 1.0,
               "reduce": 1.0}
    if collective not in factors:
        raise ValueError(f"unknown collective {collective!r}; known: {sorted(factors)}")
    return factors[collective]


def ring_bytes_sent(collective, n_bytes, world_size):
    """Bytes one rank sends in the ring algorithm (or all_to_all's direct exchange).

    all_reduce 2(P-1)/P * n; reduce_scatter, all_gather, all_to_all (P-1)/P * n; a reduce sends
    (P-1)/P * n per rank in a ring. A broadcast has no single per-rank figure (the root sends,
    the last rank does not): `broadcast_bytes_sent` gives one per rank.
    """
    _check(n_bytes, world_size)
    if collective == "broadcast":
        raise ValueError("ring_bytes_sent('broadcast', ...): a broadcast's bytes differ from rank to "
                         "rank (the root sends, the leaves do not); use "
                         "collectives.broadcast_bytes_sent(n_bytes, world_size, tree=...) for one "
                         "figure per rank")
    if collective == "reduce":
        return (world_size - 1) / world_size * n_bytes
    return bus_factor(collective, world_size) * n_bytes


def broadcast_bytes_sent(n_bytes, world_size, tree="binomial"):
    """Bytes each rank sends in a broadcast of n bytes from rank 0: a list, one figure per rank.

    tree="binomial" (gloo's, counted in chapter 1, section 4): in round k = 0, 1, ... every rank
    r < 2^k that holds the data sends it to r + 2^k (if that rank exists), so rank r sends one
    copy for each power of two 2^k > r with r + 2^k < P: the root ceil(log2 P) copies, rank 1
    one fewer, and every rank r >= P/2 none. tree="chain" (a ring cut open, pipelined): ranks
    0 .. P-2 send n each, the last rank nothing.
    """
    _check(n_bytes, world_size)
    P = world_size
    if tree == "binomial":
        copies = [sum(1 for k in range(P.bit_length()) if (1 << k) > r and r + (1 << k) < P)
                  for r in range(P)]
    elif tree == "chain":
        copies = [1] * (P - 1) + [0]
    else:
        raise ValueError(f"unknown broadcast tree {tree!r}; known: 'binomial', 'chain'")
    return [c * n_bytes for c in copies]


def algbw(n_bytes, seconds):
    """Algorithm bandwidth n / t in bytes per second."""
    return n_bytes / seconds


def busbw(collective, n_bytes, seconds, world_size):
    """Bus bandwidth: algbw times the collective's bus factor (nccl-tests' definition)."""
    return algbw(n_bytes, seconds) * bus_factor(collective, world_size)


# ---- fitting ----

def fit_alpha_beta(n_bytes, seconds, world_size, formula=ring_all_reduce_time):
    """Least-squares alpha and beta for measured (n_bytes[i], seconds[i]) under `formula`.

    Every formula here is linear in alpha and beta, t = a * alpha + b(n) * beta, so the fit is an
    ordinary least-squares problem in two unknowns; the rows are weighted by 1/t so that small
    and large messages count alike (a relative-error fit). Returns (alpha, beta): alpha >= 0,
    beta > 0.
    """
    import numpy as np
    if len(n_bytes) != len(seconds) or len(n_bytes) < 2:
        raise ValueError(f"need >= 2 matching sizes and times, got {len(n_bytes)} and {len(seconds)}")
    rows = [[formula(n, world_size, 1.0, 0.0), formula(n, world_size, 0.0, 1.0)] for n in n_bytes]
    A, t = np.array(rows, dtype=float), np.array(seconds, dtype=float)
    if not A[:, 0].any():
        raise ValueError(f"the formula takes no time on {world_size} rank(s): nothing to fit")
    weights = 1.0 / t
    (alpha, beta), *_ = np.linalg.lstsq(A * weights[:, None], t * weights, rcond=None)
    if beta <= 0:
        # Noise in the small messages can tilt the line flat or downhill: the sweep does not
        # resolve the bandwidth. Fit latency alone, then give beta what the largest message's
        # time leaves after latency (at least a tenth of that time): a link is never free.
        alpha = float(np.sum(A[:, 0] * t * weights ** 2) / np.sum((A[:, 0] * weights) ** 2))
        largest = int(np.argmax(A[:, 1]))
        beta = max(t[largest] - A[largest, 0] * alpha, 0.1 * t[largest]) / A[largest, 1]
    elif alpha < 0:             # the other way round: no latency term, refit beta alone
        alpha = 0.0
        beta = float(np.sum(A[:, 1] * t * weights ** 2) / np.sum((A[:, 1] * weights) ** 2))
    return float(alpha), float(beta)


def relative_errors(predicted, measured):
    """|predicted - measured| / measured, element by element."""
    return [abs(p - m) / m for p, m in zip(predicted, measured)]


def log2_ratios(predicted, measured):
    """log2(measured / predicted), element by element: 0 is exact, +1 twice the model, -1 half.

    Chapter 1, section 5 judges times predicted at held-out sizes by |log2 ratio| <= 1 (a factor
    2 either way), a band a constant or a latency-free model fails on a sweep from 1 KB to MBs.
    """
    if len(predicted) != len(measured):
        raise ValueError(f"log2_ratios: {len(predicted)} predictions for {len(measured)} measurements")
    if any(p <= 0 for p in predicted) or any(m <= 0 for m in measured):
        raise ValueError(f"log2_ratios: times must be > 0, got predicted {predicted}, measured {measured}")
    return [math.log2(m / p) for p, m in zip(predicted, measured)]


# ---- timing on a world ----

def _run_timed(op_bytes, n_floats, repeats, dtype_name):
    import time
    import torch
    import torch.distributed as dist
    import labkit
    op = cloudpickle.loads(op_bytes)
    P, rank, device = dist.get_world_size(), dist.get_rank(), labkit.device()
    dtype = getattr(torch, dtype_name)
    x = (torch.arange(n_floats, device=device) % 97 + rank).to(dtype)   # x: [N]
    fresh = x.clone()                      # each repeat starts from the same input (not timed)
    if isinstance(op, str):
        fn = _torch_collective(op, fresh, P)
    else:
        fn = lambda: op(fresh)             # noqa: E731
    fn()                                   # warm-up: connections, allocations
    seconds = []
    for _ in range(repeats):
        fresh.copy_(x)
        dist.barrier()
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if x.is_cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def _torch_collective(name, x, P):
    import torch
    import torch.distributed as dist
    N = x.numel()
    if name == "all_reduce":
        return lambda: dist.all_reduce(x)
    if name == "broadcast":
        return lambda: dist.broadcast(x, src=0)
    if name == "reduce":
        return lambda: dist.reduce(x, dst=0)
    shard = torch.empty(N // P, dtype=x.dtype, device=x.device)         # shard: [N/P]
    whole = x[: (N // P) * P]                                            # whole: [P * (N/P)]
    if name == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(shard, whole)
    if name == "all_gather":
        return lambda: dist.all_gather_single(whole, shard)
    if name == "all_to_all":
        out = torch.empty_like(whole)
        return lambda: dist.all_to_all_single(out, whole)
    raise ValueError(f"unknown collective {name!r}; known: {COLLECTIVES}")


def time_op(world, op, n_floats, repeats=5, dtype="float32", timeout=120):
    """Median seconds of one call of `op` on every rank of `world`, on a tensor of n_floats.

    `op` is a torch collective's name (one of COLLECTIVES, run on a [N] float tensor; for
    reduce_scatter / all_gather / all_to_all N is rounded down to a multiple of P) or a function
    `op(tensor)` that runs on every rank (your own all-reduce). Each repeat starts after a
    barrier; its time is that of the slowest rank (a collective is done when all ranks are),
    and the median over repeats is returned.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    per_rank = world.call(_run_timed, args=(cloudpickle.dumps(op), int(n_floats), repeats, dtype),
                          timeout=timeout)                    # per_rank: [P][repeats]
    slowest = [max(times) for times in zip(*per_rank)]
    return statistics.median(slowest)


def time_sweep(world, op, sizes_floats, repeats=5, dtype="float32", timeout=120):
    """[time_op(world, op, n) for n in sizes_floats]."""
    return [time_op(world, op, n, repeats, dtype, timeout) for n in sizes_floats]


# ---- pictures ----

def plot_before_after(before, after, title="", ax_pair=None):
    """Draw per-rank tensors as rows of coloured boxes: `before` on the left, `after` on the right.

    before, after: lists with one 1-D sequence of numbers per rank (lengths may differ). Each box
    shows its value; the colour follows the value, so equal values read as equal colours.
    """
    import matplotlib.pyplot as plt
    if ax_pair is None:
        width = max(len(row) for row in list(before) + list(after)) or 1
        _, ax_pair = plt.subplots(1, 2, figsize=(2 + 1.2 * width, 0.6 + 0.55 * len(before)))
    values = [float(v) for row in list(before) + list(after) for v in row]
    low, high = (min(values), max(values)) if values else (0.0, 1.0)
    cmap = plt.get_cmap("viridis")
    for ax, rows, label in zip(ax_pair, (before, after), ("before", "after")):
        for rank, row in enumerate(rows):
            for i, value in enumerate(row):
                share = 0.5 if high == low else (float(value) - low) / (high - low)
                ax.add_patch(plt.Rectangle((i, rank), 0.95, 0.9, color=cmap(0.15 + 0.7 * share)))
                ax.text(i + 0.47, rank + 0.45, f"{float(value):g}", ha="center", va="center",
                        color="white", fontsize=9)
        ax.set_xlim(0, max([len(r) for r in rows] + [1]))
        ax.set_ylim(len(rows), 0)
        ax.set_yticks([k + 0.45 for k in range(len(rows))])
        ax.set_yticklabels([f"rank {k}" for k in range(len(rows))])
        ax.set_xticks([])
        ax.set_title(f"{title}: {label}" if title else label, fontsize=10)
        for side in ax.spines.values():
            side.set_visible(False)
    return ax_pair
