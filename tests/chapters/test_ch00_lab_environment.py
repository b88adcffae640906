"""Chapter 0 / lab 0: labkit.basics (the chapter's prediction check, lab 0's checkers), and lab 0's
test cells (visible and hidden lines, run outside nbgrader) failing each wrong answer in the cells
of its task: a vague error message, a mean of per-rank means, a float32 sum, a rank that skips the
collective, no error when nobody holds a value. Also what chapter 0 says torch and gloo do
(DDP under DETAIL; mismatched shapes and dtypes without teaching mode), against the installed torch."""
import sys

import cloudpickle
import pytest

import lab_notebooks
import labkit
from labkit import basics

LAB = "lab00_first_collectives"
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_prediction_check_asks_first_and_explains(capsys):
    assert basics.check_prediction(None, 3) is False
    out = capsys.readouterr().out
    assert "No prediction yet" in out and "6" not in out          # the answer is not shown
    assert basics.check_prediction([[6, 3]] * 3, 3) is True
    assert "P(P + 1)/2" in capsys.readouterr().out
    assert basics.check_prediction([[6, 1]] * 3, 3) is False
    assert basics.check_prediction("six", 3) is False


@pytest.mark.parametrize("message, lengths, ok", [
    ("every rank must pass the same number of values; per rank: [7, 3, 9]", [7, 3, 9], True),
    ("rank 0 has 7, rank 1 has 3, rank 2 has 9", [7, 3, 9], True),
    ("lengths differ", [7, 3, 9], False),
    ("expected 7 values, got 3", [7, 3, 9], False),              # rank 2's length is missing
    ("per rank: [9, 3, 7]", [7, 3, 9], False),                   # not in rank order
    ("shapes [2] and [1] differ", [2, 1], True),
])
def test_the_length_message_must_name_every_rank(message, lengths, ok):
    if ok:
        basics.check_length_message(message, lengths)
    else:
        with pytest.raises(AssertionError, match="every rank's length"):
            basics.check_length_message(message, lengths)


def test_mean_cases_are_uneven_and_fresh():
    _, shares, expected = basics.mean_case(3, "uneven")
    counts = [len(s) for s in shares]
    assert len(set(counts)) > 1 and expected is not None
    _, again, _ = basics.mean_case(3, "uneven")
    assert any(a.shape != b.shape or not (a == b).all() for a, b in zip(shares, again))
    _, empty, expected = basics.mean_case(2, "all empty")
    assert [len(s) for s in empty] == [0, 0] and expected is None


# ---- lab 0 through its own test cells ------------------------------------------------------------

def run_lab(test_ids, answers=None):
    return lab_notebooks.run_lab(LAB, test_ids, answers)


@pytest.fixture(scope="module", autouse=True)
def _close_worlds():
    yield
    labkit.shutdown_all()


TASK2 = ["test_task2_all_reduce_result", "test_task2_length_message"]
TASK3 = ["test_task3_global_mean", "test_task3_no_values"]


MEAN_OF_MEANS = '''
def global_mean(local_values):
    mean = torch.tensor([local_values.double().mean().item() if local_values.numel() else 0.0],
                        dtype=torch.float64, device=labkit.device())
    dist.all_reduce(mean)                      # the mean of the per-rank means
    return mean.item() / dist.get_world_size()
'''


SKIPS_WHEN_EMPTY = '''
def global_mean(local_values):
    if local_values.numel() == 0:
        raise ValueError("this rank holds nothing")   # leaves the collective: the others wait
    totals = torch.tensor([local_values.double().sum().item(), float(local_values.numel())],
                          dtype=torch.float64, device=labkit.device())
    dist.all_reduce(totals)
    return totals[0].item() / totals[1].item()
'''



WRONG = lab_notebooks.wrong_answers(LAB)      # the wrong answers labkit grade also grades


def _wrong(grade_id, edit):
    return edit(lab_notebooks.answer(LAB, grade_id))


ALWAYS_REFUSES_LENGTHS = '''
def all_reduce_result(per_rank_values, op="sum"):
    lengths = [len(values) for values in per_rank_values]
    raise ValueError(f"every rank must pass the same number of values; per rank: {lengths}")
'''

ALWAYS_REFUSES_MEAN = '''
def global_mean(local_values):
    raise ValueError("no rank holds a value")
'''


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, grade_id, source, cells, fails", [
    ("leftover items on the last rank", "task1_shard_bounds",
     _wrong("task1_shard_bounds", WRONG.EXTRAS_LAST), ["test_task1_shard_bounds"],
     {"test_task1_shard_bounds"}),
    ("a message without the lengths", "task2_all_reduce_result",
     _wrong("task2_all_reduce_result", WRONG.VAGUE), TASK2, {"test_task2_length_message"}),
    ("an unknown op taken for a sum", "task2_all_reduce_result",
     _wrong("task2_all_reduce_result", WRONG.ANY_OP_IS_A_SUM), TASK2,
     {"test_task2_all_reduce_result"}),
    ("always refuses, with the right message", "task2_all_reduce_result",
     ALWAYS_REFUSES_LENGTHS, TASK2, set(TASK2)),
    ("the mean of per-rank means (and 0 when nobody holds a value)", "task3_global_mean",
     MEAN_OF_MEANS, TASK3, set(TASK3)),
    ("a float32 sum", "task3_global_mean", _wrong("task3_global_mean", WRONG.FLOAT32), TASK3,
     {"test_task3_global_mean"}),
    ("no error when nobody holds a value", "task3_global_mean",
     _wrong("task3_global_mean", WRONG.NO_ERROR), TASK3, {"test_task3_no_values"}),
    ("always refuses", "task3_global_mean", ALWAYS_REFUSES_MEAN, TASK3, set(TASK3)),
])
def test_wrong_answers_fail_the_cells_of_their_task(name, grade_id, source, cells, fails):
    outcome = run_lab(cells, {grade_id: source})
    failed = {cell for cell, error in outcome.items() if error is not None}
    assert failed == fails, f"{name}: {outcome}"


@pytest.mark.timeout(120)
def test_a_rank_that_leaves_the_collective_fails_by_timeout_not_hang():
    world = labkit.world(2, timeout=20)
    namespace = {}
    exec("import torch, torch.distributed as dist, labkit\n" + SKIPS_WHEN_EMPTY, namespace)
    with pytest.raises((labkit.RankError, labkit.CallTimeout)):
        basics.check_global_mean(world, namespace["global_mean"], "rank 0 empty", timeout=5)


# ---- what chapter 0 says about torch and gloo, kept true against the installed torch ---------------

def _build_ddp_and_step():
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(nn.Linear(4, 2))
    model(torch.ones(3, 4)).sum().backward()
    return "built"


def _debug_level():
    import torch.distributed as dist
    return str(dist.get_debug_level())


@pytest.mark.timeout(180)
def test_ddp_constructor_crashes_under_teaching_mode_as_chapter_0_says():
    """Chapter 0, section 6, and chapter 2 (which builds DDP models on teaching=False worlds): in
    torch 2.13, DDP's constructor kills a rank with SIGSEGV under TORCH_DISTRIBUTED_DEBUG=DETAIL.
    If this test fails, torch has changed: update both chapters."""
    plain = labkit.world(2, backend="gloo", teaching=False)
    assert plain.run(_build_ddp_and_step) == ["built", "built"]
    teaching = labkit.world(2, backend="gloo")
    assert teaching.run(_debug_level) == ["DebugLevel.DETAIL"] * 2
    with pytest.raises(labkit.RankDied) as died:
        teaching.run(_build_ddp_and_step)
    assert died.value.exitcode == -11, f"expected signal 11 (SIGSEGV), got exit code {died.value.exitcode}"


def _all_reduce_mismatched(case):
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    if case == "shape":
        t = torch.arange(6.0) + 100 * rank
        t = t.reshape(2, 3) if rank == 0 else t.reshape(3, 2)
    else:
        t = torch.ones(6, dtype=torch.float32 if rank == 0 else torch.int32)
    dist.all_reduce(t)
    return t.flatten()


@pytest.mark.timeout(120)
def test_without_teaching_mode_a_reshape_sums_right_and_another_dtype_gives_garbage():
    """Chapter 0, section 4, on 3 ranks (the chapter runs at WORLD_SIZE): the same count in another
    shape sums element by element; float32 against int32 leaves the same wrong bytes on every rank."""
    import torch
    world = labkit.world(3, backend="gloo", teaching=False)
    for values in world.run(_all_reduce_mismatched, "shape"):
        assert values.tolist() == [3 * i + 300.0 for i in range(6)], values
    garbage = world.run(_all_reduce_mismatched, "dtype")
    assert [t.dtype for t in garbage] == [torch.float32, torch.int32, torch.int32]
    assert all(torch.equal(t.view(torch.int32), garbage[0].view(torch.int32)) for t in garbage)
    assert all((t != 3).all() for t in garbage), garbage
