"""labkit.formulas: the ledger's checks raise on a wrong formula, record what they compared."""
import math

import nbformat
import pytest

from labkit import formulas


def test_a_check_passes_within_its_tolerance_and_raises_outside():
    assert formulas.check("x", 100, 100.5, rel_tol=0.01, kind="measured").passed
    with pytest.raises(formulas.FormulaMismatch, match=r"predicted 100, measured 110; error 10"):
        formulas.check("x", 100, 110, rel_tol=0.01, kind="measured")
    assert formulas.check("exact", 3, 3, kind="measured").worst_error == 0


def test_bounds_and_sweeps():
    assert formulas.evaluate("most alive", 4, 3, bound="upper").passed
    assert not formulas.evaluate("most alive", 4, 5, bound="upper").passed
    assert formulas.evaluate("least bytes", 10, 12, bound="lower").passed
    sweep = formulas.evaluate("sweep", [1, 2, 4], [1, 2.1, 4], rel_tol=0.1)
    assert sweep.passed and math.isclose(sweep.worst_error, 0.05)
    assert not formulas.evaluate("nan", 1.0, float("nan"), rel_tol=1).passed
    with pytest.raises(ValueError, match="2 predicted values but 3 measured"):
        formulas.evaluate("x", [1, 2], [1, 2, 3])
    with pytest.raises(TypeError):
        formulas.evaluate("x", "many", 1)


def test_one_absolute_tolerance_per_value():
    """Each value's own slack (gloo's framing times that value's message count): a value within
    its neighbour's larger tolerance but outside its own fails."""
    within = formulas.evaluate("bytes at t = 2, 3", [1000, 2000], [1100, 2280], abs_tol=[144, 288])
    assert within.passed and within.abs_tol == [144.0, 288.0]
    assert "absolute, per value" in within.line()
    assert not formulas.evaluate("bytes at t = 2, 3", [1000, 2000], [1200, 2100],
                                 abs_tol=[144, 288]).passed
    with pytest.raises(ValueError, match="abs_tol has 1 values for 2 predicted"):
        formulas.evaluate("x", [1, 2], [1, 2], abs_tol=[1])
    with pytest.raises(ValueError, match=">= 0"):
        formulas.evaluate("x", [1, 2], [1, 2], abs_tol=[1, -1])
    from labkit.tools.build import _abs_tol_text
    assert _abs_tol_text([144.0, 288.0]) == "per value 144 to 288 abs"
    assert _abs_tol_text([5.0, 5.0]) == "5 abs" and _abs_tol_text(0.0) == ""


def test_a_timing_outside_its_tolerance_is_recorded_not_raised():
    result = formulas.check("busbw", 1e9, 3e8, rel_tol=0.5, unit="B/s", timing=True)
    assert not result.passed and result.timing and "off" in result.line()


def test_records_are_read_back_from_an_executed_notebook():
    record = formulas.evaluate("ring bytes", 8, 8.01, rel_tol=0.01).as_record()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "x", outputs=[nbformat.v4.new_output("display_data", data={
            "text/plain": "[formula ok  ] ...", formulas.MIME: record})])])
    assert formulas.records_in_notebook(nb) == [record]


def test_error_against_zero_is_shown_absolute():
    zero = formulas.check("a difference that should vanish", [0, 0], [5.55e-17, 0], abs_tol=1e-10,
                          kind="measured")
    assert zero.passed and "error 5.55e-17 absolute" in zero.line()
    assert formulas.error_text([2.0], [2.2], 0.1) == "10.00%"
    assert formulas.error_text([0.0], [0.0], 0.0) == "exact"
    assert formulas.error_text([0.0], [float("nan")], None) == "not finite"


def test_a_check_without_a_kind_or_with_an_unknown_one_raises():
    with pytest.raises(ValueError, match=r"no kind given.*measured.*reproduction"):
        formulas.check("ring bytes", 8, 8)
    with pytest.raises(ValueError, match="kind must be one of"):
        formulas.check("ring bytes", 8, 8, kind="measurement")
    with pytest.raises(ValueError, match="'identity' is not a kind.*unit test in tests/"):
        formulas.check("kept = min(load, C)", 8, 8, kind="identity")
    with pytest.raises(ValueError, match="a reproduction names its source"):
        formulas.check("ZeRO figure 1", 120, 120, kind="reproduction")
    with pytest.raises(ValueError, match="a simulation says what it simulates"):
        formulas.check("bubble", 0.5, 0.5, kind="simulation")
    with pytest.raises(ValueError, match="timing=True is kind='timing'"):
        formulas.check("busbw", 1, 1, timing=True, kind="measured")
    record = formulas.check("bubble", 0.5, 0.5, kind="simulation", basis="a virtual clock",
                            why="exact: both are fractions").as_record()
    assert (record["kind"], record["basis"], record["why"]) == ("simulation", "a virtual clock",
                                                                "exact: both are fractions")
    assert "simulated 0.5" in formulas.evaluate("b", 0.5, 0.5, kind="simulation", basis="x").line()


def test_a_timing_check_outside_its_band_is_recorded_and_never_raises():
    for measured in (0.0, 3e8, 1e12, float("nan")):
        result = formulas.check("straggler wait", 0.1, measured, rel_tol=0.5, unit="s",
                                kind="timing", why="a sleep on a loaded 2-core machine")
        assert not result.passed and result.timing and result.kind == "timing"
        assert result.line().startswith("[formula off ]")
    inside = formulas.check("straggler wait", 0.1, 0.12, rel_tol=0.5, kind="timing")
    assert inside.passed and inside.as_record()["kind"] == "timing"
    assert formulas.check("old spelling", 1, 9, timing=True).kind == "timing"


@pytest.mark.timeout(120)
def test_gloo_framing_bytes_are_what_the_os_counts():
    """labkit.collectives.GLOO_FRAMING_BYTES re-measured: bytes the kernel counts for a gloo
    message of n bytes, minus n, on the sender; the receiver's notice back."""
    import labkit
    from labkit import collectives
    world = labkit.world(2, backend="gloo", teaching=False)
    try:
        for n_bytes, messages in ((4096, 1), (1 << 20, 1), (4096, 10)):
            framing = collectives.measure_gloo_framing(world, n_bytes, messages)
            assert framing["header"] == collectives.GLOO_HEADER_BYTES, framing["traffic"].table()
            assert framing["notice"] == collectives.GLOO_NOTICE_BYTES, framing["traffic"].table()
        assert collectives.GLOO_FRAMING_BYTES == (collectives.GLOO_HEADER_BYTES
                                                  + collectives.GLOO_NOTICE_BYTES)
    finally:
        world.close()
