"""Checkers for a hand-written all-reduce (lab 1): results, the ops it used, the bytes it sent.

The function under test runs on every rank as `fn(tensor, op)` with op "sum" or "max"; it must
leave the reduction in `tensor` (in place, like `dist.all_reduce`). Inputs are small integers
(stored in the requested dtype), so float sums are exact whatever the order of the additions and
results are compared exactly.

    check_all_reduce(world, ring_all_reduce, length=1003, dtype="int64", op="max", timeout=20)
    check_point_to_point_only(world, ring_all_reduce, length=1003, timeout=20)
    check_ring_traffic(world, ring_all_reduce, length=1003, timeout=20)

The same functions serve the lab's test cells and tests/chapters/test_ch01_collectives.py.
"""
from __future__ import annotations

import cloudpickle

from labkit.checks import REDUCE_OPS
from labkit.collectives import ring_bytes_sent

POINT_TO_POINT_OPS = ("send", "recv", "isend", "irecv")
SENDING_OPS = ("send", "isend")
DTYPES = ("float32", "float64", "int32", "int64")


def rank_input(rank, length, dtype="float32"):
    """The tensor rank `rank` starts with: integers in [-20, 20], different on every rank."""
    import torch
    generator = torch.Generator().manual_seed(1000 * rank + length)
    values = torch.randint(-20, 21, (length,), generator=generator)     # values: [N]
    return values.to(getattr(torch, dtype))


def expected_all_reduce(world_size, length, dtype="float32", op="sum"):
    """What every rank must hold afterwards: the element-wise op over all ranks' inputs."""
    import torch
    stacked = torch.stack([rank_input(r, length, dtype) for r in range(world_size)])  # [P, N]
    if op == "sum":
        return stacked.sum(dim=0).to(stacked.dtype)
    if op == "max":
        return stacked.max(dim=0).values
    raise ValueError(f"op must be 'sum' or 'max' here, got {op!r}")


def _call_on_rank(fn_bytes, length, dtype, op):
    import torch.distributed as dist
    fn = cloudpickle.loads(fn_bytes)
    tensor = rank_input(dist.get_rank(), length, dtype)
    fn(tensor, op)
    return tensor


def _validate(length, dtype, op):
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if op not in ("sum", "max") or op not in REDUCE_OPS:
        raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")


def check_all_reduce(world, fn, length, dtype="float32", op="sum", timeout=20):
    """Run fn(tensor, op) on every rank; every rank's tensor must equal the true reduction."""
    _validate(length, dtype, op)
    results = world.call(_call_on_rank, args=(cloudpickle.dumps(fn), length, dtype, op),
                         timeout=timeout)
    expected = expected_all_reduce(world.size, length, dtype, op)
    P = world.size
    for rank, got in enumerate(results):
        where = f"P={P}, length {length}, {dtype}, op={op!r}"
        if got.dtype != expected.dtype or got.shape != expected.shape:
            raise AssertionError(f"rank {rank} ({where}): tensor is {got.dtype} {tuple(got.shape)}"
                                 f", expected {expected.dtype} {tuple(expected.shape)}; reduce in "
                                 "place and keep the dtype")
        wrong = (got != expected).nonzero().flatten()
        if len(wrong):
            i = int(wrong[0])
            hint = ("the wrong entries start near the end: do the chunks cover every element "
                    "when P does not divide the length?" if length % P and i >= length - length % P
                    - length // P - 1 else "check which chunk each step sends and receives")
            raise AssertionError(f"rank {rank} ({where}): {len(wrong)} of {length} entries wrong, "
                                 f"first at index {i}: got {got[i].item()}, expected "
                                 f"{expected[i].item()}; {hint}")
    return results


def trace_one_call(world, fn, length, dtype="float32", op="sum", timeout=20):
    """Trace one fn(tensor, op) on every rank; returns the labkit Trace."""
    _validate(length, dtype, op)
    with world.tracing() as trace:
        world.call(_call_on_rank, args=(cloudpickle.dumps(fn), length, dtype, op),
                   timeout=timeout)
    return trace


def check_point_to_point_only(world, fn, length, dtype="float32", timeout=20):
    """fn may use send/recv/isend/irecv and nothing else (no collective, not even a barrier)."""
    trace = trace_one_call(world, fn, length, dtype, "sum", timeout)
    for rank in range(world.size):
        used = [name for name in trace.op_names(rank) if name not in POINT_TO_POINT_OPS]
        if used:
            raise AssertionError(f"rank {rank} called {used}: build the all-reduce from "
                                 f"{list(POINT_TO_POINT_OPS)} only")
    return trace


def bytes_handed_to_sends(trace, rank):
    """Bytes of the tensors the rank passed to send/isend (what it chose to send)."""
    return sum(record["tensor_bytes"] for record in trace.ops(rank, SENDING_OPS))


def check_ring_traffic(world, fn, length, dtype="float32", timeout=20):
    """Each rank sends 2(P-1)/P of the data, up to rounding; all ranks together 2(P-1) * N.

    With chunks of floor(N/P) or ceil(N/P) elements, a rank's 2(P-1) sends total between
    2(P-1) * floor(N/P) and 2(P-1) * ceil(N/P) elements. Returns {rank: bytes sent}.
    """
    import torch
    trace = check_point_to_point_only(world, fn, length, dtype, timeout)
    P, itemsize = world.size, torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    sent = {rank: bytes_handed_to_sends(trace, rank) for rank in range(P)}
    low, high = (2 * (P - 1) * (length // P) * itemsize, 2 * (P - 1) * -(-length // P) * itemsize)
    ideal = ring_bytes_sent("all_reduce", length * itemsize, P)
    for rank, count in sent.items():
        if not low <= count <= high:
            raise AssertionError(f"rank {rank} sent {count} bytes for {length} elements of "
                                 f"{itemsize} bytes on P={P}: a ring sends 2(P-1)/P of the data, "
                                 f"{ideal:.0f} bytes (between {low} and {high} with rounding)")
    total = sum(sent.values())
    if total != 2 * (P - 1) * length * itemsize:
        raise AssertionError(f"all ranks together sent {total} bytes, a ring sends 2(P-1) * N = "
                             f"{2 * (P - 1) * length * itemsize}: is every chunk sent exactly "
                             "P-1 times in each phase?")
    return sent
