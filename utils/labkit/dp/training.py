"""Training loops on the ranks, and the one-process run they must equal (chapter 2, lab 2).

    case = training.training_case(seed=3, world_size=R, steps=4, microbatches=2, tied=True)
    shares = training.shares(case)                       # rank r's part: shares[r]
    histories = world.run_each(training.train_with_sync, shares, MySync)
    training.assert_params_match(histories, training.reference_training(case))

A *training case* is plain data: the model to build (seed, layers, dtype, tied or frozen weights,
an optional block) and, for each step, every rank's microbatches (lists of (tokens, targets)
sequences, some of them empty) and the global number of valid tokens of the step. The loss of a
step is chapter 2's token loss L = sum of all token losses / all valid tokens; rank r
backpropagates R * S_{r,m} / N for each of its microbatches m, so that averaging the gradients
over the ranks gives grad L exactly.

`train_with_sync` drives a synchroniser the way a training loop drives torch's
DistributedDataParallel: every microbatch but the last inside `sync.no_sync()`, `sync.finish()`
once per step, also after an error in the middle of a step (then every rank skips the step).
Nothing here synchronises gradients itself: that is the synchroniser's job (lab 2, task 3).
"""
from __future__ import annotations

import contextlib

import torch

from labkit import dp

DTYPES = ("float64", "float32")
# Parameters after SGD steps, compared with one process: float64 agrees to ~1e-15, float32 to
# ~1e-6 (sums over ranks and microbatches in another order); a wrong scale is off by > 1e-3.
TOLERANCES = {"float64": (1e-7, 1e-10), "float32": (2e-4, 1e-5)}


class InjectedFailure(RuntimeError):
    """Raised in the middle of a backward pass by a training case's `fail` entry."""


def training_case(seed: int, world_size: int, steps: int, microbatches: int = 1,
                  layers: int = 3, hidden: int = dp.HIDDEN, dtype: str = "float64",
                  tied: bool = False, optional: bool = False, frozen: tuple = (),
                  bucket_bytes: int = 1024, lr: float = 0.5, max_len: int = 6,
                  equal: bool = False, fail: dict | None = None, empty_rank: int | None = None,
                  crossed: bool = False, first_detour_ranks: tuple | None = None) -> dict:
    """A training case (plain data; see the module docstring).

    Each rank gets `microbatches` microbatches per step of 0-3 ragged sequences (`equal`: 2
    sequences of max_len tokens each, the same count on every rank). `optional`: the model's
    detour block runs on a random half of the microbatches, so it gets no gradient on some ranks
    in some steps. `fail`: {"step": k, "ranks": [...], "microbatch": m} makes those ranks raise
    InjectedFailure in the middle of that backward pass (after the head's gradient is ready).
    `empty_rank`: that rank holds no sequence in any step. `crossed`: the model uses its blocks in
    the reverse of their creation order. `first_detour_ranks` (with `optional`): in the first
    step exactly these ranks run the detour block, in every microbatch, so the order in which
    gradients arrive in the first step differs between ranks.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if world_size < 1 or steps < 1 or microbatches < 1:
        raise ValueError(f"world_size ({world_size}), steps ({steps}) and microbatches "
                         f"({microbatches}) must be >= 1")
    g = torch.Generator().manual_seed(seed)
    plan = []
    for step in range(steps):
        while True:
            per_rank = []
            for rank in range(world_size):
                pieces = []
                for _ in range(microbatches):
                    count = 2 if equal else int(torch.randint(0, 4, (), generator=g))
                    if rank == empty_rank:
                        count = 0
                    low = max_len if equal else 0
                    sequences = dp.ragged_batch(int(torch.randint(0, 2**31, (), generator=g)),
                                                count, max_len, min_len=low)
                    detour = bool(optional and torch.rand((), generator=g) < 0.5)
                    if optional and step == 0 and first_detour_ranks is not None:
                        detour = rank in first_detour_ranks
                    pieces.append({"sequences": sequences, "detour": detour})
                per_rank.append(pieces)
            tokens = sum(dp.count_tokens(piece["sequences"]) for pieces in per_rank
                         for piece in pieces)
            if tokens:
                break                      # a step without any valid token has no loss: redraw
        failing = fail is not None and fail["step"] == step
        plan.append({"microbatches": per_rank, "tokens": tokens,
                     "fail": {"ranks": list(fail["ranks"]), "microbatch": fail["microbatch"]}
                     if failing else None})
    model = {"seed": seed, "layers": layers, "hidden": hidden, "dtype": dtype, "tied": tied,
             "optional": optional, "frozen": tuple(frozen), "crossed": crossed}
    return {"model": model, "lr": lr, "bucket_bytes": bucket_bytes, "world_size": world_size,
            "steps": plan}


def shares(case: dict) -> list:
    """Rank r's part of a case: the model, its own microbatches, the global token counts."""
    out = []
    for rank in range(case["world_size"]):
        steps = [{"microbatches": step["microbatches"][rank], "tokens": step["tokens"],
                  "fail": None if step["fail"] is None or rank not in step["fail"]["ranks"]
                  else step["fail"]["microbatch"], "agree": step["fail"] is not None}
                 for step in case["steps"]]
        out.append({"model": case["model"], "lr": case["lr"],
                    "bucket_bytes": case["bucket_bytes"], "steps": steps})
    return out


def build_model(spec: dict, device="cpu"):
    """The case's model; the same weights in every process."""
    return dp.make_model(spec["seed"], spec["layers"], spec["hidden"],
                         getattr(torch, spec["dtype"]), device, spec["tied"], spec["optional"],
                         spec["frozen"], spec.get("crossed", False))


def _fail_inside_backward(model):
    """Make the next backward raise once the gradient reaches the first block's output (the
    head's and the later blocks' gradients are ready by then: their buckets may be in flight)."""
    def raise_there(grad):
        raise InjectedFailure("injected failure in the middle of backward")

    def forward_hook(module, inputs, output):
        output.register_hook(raise_there)
    return model.blocks[0].register_forward_hook(forward_hook)


def params_of(model) -> dict:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def train_with_sync(share: dict, sync_class) -> dict:
    """On every rank: SGD steps whose gradients `sync_class(model, bucket_bytes)` synchronises.

    Each step: zero the gradients; for each microbatch, forward, loss R * S_{r,m} / N,
    backward (all but the last microbatch inside `sync.no_sync()`); `sync.finish()`; then
    p -= lr * p.grad. If a backward raises (a case's injected failure), finish() still runs, the
    ranks agree with one all_reduce that the step failed, and every rank skips it.
    Returns {"params": [parameters after each step], "skipped": [bool per step]}.
    """
    import torch.distributed as dist
    from labkit import device
    world_size = dist.get_world_size()
    model = build_model(share["model"], device())
    sync = sync_class(model, share["bucket_bytes"])
    history, skipped = [], []
    for step in share["steps"]:
        model.zero_grad(set_to_none=True)
        failed = False
        pieces = step["microbatches"]
        try:
            for m, piece in enumerate(pieces):
                last = m == len(pieces) - 1
                with contextlib.nullcontext() if last else sync.no_sync():
                    handle = _fail_inside_backward(model) if step["fail"] == m else None
                    try:
                        total, _ = dp.token_loss_sum(model, piece["sequences"],
                                                     detour=piece["detour"])
                        (total * world_size / step["tokens"]).backward()
                    finally:
                        if handle is not None:
                            handle.remove()
        except InjectedFailure:
            failed = True
        finally:
            sync.finish()             # ends the step on every rank, whatever happened in it
        if step["agree"]:             # any rank failed: every rank skips the step
            flag = torch.tensor([float(failed)], device=device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            failed = bool(flag.item())
        if failed:
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= share["lr"] * p.grad
        history.append(params_of(model))
        skipped.append(failed)
    return {"params": history, "skipped": skipped}


def reference_training(case: dict) -> dict:
    """One process, every rank's microbatches, the same SGD: what every rank must hold."""
    model = build_model(case["model"])
    history, skipped = [], []
    for step in case["steps"]:
        model.zero_grad(set_to_none=True)
        if step["fail"] is not None:
            history.append(params_of(model))
            skipped.append(True)
            continue
        for pieces in step["microbatches"]:
            for piece in pieces:
                total, _ = dp.token_loss_sum(model, piece["sequences"], detour=piece["detour"])
                (total / step["tokens"]).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= case["lr"] * p.grad
        history.append(params_of(model))
        skipped.append(False)
    return {"params": history, "skipped": skipped}


def assert_params_match(per_rank: list, reference: dict, dtype: str = "float64",
                        hint: str | None = None) -> None:
    """Every rank's parameters equal the one-process run's after every step (and the same steps
    were skipped)."""
    rtol, atol = TOLERANCES[dtype]
    if len(per_rank) < 1:
        raise AssertionError("no rank returned a training history")
    for rank, result in enumerate(per_rank):
        if result["skipped"] != reference["skipped"]:
            raise AssertionError(f"rank {rank} skipped steps {result['skipped']}, expected "
                                 f"{reference['skipped']}")
    for step, expected in enumerate(reference["params"]):
        try:
            dp.assert_grads_match([result["params"][step] for result in per_rank], expected,
                                  "data", rtol, atol, hint=hint or _hint())
        except AssertionError as error:
            raise AssertionError(f"after step {step + 1}: {error}") from None


def _hint() -> str:
    return ("check that every gradient is all-reduced once per step, from its accumulated value "
            "(the last microbatch's backward), divided by the world size, and written back to "
            "p.grad before finish() returns")


def parameter_bytes(case: dict) -> int:
    """Bytes of the gradients a synchroniser must all-reduce each step (trainable parameters)."""
    model = build_model(case["model"])
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
