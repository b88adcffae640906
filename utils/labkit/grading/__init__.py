"""Instructor autograding for labs whose code runs on several ranks.

    labkit grade LAB SUBMISSIONS_DIR [--jobs N] [--out DIR]     # see docs/INSTRUCTORS.md

    from labkit.grading import grade
    report = grade("lab00_first_collectives", "incoming/", jobs=2)

nbgrader keeps the bookkeeping (gradebook, restored test cells, feedback); the verdicts come from a
trusted process in which no student code runs (trusted.py), while the student's cells run in a
sandboxed kernel (sandbox.py). For lab authors, `check` is the comparison to use in test cells.

Kept light on purpose: the sandboxed kernel imports labkit.grading._kernel_side.
"""


def grade(*args, **kwargs):
    from labkit.grading.pipeline import grade as _grade
    return _grade(*args, **kwargs)


def check(actual, expected, what: str = "the result", rtol: float | None = None,
          atol: float | None = None, hint: str = "") -> None:
    """Assert that `actual` matches `expected` (tensors, numbers, nested lists/tuples/dicts).

    Tensors are compared with torch.testing.assert_close (default tolerances of their dtype, or
    rtol/atol); numbers as float64 tensors. The failure names `what`, and ends with `hint`.
    """
    import torch

    def as_tensor(value):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (int, float, bool)):
            return torch.tensor(float(value), dtype=torch.float64)
        return None

    def walk(a, e, where):
        ta, te = as_tensor(a), as_tensor(e)
        if te is not None:
            if ta is None:
                raise AssertionError(f"{what}{where}: expected a tensor or number, got "
                                     f"{type(a).__name__}")
            if ta.shape != te.shape:
                raise AssertionError(f"{what}{where}: shape {tuple(ta.shape)}, expected "
                                     f"{tuple(te.shape)}")
            try:
                torch.testing.assert_close(ta.to(te.dtype), te, rtol=rtol, atol=atol)
            except AssertionError as error:
                raise AssertionError(f"{what}{where}: {error}") from None
        elif isinstance(e, dict):
            if not isinstance(a, dict) or set(a) != set(e):
                raise AssertionError(f"{what}{where}: keys {sorted(map(str, a)) if isinstance(a, dict) else type(a).__name__}, "
                                     f"expected {sorted(map(str, e))}")
            for key in e:
                walk(a[key], e[key], f"{where}[{key!r}]")
        elif isinstance(e, (list, tuple)):
            if not isinstance(a, (list, tuple)) or len(a) != len(e):
                raise AssertionError(f"{what}{where}: expected {len(e)} items, got "
                                     f"{len(a) if isinstance(a, (list, tuple)) else type(a).__name__}")
            for i, (x, y) in enumerate(zip(a, e)):
                walk(x, y, f"{where}[{i}]")
        elif a != e:
            raise AssertionError(f"{what}{where} is {a!r}, expected {e!r}")

    try:
        walk(actual, expected, "")
    except AssertionError as error:
        raise AssertionError(f"{error}" + (f"; {hint}" if hint else "")) from None
