"""One real 3D step against the model of chapter 6, section 4: rates measured on the machine that
runs the step, the step's own counts, a predicted time (chapter 6, `course/06_3d_parallelism.ipynb`,
section 4; and the activations autograd keeps on a rank, for section 3's sequence parallelism).

    rates = world.run(timing.calibrate, dims, (b, T, H), timing.block_matmuls(b, T, tp))  # rank side
    rates = timing.typical(rates)                           # the median over the ranks
    parts = timing.predict_step(timing.step_counts(dims, b, T, m), rates)
    kept = world.run(...)  ->  timing.saved_bytes(fn, exclude=stage.parameters())    # rank side

The model is section 4's, with this machine's rates in place of a datasheet's:

    T_step = F_rank / P (1 + (p-1)/m) + sum over calls of (alpha + bytes / bw)

F_rank: the matrix-product FLOPs of the busiest stage's rank (`stage_flops`); P: FLOP/s of
torch.mm on the step's own shapes, timed on every rank at once (the ranks share the machine as
they do in the step), or P x eff: the same FLOPs over the time of a plain block of those shapes
run forward and backward; alpha and bw: a fit of t(n) = alpha + n / bw to an all-reduce over a
tp group, timed with every group busy at once (tp), and to one message between pipeline
neighbours (pp). Nothing overlaps, as in section 4. Under NCCL the same code times the GPUs (it
synchronises the device around each timed loop); on gloo it times CPU processes.

What the model leaves out is what a tiny step on a shared CPU spends most of its time on:
DTensor's dispatch (placements worked out in Python for every op on a sharded tensor), the
optimizer and ZeRO-1's flat buffer, the pipeline executor's bookkeeping, and eight processes
taking turns on the cores. It predicts too little here; section 4's GPU figures are the regime
where the matrix products dominate.
"""
from __future__ import annotations

import statistics
import time

import torch

from labkit.mesh import model as bench


# ---- counts: FLOPs and collectives of the chapter's step ---------------------------------------

def block_matmuls(b, T, tp, hidden=bench.HIDDEN, heads=bench.HEADS, head_dim=bench.HEAD_DIM,
                  ffn=bench.FFN):
    """The (M, K, N) of the matrix products of one block's forward on one tp rank, for a
    microbatch x [b, T, H] (x [M, K] @ w [K, N]): q, k, v, o, fc1, fc2, and the attention's two
    batched products counted as b heads/t products of [T, d] @ [d, T] and [T, T] @ [T, d]."""
    A, F, n = heads * head_dim // tp, ffn // tp, b * T
    shapes = [(n, hidden, A)] * 3 + [(n, A, hidden), (n, hidden, F), (n, F, hidden)]
    per_head = [(T, head_dim, T), (T, T, head_dim)]
    return shapes + per_head * (b * heads // tp)


def stage_flops(b, T, layers, tp, last, hidden=bench.HIDDEN, heads=bench.HEADS,
                head_dim=bench.HEAD_DIM, ffn=bench.FFN, vocab=bench.VOCAB):
    """Matrix-product FLOPs of one microbatch's forward and backward on one tp rank of a stage of
    `layers` blocks: 3 x 2 M K N over `block_matmuls` (backward: twice forward, an input and a
    weight gradient per product), plus the head [b T, H] @ [H, V] on the last stage (replicated:
    every tp rank computes all of it). Counted by torch's FlopCounterMode in the chapter's tests."""
    block = sum(2 * M * K * N for M, K, N in block_matmuls(b, T, tp, hidden, heads, head_dim, ffn))
    head = 2 * b * T * hidden * vocab if last else 0
    return 3 * (layers * block + head)


def step_counts(dims, b, T, m, layers=bench.LAYERS, itemsize=8):
    """What one rank of the chapter's 3D step (tensor parallelism without sequence parallelism,
    1F1B, ZeRO-1) computes and sends in one step, for its busiest stage: FLOPs, and per axis the
    calls and bytes per call (section 3's formulas: 4 all-reduces of [b, T, H] per block per
    microbatch on tp; one activation or gradient [b, T, H] per message on pp, m each way)."""
    dp, pp, tp = dims
    per_stage = [len(bench.stage_layers(layers, pp, k)) for k in range(pp)]
    flops = max(stage_flops(b, T, n, tp, k == pp - 1) for k, n in enumerate(per_stage))
    activation = b * T * bench.HIDDEN * itemsize
    return {"flops": m * flops, "pp": pp, "m": m, "tp_size": tp,
            "tp": {"calls": 4 * max(per_stage) * m if tp > 1 else 0, "bytes": activation},
            "pp_messages": {"calls": 2 * m if pp > 1 else 0, "bytes": activation}}


# ---- rates, measured on the ranks -------------------------------------------------------------

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, repeats, device):
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate(dims, activation_shape, matmuls, repeats=30, dtype=torch.float64,
              large=1 << 20):
    """Rank side, every rank of a dp x pp x tp world at once: this rank's measured rates.

    flops_per_s: torch.mm over the shapes `matmuls` [(M, K, N)], FLOPs 2 M K N each, over the
    median time of the whole list. block_flops_per_s: the same FLOPs (x 3: forward and backward)
    over the time of a plain `tensor_parallel.Block` of this rank's share (heads/t, F/t) run
    forward and backward on [b, T, H]: the rate with every other op of a block in it (section
    4's eff, measured: block_flops_per_s / flops_per_s), without collectives or DTensor. tp: an all-reduce over this rank's tp group of the activation
    [b, T, H] and of a `large`-element tensor, every group at once; alpha and bw from the two
    (t = alpha + 2(t-1)/t n / bw). pp: one message of the activation and of the large tensor
    between stage 0 and stage 1 (a send and a receive, timed on the sender). Each timing is
    the median of `repeats`, after a barrier."""
    import torch.distributed as dist
    from labkit import device as rank_device
    device = rank_device()
    dp, pp, tp = dims
    device_mesh = bench.device_mesh(dims)
    out = {}
    pairs = [(torch.randn(M, K, dtype=dtype, device=device),
              torch.randn(K, N, dtype=dtype, device=device)) for M, K, N in matmuls]
    flops = sum(2 * a.shape[0] * a.shape[1] * w.shape[1] for a, w in pairs)
    dist.barrier()
    seconds = _median_seconds(lambda: [torch.mm(a, w) for a, w in pairs], repeats, device)
    out["flops_per_s"] = flops / seconds
    # the same shapes as a plain block of this rank's share (heads/t, F/t), forward and backward:
    # everything a block does besides its matrix products (LayerNorm, softmax, GELU, autograd,
    # Python), but no collective and no DTensor
    from labkit import tensor_parallel as tpk
    b, T, H = activation_shape
    block = tpk.Block(H, bench.HEADS // tp, bench.HEAD_DIM, bench.FFN // tp).to(dtype).to(device)
    x = torch.randn(activation_shape, dtype=dtype, device=device, requires_grad=True)
    dist.barrier()
    seconds = _median_seconds(lambda: block(x).sum().backward(), repeats, device)
    out["block_flops_per_s"] = 3 * flops / seconds
    small = torch.randn(activation_shape, dtype=dtype, device=device)
    big = torch.randn(large, dtype=dtype, device=device)
    sizes = [small.numel() * small.element_size(), big.numel() * big.element_size()]
    if tp > 1:
        group = device_mesh.get_group("tp")
        dist.barrier()
        t = [_median_seconds(lambda x=x: dist.all_reduce(x, group=group), repeats, device)
             for x in (small, big)]
        wire = [2 * (tp - 1) / tp * n for n in sizes]
        bw = (wire[1] - wire[0]) / max(t[1] - t[0], 1e-12)
        out["tp"] = {"alpha": max(t[0] - wire[0] / bw, 0.0), "bw": bw, "seconds": t}
    if pp > 1:
        group = device_mesh.get_group("pp")
        stage = device_mesh.get_local_rank("pp")
        t = []
        for x in (small, big):
            peer = dist.get_global_rank(group, stage ^ 1) if stage ^ 1 < pp else None

            def exchange(x=x, peer=peer):
                if peer is None:
                    return
                if stage % 2 == 0:
                    dist.send(x, peer)
                    dist.recv(x, peer)
                else:
                    dist.recv(x, peer)
                    dist.send(x, peer)

            dist.barrier()
            t.append(_median_seconds(exchange, repeats, device) / 2)    # one message of two
        bw = (sizes[1] - sizes[0]) / max(t[1] - t[0], 1e-12)
        out["pp"] = {"alpha": max(t[0] - sizes[0] / bw, 0.0), "bw": bw, "seconds": t}
    return out


def typical(per_rank: list) -> dict:
    """One rate of each kind from every rank's `calibrate`: the median over the ranks (a single
    rank's figure on a shared machine is noisy: one descheduled rank doubles its alpha)."""
    rates = {kind: statistics.median(r[kind] for r in per_rank)
             for kind in ("flops_per_s", "block_flops_per_s")}
    for axis in ("tp", "pp"):
        found = [r[axis] for r in per_rank if axis in r]
        if found:
            rates[axis] = {k: statistics.median(f[k] for f in found) for k in ("alpha", "bw")}
    return rates


def predict_step(counts: dict, rates: dict, rate: str = "flops_per_s") -> dict:
    """Section 4's step time with measured rates: {"compute", "bubble", "tp", "pp", "total"} in
    seconds. compute = F_rank / P; bubble = compute (p-1)/m; each axis: calls x (alpha + bytes
    on the wire / bw), with 2(t-1)/t of the activation per tp all-reduce."""
    compute = counts["flops"] / rates[rate]
    parts = {"compute": compute, "bubble": compute * (counts["pp"] - 1) / counts["m"]}
    tp_calls = counts["tp"]["calls"]
    if tp_calls:
        t = rates["tp"]
        tp = counts["tp_size"]
        wire = counts["tp"]["bytes"] * 2 * (tp - 1) / tp
        parts["tp"] = tp_calls * (t["alpha"] + wire / t["bw"])
    else:
        parts["tp"] = 0.0
    pp_calls = counts["pp_messages"]["calls"]
    parts["pp"] = (pp_calls * (rates["pp"]["alpha"] + counts["pp_messages"]["bytes"]
                               / rates["pp"]["bw"]) if pp_calls else 0.0)
    parts["total"] = sum(parts.values())
    return parts


# ---- activations autograd keeps, DTensors included ----------------------------------------------

def _local(t):
    from torch.distributed.tensor import DTensor
    return t._local_tensor if isinstance(t, DTensor) else t     # the shard this rank stores


def _key(t):
    storage = _local(t).untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def saved_bytes(fn, exclude=()) -> int:
    """Bytes autograd keeps for backward while `fn()` runs on this rank, each storage once,
    `exclude` (the parameters) left out. A DTensor counts its local shard: what the rank holds.
    (`labkit.tensor_parallel.measure.saved_activation_bytes` does the same for plain tensors;
    a DTensor has no storage of its own.)"""
    excluded = {_key(t) for t in exclude}
    kept = {}

    def pack(t):
        key = _key(t)
        if key not in excluded:
            kept[key] = key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(kept.values())
