"""The ledger of formula checks: every formula the course teaches, and the evidence for it.

    from labkit import formulas
    formulas.check("ring all-reduce: bytes sent per rank", predicted=2 * (P - 1) / P * n,
                   measured=traffic.sent[0], rel_tol=0.01, unit="B", kind="measured",
                   why="gloo framing: 144 B per message x 4 messages")

A check compares what a formula predicts with what real ranks did (bytes counted, memory measured,
time taken) under a stated tolerance. It prints one line in the cell, records itself in the cell's
output (MIME type `application/vnd.labkit.formula+json`), and raises `FormulaMismatch` when the
measurement is outside the tolerance. `labkit build` (`make course`) collects the records of every
executed notebook into build/formulas.md and the HTML index: the course's "no naked formula" rule,
counted.

`predicted` and `measured` may be numbers or equal-length sequences of numbers (a sweep: the error
is the worst element's). `bound="upper"` checks measured <= predicted (within the tolerance), and
`bound="lower"` measured >= predicted: for formulas that are limits (the most microbatches alive,
the least bytes a split must move).

Every check says what kind of evidence it is (`kind=`, required; docs/AUTHORS.md has examples):

- "measured": a quantity produced by real ranks, the OS (socket counters, /proc) or torch's
  profiler and allocator, against a formula computed independently of the code that produced it;
- "reproduction": the course's formula against a paper's printed figures (name it in `source`);
- "simulation": against a simulation (a virtual clock, a Monte-Carlo); say of what in `basis=`
  (or in `source`): the agreement shows the arithmetic, not that the model fits the world;
- "timing": a wall-clock time or a bandwidth on a machine others share, recorded with its band
  (the tolerance) and never raised: a loaded machine is not a wrong formula. `timing=True` is the
  old spelling of kind="timing". Bytes, counts and values are never timings.

There is no "identity" kind: a check whose two sides come from the same definition (a count
compared with itself, a function of the notebook tested against its own formula) is a unit test
and lives in tests/, not in the ledger. `why=` says why the tolerance is what it is ("gloo
framing: 144 B per message x 12 messages"); the ledger shows it next to the tolerance.
"""
from __future__ import annotations

import dataclasses
import json
import math

MIME = "application/vnd.labkit.formula+json"
BOUNDS = (None, "upper", "lower")
KINDS = ("measured", "reproduction", "simulation", "timing")


class FormulaMismatch(AssertionError):
    """A measurement disagrees with the formula beyond the stated tolerance."""


@dataclasses.dataclass
class FormulaCheck:
    name: str
    predicted: list
    measured: list
    rel_tol: float
    abs_tol: float | list       # one value, or one per value (a count of messages per t, say)
    bound: str | None
    unit: str
    source: str
    worst_error: float          # relative error of the worst element (inf where predicted is 0)
    passed: bool
    timing: bool = False        # a time on a shared machine: shown, never raised
    kind: str | None = None     # one of KINDS (None only for a bare `evaluate`)
    why: str = ""               # why the tolerance is what it is
    basis: str = ""             # for a simulation: what was simulated

    def as_record(self) -> dict:
        record = dataclasses.asdict(self)
        record["worst_error"] = None if math.isinf(self.worst_error) else self.worst_error
        return record

    def line(self) -> str:
        """The one line a cell shows."""
        def show(values):
            if len(values) == 1:
                return f"{values[0]:.6g}{(' ' + self.unit) if self.unit else ''}"
            return f"[{', '.join(f'{v:.4g}' for v in values[:6])}{', ...' if len(values) > 6 else ''}]" \
                   f"{(' ' + self.unit) if self.unit else ''}"
        mark = "ok  " if self.passed else ("off " if self.timing else "FAIL")
        relation = {None: "", "upper": " (an upper bound)", "lower": " (a lower bound)"}[self.bound]
        tolerance = []
        if self.rel_tol:
            tolerance.append(f"{self.rel_tol:.3g} relative")
        if isinstance(self.abs_tol, list):
            tolerance.append(f"{show(self.abs_tol)} absolute, per value")
        elif self.abs_tol:
            tolerance.append(f"{self.abs_tol:.3g}{(' ' + self.unit) if self.unit else ''} absolute")
        error = error_text(self.predicted, self.measured, self.worst_error, self.unit)
        measured_as = {"reproduction": "reproduced", "simulation": "simulated",
                       "timing": "timed"}.get(self.kind, "measured")
        why = f" ({self.why})" if self.why else ""
        return (f"[formula {mark}] {self.name}{relation}: predicted {show(self.predicted)}, "
                f"{measured_as} {show(self.measured)}; error {error}, tolerance "
                f"{' or '.join(tolerance) or 'exact'}{why}")


def error_text(predicted: list, measured: list, worst_error: float | None, unit: str = "") -> str:
    """The worst error as a person reads it: relative, or absolute where a predicted value is 0
    (a relative error of 5.55e-17 over 0 is infinite, and says nothing)."""
    if worst_error == 0:
        return "exact"
    if worst_error is not None and math.isfinite(worst_error):
        return f"{worst_error:.2%}"
    if not all(math.isfinite(v) for v in list(predicted) + list(measured)):
        return "not finite"
    gap = max(abs(m - p) for p, m in zip(predicted, measured))
    return f"{gap:.3g}{(' ' + unit) if unit else ''} absolute"


def _as_list(value, what: str) -> list:
    if hasattr(value, "tolist"):             # tensors and numpy arrays
        value = value.tolist()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)]
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return [float(v) for v in value]
    raise TypeError(f"formulas.check: {what} must be a number or a non-empty sequence of numbers, "
                    f"got {value!r}")


def _within(predicted: float, measured: float, rel_tol: float, abs_tol: float,
            bound: str | None) -> bool:
    slack = max(rel_tol * abs(predicted), abs_tol)
    if bound == "upper":
        return measured <= predicted + slack
    if bound == "lower":
        return measured >= predicted - slack
    return abs(measured - predicted) <= slack


def _kind_of(name: str, kind: str | None, timing: bool, source: str, basis: str,
             required: bool) -> str | None:
    """The declared kind, checked: one of KINDS; timing=True means (and implies) "timing"."""
    if timing:
        if kind not in (None, "timing"):
            raise ValueError(f"formulas.check({name!r}): timing=True is kind='timing', but "
                             f"kind={kind!r} was given; drop timing=True or the other kind")
        return "timing"
    if kind is None:
        if required:
            raise ValueError(f"formulas.check({name!r}): no kind given; say what kind of evidence "
                             f"this is: kind= one of {KINDS} (see docs/AUTHORS.md)")
        return None
    if kind == "identity":
        raise ValueError(f"formulas.check({name!r}): 'identity' is not a kind of evidence: both "
                         f"sides come from the same definition; make it a unit test in tests/ or "
                         f"measure the quantity independently (kinds: {KINDS})")
    if kind not in KINDS:
        raise ValueError(f"formulas.check({name!r}): kind must be one of {KINDS}, got {kind!r}")
    if kind == "reproduction" and not source.strip():
        raise ValueError(f"formulas.check({name!r}): a reproduction names its source "
                         f"(source='Rajbhandari et al. 2020, table 1')")
    if kind == "simulation" and not (basis.strip() or source.strip()):
        raise ValueError(f"formulas.check({name!r}): a simulation says what it simulates "
                         f"(basis='a virtual clock whose step is ...')")
    return kind


def evaluate(name: str, predicted, measured, rel_tol: float = 0.0, abs_tol: float = 0.0,
             bound: str | None = None, unit: str = "", source: str = "",
             timing: bool = False, *, kind: str | None = None, why: str = "",
             basis: str = "") -> FormulaCheck:
    """The check as data, without printing or raising (what `check` records). `kind` may be
    left out here (a record without a kind cannot be published: `check` requires it)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("formulas.check: name the formula (a non-empty string)")
    kind = _kind_of(name.strip(), kind, timing, source, basis, required=False)
    if bound not in BOUNDS:
        raise ValueError(f"formulas.check: bound must be one of {BOUNDS}, got {bound!r}")
    per_value = isinstance(abs_tol, (list, tuple)) or hasattr(abs_tol, "tolist")
    tolerances = _as_list(abs_tol, "abs_tol") if per_value else None
    if rel_tol < 0 or (min(tolerances) if per_value else abs_tol) < 0:
        raise ValueError(f"formulas.check: tolerances must be >= 0, got rel_tol={rel_tol}, "
                         f"abs_tol={abs_tol}")
    predicted, measured = _as_list(predicted, "predicted"), _as_list(measured, "measured")
    if len(predicted) != len(measured):
        raise ValueError(f"formulas.check({name!r}): {len(predicted)} predicted values but "
                         f"{len(measured)} measured ones")
    if per_value and len(tolerances) != len(predicted):
        raise ValueError(f"formulas.check({name!r}): abs_tol has {len(tolerances)} values for "
                         f"{len(predicted)} predicted ones (give one tolerance, or one per value)")
    if not per_value:
        tolerances = [float(abs_tol)] * len(predicted)
    if not all(math.isfinite(v) for v in predicted + measured):
        passed, worst = False, math.inf
    else:
        passed = all(_within(p, m, rel_tol, a, bound)
                     for p, m, a in zip(predicted, measured, tolerances))
        errors = [0.0 if p == m else (abs(m - p) / abs(p) if p else math.inf)
                  for p, m in zip(predicted, measured)]
        worst = max(errors)
    return FormulaCheck(name.strip(), predicted, measured, float(rel_tol),
                        tolerances if per_value else float(abs_tol), bound,
                        unit, source, worst, passed, kind == "timing", kind, why.strip(),
                        basis.strip())


def check(name: str, predicted, measured, rel_tol: float = 0.0, abs_tol: float = 0.0,
          bound: str | None = None, unit: str = "", source: str = "",
          timing: bool = False, *, kind: str | None = None, why: str = "",
          basis: str = "") -> FormulaCheck:
    """Record a formula checked against a measurement; raise FormulaMismatch if it fails.

    name: what the formula gives ("ring all-reduce: bytes sent per rank").
    predicted, measured: numbers or equal-length sequences of numbers.
    rel_tol, abs_tol: the stated tolerance (a value passes within either); both 0 means exact.
    abs_tol may be a sequence, one tolerance per value (where each value's slack has its own
    count: messages at each t, say).
    bound: None (equal), "upper" (measured <= predicted) or "lower" (measured >= predicted).
    unit: shown after the numbers ("B", "s", "GB/s"). source: where the formula comes from
    (a paper, a section), shown in the ledger. timing: a time measured on a shared machine
    (recorded, never raised; the same as kind="timing").
    kind (required): "measured", "reproduction", "simulation" or "timing" (module docstring).
    why: the tolerance's reason, shown in the ledger. basis: what a simulation simulates.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError("formulas.check: name the formula (a non-empty string)")
    _kind_of(name.strip(), kind, timing, source, basis, required=True)
    result = evaluate(name, predicted, measured, rel_tol, abs_tol, bound, unit, source, timing,
                      kind=kind, why=why, basis=basis)
    _publish(result)
    if not result.passed and not result.timing:
        raise FormulaMismatch(result.line() + ". The measurement and the formula disagree: "
                              "check the inputs of the formula, then what was measured.")
    return result


def _publish(result: FormulaCheck) -> None:
    """Show the line; in a kernel, also attach the record to the cell's output."""
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is None or not hasattr(shell, "display_pub"):
        print(result.line())
        return
    from IPython.display import publish_display_data
    publish_display_data({"text/plain": result.line(), MIME: result.as_record()})


def records_in_notebook(nb) -> list[dict]:
    """Every formula record in an executed notebook (an nbformat node or its dict)."""
    found = []
    for cell in nb.get("cells", []):
        for output in cell.get("outputs", []):
            record = output.get("data", {}).get(MIME)
            if isinstance(record, str):
                record = json.loads(record)
            if isinstance(record, dict):
                found.append(record)
    return found
