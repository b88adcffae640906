"""Chapter 3 / lab 3: labkit.memory's formulas (the ZeRO paper's numbers, Korthikanti's
activations, the calculator), ZeRO stages 0-3 on real ranks against one process, bytes kept and
sent, the pipeline's gathers, the lab's reference answers used the way a training loop uses them,
and the lab's checkers rejecting the wrong answers issue 13 names (task 1; tasks 2-3 are
tests/chapters/test_lab03_memory.py)."""
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st

import lab_notebooks
import labkit
from lab_notebooks import answer_cells
from labkit.memory import (activations, bench, checks, ledger, measure, snapshot, zero,
                           zero_pipeline)

ROOT = Path(__file__).resolve().parents[2]
LAB = "lab03_memory_and_zero"
SOLUTION = ROOT / "solutions" / LAB / f"{LAB}.ipynb"
FEW = settings(max_examples=6, derandomize=True, deadline=None, database=None,
               suppress_health_check=list(HealthCheck))


def _answer_cells() -> dict:
    """Every answer cell of the lab's solution notebook, executed in one namespace."""
    return answer_cells(LAB, torch=torch, dist=dist, labkit=labkit, math=math, checks=checks,
                        zero=zero, measure=measure, ledger=ledger)


REF = _answer_cells()
ShardedOptimizer = REF["ShardedOptimizer"]


@pytest.fixture(scope="module")
def world():
    yield labkit.world(4, timeout=60, teaching=False)
    labkit.shutdown_all()


# ---- the ledger: formulas and the paper's numbers (one process) ----------------------------------

def test_the_zero_paper_figure_and_table_are_reproduced_to_its_rounding():
    figure = ledger.ZERO_FIGURE_1
    got = [ledger.one_decimal(sum(ledger.model_states(figure["psi"], figure["dp"], s).values()) / 1e9)
           for s in ledger.STAGES]
    assert got == [figure["stages"][s] for s in ledger.STAGES] == [120, 31.4, 16.6, 1.9]
    for (dp, psi), printed in ledger.ZERO_TABLE_1.items():
        assert [ledger.paper_round(v) for v in ledger.zero_table(psi, dp)] == list(printed)


@FEW
@given(st.floats(1e3, 1e13), st.integers(1, 4096), st.sampled_from(ledger.STAGES),
       st.sampled_from([ledger.MIXED_ADAMW, ledger.FP32_ADAMW]))
def test_model_states_are_psi_times_b_rep_plus_b_shard_over_p(psi, dp, stage, recipe):
    b_rep, b_shard = ledger.split_bytes(stage, recipe)
    assert b_rep + b_shard == recipe.total == 16
    total = sum(ledger.model_states(psi, dp, stage, recipe).values())
    assert math.isclose(total, psi * (b_rep + b_shard / dp), rel_tol=1e-12)
    assert math.isclose(total, ledger.rank_bytes(psi, b_rep, b_shard, dp)["steady"], rel_tol=1e-12)
    if stage:
        assert total <= sum(ledger.model_states(psi, dp, stage - 1, recipe).values())


def test_megatron_fp32_gradient_recipe_is_18_bytes_and_6_plus_12_over_d_with_zero_1():
    recipe = ledger.recipe_named("mixed_fp32_grads")
    assert sum(ledger.model_states(1e9, 1, 0, recipe).values()) == 18e9
    for d in (2, 8, 64):
        assert sum(ledger.model_states(1e9, d, 1, "mixed_fp32_grads").values()) \
            == pytest.approx(1e9 * (6 + 12 / d))
    bf16 = ledger.per_rank_ledger(4, 256, 4, 128, 1, dp=4, zero_stage=1)
    fp32 = ledger.per_rank_ledger(4, 256, 4, 128, 1, dp=4, zero_stage=1, recipe="mixed_fp32_grads")
    assert fp32["gradients"] == 2 * bf16["gradients"] and fp32["parameters"] == bf16["parameters"]
    with pytest.raises(ValueError, match="mixed_fp32_grads"):
        ledger.model_states(1e9, 8, 1, "bf16")


def test_one_rank_is_the_stage_that_peaks_each_part_where_it_lives():
    config = dict(layers=8, hidden=512, heads=8, vocab=32000, seq=256, micro_batch=2, dp=2, tp=1,
                  pp=4, zero_stage=1, microbatches=8)
    stages = [ledger.stage_ledger(i, **config) for i in range(4)]
    assert [s["transient_items"]["logits and their gradient"] > 0 for s in stages] == [False] * 3 + [True]
    layer = ledger.activation_bytes_per_layer(256, 2, 512, 8)
    assert [s["activations"] for s in stages] == [layer * 2 * (4 - i) for i in range(4)]
    emb = 32000 * 512 * 2                                # bf16 weights of the embedding
    assert stages[0]["parameters"] - stages[1]["parameters"] == emb == stages[3]["parameters"] - stages[1]["parameters"]
    worst = ledger.peak_rank_ledger(**config)
    assert worst["peak"] == max(s["peak"] for s in stages) and worst["stage_peaks"][worst["stage"]] == worst["peak"]
    interleaved = ledger.stage_ledger(0, **config, chunks=2)["activations"]
    assert interleaved == pytest.approx(stages[0]["activations"] * (1 + 3 / 8))   # 1 + (p-1)/(p v)
    with pytest.raises(ValueError, match="stage must be an int"):
        ledger.stage_ledger(4, **config)


def test_checkpointed_gradients_equal_only_when_dropout_is_replayed():
    plain = activations.recomputation_gradients(checkpointed=False, seed=3)
    replayed = activations.recomputation_gradients(preserve_rng_state=True, seed=3)
    redrawn = activations.recomputation_gradients(preserve_rng_state=False, seed=3)
    for name in ("x", "w1", "w2"):
        torch.testing.assert_close(replayed[name], plain[name], rtol=0, atol=0)
        assert not torch.allclose(redrawn[name], plain[name], rtol=1e-3, atol=1e-6), name
    assert torch.equal(redrawn["loss"], plain["loss"])
    no_dropout = activations.recomputation_gradients(preserve_rng_state=False, p=0.0)
    torch.testing.assert_close(no_dropout["w1"], activations.recomputation_gradients(
        checkpointed=False, p=0.0)["w1"], rtol=0, atol=0)


def test_ledger_rejects_bad_input_with_the_value():
    with pytest.raises(ValueError, match="dp must be a positive number, got 0"):
        ledger.model_states(1e9, 0, 1)
    with pytest.raises(ValueError, match="ZeRO stage must be one of"):
        ledger.model_states(1e9, 8, 4)
    with pytest.raises(ValueError, match="p must be a positive number, got -1"):
        ledger.rank_bytes(1e9, 4, 12, -1)
    with pytest.raises(ValueError, match="recompute must be one of"):
        ledger.activation_bytes_per_layer(8, 1, 16, 2, recompute="some")
    with pytest.raises(ValueError, match=r"layers \(10\) must be divisible by pp \(4\)"):
        ledger.per_rank_ledger(10, 64, 4, 32, 1, pp=4)
    with pytest.raises(ValueError, match="P must be a positive int"):
        bench.bench_case(1, P=0)


@FEW
@given(st.integers(1, 4096), st.integers(1, 16), st.sampled_from([64, 512, 4096]),
       st.sampled_from([1, 8, 32]), st.sampled_from([1, 2, 4, 8]))
def test_activation_formulas_agree_where_they_must(s, b, h, a, t):
    none = ledger.activation_bytes_per_layer(s, b, h, a)
    assert math.isclose(none, s * b * h * (34 + 5 * a * s / h))
    # at t = 1 tensor and sequence parallelism change nothing; they only ever save memory
    assert math.isclose(ledger.activation_bytes_per_layer(s, b, h, a, 1, True), none)
    tp = ledger.activation_bytes_per_layer(s, b, h, a, t)
    sp = ledger.activation_bytes_per_layer(s, b, h, a, t, True)
    assert sp <= tp <= none
    assert ledger.activation_bytes_per_layer(s, b, h, a, t, True, "full") == 2 * s * b * h / t


def test_calculator_holds_pp_microbatches_under_1f1b_and_all_under_gpipe():
    config = dict(layers=8, hidden=256, heads=8, seq=128, micro_batch=2, pp=4, microbatches=16)
    f = ledger.per_rank_ledger(schedule="1f1b", **config)
    g = ledger.per_rank_ledger(schedule="gpipe", **config)
    assert g["activations"] == 4 * f["activations"]
    assert f["peak"] == pytest.approx(sum(f[k] for k in ("parameters", "gradients",
                                                           "optimizer_states", "activations",
                                                           "transients")))
    stage3 = ledger.per_rank_ledger(zero_stage=3, dp=8, schedule="1f1b", **config)
    assert stage3["transient_items"]["gathered layers (stage 3)"] > 0
    assert ledger.in_flight_microbatches("1f1b", 4, 16, stage=3) == 1


def test_wire_bytes_are_2_psi_and_3_psi_and_grow_with_microbatches_in_stage_3():
    psi, P = 1e9, 8
    assert ledger.wire_bytes_per_rank(psi, P, 1) == pytest.approx(2 * 7 / 8 * psi * 2)
    assert ledger.wire_bytes_per_rank(psi, P, 3) == pytest.approx(3 * 7 / 8 * psi * 2)
    assert ledger.wire_bytes_per_rank(psi, P, 3, microbatches=32) == pytest.approx(
        48 * ledger.wire_bytes_per_rank(psi, P, 1, microbatches=32))


def test_wire_bytes_with_fp32_reductions_double_only_the_reductions():
    psi, P, b = 1e9, 8, 7 / 8 * 1e9
    fp32 = dict(reduction_bytes_per_element=4)
    assert ledger.wire_bytes_per_rank(psi, P, 0, **fp32) == pytest.approx(2 * b * 4)
    for stage in (1, 2):
        assert ledger.wire_bytes_per_rank(psi, P, stage, **fp32) == pytest.approx(b * (4 + 2))
    assert ledger.wire_bytes_per_rank(psi, P, 3, **fp32) == pytest.approx(b * (4 + 2 * 2))
    assert ledger.wire_bytes_per_rank(psi, P, 3, microbatches=4, **fp32) == pytest.approx(b * 4 * (4 + 4))
    assert ledger.wire_bytes_per_rank(psi, P, 3, microbatches=4, reshard="step", **fp32) \
        == pytest.approx(b * (4 + 2))
    assert ledger.wire_bytes_per_rank(psi, P, 2, reduction_bytes_per_element=2) \
        == ledger.wire_bytes_per_rank(psi, P, 2)
    with pytest.raises(ValueError, match="reduction_bytes_per_element"):
        ledger.wire_bytes_per_rank(psi, P, 2, reduction_bytes_per_element=0)


# ---- one process: the profiler's categories, saved activations, schedules ------------------------

def test_profiler_categories_of_a_plain_adamw_step_are_exact():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(8, 32)

    def step():
        model(x).square().mean().backward()
        optimizer.step()
    step()
    timeline = measure.profile(step, device="cpu")
    n = sum(p.numel() for p in model.parameters())
    assert timeline.start["parameter"] == 4 * n
    assert timeline.start["gradient"] == 4 * n
    assert timeline.start["optimizer_state"] == 8 * n + 4 * 4     # m, v; four 4-byte step counts
    assert timeline.peak >= sum(timeline.start.values())


def _entry(action, addr, size, *frames):
    return {"action": action, "addr": addr, "size": size, "stream": 0,
            "frames": [{"filename": f, "line": n, "name": name} for f, n, name in frames]}


def test_snapshot_peak_replays_a_trace_from_what_was_allocated_before_it():
    """A CUDA-format snapshot written by hand: 1000 B allocated before recording (and still at the
    end), then a 300-B and a 500-B block (the peak, 1800 B), the 300 freed, 100 more."""
    user = ("/home/me/train.py", 12, "step")
    inner = ("/venv/lib/torch/nn/functional.py", 7, "linear")
    trace = [_entry("alloc", 0x10, 300, inner, user), _entry("alloc", 0x20, 500, user),
             _entry("free_requested", 0x10, 300), _entry("free_completed", 0x10, 300),
             _entry("alloc", 0x30, 100, inner)]
    blocks = [{"size": 1000, "state": "active_allocated", "address": 0},
              {"size": 500, "state": "active_allocated", "address": 0x20},
              {"size": 100, "state": "active_allocated", "address": 0x30},
              {"size": 300, "state": "inactive", "address": 0x10}]
    snap = {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [trace]}
    found = snapshot.peak(snap, 0)
    assert (found.bytes, found.baseline, found.index, found.entries) == (1800, 1000, 1, 5)
    assert found.live == [(800, 2, "train.py:12 in step")]      # torch's own frame skipped
    assert snapshot.where([{"filename": "none", "line": 0, "name": "torch/optim/adam.py(3): f"}]) \
        == "torch/optim/adam.py(3): f (torch)"
    assert snapshot.where([]) == "(no frames)"
    assert "1,800 B" in found.table() and snapshot.Peak.from_dict(found.as_dict()) == found
    with pytest.raises(ValueError, match="device_traces"):
        snapshot.peak({"segments": []})
    with pytest.raises(ValueError, match="devices 0..0"):
        snapshot.peak(snap, 3)


def test_snapshot_of_a_cpu_step_peaks_where_the_profilers_timeline_does():
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(16, 32)

    def step():
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    step()
    snap, trace = snapshot.record(step, device="cpu")
    found = snapshot.peak(snap, trace)
    assert found.bytes == measure.profile(step, device="cpu").peak
    assert found.baseline >= 4 * 3 * sum(p.numel() for p in model.parameters())   # weights, m, v
    assert any("in step" in where or "): step" in where for _, _, where in found.live), found.live


@FEW
@given(st.sampled_from([16, 32]), st.integers(1, 3), st.sampled_from(["none", "selective", "full"]))
def test_one_process_layer_saves_the_paper_bytes_plus_the_stated_extras(s, b, recompute):
    h, a = 32, 4
    x = torch.randn(s, b, h).to(torch.bfloat16)
    measured = activations.measure(activations.Layer(h, a), x, recompute)
    assert measured == ledger.activation_bytes_per_layer(s, b, h, a, recompute=recompute) \
        + activations.extra_bytes(s, b, h, a, recompute=recompute)


@FEW
@given(st.sampled_from(zero_pipeline.SCHEDULES), st.integers(1, 4), st.integers(1, 9))
def test_schedules_run_every_microbatch_forward_before_backward(kind, pp, m):
    for stage in range(pp):
        order = zero_pipeline.schedule(kind, pp, stage, m)
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(m))
        started = max(k for k in range(len(order) + 1)
                      if all(kind_ == "F" for kind_, _ in order[:k]))
        assert started == (m if kind == "gpipe" else min(pp - stage, m))


# ---- ZeRO stages on real ranks --------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", ledger.STAGES)
def test_every_stage_trains_like_one_process_on_three_of_four_ranks(world, stage):
    case = bench.bench_case(stage, P=3, layers=2, hidden=5, batch=2, seq=3, steps=4,
                            dtype="float64", lr=1e-2, weight_decay=0.1, history=True)
    results = world.run(bench.run_bench, case)
    assert results[3] is None
    reference = bench.reference_history(case, 3)
    for result in results[:3]:
        for step, want in zip(result["history"], reference):
            for got, w in zip(step, want):
                torch.testing.assert_close(got[:w.numel()], w, rtol=1e-12, atol=1e-14)


@pytest.mark.timeout(120)
def test_bytes_kept_and_sent_match_the_ledger_at_p_3(world):
    P, layers, hidden = 3, 2, 24
    psi = layers * zero.padded_numel(hidden, P)
    for stage in ledger.STAGES:
        case = bench.bench_case(stage, P=P, layers=layers, hidden=hidden)
        world.run(bench.run_bench, case)
        with world.traffic() as traffic:
            kept = world.run(bench.run_bench, case)[0]["kept"]
        states = ledger.model_states(psi, P, stage)
        assert kept["parameters"] == states["parameters"]
        assert kept["gradients"] == states["gradients"]
        assert kept["optimizer_states"] == states["optimizer_states"] + 4 * layers
        expected = ledger.wire_bytes_per_rank(psi, P, stage)
        for rank in range(P):
            assert expected <= traffic.sent[rank] <= expected + 160 * 6 * layers * (P - 1), \
                (stage, rank, traffic.sent, expected)
        assert traffic.sent[3] == 0                      # the fourth rank sat it out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", ledger.STAGES)
def test_fp32_main_gradients_train_like_one_process_and_keep_the_18_byte_row_at_p_3(world, stage):
    # float64 run: the main gradients are float64 too, so the history must match one process
    exact = bench.bench_case(stage, P=3, layers=2, hidden=5, batch=2, seq=3, steps=3, dtype="float64",
                             lr=1e-2, weight_decay=0.1, history=True, main_grads=True)
    reference = bench.reference_history(exact, 3)
    for result in world.run(bench.run_bench, exact)[:3]:
        for step, want in zip(result["history"], reference):
            for got, w in zip(step, want):
                torch.testing.assert_close(got[:w.numel()], w, rtol=1e-12, atol=1e-14)
    # bf16 weights, FP32 main gradients: Megatron's 18 bytes, 6 + 12/d at stage 1; FP32 on the wire
    P, layers, hidden = 3, 2, 24
    psi = layers * zero.padded_numel(hidden, P)
    case = bench.bench_case(stage, P=P, layers=layers, hidden=hidden, main_grads=True)
    world.run(bench.run_bench, case)
    with world.traffic() as traffic:
        kept = world.run(bench.run_bench, case)[0]["kept"]
    states = ledger.model_states(psi, P, stage, "mixed_fp32_grads")
    assert kept["parameters"] == states["parameters"]
    assert kept["gradients"] == states["gradients"] == 4 * psi / (P if stage >= 2 else 1)
    assert kept["optimizer_states"] == states["optimizer_states"] + 4 * layers
    expected = ledger.wire_bytes_per_rank(psi, P, stage, reduction_bytes_per_element=4)
    for rank in range(P):
        assert expected <= traffic.sent[rank] <= expected + 160 * 6 * layers * (P - 1), \
            (stage, rank, traffic.sent, expected)


def test_main_gradients_and_profile_rank_refuse_what_they_do_not_build():
    block = zero.make_blocks(1, 4, 0, 1, 0, 3)[0]
    block.keep_for_step()
    with pytest.raises(ValueError, match="reshard='step'"):
        block.use_main_grad()
    with pytest.raises(ValueError, match="profile_rank"):
        bench.bench_case(0, profile="raw", profile_rank=-1)


@pytest.mark.timeout(120)
def test_stage_3_gathers_twice_per_microbatch_in_a_pipeline(world):
    for m in (1, 3):
        for zero_stage, expected in ((1, 2), (3, 2 * m * 2)):
            case = zero_pipeline.case(zero_stage=zero_stage, layers=2, microbatches=m)
            with world.tracing() as trace:
                world.call(zero_pipeline.train_step, args=(case,), timeout=60)
            assert [zero_pipeline.count(trace, r, "all_gather_single") for r in range(4)] \
                == [expected] * 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule_kind", ["1f1b", "gpipe"])
def test_stage_3_resharded_once_per_step_gathers_l_times_and_holds_zero_1_memory(world, schedule_kind):
    """The once-per-step policy (torch's pipelining stage with FSDP2): L all-gathers and L
    reduce-scatters per step whatever m, the same weights as resharding every microbatch, the
    whole weights and gradients held during the step and only the shards between steps."""
    L, m, H, b = 2, 3, 16, 4                              # float32 bench
    N = zero.padded_numel(H, 2)
    S = N // 2
    results = {}
    for reshard in ("microbatch", "step"):
        case = zero_pipeline.case(zero_stage=3, layers=L, microbatches=m, schedule=schedule_kind,
                                  hidden=H, reshard=reshard)
        with world.tracing() as trace:
            results[reshard] = world.call(zero_pipeline.train_step, args=(case,), timeout=60)
        gathers = [zero_pipeline.count(trace, r, "all_gather_single") for r in range(4)]
        scatters = [zero_pipeline.count(trace, r, "all_to_all_single") for r in range(4)]
        assert gathers == [2 * m * L if reshard == "microbatch" else L] * 4, (reshard, gathers)
        assert scatters == [m * L if reshard == "microbatch" else L] * 4, (reshard, scatters)
    for r in range(4):
        step, micro = results["step"][r], results["microbatch"][r]
        for a, c in zip(step["masters"], micro["masters"]):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
        assert micro["bytes_during"] == micro["bytes_between"] == (2 * L * S + 3 * N) * b
        assert step["bytes_during"] == (L * S + 2 * L * N + N) * b, (r, step)
        assert step["bytes_between"] == (2 * L * S + N) * b, (r, step)
    case = zero_pipeline.case(zero_stage=1, layers=L, microbatches=m, schedule=schedule_kind, hidden=H)
    for r, stage_1 in enumerate(world.call(zero_pipeline.train_step, args=(case,), timeout=60)):
        assert stage_1["bytes_during"] == stage_1["bytes_between"] == (2 * L * N + N + S) * b, r
        assert step["bytes_during"] - stage_1["bytes_during"] == (L - 1) * S * b   # its own slices


def _fsdp2_in_schedule_1f1b(steps, m, layers, hidden, pp=2):
    """FSDP2 (kept gathered, as torchtitan with pp > 1) inside torch's Schedule1F1B, rank =
    stage x dp + dp rank, microbatches [2, 4, H], `steps` steps."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    device_mesh = init_device_mesh("cpu", (pp, dist.get_world_size() // pp), mesh_dim_names=("pp", "dp"))
    stage_index = device_mesh.get_local_rank("pp")
    module = bench.plain_model(layers, hidden, stage_index, torch.float32)
    for block in module:
        fully_shard(block, mesh=device_mesh["dp"], reshard_after_forward=False)
    fully_shard(module, mesh=device_mesh["dp"], reshard_after_forward=False)
    stage = pipelining.PipelineStage(module, stage_index, pp, torch.device("cpu"),
                                     group=device_mesh.get_group("pp"))
    schedule = pipelining.Schedule1F1B(stage, m, loss_fn=lambda out, target: out.square().mean())
    x = torch.randn(2 * m, 4, hidden, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(steps):
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=torch.zeros_like(x))
        for p in module.parameters():
            p.grad = None


@pytest.mark.timeout(180)
def test_fsdp2_in_torchs_1f1b_issues_the_once_per_step_policys_collectives(world):
    """Chapter 3's claim about torch 2.13's pipelining stage: an FSDP2 stage is not resharded and
    not reduced until the last backward, so a steady step issues L all-gathers and L
    reduce-scatters whatever m, the counts of zero_pipeline's reshard="step"."""
    L, H = 2, 16
    for m in (2, 4):
        counts = {}
        for steps in (1, 2):
            with world.tracing() as trace:
                world.call(_fsdp2_in_schedule_1f1b, args=(steps, m, L, H), timeout=120)
            counts[steps] = [(zero_pipeline.count(trace, r, "all_gather_single"),
                              zero_pipeline.count(trace, r, "reduce_scatter_single")) for r in range(4)]
        steady = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(counts[1], counts[2])]
        assert steady == [(L, L)] * 4, (m, counts)
        case = zero_pipeline.case(zero_stage=3, layers=L, microbatches=m, hidden=H, reshard="step")
        with world.tracing() as trace:
            world.call(zero_pipeline.train_step, args=(case,), timeout=60)
        assert [(zero_pipeline.count(trace, r, "all_gather_single"),
                 zero_pipeline.count(trace, r, "all_to_all_single")) for r in range(4)] == steady


def test_reshard_step_is_refused_where_it_means_nothing():
    with pytest.raises(ValueError, match="stages 2-3"):
        zero_pipeline.case(zero_stage=1, reshard="step")
    with pytest.raises(ValueError, match="reshard must be one of"):
        zero_pipeline.case(zero_stage=3, reshard="layer")


@pytest.mark.timeout(120)
def test_tensor_and_sequence_parallel_layers_compute_the_same_and_save_what_is_stated(world):
    case = dict(s=16, b=2, h=32, a=4, t=2)
    for sp in (False, True):
        agree = world.run(activations.outputs_agree, dict(case, sequence_parallel=sp))
        assert max(g for g in agree if g is not None) < 1e-12
        saved = [v for v in world.run(activations.measure_on_rank, dict(case, sequence_parallel=sp))
                 if v is not None]
        expected = ledger.activation_bytes_per_layer(16, 2, 32, 4, 2, sp) \
            + activations.extra_bytes(16, 2, 32, 4, 2, sp)
        assert saved == [expected, expected]


# ---- lab 3, task 1: the reference ShardedOptimizer as a library ----------------------------------

def _train_with_accumulation(_, cls, dtype_name, steps):
    """Every rank: a tiny model with a frozen layer, 2 microbatches per step, ShardedOptimizer
    around AdamW; returns the weights after every step."""
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(dtype)
    model[0].bias.requires_grad_(False)                                   # frozen
    groups = [{"params": [model[0].weight], "weight_decay": 0.1},
              {"params": [model[2].weight, model[2].bias], "weight_decay": 0.0, "lr": 3e-3}]
    optimizer = cls(groups, torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank())
    history = []
    for _ in range(steps):
        for _ in range(2):
            model(torch.randn(4, 5, generator=g, dtype=dtype)).square().mean().div(2).backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def _single_process_accumulation(world_size, dtype_name, steps):
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(dtype)
    model[0].bias.requires_grad_(False)
    optimizer = torch.optim.AdamW([{"params": [model[0].weight], "weight_decay": 0.1},
                                   {"params": [model[2].weight, model[2].bias],
                                    "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2)
    generators = [torch.Generator().manual_seed(r) for r in range(world_size)]
    history = []
    for _ in range(steps):
        batches = [[torch.randn(4, 5, generator=g, dtype=dtype) for _ in range(2)] for g in generators]
        loss = sum(model(x).square().mean() / 2 for per_rank in batches for x in per_rank) / world_size
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reference_sharded_optimizer_with_accumulation_and_a_frozen_bias(world, dtype):
    histories = world.run(_train_with_accumulation, None, ShardedOptimizer, dtype, 6)
    reference = _single_process_accumulation(world.size, dtype, 6)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=1e-10, atol=1e-12)
    for history in histories:
        for step, want in zip(history, reference):
            for got, w in zip(step, want):
                torch.testing.assert_close(got, w, **tol)


def _step_after_an_error(_, cls):
    """A step that raises on every rank (a sparse gradient), then a good one."""
    p = torch.nn.Parameter(torch.arange(6, dtype=torch.float64))
    optimizer = cls([p], torch.optim.SGD, lr=0.5, momentum=0.9)
    p.grad = torch.ones(6, dtype=torch.float64).to_sparse()
    try:
        optimizer.step()
        raised = False
    except RuntimeError:
        raised = True
    p.grad = torch.full((6,), 2.0, dtype=torch.float64)
    optimizer.step()
    return raised, p.detach().clone()


@pytest.mark.timeout(60)
def test_reference_sharded_optimizer_is_right_after_a_failed_step(world):
    results = world.run(_step_after_an_error, None, ShardedOptimizer)
    for raised, value in results:
        assert raised
        torch.testing.assert_close(value, torch.arange(6, dtype=torch.float64) - 0.5 * 2.0)


@pytest.mark.timeout(180)
def test_the_reference_answers_pass_their_checkers(world):
    for name in ("adamw", "sgd"):
        checks.check_sharded_optimizer(world, ShardedOptimizer, name, steps=10)
    checks.check_bad_inputs(world, ShardedOptimizer)


# ---- lab 3: the wrong answers the issue names are rejected ---------------------------------------

class _FullStateEverywhere(ShardedOptimizer):
    """Every rank keeps the whole optimizer: right values, no sharding."""

    def __init__(self, params, optimizer_cls, **kwargs):
        groups = list(params)
        self.params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
        self.optimizer = optimizer_cls(groups, **kwargs)

    def step(self):
        for p in self.params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        self.optimizer.step()


class _FreshStateEveryStep(ShardedOptimizer):
    """Rebuilds its inner optimizer before every step: right after step 1, drifts later."""

    def step(self):
        groups = [dict(g) for g in self.optimizer.param_groups]          # every option kept
        self.optimizer = type(self.optimizer)(groups)
        super().step()


class _GroupOptionsLost(ShardedOptimizer):
    """Builds the inner optimizer from the constructor's defaults only: weight decay and lr of the
    second group are lost on every shard."""

    def __init__(self, params, optimizer_cls, **kwargs):
        groups = list(params)
        flat = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
        super().__init__([{"params": flat}], optimizer_cls, **kwargs)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("wrong, message", [
    (_FullStateEverywhere, "holds .* bytes of optimizer state"),
    (_FreshStateEveryStep, "step 1 was right and later ones drift"),
    (_GroupOptionsLost, "each parameter group sets its own lr and weight_decay"),
])
def test_task_1_rejects_the_named_wrong_optimizers(world, wrong, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_sharded_optimizer(world, wrong, "adamw", steps=10)


def test_task_1_rejects_a_class_that_accepts_bad_input(world):
    class Lenient(ShardedOptimizer):
        def __init__(self, params, optimizer_cls, **kwargs):
            pass
    with pytest.raises(AssertionError, match="accepted not an optimizer class"):
        checks.check_bad_inputs(world, Lenient)


# ---- lab 3 through its own test cells (issue 26: every point needs the work) ---------------------

TASK1 = ["test_task1_sharded_optimizer", "test_task1_bad_inputs"]


def run_lab(test_ids, answers=None):
    """The lab's own test cells, visible and hidden lines, outside nbgrader (lab_notebooks)."""
    return lab_notebooks.run_lab(LAB, test_ids, answers)


def _replaced(grade_id, old, new):
    source = lab_notebooks.answer(LAB, grade_id)
    assert source.count(old) == 1, f"the solution of {grade_id} changed; update this test"
    return source.replace(old, new)


def _appended(grade_id, extra):
    return lab_notebooks.answer(LAB, grade_id) + "\n" + extra


# Task 1: plain data parallelism whose full optimizer lives in a module global, and a sharded
# decoy on the instance stepped alongside it: right values, the decoy's state 1/P. Passed the
# old checker (state counted only where reachable from the instance).
GLOBAL_FULL_OPTIMIZER = lab_notebooks.wrong_answers(LAB)._GLOBAL_FULL_OPTIMIZER

@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, grade_id, source, fails", [
    ("the full optimizer in a module global", "task1_sharded_optimizer",
     lambda: _appended("task1_sharded_optimizer", GLOBAL_FULL_OPTIMIZER),
     {"test_task1_sharded_optimizer"}),
    ("P read from the notebook's WORLD_SIZE", "task1_sharded_optimizer",
     lambda: _replaced("task1_sharded_optimizer", "dist.get_rank(), dist.get_world_size()",
                       "dist.get_rank(), WORLD_SIZE"),
     {"test_task1_sharded_optimizer"}),
    ("empty slices dropped (a rank with nothing builds an empty optimizer)", "task1_sharded_optimizer",
     lambda: _replaced("task1_sharded_optimizer", "                slices.append(piece)\n",
                       "                if piece.numel():\n                    slices.append(piece)\n")
     .replace("            inner_groups.append(dict(options, params=slices))",
              "            if slices:\n                inner_groups.append(dict(options, params=slices))"),
     {"test_task1_sharded_optimizer"}),
    ("an optimizer instance refused with ValueError", "task1_sharded_optimizer",
     lambda: _replaced("task1_sharded_optimizer", "        if not (isinstance(optimizer_cls, type) and",
                       "        if isinstance(optimizer_cls, torch.optim.Optimizer):\n"
                       "            raise ValueError('pass the optimizer class, not an instance')\n"
                       "        if not (isinstance(optimizer_cls, type) and"),
     {"test_task1_bad_inputs"}),  # its main cell is the solution's: only the refusals are run
    ("a parameter in two groups accepted (duplicates checked per group; graded)",
     "task1_sharded_optimizer",
     lambda: lab_notebooks.wrong_answers(LAB).DUPLICATES_PER_GROUP(
         lab_notebooks.answer(LAB, "task1_sharded_optimizer")),
     {"test_task1_bad_inputs"}),
    ("only the refusals written, the rest a stub (passed the old bad-input cell)",
     "task1_sharded_optimizer",
     lambda: _replaced("task1_sharded_optimizer", "        self.segment = offset ",
                       "        raise NotImplementedError('Lab 3, task 1')\n"
                       "        self.segment = offset "),
     {"test_task1_sharded_optimizer", "test_task1_bad_inputs"}),
])
def test_wrong_answers_lose_exactly_the_cells_of_their_task(name, grade_id, source, fails):
    cells = TASK1                                      # tasks 2-3: tests/chapters/test_lab03_memory.py
    if fails == {"test_task1_bad_inputs"}:             # the class's steps are the solution's
        cells = ["test_task1_bad_inputs"]
    outcome = run_lab(cells, {grade_id: source()})
    failed = {test for test, error in outcome.items() if error is not None}
    assert failed == fails, f"{name}: failed {sorted(failed)}, expected {sorted(fails)}: {outcome}"


# ---- section 6, beyond the three stages: offload and hybrid sharding ---------------------------

from labkit.collectives import GLOO_FRAMING_BYTES          # noqa: E402
from labkit.memory import hsdp, offload                    # noqa: E402


@pytest.fixture(scope="module")
def late_world():
    """A world of 4 made when the first test below needs it: the lab tests above shut theirs."""
    yield labkit.world(4, timeout=60, teaching=False)
    labkit.shutdown_all()


def test_offload_ledger_row_and_wire_are_the_table():
    psi, dp = 1.0, 8
    row = offload.ledger_row(psi, dp, "optimizer")
    assert row["device"] == {"parameters": 2, "gradients": 2 / 8}
    assert sum(row["host"].values()) == pytest.approx(16 / 8)
    row = offload.ledger_row(psi, dp, "parameters")
    assert sum(row["device"].values()) == pytest.approx(4 / 8)
    assert sum(row["host"].values()) == pytest.approx(16 / 8)
    assert offload.pcie_bytes(psi, dp, "optimizer", b=2) == {"down": 0.25, "up": 0.25}
    assert offload.pcie_bytes(psi, dp, "parameters", b=2, microbatches=3) == {"down": 0.25, "up": 1.5}
    with pytest.raises(ValueError, match="policy"):
        offload.ledger_row(psi, dp, "nvme")


def test_copy_meter_counts_only_what_crosses_the_host_set():
    host, device = torch.zeros(10, dtype=torch.bfloat16), torch.ones(10, dtype=torch.bfloat16)
    other_host = torch.zeros(10)
    with offload.CopyMeter([host, other_host]) as meter:
        host.copy_(device)                    # down: 20 B
        device[:4].copy_(host[:4])            # up: 8 B (a view's bytes, not its storage's)
        other_host.copy_(host)                # inside the host set: nothing
        device.clone().copy_(device)          # inside the device: nothing
        host.to(torch.float32)                # a cast on the host, no device change: nothing
    assert (meter.down, meter.up, meter.copies) == (20, 8, 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", offload.POLICIES)
def test_offload_trains_like_one_process_and_moves_the_tables_bytes_at_p_3(late_world, policy):
    world = late_world
    for dtype, b in (("float64", 8), ("bfloat16", 2)):
        case = offload.case(policy, P=3, dtype=dtype, layers=3, steps=2)
        results = world.run(offload.run_offload, case)
        assert results[3] is None
        results = results[:3]
        psi = case["layers"] * zero.padded_numel(case["hidden"], 3)
        wire = offload.pcie_bytes(psi, 3, policy, b=b)
        for r in results:
            assert r["down"] == [wire["down"]] * 2 and r["up"] == [wire["up"]] * 2, (policy, dtype, r)
        if dtype == "float64":
            reference = bench.reference_history(case, 3)
            for r in results:
                for step, ref in zip(r["history"], reference):
                    for got, want in zip(step, ref):
                        torch.testing.assert_close(got[:len(want)], want, rtol=0, atol=1e-12)


@pytest.mark.timeout(120)
def test_hsdp_2x2_trains_like_one_process_and_keeps_the_gathers_inside_the_node(late_world):
    world = late_world
    case = hsdp.case(nodes=2, per_node=2, steps=2, dtype="float64", history=True)
    reference = bench.reference_history(case, 4)
    for r in world.run(hsdp.run_hsdp, case):
        for step, ref in zip(r["history"], reference):
            for got, want in zip(step, ref):
                torch.testing.assert_close(got[:len(want)], want, rtol=0, atol=1e-12)
    case = hsdp.case(nodes=2, per_node=2, layers=2, hidden=32)
    world.run(hsdp.run_hsdp, case)
    with world.traffic() as traffic:
        world.run(hsdp.run_hsdp, case)
    wire = hsdp.wire_bytes(2 * zero.padded_numel(32, 2), nodes=2, per_node=2, b=2)
    slack = GLOO_FRAMING_BYTES * 6 * 2
    for r in range(4):
        peer, replica = r ^ 1, (r + 2) % 4
        assert abs(traffic.matrix[r][peer] - wire["intra"]) <= slack, traffic.table()
        assert abs(traffic.matrix[r][replica] - wire["inter"]) <= slack, traffic.table()
        assert traffic.matrix[r][(peer + 2) % 4] == 0, traffic.table()   # nothing to the other node's other rank


def test_hsdp_wire_formula_on_a_bigger_mesh():
    assert hsdp.wire_bytes(1.0, nodes=4, per_node=8, b=2) == {"intra": 3 * 7 / 8 * 2, "inter": 2 * 3 / 4 * 2 / 8}


def test_gloo_framing_figures_in_the_prose_are_labkits_constant():
    """Issue 28: one framing figure across chapters 3-5, the constant's (ch. 1, section 4, measures
    it with collectives.measure_gloo_framing and checks it against the constant)."""
    import json
    import re
    from labkit.collectives import GLOO_HEADER_BYTES, GLOO_NOTICE_BYTES
    allowed = {"header": GLOO_HEADER_BYTES, "notice": GLOO_NOTICE_BYTES, "per message": GLOO_FRAMING_BYTES}
    framing = re.compile(r"(\d+)(?:-byte|\s+bytes?)\s+(?:of\s+)?(header|notice|per\s+message)")
    notebook = json.loads((ROOT / "course" / "03_memory_and_zero.ipynb").read_text())
    text = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    found = [(int(n), " ".join(what.split())) for n, what in framing.findall(text)]
    assert found and all(allowed[what] == n for n, what in found), found
    assert "160 bytes per message" not in text
    chapter1 = (ROOT / "course" / "01_collectives.ipynb").read_text()
    assert "collectives.measure_gloo_framing(" in chapter1 and "gloo frames each message with GLOO_FRAMING_BYTES" in chapter1
