"""Checkers of lab 4, task 2: grouped-query attention under tensor parallelism, any t | heads.

    check_gqa_placement(gqa_placement, 12, 4, 3)                  # which heads each rank holds
    check_gqa_attention(world, tp_gqa_attention, 12, 3)           # values and gradients
    check_gqa_traffic(world, tp_gqa_attention, 12, 3)             # bytes per pair, each phase

The placement the ranks are handed comes from the grader's reference (labkit.grading.references
.tensor_parallel) or, in the student copy, from the visible cases in expected.json: a mistake in
`gqa_placement` costs only its own cell. Each rank is sent only its slices of the weights (its
query heads' rows of q, the rows of the kv heads they read, its columns of o), x and dy; the
expected values are computed here from the full tensors. Each call runs two training steps
(a process group is made in the first and kept) and judges the second, counted from outside the
ranks on a world without teaching mode (its checks are collectives too), per pair and per phase
(marks after the first step and between the second's forward and backward).
"""
from __future__ import annotations

import re

import torch

from labkit import checks, released
from labkit.collectives import GLOO_FRAMING_BYTES
from labkit.tensor_parallel import gqa
from labkit.tensor_parallel.checks import _TOLERANCES, AFTER_FORWARD

LAB = "lab04_tensor_parallel"
BENCH = dict(hidden=64, head_dim=8)          # kv heads of 2 d (H + 1) = 1040 values: above framing
SLACK = 256                                  # stray acknowledgements, chunks rounded to an element
OUTSIDE_AFTER_FIRST_STEP = 256               # groups are made once, not every step


def _expected_placement(sizes: tuple):
    """The grader's placement for sizes = (heads, kv_heads, tp), or a visible case's from
    expected.json in the student copy (the ValueError's text where none exists)."""
    reference = released.reference("tensor_parallel")
    if reference is not None:
        return reference.placement(*sizes)
    return released.value(LAB, "gqa_placement", released.key(*sizes))


def _plain(layout):
    """[[q heads], [kv heads]] per rank as lists of ints, or None if it is not that shape."""
    try:
        return [[[int(h) for h in q], [int(h) for h in kv]] for q, kv in layout]
    except (TypeError, ValueError):
        return None


# ---- the placement (pure) -------------------------------------------------------------------------

def check_gqa_placement(fn, heads, kv_heads, tp):
    """gqa_placement(heads, kv_heads, tp): rank r's query heads [r heads/t, (r+1) heads/t) and the
    kv heads they read (query head i reads i // (heads / kv_heads)), ascending; a ValueError naming
    the sizes where no placement exists (t does not divide the query heads, or the kv heads do not
    divide them)."""
    want = _expected_placement((heads, kv_heads, tp))
    call = f"gqa_placement({heads}, {kv_heads}, {tp})"
    if isinstance(want, str):                                  # impossible: a clear refusal
        try:
            got = fn(heads, kv_heads, tp)
        except ValueError as error:
            missing = [n for n in re.findall(r"-?\d+", want) if n not in str(error)]
            if missing:
                raise AssertionError(f"{call} raised ValueError({str(error)!r}); name the sizes "
                                     f"that do not fit ({want})") from None
            return
        except Exception as error:  # noqa: BLE001 -- the type is the answer
            raise AssertionError(f"{call} raised {type(error).__name__}: {error}; expected a "
                                 f"ValueError: {want}") from None
        raise AssertionError(f"{call} returned {got!r}; expected a ValueError: {want}")
    try:
        got = fn(heads, kv_heads, tp)
    except Exception as error:  # noqa: BLE001
        raise AssertionError(f"{call} raised {type(error).__name__}: {error}; this configuration "
                             "exists: t divides the query heads, and each rank holds the kv heads "
                             "its query heads read (some kv heads on several ranks)") from None
    plain = _plain(got) if isinstance(got, (list, tuple)) else None
    if plain != want:
        group = heads // kv_heads
        raise AssertionError(
            f"{call} returned {got!r}; expected {want}: rank r holds query heads "
            f"[r * {heads // tp}, (r+1) * {heads // tp}) and the kv heads they read, ascending; "
            f"query head i reads kv head i // {group} (groups of {group} consecutive query heads, "
            "as Llama's repeat_kv)")


# ---- the attention on ranks ----------------------------------------------------------------------

def _local(full, layout, rank, head_dim):
    """Rank `rank`'s slices of the full tensors (or of their gradients), by the placement."""
    queries, kvs = layout[rank]
    q = slice(queries[0] * head_dim, (queries[-1] + 1) * head_dim)
    kv = slice(kvs[0] * head_dim, (kvs[-1] + 1) * head_dim)
    return {"q.weight": full["q.weight"][q], "q.bias": full["q.bias"][q],
            "k.weight": full["k.weight"][kv], "k.bias": full["k.bias"][kv],
            "v.weight": full["v.weight"][kv], "v.bias": full["v.bias"][kv],
            "o.weight": full["o.weight"][:, q], "o.bias": full["o.bias"]}


FIRST_STEP = "lab 4, task 2: the first step done"     # process groups are made in it


def _run_gqa(share, fn):
    """On a rank: two training steps in one call (a process group made in the first is kept for
    the second), a mark after the first and one between the second's forward and backward."""
    import labkit
    device = labkit.device()
    x = share["x"].to(device)
    for step in (1, 2):
        local = {k: v.clone().to(device).requires_grad_(True) for k, v in share["local"].items()}
        x = x.detach().requires_grad_(True)
        y = fn(local, x, share["placement"])
        if step == 2:
            labkit.mark(AFTER_FORWARD)
        y.backward(share["dy"].to(device))
        if step == 1:
            labkit.mark(FIRST_STEP)
    return {"y": y.detach(), "dx": x.grad, "grads": {k: v.grad for k, v in local.items()}}


def _gqa_case(what, tp, heads, kv_heads, batch, seq, dtype, hidden, head_dim):
    layout = _expected_placement((heads, kv_heads, tp))
    if isinstance(layout, str):
        raise ValueError(f"the checker's case has no placement: {layout}")
    case = checks.Case(what)
    params = gqa.random_params(case.generator, hidden, heads, kv_heads, head_dim,
                               dtype=getattr(torch, dtype))
    x = case.normal((batch, seq, hidden), dtype)                           # [B, T, H]
    dy = case.normal((batch, seq, hidden), dtype)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    x_ref = x.clone().requires_grad_(True)
    y = gqa.attention_reference(leaves, x_ref, heads, kv_heads)
    y.backward(dy)
    grads = {k: v.grad for k, v in leaves.items()}
    shares = [{"local": {k: v.clone() for k, v in _local(params, layout, r, head_dim).items()},
               "x": x, "dy": dy, "placement": layout} for r in range(tp)]
    expected = [_local(grads, layout, r, head_dim) for r in range(tp)]
    holders = [[r for r, (_, kv) in enumerate(layout) if j in kv] for j in range(kv_heads)]
    return case, layout, holders, shares, y.detach(), x_ref.grad, expected


def _compare(results, y, dx, expected, holders, case, dtype):
    checks.one_result_per_rank(results, len(expected), case, "tp_gqa_attention")
    tol = _TOLERANCES[dtype]
    for rank, got in enumerate(results):
        checks.check(got["y"], y, f"rank {rank}'s output", case=case, **tol,
                     hint="every rank holds the whole output: each query head attends with the kv "
                          "head it reads (query head i: kv head i // (heads / kv_heads)), o's "
                          "partial products summed by one all-reduce (g), o's bias added once")
        checks.check(got["dx"], dx, f"rank {rank}'s input gradient", case=case, **tol,
                     hint="x.grad needs one all-reduce in backward before q, k and v (Megatron's "
                          "f): each rank holds the share of its own heads")
        for name, want in expected[rank].items():
            grad = got["grads"].get(name)
            if grad is None:
                raise AssertionError(f"rank {rank}: {name} got no gradient [{case}]: use every "
                                     "tensor of `local`")
            shared = [j for j, ranks in enumerate(holders) if rank in ranks and len(ranks) > 1]
            hint = "the gradient of a slice is that slice of the full gradient"
            if name in gqa.KV_NAMES and shared:
                hint = (f"this rank shares kv heads {shared} with other ranks: each holder's "
                        "gradient is only its own query heads' share; sum it over exactly the "
                        "ranks that hold the head (one all-reduce per shared head), in backward")
            checks.check(grad, want, f"rank {rank}'s gradient of {name}", case=case, **tol,
                         hint=hint)


def _rounds(world, fn, shares, timeout):
    """Both steps in one call, counted; the second is judged."""
    with world.traffic() as traffic:
        results = world.run_each(_run_gqa, shares, fn, timeout=timeout)
    return results, traffic


def _phases(traffic):
    """The second step's forward and backward: {phase: ([tp][tp] matrix, [tp] outside)}."""
    marks = [traffic.marks.get(label) for label in (FIRST_STEP, AFTER_FORWARD)]
    if any(m is None for m in marks):
        raise AssertionError("the call ended without reaching the checker's marks between the "
                             "steps and between forward and backward; expected the checker's own "
                             "program to run")
    first, middle = marks
    ends = [first, middle, {"matrix": traffic.matrix, "outside": traffic.outside}]
    size = traffic.size
    out = {}
    for phase, (a, b) in zip(("forward", "backward"), zip(ends, ends[1:])):
        out[phase] = ([[b["matrix"][r][q] - a["matrix"][r][q] for q in range(size)]
                       for r in range(size)],
                      [b["outside"][r] - a["outside"][r] for r in range(size)])
    return out


def check_gqa_attention(world, fn, heads, kv_heads, batch=2, seq=5, dtype="float64", timeout=60,
                        hidden=BENCH["hidden"], head_dim=BENCH["head_dim"]):
    """tp_gqa_attention equals gqa.attention_reference, output, x.grad and every local gradient
    (a shared kv head's: the full gradient's rows), computed from the slices: on the same call,
    each rank sends in forward at least g's all-reduce of [B, T, H] and at most three times it, in
    backward at least f's and at most three times f's plus every kv gradient all-reduced over the
    whole world (a rank that gathers the weights and computes the whole attention sends the
    weights in forward, and nothing in backward). Which pairs carry what is check_gqa_traffic's."""
    tp = world.size
    case, layout, holders, shares, y, dx, expected = _gqa_case(
        f"GQA attention, {heads} query heads, {kv_heads} kv heads, H={hidden}, d={head_dim} on "
        f"{tp} ranks, {dtype}", tp, heads, kv_heads, batch, seq, dtype, hidden, head_dim)
    results, traffic = _rounds(world, fn, shares, timeout)
    _compare(results, y, dx, expected, holders, case, dtype)
    if tp == 1:
        return
    itemsize = y.element_size()
    n = y.numel() * itemsize
    ring = 2 * (tp - 1) / tp * n
    padded = 2 * (tp - 1) / tp * kv_heads * gqa.kv_head_bytes(hidden, head_dim, itemsize)
    framing = GLOO_FRAMING_BYTES * 4 * (tp - 1) * (2 + 4 * kv_heads) + 2 * SLACK
    phases = _phases(traffic)
    for rank in range(tp):
        for phase, low, high in (("forward", ring, 3 * ring), ("backward", ring,
                                                                3 * (ring + padded))):
            sent = sum(phases[phase][0][rank])
            if not 0.99 * low - SLACK <= sent <= high + framing:
                raise AssertionError(
                    f"rank {rank} sent {sent} bytes to the other ranks in {phase} [{case}]; "
                    f"expected {low:.0f} to {high:.0f} bytes of data (up to {high + framing:.0f} "
                    "with gloo's framing): one all-reduce of the [B, T, H] activation each way "
                    f"(g in forward, f in backward) sends {ring:.0f}; gathering the weights and "
                    "computing the whole attention sends the weights in forward and nothing in "
                    "backward")
        outside = phases["forward"][1][rank] + phases["backward"][1][rank]
        if outside > 16 * 1024:
            raise AssertionError(f"rank {rank} sent {outside} bytes to something "
                                 f"other than a rank [{case}]: compute from the slices, between "
                                 "the ranks")


def check_gqa_traffic(world, fn, heads, kv_heads, batch=2, seq=16, dtype="float64", timeout=60,
                      hidden=BENCH["hidden"], head_dim=BENCH["head_dim"]):
    """The bytes every rank sends every other rank, forward and backward apart, equal
    gqa.pair_bytes: g's all-reduce of [B, T, H] in forward; f's in backward and one all-reduce of
    each shared kv head's gradient over exactly its holders (gloo's ring: 2(s-1)/s of the head's
    2 d (H+1) values to the previous holder), within GLOO_FRAMING_BYTES per message (up to
    4(s-1) messages per all-reduce, up to four all-reduces per shared head: k and v, weight and
    bias apart or packed) and SLACK. Nothing to the store after the first step (groups made
    once). Values are judged on the same call."""
    tp = world.size
    case, layout, holders, shares, y, dx, expected = _gqa_case(
        f"traffic of GQA attention, {heads} query heads, {kv_heads} kv heads, H={hidden}, "
        f"d={head_dim} on {tp} ranks, {dtype}", tp, heads, kv_heads, batch, seq, dtype, hidden,
        head_dim)
    results, traffic = _rounds(world, fn, shares, timeout)
    _compare(results, y, dx, expected, holders, case, dtype)
    if tp == 1:
        return
    itemsize = y.element_size()
    shared = [ranks for ranks in holders if len(ranks) > 1]
    phases = _phases(traffic)
    problems = []
    for phase in ("forward", "backward"):
        want = gqa.pair_bytes(batch, seq, hidden, head_dim, holders, tp, itemsize, phase=phase)
        messages = [[0] * tp for _ in range(tp)]              # the most each pair may carry
        rings = [(list(range(tp)), 1)] + ([(ranks, 4) for ranks in shared]
                                          if phase == "backward" else [])
        for members, count in rings:
            s = len(members)
            for i, rank in enumerate(members):
                messages[rank][members[i - 1]] += count * 4 * (s - 1)
        for r in range(tp):
            for q in range(tp):
                if r == q:
                    continue
                got, data = phases[phase][0][r][q], want[r][q]
                high = data + GLOO_FRAMING_BYTES * (messages[r][q] + messages[q][r]) + SLACK
                if not data - SLACK <= got <= high:
                    problems.append(f"{phase}: rank {r} sent {got} bytes to rank {q}, expected "
                                    f"{data:.0f} of data (at most {high:.0f} with framing)")
    for rank in range(tp):
        outside = phases["forward"][1][rank] + phases["backward"][1][rank]
        if outside > OUTSIDE_AFTER_FIRST_STEP:
            problems.append(f"rank {rank} sent {outside} bytes to the store (or something else "
                            "that is not a rank) in the second step: make each process group "
                            "once (dist.new_group, in the first step) and keep it")
    if problems:
        groups = {j: ranks for j, ranks in enumerate(holders) if len(ranks) > 1}
        raise AssertionError(
            f"the traffic of tp_gqa_attention is not Megatron's plus the replica sums [{case}]: "
            + "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4
                                         else "")
            + f". Expected: forward, one all-reduce of [B, T, H] over all {tp} ranks (g); "
            "backward, one over all ranks (f) and, for each shared kv head, one all-reduce of its "
            f"gradient over exactly the ranks that hold it (here {groups or 'none'}), nothing of "
            "the other kv heads, nothing over the whole world")
