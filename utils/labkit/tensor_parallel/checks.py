"""Checkers of lab 4 (tensor parallelism): the lab's test cells and tests/chapters call these.

    check_column_parallel(world, ColumnParallelLinear, 10, 36, gather_output=True)
    check_row_parallel(world, RowParallelLinear, 36, 10, input_is_parallel=False)
    gqa_checks.check_gqa_placement(gqa_placement, 12, 4, 3)    # task 2 (labkit.tensor_parallel
    gqa_checks.check_gqa_attention(world, tp_gqa_attention, 12, 3)  # .gqa_checks)
    check_vocab_cross_entropy(world, vocab_parallel_cross_entropy, tokens=96, vocab=50)
    check_vocab_traffic(world, vocab_parallel_cross_entropy)  # bytes grow with N, not with V

Every case is drawn fresh (labkit.checks.Case; its seed is in every failure). Each rank is sent only
what it would hold in a tensor-parallel job: its slice of the weights, of the logits, of the
upstream gradient; expected values are computed here from the full tensors, never on a rank.
Bytes are counted from outside the ranks (world.traffic()) on every call whose values are judged,
forward and backward apart (a mark between them): values computed another way (the whole weight
gathered and the dense product taken, the logits gathered) fail on the wire of that same call,
whatever its shape. The trace is used only to word hints.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit import checks
from labkit import tensor_parallel as tpk

# Bytes a rank sends per collective besides the data, per peer (t - 1 of them), measured with
# world.traffic() on gloo: a ring all-reduce's 2(t-1) messages carry 288 B of headers and
# acknowledgements each, 576 B per peer; in teaching mode (TORCH_DISTRIBUTED_DEBUG=DETAIL) the
# fingerprint check before each collective adds ~800 B more per peer (1364 B at t = 2 in all).
FRAMING_PER_PEER = 1500
# float32 sums over a few hundred terms drift by ~1e-6 relative; every mistake named in the lab is
# off by far more than these (a missing all-reduce, a bias added t times: O(1) relative errors)
_TOLERANCES = {"float64": dict(rtol=1e-10, atol=1e-12), "float32": dict(rtol=1e-4, atol=1e-5)}


def _slices(size, tp):
    step = size // tp
    return [slice(r * step, (r + 1) * step) for r in range(tp)]


def _close(a, b, dtype):
    return a is not None and a.shape == b.shape and torch.allclose(a.to(b.dtype), b,
                                                                   **_TOLERANCES[dtype])


AFTER_FORWARD = "lab 4: forward done, backward next"     # the mark between the two phases


def _phases(traffic, rank):
    """(forward, backward) bytes rank `rank` sent in a call that marked AFTER_FORWARD."""
    at_mark = traffic.marks.get(AFTER_FORWARD, {}).get("sent")
    if at_mark is None:
        raise AssertionError(f"rank {rank}: the call ended without reaching its mark between "
                             "forward and backward; expected the checker's own program to run")
    return at_mark[rank], traffic.sent[rank] - at_mark[rank]


def _judge_phases(traffic, case, what, phases, hint, ops=None):
    """Each rank's bytes per phase within [0.99 data, data + framing of `collectives`]:
    phases = {"forward": (data_bytes, collectives[, most_data_bytes]), "backward": (...)}. A
    phase without a collective may send at most 512 B (nothing but stray acknowledgements)."""
    tp = traffic.size
    for rank in range(tp):
        forward, backward = _phases(traffic, rank)
        for phase, sent in (("forward", forward), ("backward", backward)):
            data, collectives, most = (*phases[phase], None)[:3]
            high = ((data if most is None else most)
                    + collectives * (tp - 1) * FRAMING_PER_PEER + 512)
            if not 0.99 * data <= sent <= high:
                called = f"; the rank called {ops(rank)}" if ops is not None else ""
                wanted = (f"{data:.0f} bytes of data" if most is None else
                          f"{data:.0f} to {most:.0f} bytes of data")
                raise AssertionError(
                    f"rank {rank} sent {sent} bytes in {what}'s {phase}; expected {wanted} (up "
                    f"to {high:.0f} with headers) [{case}]{called}; {hint(phase, sent, data)}")


# ---- task 1: column- and row-parallel linear layers ---------------------------------------------

def _run_linear(share, layer_cls, kind, in_features, out_features, option, bias, dtype):
    """On a rank: build the layer, load this rank's weight slice, forward and backward."""
    torch_dtype = getattr(torch, dtype)
    option_name = "gather_output" if kind == "column" else "input_is_parallel"
    layer = layer_cls(in_features, out_features, bias=bias, dtype=torch_dtype,
                      **{option_name: option})
    weight, layer_bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    shapes = {"weight": None if weight is None else tuple(weight.shape),
              "bias": None if layer_bias is None else tuple(layer_bias.shape),
              "dtype": None if weight is None else str(weight.dtype).replace("torch.", "")}
    wanted = {"weight": tuple(share["weight"].shape),
              "bias": tuple(share["bias"].shape) if bias else None, "dtype": dtype}
    if shapes != wanted:
        return {"shapes": shapes}
    with torch.no_grad():
        weight.copy_(share["weight"])
        if bias:
            layer_bias.copy_(share["bias"])
    import labkit
    x = share["x"].to(labkit.device()).requires_grad_(True)
    y = layer(x)
    labkit.mark(AFTER_FORWARD)
    y.backward(share["dy"].to(labkit.device()))
    return {"shapes": shapes, "y": y.detach(), "dx": x.grad,
            "dweight": weight.grad, "dbias": layer_bias.grad if bias else None}


def _linear_case(what, in_features, out_features, dtype, batch_shape, bias):
    case = checks.Case(what)
    W = case.normal((out_features, in_features), dtype, scale=in_features ** -0.5)   # [out, in]
    b = case.normal((out_features,), dtype) if bias else None
    x = case.normal((*batch_shape, in_features), dtype)                               # [..., in]
    dy = case.normal((*batch_shape, out_features), dtype)                             # [..., out]
    y = x @ W.T + (b if bias else 0)
    flat_dy, flat_x = dy.reshape(-1, out_features), x.reshape(-1, in_features)
    full = {"y": y, "dx": dy @ W, "dweight": flat_dy.T @ flat_x,
            "dbias": flat_dy.sum(0) if bias else None}
    return case, W, b, x, dy, full


def _compare_linear(results, expected, case, dtype, hints):
    checks.one_result_per_rank(results, len(expected), case)
    for rank, (got, want) in enumerate(zip(results, expected)):
        if got["shapes"] != want["shapes"]:
            raise AssertionError(
                f"rank {rank}: the layer's parameters are {got['shapes']}, expected "
                f"{want['shapes']} [{case}]; keep only this rank's slice of the weight, as a "
                "parameter named `weight` (and `bias`, or None when bias=False), in `dtype`")
        for key in ("y", "dx", "dweight", "dbias"):
            if want[key] is None:
                continue
            if not _close(got[key], want[key], dtype):
                hint = hints(rank, key, got[key])
                checks.check(got[key], want[key], f"rank {rank}'s {_NAMES[key]}", case=case,
                             hint=hint, **_TOLERANCES[dtype])


_NAMES = {"y": "output", "dx": "input gradient (x.grad)", "dweight": "weight gradient",
          "dbias": "bias gradient"}


def _check_divisibility(world, layer_cls, kind, in_features, out_features, timeout):
    """A size that tp does not divide must raise ValueError on every rank, naming the size."""
    if world.size == 1:
        return
    split = out_features if kind == "column" else in_features
    bad = split * world.size + 1                      # never divisible by world.size > 1
    sizes = (in_features, bad) if kind == "column" else (bad, out_features)
    outcomes = world.run_each(_try_construct, [None] * world.size, layer_cls, kind, *sizes,
                              timeout=timeout)
    for rank, (kind_of_error, message) in enumerate(outcomes):
        if kind_of_error != "ValueError" or str(bad) not in message:
            raise AssertionError(
                f"rank {rank}: a {kind}-parallel layer with {'out' if kind == 'column' else 'in'}"
                f"_features={bad} on tp={world.size} ranks should raise ValueError naming {bad}; "
                f"got {kind_of_error or 'no error'}{': ' + message if message else ''}")


def _try_construct(_share, layer_cls, kind, in_features, out_features):
    option = {"gather_output": True} if kind == "column" else {"input_is_parallel": False}
    try:
        layer_cls(in_features, out_features, **option)
    except Exception as error:  # noqa: BLE001 -- the type is the answer
        return type(error).__name__, str(error)[:300]
    return None, ""


def check_column_parallel(world, layer_cls, in_features, out_features, gather_output=True,
                          bias=True, dtype="float64", batch_shape=(3, 4), timeout=30):
    """ColumnParallelLinear: W [out, in] split by rows; output gathered or kept [..., out/t]."""
    tp = world.size
    if out_features % tp:
        raise ValueError(f"check_column_parallel: out_features ({out_features}) must be divisible "
                         f"by the world size ({tp})")
    case, W, b, x, dy, full = _linear_case(
        f"ColumnParallelLinear({in_features}, {out_features}, gather_output={gather_output}, "
        f"bias={bias}, {dtype}) on {tp} ranks", in_features, out_features, dtype, batch_shape, bias)
    shares, expected = [], []
    for rows in _slices(out_features, tp):
        shares.append({"weight": W[rows].clone(), "bias": b[rows].clone() if bias else None,
                       "x": x, "dy": dy if gather_output else dy[..., rows].clone()})
        expected.append({"shapes": {"weight": (out_features // tp, in_features), "dtype": dtype,
                                    "bias": (out_features // tp,) if bias else None},
                         "y": full["y"] if gather_output else full["y"][..., rows],
                         "dx": full["dx"], "dweight": full["dweight"][rows],
                         "dbias": full["dbias"][rows] if bias else None})

    def hints(rank, key, got):
        rows = _slices(out_features, tp)[rank]
        if key == "dx" and got is not None and _close(got, dy[..., rows] @ W[rows], dtype) \
                and tp > 1:
            return ("the input gradient is only this rank's share, dy_r W_r: the backward of the "
                    "layer's input must all-reduce it (Megatron's f: identity forward, all-reduce "
                    "backward)")
        if key == "y":
            return ("the output pieces are [..., out/t] column blocks: join them along the last "
                    "dim, in rank order (all_gather_into_tensor joins along dim 0)"
                    if gather_output else "this rank's output is x W_r^T + b_r, its own columns")
        if key == "dweight" and got is not None and tp > 1 and _close(got, tp * expected[rank][key],
                                                                          dtype):
            return "the weight gradient is t times too large: is the output gradient summed?"
        return "compare with a single nn.Linear holding the full weight"

    with world.tracing() as trace, world.traffic() as traffic:
        results = world.run_each(_run_linear, shares, layer_cls, "column", in_features,
                                 out_features, gather_output, bias, dtype, timeout=timeout)
    _compare_linear(results, expected, case, dtype, hints)
    if tp > 1:
        y_bytes, x_bytes = full["y"].numel() * x.element_size(), x.numel() * x.element_size()
        phases = {"forward": (tpk.all_gather_bytes(y_bytes, tp), 1) if gather_output else (0, 0),
                  "backward": (tpk.all_reduce_bytes(x_bytes, tp), 1)}

        def wire_hint(phase, sent, data):
            if phase == "forward" and not gather_output:
                return ("with gather_output=False the forward is local: f is the identity, "
                        "y_r = x W_r^T + b_r; nothing is sent (no weight gathered)")
            if phase == "forward":
                return ("the forward sends one all-gather of the [..., out/t] outputs: the layer "
                        "works on its own rows of W, it never gathers the weight")
            return ("the backward sends one all-reduce of x.grad's shares dy_r W_r (Megatron's "
                    "f); a layer that computes the dense x.grad from a gathered weight sends "
                    "nothing here")

        _judge_phases(traffic, case, f"ColumnParallelLinear(gather_output={gather_output})",
                      phases, wire_hint, ops=lambda r: [e["op"] for e in trace.ops(r)])
    _check_divisibility(world, layer_cls, "column", in_features, out_features, timeout)


def check_row_parallel(world, layer_cls, in_features, out_features, input_is_parallel=False,
                       bias=True, dtype="float64", batch_shape=(3, 4), timeout=30):
    """RowParallelLinear: W [out, in] split by columns; the partial outputs all-reduced; the bias
    added once; the input either already split ([..., in/t]) or split by the layer."""
    tp = world.size
    if in_features % tp:
        raise ValueError(f"check_row_parallel: in_features ({in_features}) must be divisible by "
                         f"the world size ({tp})")
    case, W, b, x, dy, full = _linear_case(
        f"RowParallelLinear({in_features}, {out_features}, input_is_parallel={input_is_parallel}, "
        f"bias={bias}, {dtype}) on {tp} ranks", in_features, out_features, dtype, batch_shape, bias)
    shares, expected = [], []
    for cols in _slices(in_features, tp):
        shares.append({"weight": W[:, cols].clone(), "bias": b.clone() if bias else None,
                       "x": x[..., cols].clone() if input_is_parallel else x, "dy": dy})
        expected.append({"shapes": {"weight": (out_features, in_features // tp),
                                    "bias": (out_features,) if bias else None, "dtype": dtype},
                         "y": full["y"], "dx": full["dx"][..., cols] if input_is_parallel
                         else full["dx"], "dweight": full["dweight"][:, cols],
                         "dbias": full["dbias"] if bias else None})

    def hints(rank, key, got):
        cols = _slices(in_features, tp)[rank]
        if key == "y" and bias and got is not None and tp > 1 and _close(
                got, full["y"] + (tp - 1) * b, dtype):
            return ("the output holds the bias t times: add the bias once, after the all-reduce, "
                    "not to every rank's partial sum")
        if key == "y" and got is not None and _close(got, x[..., cols] @ W[:, cols].T + (
                b if bias else 0), dtype) and tp > 1:
            return "the partial products of the ranks must be summed: an all-reduce (Megatron's g)"
        if key == "dx" and not input_is_parallel and got is not None and tp > 1:
            own = torch.zeros_like(full["dx"])
            own[..., cols] = full["dx"][..., cols]
            if _close(got, own, dtype):
                return ("x.grad is right in this rank's columns and zero elsewhere: when the layer "
                        "splits a replicated input, the backward of that split must gather (or "
                        "all-reduce) the input gradient, or the layers below see only a share")
        if key == "y":
            return ("rank r multiplies its columns x[..., r*in/t:(r+1)*in/t] by W_r: [out, in/t]; "
                    "check which size the split uses")
        return "compare with a single nn.Linear holding the full weight"

    with world.tracing() as trace, world.traffic() as traffic:
        results = world.run_each(_run_linear, shares, layer_cls, "row", in_features,
                                 out_features, input_is_parallel, bias, dtype, timeout=timeout)
    _compare_linear(results, expected, case, dtype, hints)
    if tp > 1:
        y_bytes, x_bytes = full["y"].numel() * x.element_size(), x.numel() * x.element_size()
        gather_dx = tpk.all_gather_bytes(x_bytes, tp)
        phases = {"forward": (tpk.all_reduce_bytes(y_bytes, tp), 1),
                  "backward": (0, 0) if input_is_parallel else (gather_dx, 1)}
        if not input_is_parallel:      # an all-reduce of the zero-padded gradient is let pass
            phases["backward"] = (gather_dx, 1, tpk.all_reduce_bytes(x_bytes, tp))

        def wire_hint(phase, sent, data):
            if phase == "forward":
                return ("the forward sends one all-reduce of the [..., out] partial products "
                        "(Megatron's g): the layer works on its own columns of W, it never "
                        "gathers the weight or the input")
            if input_is_parallel:
                return ("with input_is_parallel=True the backward is local: g's backward is the "
                        "identity and x.grad = dy W_r; nothing is sent")
            return ("the backward sends one all-gather of the input gradient's [..., in/t] "
                    "slices (the conjugate of taking my slice); a layer that computes the dense "
                    "x.grad from a gathered weight sends nothing here")

        _judge_phases(traffic, case, f"RowParallelLinear(input_is_parallel={input_is_parallel})",
                      phases, wire_hint, ops=lambda r: [e["op"] for e in trace.ops(r)])
    _check_divisibility(world, layer_cls, "row", in_features, out_features, timeout)


# ---- task 2: grouped-query attention, kv heads replicated where shared: gqa_checks.py ---------

# ---- task 3: vocabulary-parallel cross-entropy ---------------------------------------------------

def vocab_bounds(vocab, tp, cuts=None):
    """[(start, end)] of each rank's vocabulary columns: from the given first columns `cuts`
    (cuts[0] == 0), or as even as possible (sizes differ by at most one)."""
    if cuts is None:
        cuts = [r * vocab // tp for r in range(tp)]
    edges = list(cuts) + [vocab]
    return list(zip(edges[:-1], edges[1:]))


def _run_vocab(share, fn, ignore_index, pass_ignore):
    """On a rank: the loss from this rank's logit columns, and their gradient."""
    import labkit
    logits = share["logits"].to(labkit.device()).requires_grad_(True)
    kwargs = {"ignore_index": ignore_index} if pass_ignore else {}
    loss = fn(logits, share["targets"].to(labkit.device()), share["start"], **kwargs)
    labkit.mark(AFTER_FORWARD)
    loss.backward()
    return {"loss": loss.detach(), "grad": logits.grad}


def _vocab_case(what, tokens, vocab, tp, dtype, ignore_fraction, ignore_index, uneven):
    case = checks.Case(what)
    logits = case.normal((tokens, vocab), dtype, scale=3.0)               # [N, V]
    targets = case.integers(0, vocab - 1, (tokens,))                      # [N]
    if ignore_fraction:
        drop = torch.rand(tokens, generator=case.generator) < ignore_fraction
        drop[0] = False                                                   # at least one counted
        targets[drop] = ignore_index
    if uneven:
        cuts = sorted(case.permutation(vocab - 1)[:tp - 1])
        cuts = [0] + [c + 1 for c in cuts]                                # every rank >= 1 column
    else:
        cuts = None
    bounds = vocab_bounds(vocab, tp, cuts)
    return case, logits, targets, bounds


def check_vocab_cross_entropy(world, fn, tokens=64, vocab=48, dtype="float32",
                              ignore_fraction=0.0, ignore_index=-100, uneven=False, timeout=30):
    """Loss and gradient equal F.cross_entropy on the full logits (mean over counted tokens),
    computed from the shards: on the same call, forward and backward each send at most three
    all-reduces of N values (the max, the sum of exponentials, the target's logit), whatever
    the shards' widths. That backward sends nothing at all is check_vocab_traffic's."""
    tp = world.size
    case, logits, targets, bounds = _vocab_case(
        f"vocab-parallel cross-entropy, N={tokens}, V={vocab} over {tp} ranks "
        f"({'uneven' if uneven else 'even'} split), {dtype}, ignore_index={ignore_index}",
        tokens, vocab, tp, dtype, ignore_fraction, ignore_index, uneven)
    full = logits.clone().requires_grad_(True)
    loss = F.cross_entropy(full, targets, ignore_index=ignore_index)
    loss.backward()
    shares = [{"logits": logits[:, s:e].clone(), "targets": targets, "start": s} for s, e in bounds]
    with world.traffic() as traffic:
        results = world.run_each(_run_vocab, shares, fn, ignore_index, ignore_index != -100,
                                 timeout=timeout)
    checks.one_result_per_rank(results, tp, case, "vocab_parallel_cross_entropy")
    tol = _TOLERANCES[dtype]
    for rank, (got, (s, e)) in enumerate(zip(results, bounds)):
        checks.check(got["loss"], loss.detach(), f"rank {rank}'s loss", case=case, **tol,
                     hint="loss_i = log(sum_j exp(z_ij - m_i)) - (z_i,y_i - m_i), with the max, "
                          "the sum and the target's logit reduced over all ranks; the mean over "
                          "the tokens whose target is not ignore_index")
        checks.check(got["grad"], full.grad[:, s:e], f"rank {rank}'s gradient of its logits "
                     f"(columns {s}..{e - 1})", case=case, **tol,
                     hint="d loss / d z_ij = (softmax_ij - [j == y_i]) / (counted tokens), zero "
                          "for ignored tokens; softmax_ij uses the global max and sum")
    if tp > 1:
        itemsize = logits.element_size()
        most = 3 * tpk.all_reduce_bytes(tokens * itemsize, tp)

        def wire_hint(phase, sent, expected):
            gathered = tpk.gathered_logits_bytes(tokens, vocab, tp, itemsize)
            return (f"three all-reduces of N={tokens} values send at most {most:.0f} bytes, "
                    f"gathering the logits {gathered:.0f}: reduce [N] vectors (max, sum of "
                    "exponentials, target logit), never the [N, V_r] logits")

        _judge_phases(traffic, case, "vocab_parallel_cross_entropy",
                      {"forward": (0, 3, most), "backward": (0, 3, most)}, wire_hint)


def check_vocab_traffic(world, fn, tokens=512, vocab=256, dtype="float32", timeout=30,
                        max_reductions=4):
    """Bytes per rank do not grow with the vocabulary: the same N with V and 8V sends the same,
    and at most `max_reductions` all-reduces of N values (plus gloo's framing). Gathering the
    logits sends (t-1)/t x N V b and fails. The backward sends nothing (at most 512 B of stray
    acknowledgements): the mark between loss and backward splits the two."""
    tp = world.size
    if tp == 1:
        return
    sent = {}
    for v in (vocab, 8 * vocab):
        case, logits, targets, bounds = _vocab_case(
            f"traffic of vocab-parallel cross-entropy, N={tokens}, V={v} over {tp} ranks",
            tokens, v, tp, dtype, 0.0, -100, False)
        shares = [{"logits": logits[:, s:e].clone(), "targets": targets, "start": s}
                  for s, e in bounds]
        with world.tracing() as trace, world.traffic() as traffic:
            results = world.run_each(_run_vocab, shares, fn, -100, False, timeout=timeout)
        checks.one_result_per_rank(results, tp, case, "vocab_parallel_cross_entropy")
        reference = F.cross_entropy(logits, targets)
        checks.check(results[0]["loss"], reference, "rank 0's loss", case=case,
                     **_TOLERANCES[dtype])
        for rank in range(tp):
            backward = _phases(traffic, rank)[1]
            if backward > 512:
                ops = sorted({r["op"] for r in trace.ops(rank)})
                raise AssertionError(
                    f"rank {rank} sent {backward} bytes in the loss's backward [{case}]; the "
                    f"rank called {ops}: the backward needs no communication: keep what forward "
                    "reduced (the global max and sum, or the softmax of your columns) with "
                    "ctx.save_for_backward instead of reducing it again")
        itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        bound = max_reductions * (tpk.all_reduce_bytes(tokens * itemsize, tp)
                                  + (tp - 1) * FRAMING_PER_PEER) + 512
        for rank, count in enumerate(traffic.sent):
            if count > bound:
                ops = sorted({r["op"] for r in trace.ops(rank)})
                gathered = tpk.gathered_logits_bytes(tokens, v, tp, itemsize)
                raise AssertionError(
                    f"rank {rank} sent {count} bytes for N={tokens} tokens and V={v} [{case}]; "
                    f"{max_reductions} all-reduces of N values are at most {bound:.0f} bytes, "
                    f"gathering the logits would be {gathered:.0f}; the rank called {ops}: "
                    "reduce [N] vectors (max, sum of exponentials, target logit), never the "
                    "[N, V/t] logits")
        sent[v] = traffic.sent
    for rank in range(tp):
        if sent[8 * vocab][rank] > 1.1 * sent[vocab][rank] + 512:
            raise AssertionError(f"rank {rank} sent {sent[vocab][rank]} bytes with V={vocab} and "
                                 f"{sent[8 * vocab][rank]} with V={8 * vocab}: the bytes must not "
                                 "grow with the vocabulary")
