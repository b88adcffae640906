"""Checkers that the labs' test cells and the pytest suite share.

A checker never holds an answer to a graded task: it runs the student's function, or torch's own
collective, and compares. Every failure message says what was expected, what came back, and what
to check.
"""
from __future__ import annotations

import math

import cloudpickle

REDUCE_OPS = ("sum", "product", "max", "min")


def _call_own_input(fn_bytes: bytes, per_rank_inputs: list):
    """On a rank: call the function with this rank's entry of per_rank_inputs."""
    import torch.distributed as dist
    fn = cloudpickle.loads(fn_bytes)
    return fn(per_rank_inputs[dist.get_rank()])


def run_with_rank_inputs(world, fn, per_rank_inputs: list, timeout: float | None = None) -> list:
    """Run fn(per_rank_inputs[r]) on every rank r of `world`; return the per-rank results.

    `fn` is sent by value (a function defined in a notebook cell works). A rank that raises
    surfaces as labkit.RankError, a hang as labkit.CallTimeout after `timeout` seconds.
    """
    if len(per_rank_inputs) != world.size:
        raise ValueError(f"one input per rank expected: world has {world.size} ranks, "
                         f"got {len(per_rank_inputs)} inputs")
    return world.call(_call_own_input, args=(cloudpickle.dumps(fn), list(per_rank_inputs)),
                      timeout=timeout)


def _all_reduce_own_row(per_rank_values: list, op: str) -> list:
    import torch
    import torch.distributed as dist
    tensor = torch.tensor(per_rank_values[dist.get_rank()], dtype=torch.float64)
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()))
    return tensor.tolist()


def real_all_reduce(world, per_rank_values: list, op: str = "sum") -> list:
    """What torch.distributed.all_reduce really leaves on each rank (float64), as lists."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    if len(per_rank_values) != world.size:
        raise ValueError(f"one row per rank expected: world has {world.size} ranks, "
                         f"got {len(per_rank_values)} rows")
    return world.run(_all_reduce_own_row, [list(map(float, row)) for row in per_rank_values], op)


def assert_same_on_every_rank(results: list, expected, what: str, rel_tol: float = 1e-6,
                              hint: str = "") -> None:
    """Every rank's result equals `expected` (numbers, or nested lists of numbers)."""
    def close(a, b) -> bool:
        if isinstance(b, (list, tuple)):
            return isinstance(a, (list, tuple)) and len(a) == len(b) and all(map(close, a, b))
        try:
            return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=rel_tol)
        except (TypeError, ValueError):
            return False
    for rank, result in enumerate(results):
        if not close(result, expected):
            raise AssertionError(f"rank {rank}: {what} is {result!r}, expected {expected!r}"
                                 + (f"; {hint}" if hint else ""))
