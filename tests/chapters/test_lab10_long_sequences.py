"""Lab 10 (long sequences): labkit.context.bench's ring forward on real ranks, the lab's reference
answers used the way a training step uses them, the checkers rejecting the shortcuts the lab
names (a direct exchange with the ring's total bytes, K and V expanded before the all-to-all, a
refusal that never fires or always fires), and each graded wrong answer losing exactly its cells
(tests/grading/wrong_answers/lab10_long_sequences.py)."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st

import labkit
import lab_notebooks
from lab_notebooks import answer_cells
from labkit import context
from labkit.context import bench, checks
from labkit.grading.references import context as reference
from labkit.memory import ledger
from labkit.mesh import cost
from labkit.mesh.figures import Model

LAB = "lab10_long_sequences"
FEW = settings(max_examples=20, derandomize=True, deadline=None, database=None,
               suppress_health_check=list(HealthCheck))
REF = answer_cells(LAB, torch=torch, dist=dist, labkit=labkit, context=context, bench=bench,
                   checks=checks, dataclasses=dataclasses, cost=cost, ledger=ledger, Model=Model)


@pytest.fixture(scope="module")
def world3():
    world = labkit.world(3, backend="gloo", teaching=False)
    yield world
    labkit.shutdown_all()


def _forward_program(share):
    out, lse = bench.ring_forward(share["q"], share["k"], share["v"])
    return {"out": out, "lse": lse}


def test_ring_forward_is_one_process_attention_on_the_balanced_split(world3):
    P, generator = world3.size, torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 2 * P * 4, 8, generator=generator, dtype=torch.float64)
               for _ in range(3))
    out, lse = context.attention(q, k, v, causal=True)
    shares = [{"q": context.shard(q, P, r, True), "k": context.shard(k, P, r, True),
               "v": context.shard(v, P, r, True)} for r in range(P)]
    with world3.traffic() as traffic:
        results = world3.run_each(_forward_program, shares)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["out"], context.shard(out, P, rank, True), rtol=1e-12,
                                   atol=1e-13)
        torch.testing.assert_close(got["lse"], context.shard(lse, P, rank, True, dim=2),
                                   rtol=1e-12, atol=1e-13)
    block = 2 * 3 * 8 * 8 * 8                                  # [B, H, T/P, d] in float64
    for rank in range(P):                                      # K and V, P - 1 times, to r + 1
        sent = traffic.matrix[rank][(rank + 1) % P]
        assert 2 * (P - 1) * block <= sent <= 2 * (P - 1) * block + 8 * 160, traffic.table()
        assert traffic.matrix[rank][(rank - 1) % P] < 1024, traffic.table()


def test_merge_of_disjoint_key_sets_is_exact_and_handles_queries_that_saw_nothing():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    whole, whole_lse = context.attention(q, k, v)
    first, first_lse = context.attention(q, k[:, :, :2], v[:, :, :2])
    rest, rest_lse = context.attention(q, k[:, :, 2:], v[:, :, 2:])
    out, lse = bench.merge(first, first_lse, rest, rest_lse)
    torch.testing.assert_close(out, whole, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-13, atol=1e-14)
    empty_out, empty_lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"),
                                                           dtype=q.dtype)
    out, lse = bench.merge(empty_out, empty_lse, empty_out, empty_lse)   # nothing seen yet
    assert not out.isnan().any() and (lse == float("-inf")).all()


def test_reference_backward_called_again_and_again_stays_right(world3):
    """Like a training loop: calls in a row, float64 then float32 then float64, other shapes."""
    backward = REF["ring_attention_backward"]
    for dtype, chunk, heads in (("float64", 2, 2), ("float32", 3, 1), ("float64", 1, 4),
                                ("float64", 2, 2)):
        checks.check_ring_backward(world3, backward, chunk=chunk, heads=heads, dtype=dtype)
    checks.check_ring_backward_traffic(world3, backward, chunk=2)


def _always_refuses(q, k, v, causal=True):
    raise ValueError(f"rank {dist.get_rank()}: {k.size(1)} KV heads, P = {dist.get_world_size()}")


def _refuses_without_naming(q, k, v, causal=True):
    if k.size(1) % dist.get_world_size():
        raise ValueError("bad heads")
    return REF_ULYSSES(q, k, v, causal)


REF_ULYSSES = REF["ulysses_attention"]


def test_refusal_check_needs_good_input_accepted_and_the_rank_named(world3):
    checks.check_ulysses_refuses(world3, REF_ULYSSES)
    with pytest.raises(AssertionError, match="ordinary input"):
        checks.check_ulysses_refuses(world3, _always_refuses)
    with pytest.raises(AssertionError, match="does not name the rank, the KV heads, P"):
        checks.check_ulysses_refuses(world3, _refuses_without_naming)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_ulysses_pair_bytes_tell_the_shortcuts_apart_at_the_checked_shapes(P):
    kv = P if P > 2 else 4                         # check_ulysses_traffic's defaults
    q = 4 * kv
    ulysses = checks.ulysses_pair_bytes(q, kv, P, 1)
    expanded, gathered_kv = 4 * q // P, 2 * kv     # K, V expanded first; Llama 3's all-gather
    assert len({ulysses, expanded, gathered_kv}) == 3
    whole = q + 2 * kv                             # check_ulysses: the 0.9 bound at Hkv=P, Hq=2P
    if P > 2:
        assert checks.ulysses_pair_bytes(2 * P, P, P, 1) < 0.9 * (2 * P + 2 * P)
        assert 4 * (2 * P) // P < 0.9 * (2 * P + 2 * P)       # expanded K/V passes the values cell
    assert whole > ulysses


MODEL = Model("7.5B, 48k tokens", layers=32, hidden=4096, heads=32, seq=49152, vocab=51200)


@FEW
@given(dp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2, 3, 4, 8]),
       tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4]),
       stage=st.integers(0, 3), m=st.sampled_from([1, 2, 4]),
       recompute=st.sampled_from(["full", "none"]))
def test_reference_step_is_the_solution_and_chapter_6_at_cp_1(dp, cp, tp, pp, stage, m, recompute):
    config = {"dp": dp, "cp": cp, "tp": tp, "pp": pp, "zero_stage": stage, "microbatches": m}
    batch = 2 * dp * m
    want = reference.predict(MODEL, config, batch, recompute)
    got = REF["predict_cp_step"](MODEL, config, batch, recompute)
    assert got["bytes"] == pytest.approx(want["bytes"], rel=1e-12)
    assert got["memory"] == pytest.approx(want["memory"], rel=1e-12)
    if cp == 1:
        plain = {k: v for k, v in config.items() if k != "cp"}
        sent = cost.axis_bytes(MODEL, plain, batch, recompute)
        assert want["bytes"]["dp"] == pytest.approx(sent["dp"], rel=1e-12)
        assert want["bytes"]["tp"] == pytest.approx(sent["tp"], rel=1e-12)
        assert want["bytes"]["cp"] == 0
        assert want["memory"] == pytest.approx(cost.memory(MODEL, plain, batch, recompute)["peak"])
    else:
        assert want["bytes"]["cp"] > 0
        assert want["bytes"]["dp"] > 0                 # the cp ranks hold the same weights


def test_cp_bytes_equal_the_ring_bytes_counted_on_real_ranks(world3):
    """Task 3's cp term per layer and microbatch, recompute="none": the forward (K, V: 2 (cp-1)
    blocks, counted here on 3 real ranks of bench.ring_forward) plus the backward (K, V, dK, dV:
    4 (cp-1) blocks, counted on the reference backward)."""
    P, b, s, h = 3, 1, 2 * 3 * 4, 16
    tiny = Model("tiny", layers=1, hidden=h, heads=1, seq=s, vocab=8)
    config = {"dp": 1, "cp": P, "tp": 1, "pp": 1, "zero_stage": 0, "microbatches": 1}
    predicted = reference.predict(tiny, config, b, "none")["bytes"]["cp"] / cost.BYTES * 8
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, 1, s, h, generator=generator, dtype=torch.float64) for _ in range(3))
    shares = [{"q": context.shard(q, P, r, True), "k": context.shard(k, P, r, True),
               "v": context.shard(v, P, r, True)} for r in range(P)]
    with world3.traffic() as forward:
        world3.run_each(_forward_program, shares)
    backward = checks.check_ring_backward_traffic(world3, REF["ring_attention_backward"], batch=b,
                                                  heads=1, chunk=s // (2 * P), head_dim=h)
    measured = max(forward.sent) + max(backward.sent)
    assert predicted <= measured <= predicted * 1.05 + 16 * 160, (predicted, measured)


# ---- issue 26: every test cell lost by a wrong answer that keeps the lab's other cells ----------

WRONG10 = lab_notebooks.wrong_answers(LAB)
TASK_CELLS = {"task1_ring_backward": ["test_task1_grads", "test_task1_ring"],
              "task2_ulysses": ["test_task2_refuses", "test_task2_values", "test_task2_bytes"],
              "task3_predict": ["test_task3_bytes", "test_task3_memory"]}
EACH_LOSES = [("task1_ring_backward", "own_part_dropped", {"test_task1_grads"}),
              ("task1_ring_backward", "direct_exchange", {"test_task1_ring"}),
              ("task2_ulysses", "expanded_kv", {"test_task2_refuses", "test_task2_bytes"}),
              ("task2_ulysses", "positions_in_order", {"test_task2_values"}),
              ("task3_predict", "dp_only_gradients", {"test_task3_bytes"}),
              ("task3_predict", "zero_over_dp_only", {"test_task3_memory"})]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("grade_id, name, lost", EACH_LOSES, ids=[n for _, n, _ in EACH_LOSES])
def test_each_wrong_answer_loses_exactly_its_cells(grade_id, name, lost):
    wrong = getattr(WRONG10, name)(lab_notebooks.answer(LAB, grade_id))
    outcome = lab_notebooks.run_lab(LAB, TASK_CELLS[grade_id], {grade_id: wrong})
    assert {cell for cell, error in outcome.items() if error is not None} == lost, (name, outcome)


def test_task3_visible_cases_pass_from_expected_json_in_the_student_copy(monkeypatch):
    """The student copy has no labkit.grading: check_cp_bytes/check_cp_memory read the visible
    cp > 1 case from labs/<lab>/expected.json (what reference.released() writes) and compute the
    cp = 1 case from chapter 6's model; a wrong dp term still fails there."""
    from labkit import released
    table = reference.released()
    monkeypatch.setattr(released, "reference", lambda name: None)
    monkeypatch.setattr(released, "load", lambda lab: table)
    model, config, batch, recompute = reference.visible_cases()[0]
    model = Model(**model)
    for check in (checks.check_cp_bytes, checks.check_cp_memory):
        check(REF["predict_cp_step"], model, config, batch, recompute)
        check(REF["predict_cp_step"], model, dict(config, cp=1, dp=8), 4 * batch, recompute)

    def dp_alone(model, config, global_batch, recompute="full"):
        got = REF["predict_cp_step"](model, config, global_batch, recompute)
        return dict(got, bytes=dict(got["bytes"], dp=got["bytes"]["dp"] / 2))
    with pytest.raises(AssertionError, match="dp"):
        checks.check_cp_bytes(dp_alone, model, config, batch, recompute)
