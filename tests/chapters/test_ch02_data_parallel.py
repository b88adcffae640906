"""Chapter 2 / lab 2: the data-parallel bench (labkit.dp, placement, training), the lab's reference
synchroniser used the way a training loop uses it, and lab 2's test cells (visible and hidden
lines, run outside nbgrader) failing each wrong answer issue 12 names in the cells of its task."""
import contextlib
import math
import sys

import cloudpickle

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st

import lab_notebooks
import labkit
from labkit import dp
from labkit.dp import placement, training

LAB = "lab02_data_parallel"
cloudpickle.register_pickle_by_value(sys.modules[__name__])   # rank programs defined here
FEW = settings(max_examples=6, derandomize=True, deadline=None, database=None,
               suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def world():
    yield labkit.world(2, timeout=30)
    labkit.shutdown_all()


# ---- single-process properties of the bench ------------------------------------------------------

@FEW
@given(st.integers(0, 1000), st.integers(1, 6), st.integers(0, 4))
def test_token_loss_sum_ignores_padding(seed, n_sequences, extra):
    batch = dp.ragged_batch(seed, n_sequences, max_len=5)
    model = dp.make_model(0)
    plain_sum, plain_count = dp.token_loss_sum(model, batch)
    padded_sum, padded_count = dp.token_loss_sum(model, batch, extra_padding=extra)
    assert plain_count == padded_count == dp.count_tokens(batch)
    torch.testing.assert_close(plain_sum, padded_sum, rtol=1e-12, atol=1e-12)


@FEW
@given(st.integers(0, 1000), st.lists(st.integers(0, 4), min_size=1, max_size=4), st.integers(1, 3))
def test_token_loss_case_keeps_every_sequence_in_order(seed, rank_sizes, microbatches):
    batch = dp.ragged_batch(seed, sum(rank_sizes), max_len=4)
    case = dp.token_loss_case(batch, rank_sizes, microbatches)
    assert all(len(pieces) == microbatches for pieces in case["per_rank"])
    flat = [seq for pieces in case["per_rank"] for piece in pieces for seq in piece]
    assert flat == batch
    assert [sum(map(len, pieces)) for pieces in case["per_rank"]] == rank_sizes


def test_split_rejects_sizes_that_do_not_add_up():
    with pytest.raises(ValueError, match="add up to 3"):
        dp.split([1, 2, 3], [1, 1])


def test_reference_refuses_an_empty_global_batch():
    with pytest.raises(ValueError, match="no valid token"):
        dp.reference_gradients([([], [])])


def test_make_model_is_deterministic_and_leaves_the_global_generator_alone():
    state = torch.random.get_rng_state()
    a, b = dp.make_model(3), dp.make_model(3)
    assert torch.equal(torch.random.get_rng_state(), state)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@FEW
@given(st.integers(0, 10_000), st.integers(1, 4))
def test_placement_pieces_reassemble_the_full_gradient(seed, world_size):
    case = placement.random_case(seed, world_size)
    per_rank = [placement.local_grads(case, rank, world_size)[0] for rank in range(world_size)]
    for got, want in zip(placement.assemble(case, per_rank), case["full"]):
        assert torch.equal(got, want)
    # every element of the full gradient is held somewhere, replicas by exactly `replicas` ranks
    held = [sum(g.numel() / k for g, k in zip(*placement.local_grads(case, r, world_size)[:2]))
            for r in range(world_size)]
    assert math.isclose(sum(held), sum(t.numel() for t in case["full"]))


def test_coaching_message_names_rank_parameter_and_the_missing_division():
    reference = dp.reference_gradients(dp.ragged_batch(1, 3, 4, min_len=1))
    doubled = [{name: 2 * g for name, g in reference.items()}] * 2
    with pytest.raises(AssertionError, match=r"rank 0: embed.weight.grad differs .* divide by the "
                                             r"world size after all_reduce"):
        dp.assert_grads_match(doubled, reference)


# ---- the bench on real ranks ---------------------------------------------------------------------

def _count_from_outside(global_tokens):
    def loss(local_sum, local_count):
        return local_sum * dist.get_world_size() / global_tokens
    return loss


def _mean_of_means(local_sum, local_count):
    return local_sum / local_count.clamp(min=1)


@pytest.mark.timeout(120)
@FEW
@given(st.integers(0, 10_000), st.integers(1, 6), st.integers(0, 6), st.integers(1, 3),
       st.integers(0, 2))
def test_harness_gives_the_reference_for_any_split_with_the_right_scale(world, seed, n, cut,
                                                                         microbatches, extra):
    batch = dp.ragged_batch(seed, n, max_len=5) + [([1], [2])]
    cut = min(cut, len(batch))
    case = dp.token_loss_case(batch, [cut, len(batch) - cut], microbatches, extra)
    loss = _count_from_outside(dp.count_tokens(batch))
    per_rank = world.call(dp.token_loss_gradients, args=(loss, case), timeout=60)
    dp.assert_grads_match(per_rank, dp.reference_gradients(batch))


@pytest.mark.timeout(60)
def test_harness_exposes_the_mean_of_means_on_a_skewed_split(world):
    batch = [([1] * 9, [2] * 9), ([4], [5]), ([6], [7])]
    case = dp.token_loss_case(batch, [1, 2])
    per_rank = world.call(dp.token_loss_gradients, args=(_mean_of_means, case), timeout=60)
    assert dp.max_difference(per_rank, dp.reference_gradients(batch)) > 1e-3
    with pytest.raises(AssertionError, match="mean of per-rank means"):
        dp.assert_grads_match(per_rank, dp.reference_gradients(batch))


class _PerParameterSync:
    """A plain synchroniser (unbucketed, after backward), to test the training harness."""

    def __init__(self, model, bucket_bytes):
        self.model = model

    def no_sync(self):
        return contextlib.nullcontext()        # would sync every microbatch: one microbatch here

    def finish(self):
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


class _NoSync(_PerParameterSync):
    def finish(self):
        pass


@pytest.mark.timeout(60)
def test_training_harness_gives_the_reference_and_catches_no_sync(world):
    case = training.training_case(seed=2, world_size=2, steps=3, microbatches=1)
    histories = world.run_each(training.train_with_sync, training.shares(case), _PerParameterSync)
    training.assert_params_match(histories, training.reference_training(case))
    unsynced = world.run_each(training.train_with_sync, training.shares(case), _NoSync)
    with pytest.raises(AssertionError, match="after step 1: rank 0"):
        training.assert_params_match(unsynced, training.reference_training(case))


@pytest.mark.timeout(60)
def test_placement_harness_runs_a_rank_without_gradients(world):
    case = placement.lonely_case(2)
    assert placement.local_grads(case, 1, 2)[0] == []

    def count_pieces(grads, replicas, device):
        t = torch.tensor([float(len(grads))], device=device)
        dist.all_reduce(t)
        return t.item()
    assert world.call(placement.run_grad_norm, args=(count_pieces, case), timeout=30) == [3.0, 3.0]


# ---- the reference synchroniser, used the way a training loop uses it ---------------------------

def _solution_namespace():
    """The answer cells of lab 2's solution, executed as a notebook would (instructor side)."""
    return lab_notebooks.answer_cells(LAB, torch=torch, dist=dist, labkit=labkit, dp=dp,
                                      math=math, placement=placement, contextlib=contextlib)


@pytest.fixture(scope="module")
def reference():
    return _solution_namespace()


SCENARIOS = {   # name: training_case keywords (steps, microbatches, model, failures)
    "3 microbatches, float64": dict(steps=3, microbatches=3),
    "tied weights, float32": dict(steps=3, microbatches=2, tied=True, dtype="float32"),
    "a frozen block": dict(steps=2, microbatches=2, frozen=("blocks.1.weight", "blocks.1.bias")),
    "a block some ranks skip": dict(steps=4, microbatches=2, optional=True),
    "a rank without data": dict(steps=2, microbatches=2, empty_rank=0),
    "a failure in the middle of step 2": dict(steps=4, microbatches=2,
                                              fail={"step": 1, "ranks": [0], "microbatch": 1}),
    "a failure in an accumulating backward": dict(steps=3, microbatches=3,
                                                  fail={"step": 0, "ranks": [1], "microbatch": 0}),
    "blocks used in the reverse of their creation order": dict(steps=3, microbatches=2, crossed=True),
    "the first step's orders differ between ranks": dict(steps=3, microbatches=2, optional=True,
                                                         first_detour_ranks=(1, 2)),
}


@pytest.mark.timeout(240)
def test_reference_sync_in_a_training_loop(reference):
    """On 3 ranks every rank's parameters equal one process's after every step, in every
    scenario; the first two at three bucket sizes (one parameter per bucket, a few, all in one)."""
    world = labkit.world(3, timeout=60)
    sync = reference["BucketedGradSync"]
    for index, (name, keywords) in enumerate(SCENARIOS.items()):
        for bucket_bytes in (1, 700, 10**9) if index < 2 else (700,):
            case = training.training_case(seed=index, world_size=3, bucket_bytes=bucket_bytes,
                                          **keywords)
            histories = world.run_each(training.train_with_sync, training.shares(case), sync,
                                       timeout=60)
            try:
                training.assert_params_match(histories, training.reference_training(case),
                                             case["model"]["dtype"])
            except AssertionError as error:
                raise AssertionError(f"{name}, bucket_bytes={bucket_bytes}: {error}") from None


@pytest.mark.timeout(240)
def test_reference_sync_over_many_steps(reference):
    """40 steps of 2 microbatches with a failure in the middle: nothing drifts, nothing hangs."""
    world = labkit.world(2, timeout=60)
    case = training.training_case(seed=11, world_size=2, steps=40, microbatches=2, tied=True,
                                  optional=True, bucket_bytes=500, lr=0.1,
                                  fail={"step": 17, "ranks": [1], "microbatch": 0})
    histories = world.run_each(training.train_with_sync, training.shares(case),
                               reference["BucketedGradSync"], timeout=120)
    training.assert_params_match(histories, training.reference_training(case))


def _buckets_after_one_step(share, sync_class, sequences_of_rank):
    """One step of a crossed model whose detour block only ranks other than 0 run: the buckets
    the reference cut, by parameter name."""
    import torch.distributed as dist
    model = training.build_model(share)
    names = {p: name for name, p in model.named_parameters()}
    sync = sync_class(model, 600)
    rank = dist.get_rank()
    total, _ = dp.token_loss_sum(model, sequences_of_rank[rank], detour=rank != 0)
    total.backward()
    sync.finish()
    return [[names[p] for p in bucket] for bucket in sync.buckets]


@pytest.mark.timeout(120)
def test_reference_buckets_follow_rank_0s_observed_order(reference):
    """Task 3's rule as the reference applies it: rank 0's arrival order in the first step (then
    the parameters it got no gradient for, reversed), the same buckets on every rank although
    the other ranks saw the detour's gradients arrive early; not the reverse of creation."""
    from labkit.dp import sync_checks
    world = labkit.world(3, timeout=60)
    spec = training.training_case(seed=2, world_size=3, steps=1, optional=True,
                                  crossed=True)["model"]
    sequences = [dp.ragged_batch(seed, 2, 5, min_len=1) for seed in range(3)]
    got = world.run(_buckets_after_one_step, spec, reference["BucketedGradSync"], sequences)
    model = training.build_model(spec)
    order = sync_checks.observed_order(spec, sequences[0])
    assert order[-2:] == ["detour.bias", "detour.weight"], order     # rank 0 never ran it
    expected = sync_checks.expected_buckets(model, 600, order)
    assert got == [expected] * 3, (got, expected)
    by_creation = sync_checks.expected_buckets(
        model, 600, [n for n, p in list(model.named_parameters())[::-1]])
    assert expected != by_creation


def _misuse(share, sync_class):
    """Two backward passes without no_sync: the reference must say so, then work again."""
    import torch.distributed as dist
    model = training.build_model(share["model"])
    sync = sync_class(model, 200)
    steps = share["steps"]
    message = ""
    try:
        for piece in steps[0]["microbatches"]:
            total, _ = dp.token_loss_sum(model, piece["sequences"])
            (total * dist.get_world_size() / steps[0]["tokens"]).backward()
    except RuntimeError as error:
        message = str(error)
    finally:
        sync.finish()
    model.zero_grad(set_to_none=True)
    total, _ = dp.token_loss_sum(model, steps[1]["microbatches"][0]["sequences"])
    (total * dist.get_world_size() / steps[1]["tokens"]).backward()
    sync.finish()
    return message, dp.grads_of(model)


@pytest.mark.timeout(120)
def test_reference_sync_names_a_missing_no_sync_and_recovers(reference):
    world = labkit.world(2, timeout=60)
    case = training.training_case(seed=5, world_size=2, steps=2, microbatches=2)
    results = world.run_each(_misuse, training.shares(case), reference["BucketedGradSync"],
                             timeout=60)
    for message, _ in results:
        assert "arrived twice" in message and "no_sync" in message, message
    # the next step is right: the one-process gradient of step 2's first microbatches
    step = case["steps"][1]
    model = training.build_model(case["model"])
    for pieces in step["microbatches"]:
        total, _ = dp.token_loss_sum(model, pieces[0]["sequences"])
        (total / step["tokens"]).backward()
    dp.assert_grads_match([grads for _, grads in results], dp.grads_of(model))


# ---- lab 2 through its own test cells ------------------------------------------------------------

def run_lab(test_ids, answers=None):
    """The lab's own test cells, visible and hidden lines, outside nbgrader (lab_notebooks)."""
    return lab_notebooks.run_lab(LAB, test_ids, answers)


def _answer(grade_id):
    return lab_notebooks.answer(LAB, grade_id)


def _failed(outcome):
    return {test for test, error in outcome.items() if error is not None}


WRONG = lab_notebooks.wrong_answers(LAB)     # also graded by labkit grade (test_labs)

TASK1 = ["test_task1_gradients", "test_task1_one_synchronisation", "test_task1_logged_loss",
         "test_task1_empty_batch"]
TASK2 = ["test_task2_norm", "test_task2_norm_dtype", "test_task2_clipped_step",
         "test_task2_skipped_step"]
TASK3 = ["test_task3_values", "test_task3_missing_gradients_and_failures", "test_task3_overlap",
         "test_task3_buckets"]


def _edit(grade_id, old, new):
    source = _answer(grade_id)
    assert old in source, f"the solution changed: {old!r} is gone; update this test"
    return source.replace(old, new)


TASK1_WRONG = WRONG.TASK1


@pytest.mark.timeout(600)
def test_task_1_wrong_answers_fail_their_cells():
    answers = {name: _edit("task1_accumulation_step", *edit) for name, (edit, _) in TASK1_WRONG.items()}
    for name, (_, fails) in TASK1_WRONG.items():
        outcome = run_lab(sorted(fails), {"task1_accumulation_step": answers[name]})
        assert _failed(outcome) == fails, f"{name}: {outcome}"
    # and the correct answer passes all four (one run, also of the hidden lines)
    assert not _failed(run_lab(TASK1)), "the solution fails a task 1 cell"


TASK2_WRONG = WRONG.TASK2


@pytest.mark.timeout(600)
def test_task_2_wrong_answers_fail_their_cells():
    for name, (edit, fails) in TASK2_WRONG.items():
        # a rank that skips the collective hangs the others until the cell's timeout: run only
        # the cell it must fail
        cells = sorted(fails) if "own NaN" in name else TASK2
        outcome = run_lab(cells, {"task2_norm_and_step": _edit("task2_norm_and_step", *edit)})
        assert _failed(outcome) == fails, f"{name}: {outcome}"


SYNC = "task3_bucketed_grad_sync"
TASK3_WRONG = WRONG.TASK3


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(TASK3_WRONG))
def test_task_3_wrong_answers_fail_their_cells(name):
    edit, fails = TASK3_WRONG[name]
    outcome = run_lab(TASK3, {SYNC: _edit(SYNC, *edit)})
    assert _failed(outcome) == fails, f"{name}: {outcome}"


def test_poisoned_step_cases_always_poison_one_rank_only():
    """About 2 draws in 100 placed every gradient as a replica: the poisoned case then had no
    rank-own piece to poison and the checker raised StopIteration (a correct lab lost a point)."""
    from labkit.dp import checks as dp_checks_module

    class FakeWorld:          # _step_case reads only the size; no ranks are needed to draw a case
        size = 3

    kinds = set()
    for _ in range(1500):      # P(no all-replica draw among them) ~ 1e-8
        _, layout, *_ = dp_checks_module._step_case(FakeWorld, "poison", poison=float("nan"))
        poisoned = [w["kind"] for t, w in zip(layout["full"], layout["where"])
                    if not torch.isfinite(t).all()]
        assert len(poisoned) == 1 and poisoned[0] != "replicate", layout["where"]
        kinds.add(len(layout["full"]))
    assert kinds == {5, 6}, "no draw needed the added shard: the test did not reach the edge"


# ---- section 7, data parallelism in practice: labkit.dp.practice on real DDP ranks --------------

@pytest.fixture(scope="module")
def ddp_world():
    """P = 3 without teaching mode (DDP's constructor crashes under DETAIL debug in torch 2.13)."""
    yield labkit.world(3, teaching=False, timeout=60)
    labkit.shutdown_all()


@pytest.mark.timeout(120)
def test_gradient_as_bucket_view_leaves_no_gradient_outside_the_buckets(ddp_world):
    from labkit.dp import practice
    copied, viewed = (ddp_world.run(practice.gradient_storage, view) for view in (False, True))
    for rank, (c, v) in enumerate(zip(copied, viewed)):
        assert c["parameter_bytes"] == v["parameter_bytes"] == v["bucket_bytes"] > 0, rank
        assert c["gradient_bytes_outside_buckets"] == c["parameter_bytes"], (rank, c)  # a full copy
        assert c["gradient_storages"] == 6                                 # one per parameter
        assert v["gradient_bytes_outside_buckets"] == 0, (rank, v)          # views of the buckets
        assert v["gradient_storages"] == v["buckets"], (rank, v)


@pytest.mark.timeout(120)
def test_ddp_gradients_match_one_process_and_fp16_hook_rounds(ddp_world):
    from labkit.dp import practice
    fp32, fp16 = (ddp_world.run(practice.ddp_gradients, hook) for hook in ("fp32", "fp16"))
    model = practice._mlp(64, 2, "cpu")                  # one process: mean of the 3 ranks' losses
    loss = 0
    for rank in range(3):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1000 + rank))
        loss = loss + model(x).square().mean() / 3
    loss.backward()
    for rank in range(3):
        gaps = []
        for name, p in model.named_parameters():
            torch.testing.assert_close(fp32[rank][name], p.grad, rtol=1e-5, atol=1e-7)
            gaps.append(((fp16[rank][name] - p.grad).abs().max() / p.grad.abs().max()).item())
            assert not torch.equal(fp16[rank][name], fp32[rank][name]), (rank, name)  # hook used
        assert 2.0 ** -14 < max(gaps) < 2.0 ** -9, (rank, gaps)   # FP16 rounding, not FP32's 2^-24
    with pytest.raises(labkit.RankError, match="rank .*'fp8' is not one of"):
        ddp_world.run(practice.ddp_gradients, "fp8")


def _sequences_per_step(n, b, M):
    """A rank's sequences per optimizer step: DistributedSampler + DataLoader, a step every M."""
    from torch.utils.data import DataLoader, DistributedSampler
    loader = DataLoader(range(n), batch_size=b, sampler=DistributedSampler(range(n), seed=0))
    steps, in_step = [], []
    for i, microbatch in enumerate(loader):
        in_step.append(len(microbatch))
        if len(in_step) == M or i == len(loader) - 1:
            steps.append(sum(in_step))
            in_step = []
    return steps


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n, b, M", [(50, 2, 3), (11, 1, 2), (36, 3, 4)])
def test_steps_per_epoch_follow_the_global_batch_arithmetic(ddp_world, n, b, M):
    per_rank = ddp_world.run(_sequences_per_step, n, b, M)
    measured = [sum(step) for step in zip(*per_rank)]
    full, rest = divmod(math.ceil(n / 3), b * M)
    assert measured == [b * M * 3] * full + ([rest * 3] if rest else []), measured
    assert len({len(steps) for steps in per_rank}) == 1        # padding: every rank steps alike


def test_chapter_cites_gradscaler_defaults_and_dtype_support_as_torch_defines_them():
    """Section 6's sourced claims, read from the installed torch: GradScaler's defaults, NCCL's BF16
    and FP8 conditions, and DDP's BF16-hook test on the build (not the backend)."""
    import inspect
    import json
    import pathlib
    root = pathlib.Path(torch.__file__).parent
    chapter = "".join("".join(c["source"]) for c in json.loads(
        (pathlib.Path(__file__).parents[2] / "course/02_data_parallel.ipynb").read_text())["cells"])
    signature = inspect.signature(torch.amp.GradScaler.__init__)
    for name, value in [("init_scale", 2.0 ** 16), ("growth_factor", 2.0), ("backoff_factor", 0.5),
                        ("growth_interval", 2000)]:
        assert signature.parameters[name].default == value, name
    assert "first few iterations as its" in (root / "amp/grad_scaler.py").read_text()
    nccl_h = (root / "include/torch/csrc/cuda/nccl.h").read_text()
    assert "#define HAS_NCCL_BF16_DATATYPE (NCCL_MAJOR >= 2)" in nccl_h
    utils = (root / "include/torch/csrc/distributed/c10d/NCCLUtils.hpp").read_text()
    assert "NCCL_VERSION(2, 23, 0)" in utils and "{at::kDouble, ncclDouble}" in utils
    assert "NCCL_VERSION(2, 24, 0)" in utils.split("#define NCCL_SUPPORTS_FP8")[0]
    ddp = (root / "nn/parallel/distributed.py").read_text()
    check = ddp[ddp.index('if hook.__name__ in ["bf16_compress_hook"'):][:900]
    assert "torch.version.cuda is not None" in check and "torch.cuda.nccl.version() >= (2, 10)" in check
    assert "backend" not in check                              # the build is tested, not the group
    assert "NCCL 2.24+" in chapter and "not on the process group's backend" in chapter
    assert "only when built with NCCL 2.10+" not in chapter
