"""Checkers for lab 2, tasks 1 and 2 (task 3's are in `labkit.dp.sync_checks`).

Each rank is sent only its own share of a case drawn fresh for every check (`checks.Case`, whose
seed every failure prints); expected values are computed here, in the process that runs the test
cell, from the whole case; results are read back from the tensors handed to the student's code;
bytes are counted outside the ranks (`world.traffic()`), between `labkit.mark`s the harness sets.

Task 1: `step_fn(ddp_model, microbatches) -> logged loss`, one data-parallel step with gradient
accumulation; the harness wraps a TinyLM in torch's DistributedDataParallel.
Task 2: `norm_fn(grads, replicas, device, dtype=torch.float32)` and
`step_fn(params, grads, replicas, lr, max_norm, device) -> norm`, a clipped SGD step on sharded
and replicated pieces, skipped on every rank when the norm is not finite.
"""
from __future__ import annotations

import math

import torch

from labkit import checks, dp
from labkit.dp import placement
from labkit.errors import CallTimeout, RankDied, RankError

HIDDEN_TASK1 = 64        # gradients large enough that one synchronisation stands out in bytes


# ---- task 1: the token loss with accumulation and no_sync ---------------------------------------

def _accumulation_program(share, step_fn):
    """On a rank: a DDP-wrapped TinyLM, the student's step between two marks; the logged loss
    and the gradients read back from the model handed over."""
    import labkit
    model = dp.make_model(share["seed"], hidden=share["hidden"], device=labkit.device())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    labkit.mark("step starts")
    loss = step_fn(ddp, share["microbatches"])
    labkit.mark("step ends")
    return {"loss": float(loss), "grads": dp.grads_of(model)}


def accumulation_case(world_size, what, microbatches=3, empty_rank=None, empty=False, seed=None,
                      idle_rank=None):
    """A case: per rank, `microbatches` lists of 0-3 ragged sequences (some empty), drawn from
    the case's generator; the global batch; the model seed. `idle_rank`: that rank holds no
    microbatch at all (a rank that ran out of data); the others hold `microbatches` each. (With
    more than one on the others, a step that synchronises every microbatch would hang here, on
    counts of all-reduces that differ between ranks: that mistake is the one-synchronisation
    cell's, so the idle cases keep one microbatch on the others.)"""
    case = checks.Case(what, seed)
    per_rank = []
    for rank in range(world_size):
        pieces = []
        count_of_microbatches = microbatches
        if idle_rank is not None:
            count_of_microbatches = 0 if rank == idle_rank else microbatches
        for _ in range(count_of_microbatches):
            count = 0 if empty or rank == empty_rank else case.integer(0, 3)
            pieces.append(dp.ragged_batch(case.integer(0, 2**31 - 1), count, 7, min_len=0))
        per_rank.append(pieces)
    if not empty and not any(dp.count_tokens(p) for pieces in per_rank for p in pieces):
        busy = next(r for r, pieces in enumerate(per_rank) if pieces)
        per_rank[busy][-1] = [([1, 2, 3], [4, 5, 6])]         # at least one valid token
    batch = [seq for pieces in per_rank for piece in pieces for seq in piece]
    shares = [{"seed": case.seed % 1000, "hidden": HIDDEN_TASK1, "microbatches": pieces}
              for pieces in per_rank]
    return case, shares, batch


def ddp_world_problem(world):
    """torch 2.13 (CPU, gloo) crashes with a segmentation fault inside DistributedDataParallel's
    constructor when TORCH_DISTRIBUTED_DEBUG=DETAIL was set before the process group started,
    which is what teaching mode does; measured in a plain two-process program too."""
    if getattr(world, "teaching", False):
        return ("task 1's tests build torch's DistributedDataParallel, which crashes (segmentation "
                "fault, torch 2.13) in a world with teaching mode on: use "
                "labkit.world(n, backend=BACKEND, teaching=False)")
    return None


def _run_accumulation(world, step_fn, shares, timeout, measure=False, case=None):
    problem = ddp_world_problem(world)
    if problem:
        raise ValueError(problem)
    idle = [r for r, share in enumerate(shares) if not share["microbatches"]]
    try:
        if not measure:
            return world.run_each(_accumulation_program, shares, step_fn, timeout=timeout), None
        with world.traffic() as traffic:
            results = world.run_each(_accumulation_program, shares, step_fn, timeout=timeout)
        return results, traffic
    except (RankError, RankDied, CallTimeout) as error:
        if not idle:
            raise
        raise AssertionError(
            f"[{case}] rank {idle[0]} holds no microbatch in this step and the step failed: "
            f"{str(error).splitlines()[0]}. DDP all-reduces the gradients from inside backward "
            "(its hooks), so every rank must run one backward outside no_sync() in every step, "
            "also a rank without data: the backward of an empty microbatch's zero loss, "
            "dp.token_loss_sum(ddp_model, []), joins the others' all-reduce") from None


def check_accumulation_gradients(world, step_fn, microbatches=3, empty_rank=None, idle_rank=None,
                                 timeout=60):
    """Every rank's accumulated gradient equals the one-process gradient of the global token loss.
    `idle_rank`: that rank holds no microbatch, the others `microbatches` each."""
    P = world.size
    case, shares, batch = accumulation_case(
        P, f"accumulation step, P={P}, {microbatches} microbatches"
        + (f", rank {idle_rank} without any" if idle_rank is not None else ""),
        microbatches, empty_rank, idle_rank=idle_rank)
    results, _ = _run_accumulation(world, step_fn, shares, timeout, case=case)
    checks.one_result_per_rank(results, P, case, what="the step")
    reference = dp.reference_gradients(batch, shares[0]["seed"], hidden=HIDDEN_TASK1)
    for rank, result in enumerate(results):
        checks.check(result["grads"], reference, f"rank {rank}'s p.grad", rtol=dp.RTOL,
                     atol=dp.ATOL, case=case, hint=_gradient_hint(result["grads"], reference, P,
                                                                  microbatches))
    return results


def _gradient_hint(got, reference, P, microbatches):
    ratio = (sum(float(g.double().norm() ** 2) for g in got.values())
             / max(sum(float(r.double().norm() ** 2) for r in reference.values()), 1e-300)) ** 0.5
    for factor, words in [(P, "R times too large: DDP already divides by R; the loss of rank r "
                              "is R S / N"),
                          (1 / P, "R times too small: backpropagate R S_{r,m} / N, not S / N"),
                          (microbatches, "M times too large: is a microbatch's loss divided by "
                                         "the count of all microbatches?")]:
        if factor != 1 and math.isclose(ratio, factor, rel_tol=1e-3):
            return f"the gradient is {words}"
    return ("a token's weight depends on where it sits: divide every microbatch's summed loss "
            "by the same global count of valid tokens (all ranks, all microbatches)")


def check_one_synchronisation(world, step_fn, microbatches=3, idle_rank=None, timeout=60):
    """Between the step's marks each rank sends one gradient synchronisation, not one per
    microbatch: no_sync around every backward but the last (values are checked elsewhere).
    `idle_rank`: that rank holds no microbatch, the others `microbatches` each."""
    P = world.size
    case, shares, _ = accumulation_case(P, f"accumulation traffic, P={P}", microbatches,
                                        idle_rank=idle_rank)
    model = dp.make_model(0, hidden=HIDDEN_TASK1)
    n_params = sum(p.numel() for p in model.parameters())
    one_sync, small = calibrate_all_reduce(world, [n_params, 2], timeout, task=step_fn)
    results, traffic = _run_accumulation(world, step_fn, shares, timeout, measure=True, case=case)
    checks.one_result_per_rank(results, P, case, what="the step")
    sent = [end - start for start, end in zip(traffic.marks["step starts"]["sent"],
                                                traffic.marks["step ends"]["sent"])]
    for rank in range(P):
        low, high = 0.9 * one_sync[rank], one_sync[rank] + 4 * small[rank]
        if not low <= sent[rank] <= high:
            syncs = sent[rank] / one_sync[rank]
            raise AssertionError(
                f"rank {rank} sent {sent[rank]:,} bytes during a step of {microbatches} "
                f"microbatches [{case}]; one all-reduce of the gradients is {one_sync[rank]:,} "
                f"bytes here, so that is about {syncs:.1f} synchronisations. "
                + ("Run every backward but the last inside `with ddp_model.no_sync():`."
                   if syncs > 1.5 else "The gradients must be all-reduced once per step."))
    return sent


def _calibration_program(share, task=None):
    """On a rank: an async all_reduce (as DDP and the labs' synchronisers issue them) of float64
    tensors of the given sizes, a mark after each. `task` is not used: passing the task under
    test makes `labkit grade` run this call on the same ranks as the graded one."""
    import labkit
    import torch.distributed as dist
    for index, n in enumerate(share):
        tensor = torch.ones(n, dtype=torch.float64, device=labkit.device())
        dist.all_reduce(tensor, async_op=True).wait()
        labkit.mark(f"calibration {index}")
    return True


def calibrate_all_reduce(world, sizes, timeout=60, task=None):
    """Bytes each rank sends for one all_reduce of float64 tensors of each size, measured on this
    world as it is (teaching mode's checks included). Returns one list per size, indexed by rank.
    `task`: the function or class under test, so that a grader runs this call on the ranks it
    runs the student's calls on (this program never calls it)."""
    with world.traffic() as traffic:
        world.run_each(_calibration_program, [list(sizes)] * world.size, task, timeout=timeout)
    previous, out = [0] * world.size, []
    for index in range(len(sizes)):
        now = traffic.marks[f"calibration {index}"]["sent"]
        out.append([b - a for a, b in zip(previous, now)])
        previous = now
    return out


def check_logged_loss(world, step_fn, timeout=60):
    """The returned value is the global token loss sum S / sum n, the same on every rank."""
    P = world.size
    case, shares, batch = accumulation_case(P, f"logged loss, P={P}", 2)
    results, _ = _run_accumulation(world, step_fn, shares, timeout)
    checks.one_result_per_rank(results, P, case, what="the step")
    total, count = dp.token_loss_sum(dp.make_model(shares[0]["seed"], hidden=HIDDEN_TASK1), batch)
    expected = (total / count).item()
    for rank, result in enumerate(results):
        checks.check(result["loss"], expected, f"the loss rank {rank} returned", rtol=1e-9,
                     atol=1e-12, case=case,
                     hint="return the loss of the whole step, sum of all token losses over all "
                          "valid tokens, all-reduced and detached: not this rank's own loss, "
                          "nor the scaled value you backpropagate")


def check_empty_batch(world, step_fn, timeout=30):
    """No valid token on any rank: ValueError on every rank, no hang, no NaN; first, on the same
    ranks, a batch where rank 0 alone holds no token must be accepted (a step that always raises
    earns nothing here; its values are judged by the other cells)."""
    P = world.size
    case, shares, _ = accumulation_case(P, f"empty global batch, P={P}", 2, empty=True)
    _, ordinary, _ = accumulation_case(P, f"rank 0 without tokens, P={P}", 2, empty_rank=0)
    problem = ddp_world_problem(world)
    if problem:
        raise ValueError(problem)
    checks.expect_value_error_on_every_rank(
        world, _accumulation_program, shares, step_fn, case=case, timeout=timeout,
        refused="no rank holds a valid token (after the ranks agree on the count)",
        ordinary=ordinary)


# ---- task 2: the global norm, the clipped step, the skipped step --------------------------------

def check_norm(world, norm_fn, kind="random", timeout=30):
    """Every rank returns the norm of the full gradient, each piece counted once.
    kind: "example" (one of each placement), "lonely" (the last rank holds nothing), "random"."""
    P = world.size
    case = checks.Case(f"global norm, {kind} placement, P={P}")
    layout = {"example": lambda: placement.example_case(P),
              "lonely": lambda: placement.lonely_case(P),
              "random": lambda: placement.random_case(case.seed % 2**31, P)}[kind]()
    norms = world.run_each(placement.norm_program, placement.shares(layout, P), norm_fn,
                           timeout=timeout)
    checks.one_result_per_rank(norms, P, case, what="the norm")
    expected = placement.full_norm(layout)
    for rank, norm in enumerate(norms):
        checks.check(float(norm), expected, f"the norm on rank {rank}", rtol=1e-5, atol=0,
                     case=case, hint=_norm_hint(norm, layout, P) + "\n" +
                     placement.describe(layout, P))


def _norm_hint(norm, layout, P):
    naive = sum(sum(float(g.double().square().sum()) for g in placement.local_grads(layout, r, P)[0])
                for r in range(P)) ** 0.5
    if math.isclose(float(norm), naive, rel_tol=1e-5):
        return "replicated gradients were counted once per copy: divide by `replicas`"
    return "shards count once, replicas once in total, and every rank joins the all_reduce"


def check_norm_dtype(world, norm_fn, timeout=30):
    """The `dtype` argument: float64 gradients spanning many magnitudes, accumulated in float64,
    agree with the exact norm to 1e-12 (float32 accumulation does not); BF16 gradients,
    accumulated in the default float32, keep their small contributions."""
    P = world.size
    case = checks.Case(f"global norm in float64, P={P}")
    magnitudes = [2.0 ** case.integer(-30, 30) for _ in range(4 * P)]
    full = [case.normal((case.integer(1, 3), 2), "float64") * m for m in magnitudes]
    layout = {"full": full, "where": [{"kind": "shard"}] * len(full)}
    norms = world.run_each(placement.norm_program, placement.shares(layout, P), norm_fn,
                           torch.float64, timeout=timeout)
    checks.one_result_per_rank(norms, P, case, what="the norm")
    for rank, norm in enumerate(norms):
        checks.check(float(norm), placement.full_norm(layout), f"the float64 norm on rank {rank}",
                     rtol=1e-12, atol=0, case=case,
                     hint="accumulate the squares in the dtype you were given")
    bf16 = placement.small_contributions_case(P)
    norms = world.run_each(placement.norm_program, placement.shares(bf16, P), norm_fn,
                           timeout=timeout)
    for rank, norm in enumerate(norms):
        checks.check(float(norm), placement.full_norm(bf16), f"the BF16 gradients' norm on rank "
                     f"{rank}", rtol=1e-3, atol=0, hint="a BF16 accumulator loses the small "
                     "squares next to a large one: accumulate in float32 by default")


def _step_case(world, what, poison=None):
    P = world.size
    case = checks.Case(what)
    layout = placement.random_case(case.seed % 2**31, P, dtype=torch.float32)
    layout["full"].append(case.normal((3, 2), "float32"))       # always one replica on every rank
    layout["where"].append({"kind": "replicate", "ranks": list(range(P))})
    if poison is not None:                # a NaN or inf in the piece of one rank only
        if all(w["kind"] == "replicate" for w in layout["where"]):   # a draw can hold no shard
            layout["full"].append(case.normal((P + 1, 2), "float32"))
            layout["where"].append({"kind": "shard"})
        target = next(i for i, w in enumerate(layout["where"]) if w["kind"] != "replicate")
        layout["full"][target].view(-1)[0] = poison
    params = [case.normal(t.shape, "float32") for t in layout["full"]]
    lr = 0.1 * case.integer(1, 9)
    norm = placement.full_norm(layout)
    max_norm = norm / 3 if math.isfinite(norm) else 1.0       # clipping active
    return case, layout, params, lr, max_norm


def _check_step(world, step_fn, case, layout, params, lr, max_norm, timeout, hint):
    P = world.size
    results = world.run_each(placement.step_program, placement.shares(layout, P, params),
                             step_fn, lr, max_norm, timeout=timeout)
    checks.one_result_per_rank(results, P, case, what="the step")
    norm, new_params, new_grads = placement.reference_step(layout, params, lr, max_norm)
    for rank, result in enumerate(results):
        if math.isfinite(norm):
            checks.check(result["norm"], norm, f"the norm rank {rank} returned", rtol=1e-5,
                         atol=0, case=case, hint="return the norm before clipping")
        elif math.isfinite(result["norm"]):
            raise AssertionError(f"[{case}] rank {rank} returned the norm {result['norm']}, but "
                                 "a gradient holds a NaN or inf: the global norm is not finite")
        checks.check(result["params"], placement.expected_pieces(layout, new_params, rank, P),
                     f"rank {rank}'s parameters after the step", rtol=1e-5, atol=1e-6,
                     case=case, hint=hint)
        checks.check(result["grads"], placement.expected_pieces(layout, new_grads, rank, P),
                     f"rank {rank}'s gradients after the step", rtol=1e-5, atol=1e-6,
                     case=case, hint=hint + "; the gradients are scaled in place, the tensors "
                     "handed over (do not rebind list entries)")


def check_clipped_step(world, step_fn, timeout=30):
    """Gradients scaled in place by min(1, max_norm / (norm + 1e-6)), then p -= lr * g, with the
    global norm: the pieces equal those of the full clipped step, replicas alike."""
    case, layout, params, lr, max_norm = _step_case(world, f"clipped step, P={world.size}")
    _check_step(world, step_fn, case, layout, params, lr, max_norm, timeout,
                "clip with the global norm (every rank the same factor), then p -= lr * g")


def check_skipped_step(world, step_fn, poison=float("nan"), timeout=15):
    """A NaN or inf in one rank's gradient: the norm is not finite on every rank, and every rank
    leaves its parameters and gradients untouched (no hang: every rank still joins the norm)."""
    case, layout, params, lr, max_norm = _step_case(
        world, f"skipped step ({poison} in one piece), P={world.size}", poison)
    _check_step(world, step_fn, case, layout, params, lr, max_norm, timeout,
                "when the global norm is not finite, skip the step on every rank: leave the "
                "parameters and the gradients as they were")
