"""What every drill is made of: a problem with its answer, the parsing of what a person types,
the verdict, and the link to the chapter that teaches it. No torch here.

A numeric answer is typed the way people write it on a whiteboard: `1.75e9`, `1.75 GB`, `1,750 MB`,
`27.3%`, `3/11`, `2^20`. A bare number is read in the unit the question asks for; a number with a
unit is converted (`1750 MB` answers a question asked in GB). A list answer (ranks of a group) is
`0, 4, 8` or `[0, 4, 8]`.
"""
from __future__ import annotations

import dataclasses
import html
import math
import re
from pathlib import Path

from labkit.errors import LabkitError


class DrillError(LabkitError, ValueError):
    """A drill asked for something that does not exist (a topic, a drill id); the message lists
    what does."""


class MissingFormula(LabkitError, LookupError):
    """A drill needs a chapter's function that is not in labkit (yet): `name` is its dotted name."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name} is not available: {reason}")
        self.name = name
        self.reason = reason


# ---- the chapters ------------------------------------------------------------------------------

CHAPTERS = {0: "the lab environment", 1: "collectives", 2: "data parallelism and numerics",
            3: "memory and ZeRO", 4: "tensor parallelism", 5: "pipeline parallelism",
            6: "3D parallelism", 7: "mixture of experts", 8: "checkpoints",
            9: "failures at scale", 10: "long sequences"}
COURSE = Path(__file__).resolve().parents[3] / "course"     # utils/labkit/drill -> the repository


def chapter_file(chapter: int) -> str | None:
    """course/NN_<title>.ipynb of a chapter, found by its number (None where this copy of the course has no such notebook)."""
    found = sorted(COURSE.glob(f"{chapter:02d}_*.ipynb")) if COURSE.is_dir() else []
    return f"course/{found[0].name}" if found else None


def chapter_link(chapter: int, section: str = "") -> str:
    """'chapter 7 (course/07_mixture_of_experts.ipynb), section 5' in plain words."""
    where = chapter_file(chapter)
    title = CHAPTERS.get(chapter, "")
    shown = f"chapter {chapter}, {title}" + (f" ({where})" if where else " (not in this copy of the course)")
    return shown + (f", {section}" if section else "")


def chapter_link_html(chapter: int, section: str = "") -> str:
    """The same as a link a notebook in course/ can follow."""
    where = chapter_file(chapter)
    title = html.escape(f"chapter {chapter}, {CHAPTERS.get(chapter, '')}")
    shown = f'<a href="{html.escape(Path(where).name)}" target="_blank">{title}</a>' if where \
        else f"{title} (not in this copy of the course)"
    return shown + (f", {html.escape(section)}" if section else "")


# ---- units -------------------------------------------------------------------------------------

UNITS = {
    "bytes": {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40},
    "seconds": {"s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "min": 60, "h": 3600},
    "bandwidth": {"B/s": 1, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12},
    "fraction": {"%": 0.01},
}
MULTIPLIERS = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}    # "1.5G": a bare SI prefix
_ALIASES = {"sec": "s", "seconds": "s", "second": "s", "minutes": "min", "mins": "min",
            "hours": "h", "hour": "h", "bytes": "B", "byte": "B", "percent": "%", "kb": "KB",
            "mb": "MB", "gb": "GB", "tb": "TB", "gb/s": "GB/s", "mb/s": "MB/s"}


def dimension(unit: str) -> str | None:
    """The quantity a unit measures ("bytes", "seconds", ...); None for a plain number."""
    return next((dim for dim, table in UNITS.items() if unit in table), None)


def factor(unit: str) -> float:
    dim = dimension(unit)
    return UNITS[dim][unit] if dim else 1.0


class AnswerError(ValueError):
    """What a person typed cannot be read as an answer; the message says what to type instead."""


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"


def _read_number(text: str) -> float:
    """One number: 1.5, 1.5e9, 3/11, 2^20, 2**20, 1,024 (thousands separators)."""
    t = text.replace(",", "").replace("_", "").replace(" ", "")
    if re.fullmatch(_NUMBER, t):
        return float(t)
    if m := re.fullmatch(rf"({_NUMBER})/({_NUMBER})", t):
        top, bottom = float(m[1]), float(m[2])
        if bottom == 0:
            raise AnswerError(f"{text!r} divides by zero")
        return top / bottom
    if m := re.fullmatch(rf"({_NUMBER})(?:\^|\*\*)({_NUMBER})", t):
        return float(m[1]) ** float(m[2])
    if m := re.fullmatch(rf"({_NUMBER})[x*]10(?:\^|\*\*)({_NUMBER})", t):
        return float(m[1]) * 10 ** float(m[2])
    raise AnswerError(f"{text.strip()!r} is not a number")


def parse_number(text: str, unit: str = "") -> float:
    """What a person typed, in the question's `unit` (see the module's docstring)."""
    if text is None or not str(text).strip():
        raise AnswerError("empty answer")
    raw = str(text).strip().lstrip("~≈=").strip()
    m = re.fullmatch(r"(.*?\d\.?)\s*([a-zA-Zµ%][a-zA-Zµ/%]*)", raw)    # a unit after a digit
    number_part, given = (m[1], m[2]) if m else (raw, "")
    given = _ALIASES.get(given, _ALIASES.get(given.lower(), given)) if given else ""
    scale = 1.0
    if given and dimension(given) is None:
        if given in MULTIPLIERS:                        # 1.5G: a bare prefix, no unit
            scale, given = MULTIPLIERS[given], ""
        else:
            raise AnswerError(f"{given!r} is not a unit I know"
                              + (f" (this answer is in {unit})" if unit else
                                 " (this answer is a plain number)"))
    value = _read_number(number_part) * scale
    if not math.isfinite(value):
        raise AnswerError(f"{text.strip()!r} is not a finite number")
    if not given:
        return value
    if dimension(given) != dimension(unit):
        wanted = f"{unit} ({dimension(unit)})" if dimension(unit) else "a plain number"
        raise AnswerError(f"{given!r} measures {dimension(given)}, but this answer is {wanted}")
    return value * factor(given) / factor(unit)


def parse_ranks(text: str) -> tuple:
    """'0, 4, 8', '[0 4 8]' or '(1, 0, 2)' -> (0, 4, 8): whole numbers only."""
    if text is None or not str(text).strip():
        raise AnswerError("empty answer")
    inner = str(text).strip().strip("[](){}")
    parts = [p for p in re.split(r"[,\s;]+", inner) if p]
    if not parts or not all(re.fullmatch(r"[-+]?\d+", p) for p in parts):
        raise AnswerError(f"{str(text).strip()!r} is not a list of whole numbers")
    return tuple(int(p) for p in parts)


# ---- a problem and its verdict -------------------------------------------------------------------

@dataclasses.dataclass
class Problem:
    """One drawn instance of a numeric drill: the question, its answer, how it is derived."""
    drill_id: str
    topic: str
    title: str
    question: str                 # plain text; `code` in backticks
    answer: object                # a number (in `unit`), or a tuple of ints for kind "set"/"tuple"
    unit: str                     # "GB", "ms", "%", "" for a plain number
    solution: list                # the worked solution, one step per line
    chapter: int
    section: str
    uses: tuple                   # the chapter functions the answer comes from
    params: dict
    seed: object = None
    kind: str = "number"          # "number"; "set" (order free) or "tuple" (ordered) of ints
    rel_tol: float = 0.02         # answers worked out by hand are rounded
    abs_tol: float = 0.0
    source: str = ""
    slips: tuple = ()             # ((ratio to the answer, what that slip is), ...): this drill's own

    def expected(self) -> str:
        if self.kind != "number":
            return "[" + ", ".join(str(v) for v in self.answer) + "]"
        return show(self.answer, self.unit)

    def how_to_answer(self) -> str:
        if self.kind == "set":
            return "Answer with the ranks, e.g. 0, 4, 8 (any order)."
        if self.kind == "tuple":
            return "Answer with the numbers in order, e.g. 1, 0, 2."
        exact = self.rel_tol == 0 and self.abs_tol < 1
        return (f"Answer in {self.unit}" if self.unit else "Answer with a number") + \
            (" (exactly)." if exact else f" (within {self.rel_tol:.0%}).")


@dataclasses.dataclass
class Verdict:
    status: str                   # "right", "wrong" or "invalid" (nothing recorded; ask again)
    message: str
    value: object = None


def check(problem: Problem, text) -> Verdict:
    """The verdict on what a person typed; never raises on bad input."""
    try:
        if problem.kind == "number":
            value = parse_number(text, problem.unit)
        else:
            value = parse_ranks(text)
    except AnswerError as exc:
        hint = {"number": f"Type a number such as {example(problem)}",
                "set": "Type the ranks separated by commas, such as 0, 4, 8",
                "tuple": "Type the numbers in order, separated by commas, such as 1, 0, 2"}
        return Verdict("invalid", f"{str(exc)[0].upper()}{str(exc)[1:]}. "
                       f"{hint[problem.kind]}, or 'skip' to see the worked solution.")
    if problem.kind == "set":
        right = sorted(value) == sorted(problem.answer)
    elif problem.kind == "tuple":
        right = tuple(value) == tuple(problem.answer)
    else:
        right = abs(value - problem.answer) <= problem.rel_tol * abs(problem.answer) + \
            problem.abs_tol
        if not right and problem.unit == "%" and problem.answer and \
                abs(100 * value - problem.answer) <= problem.rel_tol * abs(problem.answer):
            return Verdict("invalid", f"{value:g} looks like a fraction; this answer is in %: "
                           f"type {100 * value:g} or {100 * value:g}%.")
    if right:
        return Verdict("right", f"Right: {problem.expected()}.", value)
    shown = show(value, problem.unit) if problem.kind == "number" else list(value)
    slip = recognise_slip(value, problem) if problem.kind == "number" else None
    return Verdict("wrong", f"Not quite: you said {shown}, the answer is {problem.expected()}."
                   + (f" {slip}" if slip else ""), value)


def recognise_slip(value: float, problem: Problem) -> str | None:
    """A wrong number whose ratio to the answer is a known slip gets a line naming it: a factor of
    2 (forward only, one direction), (P-1)/P (the bus factor of a ring), P (per rank against the
    whole group), 1000 or 1024 (units), after the drill's own `slips` (a checkpoint counted
    with its gradients, a per-GPU rate not divided by the GPUs). None when the ratio says
    nothing."""
    answer = float(problem.answer)
    if not answer or not value or not math.isfinite(value):
        return None
    ratio = value / answer
    near = lambda target, tol=0.01: abs(ratio / target - 1) <= tol
    for target, slip in problem.slips:  # the drill's own slips first: they know its factors
        if near(target):
            return slip
    ranks = [int(problem.params[k]) for k in ("P", "dp", "tp", "pp")
             if isinstance(problem.params.get(k), int) and problem.params[k] >= 3]
    for P in ranks:                     # P >= 3: at P = 2, (P-1)/P = 1/2 reads as a factor 2
        if near((P - 1) / P):
            return f"That is (P-1)/P = {P - 1}/{P} of the answer: a step counted once too few?"
        if near(P / (P - 1)):
            return (f"That is P/(P-1) = {P}/{P - 1} times the answer: the (P-1)/P factor is "
                    "missing (a rank keeps its own share; it never sends it).")
        if near(P):
            return f"That is P = {P} times the answer: the whole group's, not one rank's?"
        if near(1 / P):
            return f"That is 1/P = 1/{P} of the answer: one rank's share, not the total?"
    for factor, slip in ((0.5, "half the answer: forward only, or one direction of two?"),
                         (2.0, "twice the answer: a pass or a direction counted twice?")):
        if near(factor):
            return f"That is {slip}"
    for factor, slip in ((1e3, "1000"), (1e-3, "1/1000"), (1e6, "10^6"), (1e-6, "10^-6")):
        if near(factor):
            return f"That is {slip} times the answer: check the units ({problem.unit or 'none'})."
    for power in (1, 2, 3):
        for factor, slip in ((1.024 ** power, "binary"), (1.024 ** -power, "decimal")):
            if near(factor, 0.002) and problem.unit in ("KB", "MB", "GB", "TB"):
                return (f"That is {factor:.3f} times the answer: {slip} units? "
                        f"This answer's {problem.unit} is decimal (1 GB = 10^9 B).")
    return None


# ---- numbers as people write them ----------------------------------------------------------------

def sig(x: float, digits: int = 4) -> str:
    """x with `digits` significant digits, no exponent for everyday sizes: 1.75, 4688, 0.0273."""
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    if float(x).is_integer() and abs(x) < 1e15:
        return f"{int(x):,}"
    magnitude = math.floor(math.log10(abs(x)))
    if -4 <= magnitude < 15:
        decimals = max(digits - 1 - magnitude, 0)
        text = f"{x:,.{decimals}f}"
        return text.rstrip("0").rstrip(".") if decimals else text
    return f"{x:.{digits - 1}e}"


def show(x: float, unit: str = "") -> str:
    return sig(x) + (("" if unit == "%" else " ") + unit if unit else "")


def example(problem: Problem) -> str:
    """A sample of the answer's format that says nothing about its value."""
    if problem.unit == "%":
        return "12.5 or 12.5%"
    return f"12.5 or 12.5 {problem.unit}" if problem.unit else "12 or 1.5e3"


def bytes_text(n: float) -> str:
    """1.75e9 -> '1.75 GB' (powers of 1000, as the course's ledgers)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{sig(n / size)} {unit}"
    return f"{sig(n)} B"


def html_text(text: str) -> str:
    """Plain question text as HTML: escaped, `code` in <code>, paragraphs kept."""
    escaped = html.escape(text)
    escaped = re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)
    return "<br>".join(escaped.splitlines())


def taught_in(links, as_html: bool = False) -> str:
    """'Taught in chapter 7, ... (course/07_....ipynb), section 5; ...' for [(chapter, section)]."""
    link = chapter_link_html if as_html else chapter_link
    return "Taught in " + "; ".join(link(c, s) for c, s in links) + "."
