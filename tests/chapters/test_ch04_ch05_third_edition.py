"""Chapters 4 and 5, third edition (issue 28): what the course notebooks now write themselves or
state as a figure, checked against labkit and against arithmetic done here.

- every gloo framing figure in the two notebooks' prose is labkit.collectives' constant;
- chapter 5's GPipe generator and buffered-send simulation, written in the notebook, agree with
  labkit.pipeline on every schedule of random shapes and orders, deadlocked ones included;
- chapter 5's table of bytes per layer per step (pipeline, tensor, data parallel) against the
  three formulas computed here from scratch;
- torch's V-shaped tables (ZB-V, DualPipeV) scored in the V layout, and the layout's own map;
- interleaving's first-stage penalty in bytes of saved activations on torch's executor (p = 3).
"""
import ast
import json
import random
import re
from fractions import Fraction
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


# ---- chapter 5: torch's V-shaped tables scored, interleaving's memory measured in bytes ---------

@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_v_layout_maps_back_and_forth(p):
    seen = set()
    for rank in range(p):
        for chunk in (0, 1):
            s = pipeline.virtual_stage(rank, chunk, p, "v")
            assert pipeline.placement(s, p, "v") == (rank, chunk)
            seen.add(s)
    assert seen == set(range(2 * p))
    assert pipeline.virtual_stage(0, 1, p, "v") == 2 * p - 1          # rank 0: first and last
    assert pipeline.virtual_stage(p - 1, 1, p, "v") == p              # rank p-1: the two middle ones
    with pytest.raises(ValueError, match="two chunks"):
        pipeline.virtual_stage(0, 2, p, "v")
    with pytest.raises(ValueError, match="layout"):
        pipeline.placement(0, p, "zigzag")


@pytest.mark.parametrize("p", [2, 3, 4])
def test_torch_v_tables_score_as_the_chapter_says(p):
    """ZB-V: complete, finishes, no idle inside a rank's span, 2p chunk-microbatches alive, the
    ramp (p-1)/2 idle per rank; DualPipeV: complete, finishes, one chunk-microbatch more. Both
    deadlock with blocking sends (like 1F1B), for m = 2p and 4p."""
    for m in (2 * p, 4 * p):
        for name, alive in (("ZBVZeroBubble", 2 * p), ("DualPipeV", 2 * p + 1)):
            table = pipeline.torch_v_schedule(name, p, m)
            report = pipeline.check_schedule(table, m, layout="v")
            assert report.ok, (name, p, m, report)
            assert report.peak_alive == [alive] * p, (name, report.peak_alive)
            assert report.blocking_deadlock is not None
            if name == "ZBVZeroBubble":
                spans = [[report.timeline[(k, a)] for a in acts] for k, acts in enumerate(table)]
                in_span = [max(e for _, e in s) - min(b for b, _ in s) - busy
                           for s, busy in zip(spans, report.busy)]
                assert in_span == [0] * p
                assert [report.makespan - busy for busy in report.busy] == [Fraction(p - 1, 2)] * p


@pytest.mark.parametrize("p", [2, 3])
def test_the_layout_matters_a_v_table_read_looped_fails(p):
    """Sensitivity: the same table under the looped map is not a working schedule (a stage waits
    for a virtual stage that comes after it), so the V result is the map's, not the checker's
    leniency."""
    m = 2 * p
    table = pipeline.torch_v_schedule("ZBVZeroBubble", p, m)
    assert not pipeline.check_schedule(table, m, layout="loop").ok
    with pytest.raises(ValueError, match="two chunks"):
        pipeline.check_schedule(pipeline.interleaved_1f1b(p, 3 * p, 3), 3 * p, layout="v")


def test_notebook_scores_the_v_tables_with_the_v_layout():
    code = "\n".join(_cells(CH5, "code"))
    assert 'torch_v_schedule("ZBVZeroBubble"' in code and 'torch_v_schedule("DualPipeV"' in code
    assert 'layout=layout' in code and "torch_table_kinds" not in code
    markdown = "\n".join(_cells(CH5, "markdown"))
    assert "counted, not scheduled" not in markdown


@pytest.fixture(scope="module")
def world3_memory():
    yield labkit.world(3, timeout=60)
    labkit.shutdown_all()


@pytest.mark.timeout(180)
def test_torch_interleaved_first_stage_saves_megatrons_penalty_in_bytes(world3_memory):
    """On 3 real ranks (p odd): rank 0's peak of saved bytes under torch's ScheduleInterleaved1F1B
    is (v p + p - 1) chunk-microbatches of 2 b T H x 8 bytes per block, i.e.
    p (1 + (p-1)/(p v)) microbatches of its stage; 1F1B's is p; the ranks after it hold
    v p + p - 1 - 2r (the warm-up shrinks by 2 per rank), the last one adding its loss's input."""
    p, b, T, H = 3, 2, 5, 8
    one = 2 * b * T * H * 8
    for name, v, blocks in (("1F1B", 1, 2), ("Interleaved1F1B", 2, 1), ("Interleaved1F1B", 3, 1)):
        for m in (2 * p, 4 * p):
            results = world3_memory.call(pipeline.torch_runs.torch_activation_peak,
                                         args=(name, m, v, blocks, b, T, H), timeout=120)
            peaks = [r["peak_bytes"] for r in results]
            stage_microbatch = v * blocks * one
            if v == 1:
                assert peaks[0] == p * stage_microbatch
            else:
                assert peaks[0] == (v * p + p - 1) * one
                assert peaks[1] == (v * p + p - 3) * one
                assert peaks[0] / stage_microbatch == pytest.approx(p * (1 + (p - 1) / (p * v)))
    with pytest.raises(ValueError, match="Interleaved1F1B"):
        pipeline.torch_runs.torch_activation_peak("1F1B", 4, 2)
