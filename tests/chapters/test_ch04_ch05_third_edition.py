"""Chapters 4 and 5, third edition (issue 28): what the course notebooks now write themselves or
state as a figure, checked against labkit and against arithmetic done here.

- every gloo framing figure in the two notebooks' prose is labkit.collectives' constant;
- chapter 5's GPipe generator and buffered-send simulation, written in the notebook, agree with
  labkit.pipeline on every schedule of random shapes and orders, deadlocked ones included;
- chapter 5's table of bytes per layer per step (pipeline, tensor, data parallel) against the
  three formulas computed here from scratch.
"""
import ast
import json
import random
import re
from pathlib import Path

import pytest
import torch

import labkit
from labkit import pipeline
from labkit.collectives import GLOO_FRAMING_BYTES, GLOO_HEADER_BYTES, GLOO_NOTICE_BYTES
from labkit.pipeline import Action

ROOT = Path(__file__).resolve().parents[2]
CH4 = ROOT / "course" / "04_tensor_parallel.ipynb"
CH5 = ROOT / "course" / "05_pipeline_parallel.ipynb"


def _cells(path, kind):
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]
            if c["cell_type"] == kind]


def _function(path, name):
    """The function `name` defined in one of the notebook's code cells, alone (the rest of the
    cell, which needs ranks or earlier cells, is not run)."""
    namespace = {"Action": Action, "pipeline": pipeline, "labkit": labkit, "torch": torch}
    for source in _cells(path, "code"):
        if f"def {name}(" not in source:
            continue
        tree = ast.parse(source)
        node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        exec(compile(ast.Module(body=[node], type_ignores=[]), f"{path.name}:{name}", "exec"),
             namespace)
        return namespace[name]
    raise AssertionError(f"{path.name} defines no function {name!r} in a code cell")


# ---- gloo's framing: one figure, the constant's ------------------------------------------------

FRAMING = re.compile(r"(\d+)(?:-byte|\s+bytes?)\s+(?:of\s+)?(header|notice|per\s+message)")


@pytest.mark.parametrize("path", [CH4, CH5], ids=["ch04", "ch05"])
def test_framing_figures_in_prose_are_the_constant(path):
    allowed = {"header": GLOO_HEADER_BYTES, "notice": GLOO_NOTICE_BYTES,
               "per message": GLOO_FRAMING_BYTES}
    found = []
    for text in _cells(path, "markdown"):
        for figure, what in FRAMING.findall(text):
            what = re.sub(r"\s+", " ", what)
            found.append((int(figure), what))
            assert int(figure) == allowed[what], (
                f"{path.name} states gloo's {what} as {figure} bytes; "
                f"labkit.collectives says {allowed[what]} (GLOO_*_BYTES)")
    assert found, f"{path.name}: no gloo framing figure found in its prose (the regex is stale?)"
    assert any("GLOO_FRAMING_BYTES" in text for text in _cells(path, "markdown")), \
        f"{path.name}: the prose should name labkit.collectives.GLOO_FRAMING_BYTES"


def test_framing_regex_catches_the_old_figure():
    """The check above fails on the figure chapter 4 used to print (sensitivity)."""
    old = "gloo's per-message headers (288 bytes\nper message, measured)"
    (figure, what), = FRAMING.findall(old)
    assert int(figure) != GLOO_FRAMING_BYTES and re.sub(r"\s+", " ", what) == "per message"


# ---- chapter 5: GPipe and the buffered simulation, written in the notebook ---------------------

gpipe_schedule = _function(CH5, "gpipe_schedule")
stuck_with_buffered_sends = _function(CH5, "stuck_with_buffered_sends")


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_notebook_gpipe_is_labkits(p, m):
    assert gpipe_schedule(p, m) == pipeline.gpipe(p, m)


def _split_backwards(schedule, rng):
    """Some B i replaced by I i W i (zero bubble's split), at random."""
    out = []
    for actions in schedule:
        stage = []
        for a in actions:
            if a.kind == "B" and rng.random() < 0.5:
                stage += [Action("I", a.microbatch), Action("W", a.microbatch)]
            else:
                stage.append(a)
        out.append(stage)
    return out


def _random_schedules(count=300, seed=0):
    rng = random.Random(seed)
    for _ in range(count):
        p, m = rng.randint(1, 4), rng.randint(1, 5)
        base = pipeline.gpipe(p, m) if m < p or rng.random() < 0.5 else \
            pipeline.torch_schedule("1F1B", p, m)
        schedule = _split_backwards(base, rng)
        if rng.random() < 0.6:                  # shuffle some stages: many of these deadlock
            schedule = [rng.sample(s, len(s)) if rng.random() < 0.5 else s for s in schedule]
        yield p, m, schedule


def test_notebook_simulation_agrees_with_labkit_on_random_schedules():
    finished = deadlocked = 0
    for p, m, schedule in _random_schedules():
        ours = stuck_with_buffered_sends(schedule)
        deadlock = pipeline.check_schedule(schedule, m).deadlock
        expected = None if deadlock is None else deadlock.stuck
        assert ours == expected, (f"p={p}, m={m}: the notebook says {ours}, labkit {expected} "
                                  f"for\n{pipeline.format_schedule(schedule)}")
        finished += ours is None
        deadlocked += ours is not None
    assert finished > 30 and deadlocked > 30, (finished, deadlocked)   # both verdicts exercised


def test_notebook_simulation_on_the_chapters_deadlocks():
    crossed = pipeline.parse("F0 F1 F2 B0 B1 B2\nF0 F1 B0 F2 B1 B2\nF0 B0 F1 B1 F2 B2\n"
                             "F1 B1 F0 B0 F2 B2")
    assert stuck_with_buffered_sends(crossed) == {0: Action("B", 0), 1: Action("B", 0),
                                                  2: Action("B", 0), 3: Action("F", 1)}
    zb = pipeline.zero_bubble(pipeline.torch_schedule("1F1B", 3, 6), 6)
    assert stuck_with_buffered_sends(zb) is None
    w_first = [[Action("F", 0), Action("W", 0), Action("I", 0)]]          # W before its I
    assert stuck_with_buffered_sends(w_first) == {0: Action("W", 0)}


# ---- chapter 5: bytes per layer per step, three axes --------------------------------------------

def test_pipeline_tensor_data_bytes_table(capsys):
    source = next(s for s in _cells(CH5, "code") if "H_REAL, T_REAL" in s)
    namespace = {}
    exec(compile(source, f"{CH5.name}:bytes per layer", "exec"), namespace)
    per_layer = namespace["per_layer"]
    H, T, layers, m, degree, b = 12288, 2048, 96, 8, 8, 2
    n = T * H * b                                           # one [1, T, H] BF16 activation
    assert per_layer["pipeline, a middle stage"] == pytest.approx(2 * m * n / (layers / degree))
    assert per_layer["tensor parallel"] == pytest.approx(m * 4 * 2 * (degree - 1) / degree * n)
    assert per_layer["data parallel"] == pytest.approx(2 * (degree - 1) / degree * 12 * H * H * b)
    ratio = per_layer["tensor parallel"] / per_layer["pipeline, a middle stage"]
    assert 35 < ratio < 50, ratio                           # the prose says "about 40 times"
    markdown = "\n".join(_cells(CH5, "markdown"))
    assert "about\n40 times more" in markdown or "about 40 times more" in markdown


# ---- chapter 5: interleaving's memory penalty, and its message count in the prose ---------------

@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_stage0_holds_megatrons_penalty(p, v):
    """Stage 0 of interleaved 1F1B keeps v p + p - 1 chunk-microbatches at its peak, i.e.
    p (1 + (p-1)/(p v)) stage-microbatches, once m >= 2p (the chapter's check, on more shapes)."""
    for m in (2 * p, 3 * p, 5 * p):
        alive = pipeline.check_schedule(pipeline.interleaved_1f1b(p, m, v), m).peak_alive[0]
        assert alive == v * p + p - 1, (p, v, m, alive)
        assert alive / v == pytest.approx(p * (1 + (p - 1) / (p * v)))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_torch_interleaved_order_holds_the_same_penalty(p):
    for m in (2 * p, 4 * p):
        order = pipeline.torch_schedule("Interleaved1F1B", p, m, 2)
        assert pipeline.check_schedule(order, m).peak_alive[0] == 3 * p - 1


def test_prose_no_longer_says_interleaving_sends_v_times():
    markdown = "\n".join(_cells(CH5, "markdown"))
    assert "Interleaving sends v = 2 times" not in markdown
    assert "(v p - 1)/(p - 1) times as\nmany messages" in markdown
    assert "p\\left(1 + \\frac{p-1}{p\\,v}\\right)" in markdown
