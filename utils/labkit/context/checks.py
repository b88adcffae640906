"""Lab 10's checkers (the lab's test cells and tests/chapters/test_lab10_long_sequences.py call
the same functions).

    check_ring_backward(world, ring_attention_backward)          # task 1: dq, dk, dv; bytes per rank
    check_ring_backward_traffic(world, ring_attention_backward)  # task 1: the ring's pairs, with dq
    check_ulysses_refuses(world, ulysses_attention)              # task 2: P must divide the KV heads
    check_ulysses(world, ulysses_attention)                      # task 2: values, balanced causal
    check_ulysses_traffic(world, ulysses_attention)              # task 2: bytes per pair, with values
    check_cp_bytes(predict_cp_step), check_cp_memory(...)        # task 3: see the lab's text

Every case is drawn fresh (`checks.Case`); each rank is sent its own tokens only (its shard of
the balanced split); the expected values are torch autograd of one-process attention
(`labkit.context.attention`) computed here, in float64; bytes are counted outside the ranks.
"""
from __future__ import annotations

import math
import re

import torch

from labkit import checks, context
from labkit.checks import GLOO_BYTES_PER_MESSAGE

TOLERANCE = {"float64": (1e-9, 1e-11), "float32": (1e-4, 1e-5)}   # (rtol, atol): the order of
# the block sums differs from one process's; float64 agrees to ~1e-15, float32 to ~1e-6


# ---- task 1: the backward pass of the balanced ring ---------------------------------------------

def _backward_case(case, P, batch, heads, chunk, head_dim, dtype):
    """The whole sequence (T = 2 P chunk tokens), its attention and gradients in one process, and
    rank r's share: its tokens of q, k, v, out, lse and dout."""
    B, H, T, d = batch, heads, 2 * P * chunk, head_dim
    q, k, v = (case.normal((B, H, T, d), "float64") for _ in range(3))
    dout = case.normal((B, H, T, d), "float64")
    q, k, v, dout = (t.to(getattr(torch, dtype)).double() for t in (q, k, v, dout))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = context.attention(*leaves, causal=True)
    (out * dout).sum().backward()
    grads = [t.grad for t in leaves]
    cast = lambda t: t.detach().to(getattr(torch, dtype))
    shares, expected = [], []
    for rank in range(P):
        mine = lambda t: cast(context.shard(t, P, rank, balanced=True))
        shares.append({"rank": rank, "q": mine(q), "k": mine(k), "v": mine(v), "out": mine(out),
                       "lse": mine(lse), "dout": mine(dout)})
        expected.append({"dq": mine(grads[0]), "dk": mine(grads[1]), "dv": mine(grads[2])})
    return shares, expected


def _backward_program(share, backward):
    """On a rank: backward(q, k, v, out, lse, dout) -> (dq, dk, dv) for this rank's tokens."""
    names = ("q", "k", "v", "out", "lse", "dout")
    got = backward(*(share[n].clone() for n in names))
    if not (isinstance(got, (tuple, list)) and len(got) == 3
            and all(isinstance(g, torch.Tensor) for g in got)):
        raise TypeError(f"rank {share['rank']}: ring_attention_backward returned "
                        f"{type(got).__name__}, expected a tuple (dq, dk, dv) of tensors")
    return {"dq": got[0].detach(), "dk": got[1].detach(), "dv": got[2].detach()}


def _backward_call(world, backward, batch, heads, chunk, head_dim, dtype, timeout, seed, what):
    P = world.size
    case = checks.Case(f"lab 10 task 1: {what} on {P} ranks, B={batch}, H={heads}, "
                       f"T={2 * P * chunk}, d={head_dim}, {dtype}", seed)
    shares, expected = _backward_case(case, P, batch, heads, chunk, head_dim, dtype)
    with world.traffic() as traffic:
        results = world.run_each(_backward_program, shares, backward, timeout=timeout)
    checks.one_result_per_rank(results, P, case, "ring_attention_backward")
    block = batch * heads * chunk * 2 * head_dim * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    return case, results, expected, traffic, block


_HINTS = {
    "dq": "dq of a block is dS k / sqrt(d) with dS = P * (dout v^T - rowsum(dout * out)) and "
          "P = exp(q k^T / sqrt(d) - lse) under the causal mask of the *global* positions "
          "(context.positions(T, P, rank, balanced=True) for the queries, the block owner's for "
          "the keys); every block of K and V must reach every rank",
    "dk": "dk and dv of a block are summed over every rank's queries: each rank adds its part to "
          "an accumulator that travels with the block, and the sum must end on the block's "
          "owner (after the last step it is one rank short of home: one more ring step)",
}


def check_ring_backward(world, backward, batch=1, heads=2, chunk=8, head_dim=16,
                        dtype="float64", timeout=60, seed=None):
    """Task 1a: dq, dk and dv of every rank equal torch autograd of one-process causal attention
    (float64: rtol 1e-9, atol 1e-11; float32: 1e-4, 1e-5), and on the same call no rank sends more
    than the ring's bytes: K, V (P - 1 times) and dK, dV (at most P times) of [B, H, T/P, d] each,
    (4P - 2) blocks, plus gloo's framing (a rank that gathers every rank's q, out and dout sends
    more). Returns the traffic."""
    case, results, expected, traffic, block = _backward_call(
        world, backward, batch, heads, chunk, head_dim, dtype, timeout, seed, "dq, dk, dv")
    rtol, atol = TOLERANCE[dtype]
    for rank, (got, want) in enumerate(zip(results, expected)):
        for key in ("dq", "dk", "dv"):
            checks.check(got[key].cpu(), want[key], f"rank {rank}'s {key}", rtol=rtol, atol=atol,
                         case=case, hint=_HINTS["dq" if key == "dq" else "dk"])
    P = world.size
    if world.backend == "gloo" and P > 1:
        limit = (4 * P - 2) * block + 2 * 8 * P * GLOO_BYTES_PER_MESSAGE + 1024
        for rank in range(P):
            if traffic.sent[rank] > limit:
                raise AssertionError(
                    f"rank {rank} sent {traffic.sent[rank]} bytes during the backward pass; the "
                    f"ring sends at most (4P - 2) = {4 * P - 2} blocks of {block} bytes (K and V "
                    f"P - 1 times, dK and dV at most P times) = {(4 * P - 2) * block} [{case}]. "
                    "Pass K, V and the dK, dV accumulators around the ring, one block a step: "
                    "gathering K and V (or q, out, dout) with collectives and reducing the "
                    "gradients with them sends more")
    return traffic


def check_ring_backward_traffic(world, backward, batch=1, heads=2, chunk=8, head_dim=16,
                                dtype="float64", timeout=60, seed=None):
    """Task 1b: a ring: every rank sends to one neighbour only (rank r + 1 on every rank, or
    r - 1 on every rank), between 4 (P - 1) blocks (K, V, dK, dV each P - 1 times) and 4P - 2
    (dK, dV once more), plus framing, and nothing to the others; on the same call every rank's dq
    (which needs every block of K and V) equals the reference. A direct exchange (each rank
    sends its K, V to every rank and the dK, dV parts straight to their owners) has the ring's
    total bytes at any P: only the pairs tell them apart, so P >= 3."""
    case, results, expected, traffic, block = _backward_call(
        world, backward, batch, heads, chunk, head_dim, dtype, timeout, seed, "the ring's bytes")
    rtol, atol = TOLERANCE[dtype]
    for rank, (got, want) in enumerate(zip(results, expected)):
        checks.check(got["dq"].cpu(), want["dq"], f"rank {rank}'s dq", rtol=rtol, atol=atol,
                     case=case, hint=_HINTS["dq"])
    P = world.size
    if world.backend != "gloo" or P == 1:
        print("check_ring_backward_traffic: bytes are counted on gloo's sockets only")
        return traffic
    framing = 2 * 8 * P * GLOO_BYTES_PER_MESSAGE + 1024
    low, high = 4 * (P - 1) * block, (4 * P - 2) * block + framing
    verdicts = {}
    for direction in (+1, -1):
        problems = []
        for r in range(P):
            for q in range(P):
                if q == r:
                    continue
                got = traffic.matrix[r][q]
                if q == (r + direction) % P:
                    if not low <= got <= high:
                        problems.append(f"rank {r} sent its neighbour {q} {got} bytes, expected "
                                        f"{low} (4 (P - 1) blocks of {block} bytes) to {high}")
                elif got > framing:
                    problems.append(f"rank {r} sent rank {q} {got} bytes; on a ring it sends "
                                    f"only to rank {(r + direction) % P}")
        verdicts[direction] = problems
    if verdicts[+1] and verdicts[-1]:
        best = min(verdicts.values(), key=len)
        raise AssertionError(
            f"the backward pass's traffic is not a ring's [{case}]: " + "; ".join(best[:4])
            + ". Each step, every rank sends the block it holds (K, V and the dK, dV accumulator "
            "of that block) to its next rank only, and receives the next block from its previous "
            "rank; the dK, dV parts are not sent straight to their owners")
    return traffic


# ---- task 2: Ulysses with grouped KV heads ------------------------------------------------------

_FRAMING = 16 * GLOO_BYTES_PER_MESSAGE   # a few all-to-alls' framing per pair, both ways


def _ulysses_case(case, P, batch, q_heads, kv_heads, chunk, head_dim, dtype, causal):
    B, T, d = batch, 2 * P * chunk, head_dim
    q = case.normal((B, q_heads, T, d), "float64")
    k, v = (case.normal((B, kv_heads, T, d), "float64") for _ in range(2))
    q, k, v = (t.to(getattr(torch, dtype)) for t in (q, k, v))
    expected = None
    if q_heads % kv_heads == 0:
        group = q_heads // kv_heads
        out, _ = context.attention(q.double(), k.double().repeat_interleave(group, dim=1),
                                   v.double().repeat_interleave(group, dim=1), causal)
        expected = [context.shard(out, P, r, balanced=True).to(q.dtype) for r in range(P)]
    shares = [{"rank": r, "causal": causal, "q": context.shard(q, P, r, balanced=True),
               "k": context.shard(k, P, r, balanced=True),
               "v": context.shard(v, P, r, balanced=True)} for r in range(P)]
    return shares, expected


def _ulysses_program(share, ulysses):
    out = ulysses(share["q"].clone(), share["k"].clone(), share["v"].clone(), share["causal"])
    if not isinstance(out, torch.Tensor) or out.shape != share["q"].shape:
        raise TypeError(f"rank {share['rank']}: ulysses_attention returned "
                        f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
                        f", expected a tensor of q's shape {tuple(share['q'].shape)}")
    return out.detach()


def _ulysses_refusal_program(share, ulysses):
    try:
        ulysses(share["q"].clone(), share["k"].clone(), share["v"].clone(), share["causal"])
    except ValueError as error:
        return {"raised": "ValueError", "message": str(error)}
    except Exception as error:                     # noqa: BLE001 - reported to the checker
        return {"raised": type(error).__name__, "message": str(error)[:300]}
    return {"raised": None, "message": ""}


def check_ulysses_refuses(world, ulysses, q_heads=None, kv_heads=None, batch=1, chunk=2,
                          head_dim=4, timeout=60, seed=None):
    """Task 2a: KV heads that P does not divide (while P divides the query heads) are refused
    with a ValueError on every rank whose message names the rank, the KV heads and P; and on the
    same ranks, first, a shape P divides is accepted (it returns an output of q's shape).
    Defaults: 5 KV heads (6 at P = 4), numbers no rank id can be mistaken for, and as query heads
    their least common multiple with P (so a check of the query heads alone does not refuse)."""
    P = world.size
    if kv_heads is None:
        kv_heads = 6 if P == 4 else 5
    if q_heads is None:
        q_heads = kv_heads * P // math.gcd(kv_heads, P)
    if kv_heads % P == 0 or q_heads % P or q_heads % kv_heads:
        raise ValueError(f"check_ulysses_refuses: need P ({P}) not dividing kv_heads "
                         f"({kv_heads}) but dividing q_heads ({q_heads}), a multiple of kv_heads")
    case = checks.Case(f"lab 10 task 2: Ulysses on {P} ranks refuses {kv_heads} KV heads "
                       f"({q_heads} query heads)", seed)
    ordinary, _ = _ulysses_case(case, P, batch, 2 * P, P, chunk, head_dim, "float64", False)
    try:
        results = world.run_each(_ulysses_program, ordinary, ulysses, timeout=timeout)
    except Exception as error:                     # noqa: BLE001 - a rank raised or hung
        raise AssertionError(
            f"[{case}] an ordinary input ({2 * P} query heads, {P} KV heads on {P} ranks) was "
            f"refused or failed before the uneven one was tried: {str(error).splitlines()[0]}; "
            f"raise only when P does not divide the KV heads") from None
    checks.one_result_per_rank(results, P, case, "ulysses_attention")
    bad, _ = _ulysses_case(case, P, batch, q_heads, kv_heads, chunk, head_dim, "float64", False)
    answers = world.run_each(_ulysses_refusal_program, bad, ulysses, timeout=timeout)
    checks.one_result_per_rank(answers, P, case, "ulysses_attention")
    for rank, answer in enumerate(answers):
        if answer["raised"] != "ValueError":
            what = ("returned" if answer["raised"] is None
                    else f"raised {answer['raised']} ({answer['message'][:120]})")
            raise AssertionError(
                f"[{case}] rank {rank} {what}; with {kv_heads} KV heads on {P} ranks every rank "
                f"should raise ValueError before any all-to-all: the heads cannot be scattered "
                f"evenly. Check the KV heads, not only the query heads ({q_heads}, which "
                f"{P} divides)")
        message = answer["message"]
        missing = [name for name, pattern in
                   (("the rank", rf"(?i)\brank\W{{0,3}}{rank}\b"), ("the KV heads", rf"\b{kv_heads}\b"),
                    ("P", rf"\b{P}\b")) if not re.search(pattern, message)]
        if missing:
            raise AssertionError(
                f"[{case}] rank {rank}'s ValueError does not name {', '.join(missing)}: "
                f"{message[:200]!r}. Say which rank, what was expected and what was received "
                f"(P = {P} must divide the {kv_heads} KV heads), and a fix")


def _ulysses_call(world, ulysses, q_heads, kv_heads, batch, chunk, head_dim, dtype, causal,
                  timeout, seed, what):
    P = world.size
    case = checks.Case(f"lab 10 task 2: {what} on {P} ranks, {q_heads} query heads, {kv_heads} "
                       f"KV heads, B={batch}, T={2 * P * chunk}, d={head_dim}, {dtype}, "
                       f"causal={causal}", seed)
    shares, expected = _ulysses_case(case, P, batch, q_heads, kv_heads, chunk, head_dim, dtype,
                                     causal)
    with world.traffic() as traffic:
        results = world.run_each(_ulysses_program, shares, ulysses, timeout=timeout)
    checks.one_result_per_rank(results, P, case, "ulysses_attention")
    rtol, atol = TOLERANCE[dtype]
    hint = ("scatter the heads and gather the sequence (all-to-all), attend over the whole "
            "sequence with the query heads of each KV head, and all-to-all back")
    if causal:
        hint += ("; the gathered sequence is in rank order, and each rank holds the tokens of "
                 "the balanced split (context.positions(T, P, rank, balanced=True)): the causal "
                 "mask needs those positions, not 0..T-1")
    for rank, got in enumerate(results):
        checks.check(got.cpu(), expected[rank], f"rank {rank}'s output", rtol=rtol, atol=atol,
                     case=case, hint=hint)
    unit = batch * chunk * 2 * head_dim * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    return case, traffic, unit          # unit: one head of a rank's T/P tokens, in bytes


def check_ulysses(world, ulysses, q_heads=None, kv_heads=None, batch=1, chunk=4, head_dim=32,
                  dtype="float64", timeout=60, seed=None):
    """Task 2b: causal attention over the balanced split with grouped KV heads (q head h uses KV
    head h // (Hq / Hkv)) equals one process; on the same call no rank sends another rank 0.9 of
    its whole q, k and v or more, beyond framing (gathering every rank's inputs is not Ulysses;
    at the defaults, Hkv = P and Hq = 2P, Ulysses sends 1/2 of it at P = 3 and 3/8 at P = 4)."""
    P = world.size
    kv_heads = P if kv_heads is None else kv_heads
    q_heads = 2 * kv_heads if q_heads is None else q_heads
    case, traffic, unit = _ulysses_call(world, ulysses, q_heads, kv_heads, batch, chunk,
                                        head_dim, dtype, True, timeout, seed, "values")
    whole = (q_heads + 2 * kv_heads) * unit
    if world.backend == "gloo":
        for r in range(P):
            for q in range(P):
                if q != r and traffic.matrix[r][q] - _FRAMING >= 0.9 * whole:
                    raise AssertionError(
                        f"rank {r} sent rank {q} {traffic.matrix[r][q]} bytes, as much as its "
                        f"whole q, k and v ({whole} bytes) [{case}]: Ulysses sends each rank only "
                        f"its heads of this rank's tokens")
    return traffic


def ulysses_pair_bytes(q_heads, kv_heads, P, unit):
    """Bytes rank r sends rank q in Ulysses: its tokens of q's share of the heads, q, k and v
    (Hq/P + 2 Hkv/P heads) going, and of the output (Hq/P) coming back: (2 Hq + 2 Hkv) / P heads
    of `unit` bytes (one head of T/P tokens). K and V travel with Hkv heads, not expanded."""
    return (2 * q_heads + 2 * kv_heads) // P * unit


def check_ulysses_traffic(world, ulysses, q_heads=None, kv_heads=None, batch=1, chunk=4,
                          head_dim=16, dtype="float64", timeout=60, seed=None):
    """Task 2c: on a non-causal call whose values are checked, rank r sends rank q exactly
    (2 Hq + 2 Hkv) / P heads of its T/P tokens (`ulysses_pair_bytes`) plus framing: K and V sent
    with Hkv heads (expanded to Hq first they cost 4 Hq / P), no all-gather of K and V (2 Hkv,
    Llama 3's all-gather context parallelism, another algorithm). Defaults Hkv = P (4 at
    P = 2), Hq = 4 Hkv: the three differ at every P."""
    P = world.size
    kv_heads = (P if P > 2 else 4) if kv_heads is None else kv_heads
    q_heads = 4 * kv_heads if q_heads is None else q_heads
    case, traffic, unit = _ulysses_call(world, ulysses, q_heads, kv_heads, batch, chunk,
                                        head_dim, dtype, False, timeout, seed, "bytes")
    if world.backend != "gloo":
        print("check_ulysses_traffic: bytes are counted on gloo's sockets only")
        return traffic
    pair = ulysses_pair_bytes(q_heads, kv_heads, P, unit)
    data = [[0 if r == q else pair for q in range(P)] for r in range(P)]
    checks.expect_traffic(traffic, data, messages=[[8] * P for _ in range(P)], case=case,
                          what="ulysses_attention",
                          hint=f"each pair carries (2 Hq + 2 Hkv) / P = {(2 * q_heads + 2 * kv_heads) // P} "
                               f"heads of {unit} bytes: q, k, v of the receiver's heads going, "
                               "the output coming back. Send K and V with their Hkv heads and "
                               "expand them to the query heads after the all-to-all")
    return traffic


# ---- task 3: a dp x cp x tp x pp configuration's bytes and memory --------------------------------

LAB = "lab10_long_sequences"


def _expected_step(model, config, global_batch, recompute):
    """The reference's prediction (with the grader) or the visible case's released value. At
    cp = 1 it is chapter 6's model itself (`labkit.mesh.cost`), computed here."""
    import dataclasses
    from labkit import released
    from labkit.mesh import cost
    if config["cp"] == 1:
        plain = {k: config[k] for k in ("dp", "tp", "pp", "zero_stage", "microbatches")}
        sent = cost.axis_bytes(model, plain, global_batch, recompute)
        return {"bytes": {"dp": float(sent["dp"]), "cp": 0.0, "tp": float(sent["tp"]),
                          "pp": float(sent["pp"])},
                "memory": float(cost.memory(model, plain, global_batch, recompute)["peak"])}
    as_dict = dataclasses.asdict(model)
    reference = released.reference("context")
    if reference is not None:
        return reference.expected(as_dict, dict(config), global_batch, recompute)
    return released.value(LAB, "predict", released.key(as_dict, dict(config), global_batch,
                                                       recompute))


def _predicted(fn, model, config, global_batch, recompute):
    got = fn(model, dict(config), global_batch, recompute)
    what = f"predict_cp_step({model.name!r}, {config}, {global_batch}, {recompute!r})"
    if not (isinstance(got, dict) and isinstance(got.get("bytes"), dict) and "memory" in got):
        raise AssertionError(f"{what} should return {{'bytes': {{'dp', 'cp', 'tp', 'pp'}}, "
                             f"'memory': ...}}, got {got!r:.200}")
    if set(got["bytes"]) != {"dp", "cp", "tp", "pp"}:
        raise AssertionError(f"{what}['bytes'] should have the keys dp, cp, tp, pp; got "
                             f"{sorted(got['bytes'])}")
    return got, what


_STEP_HINTS = {
    "dp": "the gradient is reduced over every rank that holds the same weights: the dp ranks "
          "and the cp ranks of each (they saw different tokens of the same sequences)",
    "cp": "per layer of the stage and microbatch: each forward sends K and V of the other "
          "cp - 1 blocks, the backward K and V again and dK, dV; a block is "
          "[b, s/cp, h/tp] in 2 bytes; full recomputation runs the forward twice",
    "tp": "tensor parallelism moves [b, s/cp, h] activations: chapter 6's tp bytes at s/cp",
    "pp": "the pipeline sends [b, s/cp, h] activations: chapter 6's pp bytes at s/cp",
    "memory": "chapter 3's ledger (memory.ledger.per_rank_ledger) at s/cp tokens a rank, with "
              "the optimizer states sharded over the dp x cp ranks that hold the same weights",
}


def check_cp_bytes(fn, model, config, global_batch, recompute="full"):
    """Task 3a: the bytes one rank sends per step on each axis (rel 1e-9)."""
    got, what = _predicted(fn, model, config, global_batch, recompute)
    want = _expected_step(model, config, global_batch, recompute)
    for axis in ("dp", "cp", "tp", "pp"):
        checks.check(float(got["bytes"][axis]), want["bytes"][axis], f"{what}['bytes'][{axis!r}]",
                     rtol=1e-9, atol=1e-6, hint=_STEP_HINTS[axis])


def check_cp_memory(fn, model, config, global_batch, recompute="full"):
    """Task 3b: a rank's peak memory (chapter 3's ledger at s/cp, ZeRO over dp x cp; rel 1e-9)."""
    got, what = _predicted(fn, model, config, global_batch, recompute)
    want = _expected_step(model, config, global_batch, recompute)
    checks.check(float(got["memory"]), want["memory"], f"{what}['memory']", rtol=1e-9, atol=1e-3,
                 hint=_STEP_HINTS["memory"])
