"""Checkers for lab 1: a hand-written all-reduce, checked by its values and by its traffic.

The function under test runs on every rank as `fn(tensor, op)`, with op "sum" or "max"; it must
leave the reduction in `tensor` (in place, like `dist.all_reduce`), and it is the tensor handed
over that is read back. Each rank is sent only its own input (`world.run_each`), drawn fresh for
every check (`checks.Case`: the seed is printed in every failure) and spanning the dtype's range,
so that a detour through a narrower dtype shows. Expected values are computed here, never on a
rank. Traffic is counted outside the ranks (`world.traffic()`) on the same call as the values.

    check_all_reduce(world, ring_all_reduce, length=1003, dtype="int64", op="max")
    check_ring_traffic(world, ring_all_reduce, length=1003)           # P >= 3 tells a ring
    check_recursive_doubling_traffic(world, recursive_doubling_all_reduce, length=100)

The same functions serve the lab's test cells and tests/chapters/test_ch01_collectives.py.
"""
from __future__ import annotations

from labkit import checks

POINT_TO_POINT_OPS = ("send", "recv", "isend", "irecv")
DTYPES = ("float32", "float64", "int32", "int64")
OPS = ("sum", "max")


def _program(share, fn, op):
    """On a rank: hand this rank's input to fn; the same tensor is read back."""
    tensor = share.clone()
    fn(tensor, op)
    return tensor


def _validate(world, length, dtype, op):
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")


def _hint(got, expected, share, others, op, length, P) -> str:
    """Name the likely mistake from what came back."""
    import torch
    if got.dtype != expected.dtype:
        return f"the tensor came back as {got.dtype}: keep the dtype ({expected.dtype})"
    wrong = (got != expected).nonzero().flatten()
    first = int(wrong[0])
    base = length // P
    if length % P and first >= P * base:
        return ("the wrong entries are the last ones: when P does not divide the length, the "
                "first N % P chunks get one element more; do the chunks cover every element?")
    if torch.equal(got, share):
        return ("the tensor handed over is unchanged: reduce into it in place (flat = "
                "tensor.view(-1); add_/copy_ into slices of flat), do not rebind the name")
    if op == "max" and torch.equal(got, checks.reduce(others, "sum")):
        return "op='max' came back as a sum: apply the op you were given"
    ends = [sum(_chunk_sizes(length, P)[:i + 1]) for i in range(P)]      # where chunk i ends
    chunk = next(i for i in range(P) if first < ends[i])
    return (f"the first wrong element is in chunk {chunk} of {P}: check which chunk each step "
            "sends and which it receives, and that every chunk is reduced P - 1 times")


def check_all_reduce(world, fn, length, dtype="float32", op="sum", timeout=20):
    """Run fn(tensor, op) on every rank; every rank's tensor must equal the true reduction.

    Returns the per-rank results. Raises AssertionError naming the rank, the case's seed, the
    first wrong entry and the likely mistake."""
    _validate(world, length, dtype, op)
    P = world.size
    case = checks.Case(f"all-reduce of {length} {dtype} elements, op={op!r}, P={P}")
    shares = [case.exact_values((length,), dtype, terms=P) for _ in range(P)]   # each: [N]
    expected = checks.reduce(shares, op)                                        # [N]
    results = world.run_each(_program, shares, fn, op, timeout=timeout)
    checks.one_result_per_rank(results, P, case, what="the all-reduce")
    import torch
    for rank, got in enumerate(results):
        same_form = (isinstance(got, torch.Tensor) and got.shape == expected.shape)
        if same_form and got.dtype == expected.dtype and torch.equal(got, expected):
            continue
        hint = _hint(got, expected, shares[rank], shares, op, length, P) if same_form else ""
        # sums of these inputs are exact in the dtype: compare exactly
        checks.check(got, expected, f"rank {rank}'s tensor", rtol=0, atol=0, case=case,
                     hint=hint)
    return results


def _chunk_sizes(length, P):
    base, extra = divmod(length, P)
    return [base + (1 if i < extra else 0) for i in range(P)]


def ring_payload(length, P, itemsize):
    """(data, messages): bytes and messages rank r must send to rank q in the lab's ring.

    Counted from what each half must deliver, not step by step: in the reduce-scatter rank r
    passes its right neighbour a partial sum of every chunk but the one rank r itself finishes,
    chunk (r + 1) mod P; in the all-gather it passes on every finished chunk but the one its
    right neighbour finished, chunk (r + 2) mod P. Everything goes to (r + 1) mod P, one
    message per non-empty chunk."""
    sizes = _chunk_sizes(length, P)
    data = [[0] * P for _ in range(P)]
    messages = [[0] * P for _ in range(P)]
    for r in range(P):
        right = (r + 1) % P
        for kept in ((r + 1) % P, (r + 2) % P):              # reduce-scatter, then all-gather
            passed = [c for c in range(P) if c != kept]       # P - 1 chunks
            data[r][right] += sum(sizes[c] for c in passed) * itemsize
            messages[r][right] += sum(1 for c in passed if sizes[c])
    return data, messages


def recursive_doubling_payload(length, P, itemsize):
    """(data, messages) of the lab's recursive doubling: ranks r >= p2 (the largest power of two
    <= P) fold into r - p2 and get the result back; ranks below p2 swap the whole tensor with
    r XOR 2^k for each 2^k < p2."""
    n = length * itemsize
    p2 = 1 << (P.bit_length() - 1)
    data = [[0] * P for _ in range(P)]
    messages = [[0] * P for _ in range(P)]

    def add(r, q):
        data[r][q] += n
        messages[r][q] += 1
    for r in range(p2, P):
        add(r, r - p2)
        add(r - p2, r)
    for r in range(p2):
        distance = 1
        while distance < p2:
            add(r, r ^ distance)
            distance *= 2
    return data, messages


def _traffic_program(share, fn, op):
    return _program(share, fn, op)


def _check_traffic(world, fn, length, dtype, timeout, payload, what, hint):
    import torch
    _validate(world, length, dtype, "sum")
    P = world.size
    case = checks.Case(f"{what}: {length} {dtype} elements, P={P}")
    shares = [case.exact_values((length,), dtype, terms=P) for _ in range(P)]
    expected = checks.reduce(shares, "sum")
    # One unmeasured call first: connections (and teaching mode's point-to-point group) are set
    # up through the rendezvous store on first use, which would count as traffic to no rank.
    world.run_each(_traffic_program, [share[:P] for share in shares], fn, "sum", timeout=timeout)
    with world.traffic() as traffic:
        results = world.run_each(_traffic_program, shares, fn, "sum", timeout=timeout)
    checks.one_result_per_rank(results, P, case, what=what)
    for rank, got in enumerate(results):
        checks.check(got, expected, f"rank {rank}'s tensor", rtol=0, atol=0, case=case)
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    data, messages = payload(length, P, itemsize)
    checks.expect_traffic(traffic, data, messages, case=case, what=what, hint=hint)
    return traffic


def check_ring_traffic(world, fn, length, dtype="float32", timeout=20):
    """The values and, on the same call, the bytes each rank sent to each other rank: exactly
    the chunks of the ring, to the right neighbour (r + 1) mod P only, 2(P - 1)/P of the data
    per rank. Meaningful at P >= 3 (at P = 2 both neighbours are the same rank)."""
    return _check_traffic(
        world, fn, length, dtype, timeout, ring_payload, "ring all-reduce traffic",
        "a ring sends each rank's chunks to its right neighbour (r + 1) mod P and nothing to "
        "anyone else, 2(P - 1) chunks in all; a direct exchange, a collective called inside, or "
        "a ring turning the other way sends to other ranks")


def check_recursive_doubling_traffic(world, fn, length, dtype="float32", timeout=20):
    """The values and the partners: rank r exchanges the whole tensor with r XOR 2^k for each
    step, ranks beyond the largest power of two fold in and get the result back."""
    return _check_traffic(
        world, fn, length, dtype, timeout, recursive_doubling_payload,
        "recursive doubling traffic",
        "recursive doubling swaps the whole tensor with partner r XOR 2^k in step k (k = 0, 1, "
        "...), and ranks r >= p2 send to r - p2 first and get the result back last; a ring, or "
        "a collective called inside, talks to other partners")


def ops_used(world, fn, length=64, timeout=20):
    """{rank: op names} a call of fn made through torch.distributed, from labkit's trace (records
    written inside the ranks: a hint for messages, never evidence for points)."""
    import torch
    shares = [torch.arange(length, dtype=torch.float32) * (rank + 1) for rank in range(world.size)]
    with world.tracing() as trace:
        world.run_each(_program, shares, fn, "sum", timeout=timeout)
    return {rank: trace.op_names(rank) for rank in range(world.size)}


def explain_ops(used: dict) -> None:
    """Raise with the ranks that called something other than send/recv (a hint only)."""
    bad = {rank: [op for op in names if op not in POINT_TO_POINT_OPS]
           for rank, names in used.items()}
    bad = {rank: names for rank, names in bad.items() if names}
    if bad:
        raise AssertionError(f"these ranks called more than send/recv/isend/irecv: {bad}; build "
                             f"the all-reduce from {list(POINT_TO_POINT_OPS)} only")


# ---- task 3: the uneven all_to_all of a mixture-of-experts dispatch ----------------------------

ROW_DTYPES = ("float32", "float64", "int64")
COUNT_BYTES = 8            # the int64 count a rank sends each other rank before the rows
MARGIN_BYTES = 56          # on top of framing and count; measured overhead is exact (below)


def routing_table(case, P, pattern="random"):
    """counts[r][q]: rows rank r routes to rank q, a P x P table drawn from `case`.

    Every table has a zero off the diagonal (an empty block: gloo still sends a header for it)
    and a hot receiver that gets 24-40 rows from every rank (a popular expert), so that a rank
    padding every block to the largest one sends at least 24 rows too many on the empty pair.
    pattern="hot" also gives rank P - 1 nothing to receive and, for P >= 3, rank 1 no rows at all.
    """
    if pattern not in ("random", "hot"):
        raise ValueError(f"pattern must be 'random' or 'hot', got {pattern!r}")
    counts = case.integers(1, 12, (P, P)).tolist()
    if P == 1:
        return counts
    hot = case.integer(0, P - 1) if pattern == "random" else 0
    for r in range(P):
        counts[r][hot] = case.integer(24, 40)
    counts[hot][(hot + 1) % P] = 0                # an empty block: the hot rank sends right nothing
    if pattern == "hot":
        for r in range(P):
            counts[r][P - 1] = 0 if r != P - 1 else counts[r][P - 1]
        if P >= 3:
            counts[1] = [0] * P
    return counts


_CHAPTER_7_EXCHANGE = ("exchange_counts", "all_to_all")   # labkit.moe.ep: chapter 7's dispatch


_REFUSED = ("lab 1, task 3 asks for this exchange written with torch.distributed (the counts, "
            "then one all_to_all_single with split sizes); labkit.moe.ep.exchange_counts and "
            "labkit.moe.ep.all_to_all are chapter 7's finished version of it and cannot be used "
            "here")


def _rows_program(share, fn):
    """On a rank: hand this rank's rows and destinations to fn; return what arrived. Chapter 7's
    dispatch helpers are refused for the call, by name and by attribute (labkit.refusal: a clear
    error, not a score for the task's work done by labkit)."""
    from labkit import refusal
    from labkit.moe import ep
    rows, dest = share
    with refusal.refused(fn, ep, _CHAPTER_7_EXCHANGE, _REFUSED):
        return fn(rows.clone(), dest.clone())


def check_uneven_all_to_all(world, fn, hidden=64, dtype="float32", pattern="random", timeout=20):
    """fn(rows, dest) on every rank: rows [M_r, H], dest [M_r] (int64 ranks). It must return the
    rows every rank routed here, [sum_q counts[q][r], H]: rank 0's first, then rank 1's, ..., each
    sender's rows in their original order. On the same call, the bytes each rank sent to each
    other rank (counted outside the ranks) must be the rows it routed there: counts[r][q] * H *
    itemsize, plus gloo's framing (`GLOO_FRAMING_BYTES` per message; two collectives, the counts
    and the rows, so two messages per pair even where a block is empty) and the count itself (8
    bytes), within 56 bytes. The rows a rank keeps never travel. The world must have teaching
    mode off (its fingerprints add more bytes than that)."""
    import torch
    from labkit.collectives import GLOO_FRAMING_BYTES
    if world.teaching:
        raise ValueError("check_uneven_all_to_all needs a world with teaching=False: teaching "
                         "mode's fingerprint exchange adds 300-3100 bytes per pair to every "
                         "collective, more than the framing the check allows; use "
                         "labkit.world(P, backend=BACKEND, teaching=False)")
    if dtype not in ROW_DTYPES:
        raise ValueError(f"dtype must be one of {ROW_DTYPES}, got {dtype!r}")
    P = world.size
    case = checks.Case(f"uneven all_to_all of rows [M, {hidden}] {dtype}, routing {pattern!r}, P={P}")
    counts = routing_table(case, P, pattern)                          # [P, P]
    shares = []
    for r in range(P):
        dest = torch.tensor([q for q in range(P) for _ in range(counts[r][q])], dtype=torch.int64)
        dest = dest[torch.tensor(case.permutation(dest.numel()), dtype=torch.int64)]   # [M_r], mixed
        rows = case.exact_values((dest.numel(), hidden), dtype)      # [M_r, H]
        shares.append((rows, dest))
    expected = [torch.cat([rows[dest == q] for rows, dest in shares]) for q in range(P)]  # [R_q, H]
    with world.traffic() as traffic:
        results = world.run_each(_rows_program, shares, fn, timeout=timeout)
    checks.one_result_per_rank(results, P, case, what="the all_to_all")
    for rank, got in enumerate(results):
        hint = ""
        if isinstance(got, torch.Tensor) and got.shape == expected[rank].shape \
                and not torch.equal(got, expected[rank]):
            hint = ("the right number of rows, in the wrong order or from the wrong senders: "
                    "sort the rows by destination with a stable sort, so each block keeps its "
                    "order, and read the output as blocks from rank 0, 1, ... in turn")
        elif isinstance(got, torch.Tensor) and got.dim() and got.size(0) != expected[rank].size(0):
            hint = (f"{got.size(0)} rows came back, {expected[rank].size(0)} were routed here: size "
                    "the output from the counts the other ranks send you (output_split_sizes), "
                    "including the rows this rank keeps")
        checks.check(got, expected[rank], f"rank {rank}'s received rows", rtol=0, atol=0,
                     case=case, hint=hint)
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    data = [[counts[r][q] * hidden * itemsize if q != r else 0 for q in range(P)] for r in range(P)]
    messages = [[2 if q != r else 0 for q in range(P)] for r in range(P)]
    # Tolerance per pair r -> q: 2 messages each way, and each message puts a 96-byte header on
    # its sender's socket and a 48-byte notice on its receiver's (GLOO_FRAMING_BYTES = 144 per
    # message): 2 x 144 = 288 B, which expect_traffic counts as per_message x (2 + 2) with
    # per_message = 72; plus the 8-byte count and a 56-byte margin. Measured on this solution's
    # exchange at P = 2, 3, 4: exactly 296 B over the rows on every pair.
    checks.expect_traffic(
        traffic, data, messages, case=case, what="the uneven all_to_all",
        slack=COUNT_BYTES + MARGIN_BYTES, per_message=GLOO_FRAMING_BYTES / 2,
        hint=("each pair should carry exactly the rows routed along it: exchange the counts first "
              "(one all_to_all_single of P integers), then one all_to_all_single of the rows with "
              "input_split_sizes and output_split_sizes; padding every block to the largest, or "
              "sending every row everywhere, shows on the pairs with few rows"))
    return traffic
