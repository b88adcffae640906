"""Lab 3, tasks 2 and 3 (issue 28): the measurements the checkers grade with, the reference
answers against them on real ranks, and each graded wrong answer alone losing exactly the cells
of its own task.

Task 2's peak is counted operation by operation below autograd (`checks._StepPeak`, a
TorchDispatchMode like labkit.tensor_parallel.measure.peak_bytes), so it follows from the
operations the bench calls; task 3 reads what a rank of each pipeline stage holds after every
forward and backward of a steady step (`checks.pipeline_memory_program`)."""
import math

import pytest
import torch
import torch.distributed as dist

import lab_notebooks
import labkit
from lab_notebooks import answer_cells
from labkit.memory import checks, ledger, measure, zero, zero_pipeline

LAB = "lab03_memory_and_zero"
REF = answer_cells(LAB, torch=torch, dist=dist, labkit=labkit, math=math, checks=checks,
                   zero=zero, measure=measure, ledger=ledger, zero_pipeline=zero_pipeline)
WRONG = lab_notebooks.wrong_answers(LAB)


@pytest.fixture(scope="module", autouse=True)
def _shutdown():
    yield
    labkit.shutdown_all()


@pytest.fixture
def world():
    """A world of 4 (the same one while it is open: the lab's own cells, run by the wrong-answer
    tests, replace it with worlds of their own)."""
    return labkit.world(4, timeout=60, teaching=False)


# ---- the measurements ----------------------------------------------------------------------------

def test_step_peak_counts_new_storages_at_once_and_the_phase_they_peaked_in():
    a = torch.ones(100, 10)                                  # before: not counted
    tracker = checks._StepPeak()
    with tracker:
        b = a @ a.T                                          # [100, 100] float32: 40000 B
        tracker.phase = "backward"
        c = b.view(-1)                                       # a view: nothing new
        d = b + 1                                            # 40000 B more, both alive
        del b, c, d
        tracker.phase = "optimizer step"
        e = torch.zeros(5000)                                # 20000 B: not a new peak
        del e
    assert tracker.peak == 80000 and tracker.peak_phase == "backward"
    assert tracker.live == 0
    assert [phase for phase, _, _ in tracker.timeline][-1] == "optimizer step"


@pytest.mark.timeout(120)
def test_the_bench_peak_is_the_reference_formula_exactly_in_both_moments(world):
    """The reference's peak and moment against the measured ones, exactly (the checker allows
    0.5%), on configurations where each moment wins, at P = 2, 3 and 4 and in every stage."""
    for config in (dict(stage=0, P=2, layers=1, hidden=40, batch=1, seq=4),
                   dict(stage=2, P=4, batch=8, seq=16), dict(stage=1, P=3, batch=4, seq=32),
                   dict(stage=3, P=3, batch=2, seq=8)):
        config = dict(checks.BENCH, **config)
        measured = world.call(checks.memory_program, args=(config,), timeout=60)[0]
        predicted = REF["predict_memory"](config["stage"], config["P"], config["layers"],
                                          config["hidden"], config["batch"], config["seq"])
        assert predicted["peak"] == measured["peak"], (config, predicted, measured["peak"])
        assert predicted["moment"] == measured["moment"]


@pytest.mark.timeout(120)
def test_pipeline_readings_free_the_step_policys_full_copies_at_the_last_backward(world):
    case = zero_pipeline.case(zero_stage=3, reshard="step", schedule="gpipe", layers=2,
                              microbatches=3, pp=2)
    results = world.call(checks.pipeline_memory_program, args=(case,), timeout=60)
    L, n = 2, zero.padded_numel(16, 2)
    for result in results:
        readings = result["readings"]                        # after F0 F1 F2 B0 B1 B2
        assert readings[3] - readings[2] == L * n * 4 - 9 * 2 * 4 * 16 * 4 * L   # gradients in, one
        assert readings[-1] == 2 * L * (n // 2) * 4 + n * 4  # microbatch's activations out
    assert REF["predict_pipeline_peaks"](case, 2) == [max(r["readings"]) for r in results[::2]]


# ---- each graded wrong answer alone ----------------------------------------------------------------

TASK2 = ["test_task2_predict_memory", "test_task2_peak_moment"]
TASK3 = ["test_task3_one_f_one_b", "test_task3_gpipe"]


def _wrong(grade_id, student):
    return WRONG.WRONG[student][0][grade_id](lab_notebooks.answer(LAB, grade_id))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("grade_id, student, fails", [
    ("task2_predict_memory", "global_and_one_moment", {"test_task2_peak_moment"}),
    ("task2_predict_memory", "world_size_and_fudge", {"test_task2_predict_memory"}),
    ("task3_pipeline_peaks", "global_and_one_moment", {"test_task3_one_f_one_b"}),
    ("task3_pipeline_peaks", "world_size_and_fudge", {"test_task3_gpipe"}),
])
def test_wrong_answers_lose_exactly_their_cells(grade_id, student, fails):
    cells = TASK2 if grade_id.startswith("task2") else TASK3
    outcome = lab_notebooks.run_lab(LAB, cells, {grade_id: _wrong(grade_id, student)})
    failed = {test for test, error in outcome.items() if error is not None}
    assert failed == fails, f"{student}, {grade_id}: failed {sorted(failed)}, expected {sorted(fails)}: {outcome}"


def test_the_predictor_refuses_bad_input():
    for bad in ((4, 2, 3, 48, 2, 8), (1, 0, 3, 48, 2, 8), (2, 2, 3, 48, 0, 8)):
        with pytest.raises(ValueError):
            REF["predict_memory"](*bad)


def _without_transients(*args):
    r = REF["predict_memory"](*args)
    r["peak"] = sum(r[k] for k in ("parameters", "gradients", "optimizer_states", "activations"))
    return r


def _without_activations(*args):
    r = REF["predict_memory"](*args)
    r["peak"] -= r["activations"]
    r["activations"] = 0
    return r


@pytest.mark.timeout(180)
@pytest.mark.parametrize("wrong, message", [(_without_transients, "peak predicted"),
                                            (_without_activations, "activations predicted 0")])
def test_task_2_rejects_a_predictor_without_transients_or_activations(world, wrong, message):
    for config in (dict(stage=3, P=4, batch=4, seq=32), dict(stage=1, P=2, batch=2, seq=8)):
        with pytest.raises(AssertionError, match=message):
            checks.check_memory_predictor(world, wrong, [config])
