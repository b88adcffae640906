"""What every lab's checkers are built from (docs/AUTHORS.md, "How a checker is written").

    case = checks.Case("ring all-reduce")                   # a fresh seed every run
    shares = [case.exact_values((n,), "int64", terms=P) for _ in range(P)]
    expected = checks.reduce(shares, "sum")                 # computed here, never on a rank
    with world.traffic() as traffic:                        # counted outside the ranks
        results = world.run_each(program, shares, fn)       # rank r is sent shares[r] only
    checks.one_result_per_rank(results, P, case)
    checks.check(results[0], expected, "rank 0's tensor", case=case)
    checks.expect_traffic(traffic, data_bytes, case=case, messages=counts)

A checker never holds an answer to a graded task: it runs the student's function, or torch's own
collective, and compares. Every failure names what was checked, the case's seed (to reproduce it:
`Case(..., seed=S)` or LABKIT_CASE_SEED=S), what came back, what was expected, and a hint.
Lab 0's checkers are at the end of this file.
"""
from __future__ import annotations

import math
import os

REDUCE_OPS = ("sum", "product", "max", "min")
# For each dtype: the largest magnitude a single value may have so that any sum of `terms` values
# is exact, and the scale (a power of two) of the smallest step. Chosen so that the values use the
# dtype's whole precision: computing in any narrower type (float32 for float64 or int64, bfloat16
# for float32, float32 for int32) changes the result.
_EXACT = {
    "int64": (2 ** 62, 1.0), "int32": (2 ** 30, 1.0), "int16": (2 ** 14, 1.0),
    "int8": (2 ** 6, 1.0), "uint8": (2 ** 7, 1.0),
    "float64": (2 ** 51, 2.0 ** -20), "float32": (2 ** 23, 2.0 ** -8),
    "bfloat16": (2 ** 7, 2.0 ** -2), "float16": (2 ** 10, 2.0 ** -4),
}
# Bytes gloo puts on a TCP connection besides a point-to-point message's payload: a header with
# each message and a short notice from the receiver back to the sender (measured: 96 and 48 bytes).
# A collective's own messages carry more (about 288 bytes per chunk of an all-reduce), and teaching
# mode adds a fingerprint exchange of about 800 bytes per peer per collective: checkers of
# collectives pass their own per_message (or rel), and may read world.teaching.
GLOO_BYTES_PER_MESSAGE = 160


class Case:
    """The randomness of one checked case: a fresh seed each run, named in every failure.

    `seed`: reuse a case (also LABKIT_CASE_SEED). Under `labkit grade` the seed is drawn by the
    grader, never by code that runs next to the student's.
    """

    def __init__(self, what: str, seed: int | None = None):
        import torch
        if seed is None:
            env = os.environ.get("LABKIT_CASE_SEED")
            seed = int(env) if env else int.from_bytes(os.urandom(6), "little")
        self.what, self.seed = what, int(seed)
        self.generator = torch.Generator().manual_seed(self.seed)

    def __str__(self):
        return f"{self.what} (case seed {self.seed})"

    def integers(self, low: int, high: int, shape=()):
        """Uniform integers in [low, high] (int64), from this case's generator."""
        import torch
        return torch.randint(low, high + 1, tuple(shape), generator=self.generator)

    def integer(self, low: int, high: int) -> int:
        return int(self.integers(low, high))

    def normal(self, shape, dtype="float32", scale: float = 1.0):
        import torch
        return (torch.randn(tuple(shape), generator=self.generator, dtype=torch.float64)
                * scale).to(_dtype(dtype))

    def permutation(self, n: int) -> list:
        import torch
        return torch.randperm(n, generator=self.generator).tolist()

    def exact_values(self, shape, dtype="float32", terms: int = 1):
        """Values that span the dtype: any sum of `terms` of them is exact in `dtype` (so results
        compare exactly, whatever the order of the additions), and wrong in any narrower type.
        Signs are mixed; magnitudes run from 1 step to the largest allowed."""
        import torch
        name = str(_dtype(dtype)).replace("torch.", "")
        if name not in _EXACT:
            raise ValueError(f"exact_values: no rule for dtype {name}; known: {sorted(_EXACT)}")
        if terms < 1:
            raise ValueError(f"exact_values: terms must be >= 1, got {terms}")
        largest, step = _EXACT[name]
        limit = max(1, largest // terms)
        if name == "uint8":
            raw = self.integers(0, limit, shape)
        else:
            # magnitudes spread over every power of two up to the limit, not bunched at the top
            bits = self.integers(0, max(0, limit.bit_length() - 1), shape)
            raw = torch.div(self.integers(0, limit, shape), 2 ** bits, rounding_mode="floor")
            raw = raw * (self.integers(0, 1, shape) * 2 - 1)
        if name.startswith(("int", "uint")):
            return raw.to(_dtype(name))
        return (raw.to(torch.float64) * step).to(_dtype(name))


def _dtype(dtype):
    import torch
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def reduce(shares: list, op: str = "sum"):
    """The element-wise `op` over the ranks' tensors, in their dtype: what an all-reduce leaves."""
    import torch
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    stacked = torch.stack(list(shares))                                   # [P, ...]
    if op == "sum":
        return stacked.sum(dim=0).to(stacked.dtype)
    if op == "product":
        return stacked.prod(dim=0).to(stacked.dtype)
    return stacked.amax(dim=0) if op == "max" else stacked.amin(dim=0)


def _where(case) -> str:
    return f" [{case}]" if case is not None else ""


def one_result_per_rank(results, size: int, case=None, what: str = "the call"):
    """Exactly one result per rank, none missing: checked before any comparison (a loop over an
    empty list passes anything)."""
    if not isinstance(results, (list, tuple)):
        raise AssertionError(f"{what} returned {type(results).__name__}, expected a list with one "
                             f"result per rank{_where(case)}")
    if len(results) != size:
        raise AssertionError(f"{what} returned {len(results)} results for {size} ranks"
                             f"{_where(case)}: every rank must return its own")
    missing = [rank for rank, result in enumerate(results) if result is None]
    if missing:
        raise AssertionError(f"ranks {missing} returned None from {what}{_where(case)}: did the "
                             "function return its result?")
    return list(results)


def check(actual, expected, what: str = "the result", rtol: float | None = None,
          atol: float | None = None, hint: str = "", case=None) -> None:
    """Assert that `actual` matches `expected` (tensors, numbers, nested lists/tuples/dicts).

    Tensors are compared with torch.testing.assert_close (default tolerances of their dtype, or
    rtol/atol; integers exactly); numbers as float64 tensors. Dtypes and shapes must match. The
    failure names `what` and the case, and ends with `hint`.
    """
    import torch

    def as_tensor(value):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return torch.tensor(float(value), dtype=torch.float64)
        return None

    def walk(a, e, where):
        ta, te = as_tensor(a), as_tensor(e)
        if te is not None:
            if ta is None:
                raise AssertionError(f"{what}{where}: expected a tensor or number, got "
                                     f"{type(a).__name__}")
            if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor) and a.dtype != e.dtype:
                raise AssertionError(f"{what}{where}: dtype {a.dtype}, expected {e.dtype}")
            if ta.shape != te.shape:
                raise AssertionError(f"{what}{where}: shape {tuple(ta.shape)}, expected "
                                     f"{tuple(te.shape)}")
            try:
                torch.testing.assert_close(ta.to(te.dtype), te, rtol=rtol, atol=atol,
                                           equal_nan=True)
            except AssertionError as error:
                raise AssertionError(f"{what}{where}: {error}") from None
        elif isinstance(e, dict):
            if not isinstance(a, dict) or set(a) != set(e):
                got = sorted(map(str, a)) if isinstance(a, dict) else type(a).__name__
                raise AssertionError(f"{what}{where}: keys {got}, expected {sorted(map(str, e))}")
            for key in e:
                walk(a[key], e[key], f"{where}[{key!r}]")
        elif isinstance(e, (list, tuple)):
            if not isinstance(a, (list, tuple)) or len(a) != len(e):
                got = len(a) if isinstance(a, (list, tuple)) else type(a).__name__
                raise AssertionError(f"{what}{where}: expected {len(e)} items, got {got}")
            for i, (x, y) in enumerate(zip(a, e)):
                walk(x, y, f"{where}[{i}]")
        elif a != e:
            raise AssertionError(f"{what}{where} is {a!r}, expected {e!r}")

    try:
        walk(actual, expected, "")
    except AssertionError as error:
        raise AssertionError(f"{error}{_where(case)}" + (f"; {hint}" if hint else "")) from None


def expect_traffic(traffic, data, messages=None, case=None, what: str = "the call",
                   per_message: int = GLOO_BYTES_PER_MESSAGE, rel: float = 0.0,
                   slack: int = 256, hint: str = "") -> None:
    """The bytes each rank sent to each other rank, counted outside the ranks, match what the
    algorithm must send.

    data[r][q]: payload bytes rank r must send to rank q (0: nothing). messages[r][q]: how many
    messages carry them (default: one wherever data[r][q] > 0). A pair may carry its payload plus
    `per_message` bytes of framing for each message either way plus `slack` (and `rel` of the
    payload, for collectives whose internal chunking is not fixed); never less than its payload.
    Nothing may leave the ranks by other connections (`traffic.outside`), nor by paths no rank
    socket carried (`traffic.unaccounted`, where the grader can see it).
    """
    size = traffic.size
    if not getattr(traffic, "complete", False):
        raise AssertionError(f"the traffic of {what} could not be counted (the ranks were "
                             f"restarted during it){_where(case)}")
    if len(data) != size or any(len(row) != size for row in data):
        raise ValueError(f"expect_traffic: data must be a {size} x {size} matrix")
    if messages is None:
        messages = [[1 if data[r][q] else 0 for q in range(size)] for r in range(size)]
    problems = []
    for r in range(size):
        for q in range(size):
            if r == q:
                continue
            low = data[r][q]
            high = data[r][q] * (1 + rel) + per_message * (messages[r][q] + messages[q][r]) + slack
            got = traffic.matrix[r][q]
            if got < low:
                problems.append(f"rank {r} sent {got} bytes to rank {q}, at least {low} expected")
            elif got > high:
                expected = f"{low} bytes of data" if low else "no data"
                problems.append(f"rank {r} sent {got} bytes to rank {q}, expected {expected} "
                                f"(at most {high:.0f} bytes with framing)")
        if traffic.outside[r] > slack:
            problems.append(f"rank {r} sent {traffic.outside[r]} bytes over connections to "
                            "something other than a rank")
    if traffic.unaccounted is not None and traffic.unaccounted > slack + 64 * size:
        problems.append(f"{traffic.unaccounted} bytes crossed the ranks' network outside their "
                        "process-group connections")
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4
                                           else "")
        raise AssertionError(f"{what}: the traffic between ranks is not what the algorithm sends"
                             f"{_where(case)}: {shown}" + (f". {hint}" if hint else ""))


# ---- lab 0 --------------------------------------------------------------------------------------

def expect_value_error_on_every_rank(world, program, shares, *args, case=None,
                                     refused: str, timeout: float | None = None,
                                     ordinary: list | None = None) -> None:
    """Run `program` on every rank with its own share (`world.run_each`); pass only if every rank
    raised ValueError. `refused` says what should have been refused, for the message.
    `ordinary`: shares of an input that must be accepted, run first on the same ranks: a function
    that refuses everything must not earn a refusal's points (issue 26, class 3)."""
    from labkit.errors import RankError
    if ordinary is not None:
        try:
            world.run_each(program, ordinary, *args, timeout=timeout)
        except RankError as error:
            first_lines = {rank: text.splitlines()[0][:80] for rank, text in error.errors.items()}
            raise AssertionError(
                f"[{case}] an ordinary input (values on the ranks) was refused before the bad one "
                f"was tried: {first_lines}; raise only when {refused}") from None
    try:
        world.run_each(program, shares, *args, timeout=timeout)
    except RankError as error:
        first_lines = {rank: text.splitlines()[0][:80] for rank, text in error.errors.items()}
        if sorted(first_lines) != list(range(world.size)) or not all(
                "ValueError" in text for text in error.errors.values()):
            raise AssertionError(f"[{case}] every rank should raise ValueError when {refused}; "
                                 f"these raised: {first_lines}") from None
        return
    raise AssertionError(f"[{case}] every rank should raise ValueError when {refused}, "
                         "not return")


def _call_with_share(share, fn):
    return fn(share)


def run_with_rank_inputs(world, fn, per_rank_inputs: list, timeout: float | None = None) -> list:
    """Run fn(per_rank_inputs[r]) on every rank r of `world` (each rank is sent its own input
    only); return the per-rank results. A rank that raises surfaces as labkit.RankError, a hang
    as labkit.CallTimeout after `timeout` seconds."""
    if len(per_rank_inputs) != world.size:
        raise ValueError(f"one input per rank expected: world has {world.size} ranks, "
                         f"got {len(per_rank_inputs)} inputs")
    return world.run_each(_call_with_share, list(per_rank_inputs), fn, timeout=timeout)


def _all_reduce_own_row(row: list, op: str) -> list:
    import torch
    import torch.distributed as dist
    tensor = torch.tensor(row, dtype=torch.float64)
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()))
    return tensor.tolist()


def real_all_reduce(world, per_rank_values: list, op: str = "sum") -> list:
    """What torch.distributed.all_reduce really leaves on each rank (float64), as lists."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    if len(per_rank_values) != world.size:
        raise ValueError(f"one row per rank expected: world has {world.size} ranks, "
                         f"got {len(per_rank_values)} rows")
    return world.run_each(_all_reduce_own_row, [list(map(float, row)) for row in per_rank_values],
                          op)


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
    if not results:
        raise AssertionError(f"{what}: no result came back (expected one per rank)")
    for rank, result in enumerate(results):
        if not close(result, expected):
            raise AssertionError(f"rank {rank}: {what} is {result!r}, expected {expected!r}"
                                 + (f"; {hint}" if hint else ""))
