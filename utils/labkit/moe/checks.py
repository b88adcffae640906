"""Checkers for lab 7 (mixture of experts); the lab's test cells and tests/chapters call the same.

    check_dispatch_plan(dispatch, tokens=48, experts=6, top_k=2, capacity_factor=1.0)   # task 1
    check_dispatch_combine(dispatch, combine, tokens=48, experts=6, top_k=2)           # task 1
    check_ep_layer(world, ep_moe_layer, experts_per_rank=2, top_k=2)                   # task 2
    check_ep_traffic(world, ep_moe_layer)                                              # task 2
    check_balance_step(world, balance_step)                                            # task 3
    check_quantize(quantize_e4m3, dequantize_e4m3, hidden=200, block=64)               # task 4
    check_fp8_dispatch(world, fp8_dispatch, hidden=200, block=64)                      # task 4

Every case is drawn fresh (`labkit.checks.Case`: the seed is printed in every failure). Expected
values are computed here, from the case, by single-process references; ranks get only their own
share (`world.run_each`); bytes are counted outside the ranks (`world.traffic()`).
"""
from __future__ import annotations

import torch

from labkit import checks
from labkit.moe import capacity, fp8, route
from labkit.moe.ep_checks import check_ep_layer, check_ep_traffic, ep_case  # noqa: F401 (task 2)
from labkit.moe.references import (assert_plan_shape, balance_reference, dense_moe,
                                   received_rows, verify_drops)

FACTORS = (None, 0.5, 1.0, 1.25, 2.0)


def _skewed_logits(case, tokens, experts, dtype=torch.float64):
    """[N, E] logits with a random popularity skew, so that capacity binds on popular experts."""
    skew = float(case.integer(0, 20)) / 10
    popularity = -skew * torch.log1p(torch.arange(experts, dtype=torch.float64))
    order = torch.tensor(case.permutation(experts))
    return (case.normal((tokens, experts), "float64") + popularity[order]).to(dtype)


# ---- task 1: dispatch and combine with capacity ------------------------------------------------

def _draw_task1(case, tokens, experts, top_k, hidden, dtype):
    x = case.normal((tokens, hidden), dtype)
    logits = _skewed_logits(case, tokens, experts, getattr(torch, dtype))
    expert_maps = case.normal((experts, hidden, hidden), dtype, scale=hidden ** -0.5)
    return x, logits, expert_maps


def check_dispatch_plan(dispatch, tokens=48, experts=6, top_k=2, capacity_factor=1.0,
                        hidden=8, dtype="float64", seed=None):
    """dispatch(x, logits, top_k, capacity_factor) keeps min(load, C) rows per expert and drops,
    per expert, the assignments with the lowest router weights. Returns the plan."""
    case = checks.Case(f"lab 7 task 1: dispatch of {tokens} tokens to {experts} experts, top-"
                       f"{top_k}, capacity factor {capacity_factor}, {dtype}", seed)
    x, logits, _ = _draw_task1(case, tokens, experts, top_k, hidden, dtype)
    plan = dispatch(x.clone(), logits.clone(), top_k, capacity_factor)
    assert_plan_shape(plan, tokens, experts, top_k, hidden, x.dtype, case)
    weights, chosen = route(logits, top_k)
    cap = None if capacity_factor is None else capacity(tokens, top_k, experts, capacity_factor)
    load = torch.bincount(chosen.reshape(-1), minlength=experts)
    formula = ("no capacity: every assignment is kept" if cap is None else
               f"C = ceil({tokens} * {top_k} / {experts} * {capacity_factor}) = {cap}")
    expected_counts = load if cap is None else load.clamp(max=cap)
    checks.check(plan["tokens_per_expert"], expected_counts, "plan['tokens_per_expert']",
                 case=case, hint=f"loads are {load.tolist()} and {formula}: an expert keeps "
                                 "min(load, C) rows (moe.capacity computes C)")
    problem = verify_drops(plan["dropped"], weights, chosen, experts, cap, case)
    if problem is not None:
        hint = ("drop each expert's lowest-weight assignments, not the last ones in token order"
                if "weight" in problem else "check that dropping happens per expert, at C")
        raise AssertionError(f"plan['dropped'] is wrong [{case}]: {problem}. {hint} (choice j of "
                             "token t is column j of moe.route(logits, top_k))")
    return plan


def check_dispatch_combine(dispatch, combine, tokens=48, experts=6, top_k=2,
                           capacity_factor=1.0, hidden=8, dtype="float64", seed=None):
    """Run every expert on its rows of plan['packed'], combine, and compare with the dense
    reference in which every expert sees every token under a mask of the kept assignments."""
    case = checks.Case(f"lab 7 task 1: dispatch, experts, combine of {tokens} tokens, {experts} "
                       f"experts, top-{top_k}, capacity factor {capacity_factor}, {dtype}", seed)
    x, logits, expert_maps = _draw_task1(case, tokens, experts, top_k, hidden, dtype)
    plan = dispatch(x.clone(), logits.clone(), top_k, capacity_factor)
    assert_plan_shape(plan, tokens, experts, top_k, hidden, x.dtype, case)
    counts = plan["tokens_per_expert"].tolist()
    pieces = plan["packed"].split(counts)                             # one block per expert
    outputs = torch.cat([piece @ expert_maps[e] for e, piece in enumerate(pieces)])   # [M, H]
    y = combine(outputs, plan)
    weights, chosen = route(logits, top_k)
    kept = ~plan["dropped"]              # whichever assignments dispatch kept (task 1's other cell
    expected = dense_moe(x, weights, chosen, kept, expert_maps)   # checks that choice)
    kept_counts = torch.bincount(chosen[kept], minlength=experts).tolist()
    if counts != kept_counts:
        raise AssertionError(f"plan['tokens_per_expert'] = {counts} does not count the kept "
                             f"assignments of each expert, {kept_counts} [{case}]")
    if isinstance(y, torch.Tensor) and y.shape == expected.shape and y.dtype == expected.dtype:
        identity = combine(plan["packed"].clone(), plan)   # identity experts: the gated input
        gates = (weights * kept).sum(dim=-1, keepdim=True)
        if not torch.allclose(identity, gates.to(x.dtype) * x, rtol=1e-6, atol=1e-9):
            raise AssertionError(
                f"with identity experts, combine(plan['packed'], plan) should give each token "
                f"its own row times its kept gate weights [{case}]: does combine put every row "
                "back on the token it came from (undo the sort), and do the rows of "
                "plan['packed'] come in expert order?")
    tolerance = {"float64": (1e-10, 1e-12), "float32": (1e-4, 1e-5)}[dtype]
    checks.check(y, expected, "combine's output", rtol=tolerance[0], atol=tolerance[1], case=case,
                 hint="expert e ran on rows sum(tokens_per_expert[:e]) .. sum(tokens_per_expert"
                      "[:e+1]) of plan['packed']; combine must weigh each output by its gate "
                      "weight (as moe.route gave it: for K > 1 renormalised over the K before "
                      "dropping, never after) and add it to its token")
    return y


# ---- task 3: balancing over ranks ---------------------------------------------------------------

def _balance_program(share, fn):
    from labkit import device
    dev = device()
    logits = share["logits"].to(dev).requires_grad_(True)
    out = fn(logits, share["top_k"], share["bias"].to(dev), share["alpha"], share["gamma"])
    if not isinstance(out, dict):
        raise TypeError(f"rank {share['rank']}: balance_step returned {type(out).__name__}, "
                        "expected a dict")
    aux = out.get("aux_loss")
    if isinstance(aux, torch.Tensor) and aux.requires_grad:
        aux.backward()
    grad = logits.grad if logits.grad is not None else torch.zeros_like(logits)
    return {"aux_value": float(out.get("aux_value", float("nan"))),
            "load": out.get("load"), "bias": out.get("bias"),
            "imbalance": dict(out.get("imbalance", {})), "grad": grad.detach()}


def balance_shares(case, world_size, tokens=None, experts=8, top_k=2, alpha=0.01, gamma=0.001):
    counts = (list(tokens) if tokens is not None
              else [case.integer(0, 24) for _ in range(world_size)])
    bias = case.normal((experts,), "float64", scale=0.05)
    logits = _skewed_logits(case, sum(counts), experts)
    return [{"rank": r, "logits": piece, "top_k": top_k, "bias": bias.clone(), "alpha": alpha,
             "gamma": gamma} for r, piece in enumerate(logits.split(counts))]


def check_balance_step(world, fn, tokens=None, experts=8, top_k=2, alpha=0.01, gamma=0.001,
                       timeout=60, seed=None):
    """Every rank returns the global batch's load, auxiliary loss value, updated bias and
    imbalance metrics, and backpropagates a loss whose gradient with respect to its own logits
    is that of the global auxiliary loss."""
    P = world.size
    case = checks.Case(f"lab 7 task 3: balance step on {P} ranks, {experts} experts, top-{top_k}",
                       seed)
    shares = balance_shares(case, P, tokens, experts, top_k, alpha, gamma)
    if sum(s["logits"].size(0) for s in shares) == 0:
        raise ValueError("check_balance_step needs at least one token (see the empty-batch test)")
    expected = balance_reference(torch.cat([s["logits"] for s in shares]), top_k, shares[0]["bias"],
                                 alpha, gamma)
    results = world.run_each(_balance_program, shares, fn, timeout=timeout)
    checks.one_result_per_rank(results, P, case, "balance_step")
    grads = expected["grad"].split([s["logits"].size(0) for s in shares])
    local = "all-reduce the counts (and the probability sums, and the token count) first"
    for rank, got in enumerate(results):
        checks.check(got["load"], expected["load"], f"rank {rank}'s 'load'", case=case,
                     hint="the load is the global one: every rank's assignments, counted with "
                          f"the bias in the selection (moe.route(logits, top_k, bias)); {local}")
        checks.check(got["bias"], expected["bias"], f"rank {rank}'s updated 'bias'", case=case,
                     rtol=0, atol=1e-12, hint="b + gamma * sign(mean load - load), from the "
                                              "global load, so that every rank keeps the same bias")
        checks.check(got["aux_value"], expected["aux_value"], f"rank {rank}'s 'aux_value'",
                     rtol=1e-9, atol=1e-15, case=case,
                     hint="alpha * E * sum_i f_i P_i with f and P over the global batch")
        checks.check(got["grad"].cpu(), grads[rank], f"rank {rank}'s gradient of 'aux_loss' with "
                     "respect to its logits", rtol=1e-9, atol=1e-15, case=case,
                     hint="f is a count (no gradient) over the global batch; P_i sums this rank's "
                          "probabilities over the global token count")
        checks.check(got["imbalance"], expected["imbalance"], f"rank {rank}'s 'imbalance'",
                     rtol=1e-9, atol=1e-12, case=case,
                     hint="moe.imbalance of the global load")
    return results


def check_balance_refuses_empty_batch(world, fn, experts=8, top_k=2, timeout=30):
    """With no token on any rank, every rank raises ValueError (none divides by zero or hangs)."""
    import labkit
    P = world.size
    case = checks.Case(f"lab 7 task 3: an empty global batch on {P} ranks")
    shares = balance_shares(case, P, [0] * P, experts, top_k)
    try:
        world.run_each(_balance_program, shares, fn, timeout=timeout)
    except labkit.RankError as error:
        raised = sorted(error.errors)
        value_errors = all("ValueError" in text for text in error.errors.values())
        if raised != list(range(P)) or not value_errors:
            raise AssertionError(f"on an empty global batch every rank should raise ValueError; "
                                 f"ranks {raised} raised: {error.errors}") from None
        return
    raise AssertionError("a global batch without tokens must raise ValueError on every rank "
                         "(after the ranks agree on the token count), not return")


# ---- task 4: FP8 on the wire --------------------------------------------------------------------

def fp8_rows(case, rows, hidden, block):
    """[rows, hidden] float32 whose blocks span magnitudes 1e-4 .. 1e3; one block all zero."""
    n_blocks = fp8.blocks(hidden, block)
    exponent = case.integers(-4, 3, (rows, n_blocks)).to(torch.float64)
    scale = (10.0 ** exponent).repeat_interleave(block, dim=1)[:, :hidden]
    x = case.normal((rows, hidden), "float64") * scale
    if rows and n_blocks > 1:
        zero_row, zero_block = case.integer(0, rows - 1), case.integer(0, n_blocks - 1)
        x[zero_row, zero_block * block:(zero_block + 1) * block] = 0.0
    return x.float()


def _within_bound(restored, x, block, what, case, hint):
    if not isinstance(restored, torch.Tensor) or restored.shape != x.shape:
        got = (tuple(restored.shape) if isinstance(restored, torch.Tensor)
               else type(restored).__name__)
        raise AssertionError(f"{what}: expected a tensor of shape {tuple(x.shape)}, got {got} "
                             f"[{case}]")
    error = (restored.float() - x).abs()
    bound = fp8.error_bound(x, block)
    bad = ~(error <= bound)
    if bad.any():
        i, j = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {x.numel()} values are off by more than FP8 with "
            f"per-block scales allows [{case}]; e.g. row {i}, column {j}: sent "
            f"{x[i, j].item():.4g}, got {restored[i, j].item():.4g}, bound "
            f"{bound[i, j].item():.3g}. {hint}")


def check_quantize(quantize, dequantize, rows=12, hidden=200, block=64, seed=None):
    """quantize(x, block) -> (payload uint8 [N, H], scales float32 [N, ceil(H/block)]);
    dequantize(payload, scales, block) -> float32 [N, H] within fp8.error_bound of x."""
    case = checks.Case(f"lab 7 task 4: FP8 quantisation of [{rows}, {hidden}], block {block}", seed)
    x = fp8_rows(case, rows, hidden, block)
    out = quantize(x.clone(), block)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise AssertionError(f"quantize should return (payload, scales), got "
                             f"{type(out).__name__} [{case}]")
    payload, scales = out
    if payload.dtype != torch.uint8 or tuple(payload.shape) != (rows, hidden):
        raise AssertionError(f"the payload should be uint8 [{rows}, {hidden}] (one byte per "
                             f"value: q.view(torch.uint8)), got {payload.dtype} "
                             f"{tuple(payload.shape)} [{case}]")
    n_blocks = fp8.blocks(hidden, block)
    if scales.dtype != torch.float32 or tuple(scales.shape) != (rows, n_blocks):
        raise AssertionError(f"scales should be float32 [{rows}, {n_blocks}] (one per block of "
                             f"{block}, the last one shorter), got {scales.dtype} "
                             f"{tuple(scales.shape)} [{case}]")
    restored = dequantize(payload.clone(), scales.clone(), block)
    _within_bound(restored, x, block, "dequantize(quantize(x))", case,
                  "Scale each block by its own amax / 448 before the cast (a plain cast clamps at "
                  "448 and flushes small values), and multiply back by the same scale")
    if torch.is_floating_point(restored) and restored.dtype != torch.float32:
        raise AssertionError(f"dequantize should return float32, got {restored.dtype} [{case}]")
    return payload, scales


def _fp8_program(share, fn):
    from labkit import device
    out = fn(share["rows"].to(device()), list(share["send_counts"]), share["block"])
    return out.detach().float() if isinstance(out, torch.Tensor) else out


def check_fp8_dispatch(world, fn, hidden=200, block=64, timeout=60, seed=None):
    """fn(rows, send_counts, block) on every rank: rows [sum(send_counts), H] float32 grouped by
    destination; returns what arrived from every rank, in source-rank order, dequantised, within
    the FP8 bound; and the bytes between any two ranks are those of FP8 rows with their scales."""
    P = world.size
    case = checks.Case(f"lab 7 task 4: FP8 dispatch on {P} ranks, H = {hidden}, block {block}",
                       seed)
    counts = [[case.integer(0, 6) for _ in range(P)] for _ in range(P)]
    busy = case.integer(0, P - 1)                       # sends many rows to every other rank
    counts[busy] = [30 + case.integer(0, 20) if q != busy else 3 for q in range(P)]
    if P > 2:                                           # another rank receives nothing at all
        idle = (busy + 1 + case.integer(0, P - 2)) % P
        for r in range(P):
            counts[r][idle] = 0
    shares = [{"rows": fp8_rows(case, sum(counts[r]), hidden, block), "send_counts": counts[r],
               "block": block} for r in range(P)]
    with world.traffic() as traffic:
        results = world.run_each(_fp8_program, shares, fn, timeout=timeout)
    checks.one_result_per_rank(results, P, case, "fp8_dispatch")
    for rank, got in enumerate(results):
        sent = received_rows([s["rows"] for s in shares], counts, rank)
        _within_bound(got, sent, block, f"what rank {rank} received", case,
                      "quantise before sending, send the payload and its scales with the same "
                      "split sizes, dequantise after receipt; rows from rank 0 first, then "
                      "rank 1, ...")
    if world.backend != "gloo":
        print(f"check_fp8_dispatch: bytes are counted on gloo's sockets only, not on "
              f"{world.backend}")
        return results
    row = fp8.row_bytes(hidden, block)
    problems = []
    for r in range(P):
        for q in range(P):
            if r == q:
                continue
            low = counts[r][q] * hidden
            high = counts[r][q] * row + 64 + 6 * checks.GLOO_BYTES_PER_MESSAGE
            got = traffic.matrix[r][q]
            if not low <= got <= high:
                problems.append(f"rank {r} sent rank {q} {got} bytes for {counts[r][q]} rows of "
                                f"{hidden} values; FP8 rows with float32 scales per {block} take "
                                f"{counts[r][q] * row} (at most {high} with counts and framing)")
    if problems:
        raise AssertionError(f"the FP8 dispatch's traffic is off [{case}]: "
                             + "; ".join(problems[:3]) + ". Send one byte per value "
                             "(payload.view(torch.uint8)) and one float32 per block; BF16 would "
                             "be two bytes per value")
    return results
