"""The chapter's bench on real ranks: ZeRO stages 0-3 trained, measured and compared with one
process (chapter 3, sections 2-5; the tests of lab 3).

    case = bench.bench_case(stage=3, P=3, layers=3, hidden=48, steps=2, history=True)
    results = world.run(bench.run_bench, case)      # ranks 0 .. P-1: kept bytes, weights, timeline
    reference = bench.reference_history(case, P=3)  # one process, the whole batch, float64

Rank r of P trains on rows [r*batch, (r+1)*batch) of each step's global batch of P*batch
sequences (`batches`), so that the mean of the ranks' gradients is the gradient of the whole batch.
`plain_model` is the same network as ordinary nn.Linear layers, for torch's own ZeRO (the
ZeroRedundancyOptimizer) and FSDP2 (`fully_shard`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.memory.zero import STAGES, ZeroTrainer, initial_flat, make_blocks, subgroup, unflatten


class PlainBlock(nn.Module):
    """The same block as ordinary nn.Linear layers: x + fc2(gelu(fc1(x))). For torch's own
    ZeroRedundancyOptimizer and fully_shard, which shard ordinary modules."""

    def __init__(self, hidden, initial):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden, dtype=initial.dtype, device=initial.device)
        self.fc2 = nn.Linear(4 * hidden, hidden, dtype=initial.dtype, device=initial.device)
        w1, b1, w2, b2 = unflatten(initial, hidden)
        with torch.no_grad():
            for p, value in zip((self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias),
                                (w1, b1, w2, b2)):
                p.copy_(value)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))

    def flat(self):
        return torch.cat([p.detach().reshape(-1) for p in (self.fc1.weight, self.fc1.bias,
                                                           self.fc2.weight, self.fc2.bias)])


def plain_model(layers, hidden, seed, dtype=torch.float64, device="cpu"):
    """The bench as an ordinary nn.Sequential of PlainBlocks, with the same initial weights."""
    return nn.Sequential(*[PlainBlock(hidden, initial_flat(hidden, seed, i, dtype).to(device))
                           for i in range(layers)])


# ---- single process: the reference the ranks must reproduce -------------------------------------

def reference_training(layers, hidden, seed, batches, lr=1e-3, weight_decay=0.0, dtype=torch.float64):
    """One process, the whole batch: the same blocks and AdamW, in `dtype`. Returns the weights
    [N_l] of every block after each step. batches: a list of [B, T, H] tensors."""
    weights = [initial_flat(hidden, seed, i, dtype).requires_grad_(True) for i in range(layers)]
    optimizer = torch.optim.AdamW(weights, lr=lr, weight_decay=weight_decay, foreach=False)
    history = []
    for x in batches:
        optimizer.zero_grad()
        out = x.to(dtype)
        for w in weights:
            w1, b1, w2, b2 = unflatten(w, hidden)
            out = out + F.gelu(out @ w1.T + b1) @ w2.T + b2
        out.double().square().mean().backward()
        optimizer.step()
        history.append([w.detach().clone() for w in weights])
    return history


# ---- rank programs for the chapter and the tests -------------------------------------------------

def bench_case(stage, P=None, layers=3, hidden=48, batch=4, seq=16, steps=1, dtype="bfloat16",
               lr=1e-3, weight_decay=0.0, seed=0, profile=False, history=False,
               main_grads=False, profile_rank=None) -> dict:
    """Plain data for `run_bench`: P ranks (default: the whole world) train `layers` blocks with
    ZeRO `stage`, each on its own [batch, seq, hidden] slice of the data, for `steps` steps.
    main_grads=True: gradients accumulated and reduced in FP32 (FP64 for float64 runs), Megatron's
    18 bytes per parameter (`zero.ZeroTrainer`). profile_rank: profile the extra step on that rank
    only (the others take the same step unprofiled); default: every rank."""
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
    if P is not None and (not isinstance(P, int) or P < 1):
        raise ValueError(f"P must be a positive int (ranks sharing the states), got {P!r}")
    if profile not in (False, "roles", "raw", "snapshot"):
        raise ValueError(f"profile must be False, 'roles', 'raw' or 'snapshot', got {profile!r}")
    if profile_rank is not None and (not isinstance(profile_rank, int) or profile_rank < 0):
        raise ValueError(f"profile_rank must be None or a rank (an int >= 0), got {profile_rank!r}")
    return dict(stage=stage, P=P, layers=layers, hidden=hidden, batch=batch, seq=seq, steps=steps,
                dtype=dtype, lr=lr, weight_decay=weight_decay, seed=seed, profile=profile,
                history=history, main_grads=bool(main_grads), profile_rank=profile_rank)


def batches(case, rank, P):
    """The data of `case`: rank r's [batch, seq, hidden] slice of each step's global batch."""
    g = torch.Generator().manual_seed(case["seed"] + 1)
    shape = (P * case["batch"], case["seq"], case["hidden"])
    whole = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(case["steps"])]
    return whole if rank is None else [x[rank * case["batch"]:(rank + 1) * case["batch"]]
                                       for x in whole]


def run_bench(case):
    """On every rank: ranks 0 .. P-1 run the case; the others return None. Returns the bytes this
    rank keeps by category (after the steps), the weights after each step (history=True, float64),
    and the timeline of one more step: profile="roles" files the tensors by the course's categories
    (`trainer.roles()`), profile="raw" keeps torch's own labels, profile="snapshot" records an
    allocator snapshot instead (`labkit.memory.snapshot`: the CUDA allocator's history on a GPU,
    torch's memory profile in the same format on a CPU) and returns its peak. On a GPU also CUDA's
    own peak statistics of that step (`torch.cuda.max_memory_allocated` and `max_memory_reserved`)."""
    import labkit
    from labkit.memory import measure
    P = case["P"] or dist.get_world_size()
    group = subgroup(P)
    rank = dist.get_rank()
    if rank >= P:
        return None
    dtype = getattr(torch, case["dtype"])
    device = labkit.device()
    blocks = make_blocks(case["layers"], case["hidden"], case["seed"], P, rank, case["stage"],
                         dtype=dtype, device=device, group=group)
    trainer = ZeroTrainer(blocks, case["stage"], group=group, lr=case["lr"],
                          weight_decay=case["weight_decay"],
                          master_dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                          main_grads=case.get("main_grads", False))
    weights = []
    loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def step(x):                                       # the loss in fp32 (fp64 for float64 runs)
        trainer.forward(x).to(loss_dtype).square().mean().backward()
        trainer.step()
    for x in batches(case, rank, P):
        step(x.to(device=device, dtype=dtype))
        if case["history"]:
            weights.append([w.cpu() for w in trainer.full_weights()])
    roles = trainer.roles()
    kept = {category: sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                           for t in tensors}.values()) for category, tensors in roles.items()}
    result = {"kept": kept, "history": weights}
    if case["profile"] and case.get("profile_rank") not in (None, rank):
        step(batches(dict(case, steps=1), rank, P)[0].to(device=device, dtype=dtype))  # unprofiled
    elif case["profile"]:
        x = batches(dict(case, steps=1), rank, P)[0].to(device=device, dtype=dtype)
        labels = roles if case["profile"] == "roles" else None
        if device.type == "cuda":                        # CUDA's own count, allocator included
            torch.cuda.reset_peak_memory_stats(device)
        if case["profile"] == "snapshot":
            from labkit.memory import snapshot
            snap, trace = snapshot.record(step, x, device=device)
            result["snapshot"] = snapshot.peak(snap, trace).as_dict()
        else:
            result["timeline"] = measure.profile(step, x, roles=labels).as_dict()
        if device.type == "cuda":
            result["cuda"] = {"max_allocated": torch.cuda.max_memory_allocated(device),
                              "max_reserved": torch.cuda.max_memory_reserved(device)}
    return result


def reference_history(case, P):
    """One process, the whole global batch of P ranks, every step, float64: the weights after
    each step (what `run_bench` with history=True must reproduce)."""
    return reference_training(case["layers"], case["hidden"], case["seed"], batches(case, None, P),
                              lr=case["lr"], weight_decay=case["weight_decay"])
