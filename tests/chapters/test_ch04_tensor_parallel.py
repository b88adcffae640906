"""Chapter 4 / lab 4: labkit.tensor_parallel (bench, formulas, placements, measurements), the lab's
reference solution used as a library, and the lab's checkers rejecting the wrong answers the issue
names (each on real ranks, through the same functions the test cells call)."""
import math
import sys
from pathlib import Path

import cloudpickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import lab_notebooks
import labkit
from labkit import tensor_parallel as tpk
from labkit.tensor_parallel import checks, gqa, gqa_checks, measure, placement

ROOT = Path(__file__).resolve().parents[2]
LAB = "lab04_tensor_parallel"
SOLUTION = ROOT / "solutions" / LAB / f"{LAB}.ipynb"
cloudpickle.register_pickle_by_value(sys.modules[__name__])   # rank programs defined here
FEW = settings(max_examples=5, derandomize=True, deadline=None, database=None,
               suppress_health_check=list(HealthCheck))


def _cell(grade_id):
    import nbformat
    return next(c.source for c in nbformat.read(str(SOLUTION), as_version=4).cells
                if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def _reference(grade_id, source=None):
    """The namespace of a solution answer cell (optionally edited), as a student's would be."""
    namespace = {"torch": torch, "dist": dist, "nn": nn, "F": F, "labkit": labkit, "tpk": tpk,
                 "__name__": "__main__"}
    exec(compile(source or _cell(grade_id), f"{LAB}:{grade_id}", "exec"), namespace)
    return namespace


@pytest.fixture
def world3():
    # labkit keeps one world: the same one while the settings stay, a fresh one after plain3
    yield labkit.world(3, timeout=60)


@pytest.fixture
def plain3():
    """Three ranks without teaching mode: lab 4, task 2 counts bytes per pair."""
    yield labkit.world(3, timeout=60, teaching=False)


@pytest.fixture(scope="module", autouse=True)
def _close_worlds():
    yield
    labkit.shutdown_all()


# ---- the bench, in one process ------------------------------------------------------------------

@FEW
@given(st.integers(0, 10_000), st.sampled_from([torch.float32, torch.float64]))
def test_block_reference_is_the_module(seed, dtype):
    block = tpk.make_block(seed, dtype=dtype)
    x = torch.randn(2, 5, tpk.HIDDEN, dtype=dtype, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(tpk.block_reference(tpk.fused_params(block), x, tpk.HEADS), block(x))


def test_make_block_is_deterministic_and_never_square():
    a, b = tpk.make_block(3), tpk.make_block(3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert all(p.shape[0] != p.shape[1] for p in a.parameters() if p.dim() == 2)


@FEW
@given(st.integers(1, 3), st.sampled_from([4, 6, 12]), st.sampled_from([8, 12]))
def test_activation_formula_counts_what_autograd_keeps(batch, seq, ffn):
    block = tpk.make_block(0, hidden=20, heads=4, head_dim=3, ffn=ffn, dtype=torch.float32)
    x = torch.randn(batch, seq, 20, requires_grad=True)
    kept = measure.saved_activation_bytes(lambda: block(x), exclude=block.parameters())
    assert kept == 4 * tpk.activation_elements(batch, seq, 20, 12, ffn, 4)


@given(st.integers(1, 64), st.integers(1, 64), st.integers(1, 512), st.integers(1, 8))
def test_sequence_parallel_sends_what_tensor_parallel_sends_on_a_ring(B, T, H, tp):
    assert math.isclose(tpk.tp_layer_bytes(B, T, H, tp, sequence_parallel=True),
                        tpk.tp_layer_bytes(B, T, H, tp), rel_tol=1e-12)


def test_vocab_loss_bytes_do_not_depend_on_the_vocabulary():
    assert tpk.vocab_parallel_ce_bytes(4096, 4) == 3 * 2 * 3 / 4 * 4096 * 4
    assert tpk.gathered_logits_bytes(4096, 1000, 4) > 100 * tpk.vocab_parallel_ce_bytes(4096, 4)


def test_placement_records_refuse_inconsistent_shapes():
    with pytest.raises(ValueError, match=r"Shard\(0\) piece of a \(10, 4\) tensor over tp=2"):
        placement.Placed(torch.zeros(4, 4), (10, 4), placement.Shard(0), tp=2)
    with pytest.raises(ValueError, match="not divisible by tp"):
        placement.place(torch.zeros(10, 4), placement.Shard(0), 0, 3)
    record = placement.place(torch.arange(12.).view(3, 4), placement.Shard(1), 1, 2)
    assert record.local.tolist() == [[2, 3], [6, 7], [10, 11]] and record.local_shape == (3, 2)


def test_peak_bytes_follows_storages_not_views():
    x = torch.randn(256, 256)

    def two_buffers():
        a = x * 2                     # 256 KiB
        view = a.view(-1)             # no allocation
        b = torch.softmax(a, dim=-1)  # 256 KiB
        del a, view
        return b.sum()

    peak, _ = measure.peak_bytes(two_buffers)
    assert peak == 2 * x.numel() * 4


def test_self_check_skips_unanswered_questions(capsys):
    assert tpk.self_check({}) == 0
    assert "not answered yet" in capsys.readouterr().out
    right = {"column weight shape": (2048, 4096), "block bytes": 469762048,
             "g under sequence parallelism": "reduce-scatter", "loss bytes": 147456,
             "loss bytes, vocabulary doubled": 147456}
    assert tpk.self_check(right) == 5
    with pytest.raises(KeyError):
        tpk.self_check({"no such question": 1})


# ---- the reference solution passes every checker, at P = 1..4 -----------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_reference_passes_the_visible_checks(size):
    world = labkit.world(size, timeout=60)
    layers = _reference("task1_parallel_linear")
    loss = _reference("task3_vocab_parallel_ce")["vocab_parallel_cross_entropy"]
    checks.check_column_parallel(world, layers["ColumnParallelLinear"], 10, 36, gather_output=True)
    checks.check_row_parallel(world, layers["RowParallelLinear"], 36, 10, input_is_parallel=False)
    checks.check_vocab_cross_entropy(world, loss, tokens=40, vocab=22, uneven=True,
                                     ignore_fraction=0.3)
    attention = _reference("task2_gqa")["tp_gqa_attention"]
    plain = labkit.world(size, timeout=60, teaching=False)
    for kv_heads in (3, 2, 1):                  # at t = 2 and 4, (12, 3) and (12, 2) share heads
        gqa_checks.check_gqa_attention(plain, attention, 12, kv_heads)
        gqa_checks.check_gqa_traffic(plain, attention, 12, kv_heads)


@pytest.mark.timeout(300)
def test_reference_passes_every_checker_at_three_ranks(world3):
    layers = _reference("task1_parallel_linear")
    for gather in (True, False):
        checks.check_column_parallel(world3, layers["ColumnParallelLinear"], 7, 12, gather,
                                     bias=not gather, dtype="float32", batch_shape=(5,))
    for parallel in (True, False):
        checks.check_row_parallel(world3, layers["RowParallelLinear"], 12, 7, parallel,
                                  bias=parallel, dtype="float64", batch_shape=(2, 2, 2))
    loss = _reference("task3_vocab_parallel_ce")["vocab_parallel_cross_entropy"]
    checks.check_vocab_cross_entropy(world3, loss, tokens=17, vocab=5, uneven=True,
                                     dtype="float64", ignore_fraction=0.5, ignore_index=-1)
    checks.check_vocab_traffic(world3, loss)


def _train_mlp(share, column_cls, row_cls, steps, microbatches):
    """On a rank: a column-then-row MLP (the first bias frozen), SGD with gradient accumulation."""
    layer1 = column_cls(6, 12, bias=True, gather_output=False, dtype=torch.float64)
    layer2 = row_cls(12, 6, bias=False, input_is_parallel=True, dtype=torch.float64)
    with torch.no_grad():
        layer1.weight.copy_(share["w1"])
        layer1.bias.copy_(share["b1"])
        layer2.weight.copy_(share["w2"])
    layer1.bias.requires_grad_(False)                      # a frozen parameter
    params = [layer1.weight, layer2.weight]
    for step in range(steps):
        for p in params:
            p.grad = None
        for x in share["batches"][step].chunk(microbatches):
            (layer2(torch.tanh(layer1(x))).square().mean() / microbatches).backward()
        with torch.no_grad():
            for p in params:
                p -= 0.1 * p.grad
    return [layer1.weight.detach(), layer2.weight.detach()]


@pytest.mark.timeout(120)
def test_reference_layers_train_like_one_process(world3):
    """Several steps, gradient accumulation over microbatches, a frozen bias, a layer without
    bias: the sharded weights after training are the slices of the single-process weights."""
    layers = _reference("task1_parallel_linear")
    g = torch.Generator().manual_seed(0)
    w1, b1, w2 = (torch.randn(12, 6, generator=g, dtype=torch.float64), torch.randn(12, generator=g,
                  dtype=torch.float64), torch.randn(6, 12, generator=g, dtype=torch.float64))
    batches = [torch.randn(8, 6, generator=g, dtype=torch.float64) for _ in range(3)]
    rows = checks._slices(12, 3)
    shares = [{"w1": w1[r], "b1": b1[r], "w2": w2[:, r], "batches": batches} for r in rows]
    results = world3.run_each(_train_mlp, shares, layers["ColumnParallelLinear"],
                              layers["RowParallelLinear"], 3, 2)
    ref1, ref2 = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    for batch in batches:
        ref1.grad = ref2.grad = None
        for x in batch.chunk(2):
            ((torch.tanh(x @ ref1.T + b1) @ ref2.T).square().mean() / 2).backward()
        with torch.no_grad():
            ref1 -= 0.1 * ref1.grad
            ref2 -= 0.1 * ref2.grad
    for (got1, got2), r in zip(results, rows):
        torch.testing.assert_close(got1, ref1.detach()[r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got2, ref2.detach()[:, r], rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(60)
def test_a_bad_size_raises_and_the_world_stays_usable(world3):
    layers = _reference("task1_parallel_linear")
    outcomes = world3.run_each(checks._try_construct, [None] * 3, layers["ColumnParallelLinear"],
                               "column", 10, 7)
    assert all(kind == "ValueError" and "out_features (7)" in message for kind, message in outcomes)
    checks.check_column_parallel(world3, layers["ColumnParallelLinear"], 4, 6)


# ---- the wrong answers the issue names fail, each in its own task -------------------------------

ROW_WITHOUT_F = ("            x = _SplitLastDim.apply(x)",
                 "            x = _my_slice(x)            # no backward: x.grad stays a share")
COLUMN_WITHOUT_F = ("F.linear(_CopyToTP.apply(x), self.weight, self.bias)",
                    "F.linear(x, self.weight, self.bias)")
SQUARE_ONLY = ('local = _divide(in_features, tp, "in_features")',
               'local = _divide(out_features, tp, "out_features")   # the wrong size')
BLOCK_TWICE = ("        return x.view_as(x)\n\n    @staticmethod\n    def backward(ctx, grad):\n"
               "        grad = grad.contiguous()",
               "        x = x.contiguous() / dist.get_world_size()\n"
               "        dist.all_reduce(x)   # 'make sure every rank has the same input'\n"
               "        return x\n\n    @staticmethod\n"
               "    def backward(ctx, grad):\n        grad = grad.contiguous()")
GATHERING_LOSS = '''
def vocab_parallel_cross_entropy(local_logits, targets, vocab_start, ignore_index=-100):
    tp, rank = dist.get_world_size(), dist.get_rank()
    widths = [torch.zeros((), dtype=torch.int64) for _ in range(tp)]
    dist.all_gather(widths, torch.tensor(local_logits.shape[-1]))
    widest = max(int(w) for w in widths)                    # gloo gathers equal sizes: pad
    padded = F.pad(local_logits.detach(), (0, widest - local_logits.shape[-1]))
    pieces = [torch.empty_like(padded) for _ in range(tp)]
    dist.all_gather(pieces, padded.contiguous())
    pieces = [piece[:, :int(w)] for piece, w in zip(pieces, widths)]
    pieces[rank] = local_logits                              # keep the gradient of my columns
    return F.cross_entropy(torch.cat(pieces, dim=-1), targets, ignore_index=ignore_index)
'''


def _edited(grade_id, old, new):
    source = _cell(grade_id)
    assert old in source, f"the solution changed: {old!r} is gone; update this test"
    return _reference(grade_id, source.replace(old, new))


@pytest.mark.timeout(120)
def test_a_row_layer_without_the_backward_all_reduce_fails(world3):
    layers = _edited("task1_parallel_linear", *ROW_WITHOUT_F)
    checks.check_row_parallel(world3, layers["RowParallelLinear"], 36, 10, input_is_parallel=True)
    with pytest.raises(AssertionError, match="zero elsewhere"):
        checks.check_row_parallel(world3, layers["RowParallelLinear"], 36, 10,
                                  input_is_parallel=False)
    layers = _edited("task1_parallel_linear", *COLUMN_WITHOUT_F)
    with pytest.raises(AssertionError, match="Megatron's f"):
        checks.check_column_parallel(world3, layers["ColumnParallelLinear"], 10, 36)


@pytest.mark.timeout(120)
def test_a_split_that_only_works_for_square_weights_fails(world3):
    layers = _edited("task1_parallel_linear", *SQUARE_ONLY)
    # square: every value is right; only the error for a size tp does not divide is missed
    with pytest.raises(AssertionError, match="should raise ValueError naming"):
        checks.check_row_parallel(world3, layers["RowParallelLinear"], 12, 12,
                                  input_is_parallel=False)
    with pytest.raises(AssertionError, match=r"the layer's parameters are .*\(12, 12\)"):
        checks.check_row_parallel(world3, layers["RowParallelLinear"], 36, 12,
                                  input_is_parallel=False)


@pytest.mark.timeout(180)
def test_reference_gqa_trains_at_three_ranks_in_every_regime(plain3):
    """t = 3 with kv heads split (6, 3), chained (12, 4: rank 1 holds kv heads 1 and 2),
    replicated in a group of two (6, 2) and on every rank (12, 1: MQA); float32 and float64."""
    attention = _reference("task2_gqa")["tp_gqa_attention"]
    for heads, kv_heads in ((6, 3), (12, 4), (6, 2), (12, 1)):
        gqa_checks.check_gqa_traffic(plain3, attention, heads, kv_heads)
    gqa_checks.check_gqa_attention(plain3, attention, 12, 4, dtype="float32", batch=1, seq=9)


def test_gqa_placement_reference_and_solution_agree():
    from labkit.grading.references import tensor_parallel as ref
    solution = _reference("task2_gqa")["gqa_placement"]
    for heads in (1, 6, 8, 12, 24, 32, 64):
        for kv_heads in range(1, heads + 1):
            for tp in range(1, heads + 1):
                want = ref.placement(heads, kv_heads, tp)
                if isinstance(want, str):
                    with pytest.raises(ValueError):
                        solution(heads, kv_heads, tp)
                    continue
                got = [[list(q), list(kv)] for q, kv in solution(heads, kv_heads, tp)]
                assert got == want, (heads, kv_heads, tp)
                # each rank holds at most ceil(kv/t) + 1 kv heads, and every kv head someone
                assert max(len(kv) for _, kv in got) <= -(-kv_heads // tp) + 1
                assert sorted({j for _, kv in got for j in kv}) == list(range(kv_heads))
    assert ref.holders(ref.placement(12, 4, 3)) == [[0], [0, 1], [1, 2], [2]]


def test_gqa_pair_bytes_is_two_world_rings_plus_one_ring_per_shared_head():
    holders = [[0], [0, 1], [1, 2], [2]]
    n, head = 2 * 16 * 64 * 8, gqa.kv_head_bytes(64, 8, 8)
    step = gqa.pair_bytes(2, 16, 64, 8, holders, 3, 8)
    ring = 2 * 2 / 3 * n
    assert step[0][2] == 2 * ring and step[1][0] == 2 * ring + head and step[0][1] == head
    assert step[2][1] == 2 * ring + head and step[1][2] == head and step[2][0] == 0
    assert gqa.pair_bytes(2, 16, 64, 8, holders, 3, 8, phase="forward")[0][1] == 0
    with pytest.raises(ValueError, match="phase"):
        gqa.pair_bytes(2, 16, 64, 8, holders, 3, 8, phase="both")


def test_gqa_reference_is_mha_when_every_head_has_its_kv():
    g = torch.Generator().manual_seed(0)
    params = gqa.random_params(g, 20, 4, 4, 3)
    x = torch.randn(2, 5, 20, generator=g, dtype=torch.float64)
    y = gqa.attention_reference(params, x, 4, 4)
    q, k, v = (tpk.split_heads(F.linear(x, params[f"{n}.weight"], params[f"{n}.bias"]), 3)
               for n in "qkv")
    want = F.linear(tpk.merge_heads(tpk.attention_core(q, k, v)), params["o.weight"],
                    params["o.bias"])
    torch.testing.assert_close(y, want)


@pytest.mark.timeout(120)
def test_kv_gradients_summed_over_the_whole_world_fail_only_on_the_wire(plain3):
    source = WRONG.edited("world_sum", lab_notebooks.answer(LAB, "task2_gqa"))
    attention = _reference("task2_gqa", source)["tp_gqa_attention"]
    gqa_checks.check_gqa_attention(plain3, attention, 12, 4)               # the values are right
    with pytest.raises(AssertionError, match="rank 0 sent .* bytes to rank 2"):
        gqa_checks.check_gqa_traffic(plain3, attention, 12, 4)


@pytest.mark.timeout(120)
def test_a_cross_entropy_that_gathers_the_logits_fails_on_the_wire(world3):
    namespace = _reference("task3_vocab_parallel_ce", GATHERING_LOSS)
    loss = namespace["vocab_parallel_cross_entropy"]
    checks.check_vocab_cross_entropy(world3, loss, tokens=30, vocab=27)      # the values are right
    with pytest.raises(AssertionError, match="gathering the logits would be"):
        checks.check_vocab_traffic(world3, loss)


@FEW
@given(st.integers(2, 40), st.integers(3, 30), st.booleans())
def test_vocab_bounds_cover_the_vocabulary_once(tokens, vocab, uneven):
    case, logits, targets, bounds = checks._vocab_case("bounds", tokens, vocab, 3, "float32",
                                                       0.3, -100, uneven)
    assert bounds[0][0] == 0 and bounds[-1][1] == vocab
    assert all(e > s for s, e in bounds) and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert (targets != -100).any()


# ---- third edition (issue 28): the two sequence-parallel deals, bytes, overlap, GQA, vocab ------

@given(st.integers(1, 8), st.sampled_from([6, 12, 24]), st.integers(1, 4))
def test_regather_in_backward_keeps_exactly_one_over_t(B, T, tp):
    shape = dict(B=B, T=T, H=20, A=12, F=36, heads=4)
    one = tpk.activation_elements(**shape)
    regather = tpk.activation_elements(**shape, tp=tp, sequence_parallel=True, regather_in_backward=True)
    whole = tpk.activation_elements(**shape, tp=tp, sequence_parallel=True)
    assert math.isclose(regather * tp, one, rel_tol=1e-12)
    assert math.isclose(whole - regather, 2 * B * T * 20 * (1 - 1 / tp), rel_tol=1e-12, abs_tol=1e-9)


def test_regather_in_backward_costs_two_all_gathers_and_needs_sequence_parallelism():
    n = 8 * 96 * 48 * 4
    extra = (tpk.tp_layer_bytes(8, 96, 48, 3, sequence_parallel=True, regather_in_backward=True)
             - tpk.tp_layer_bytes(8, 96, 48, 3, sequence_parallel=True))
    assert math.isclose(extra, 2 * 2 / 3 * n)
    with pytest.raises(ValueError, match="needs sequence_parallel=True"):
        tpk.tp_layer_bytes(8, 96, 48, 3, regather_in_backward=True)
    with pytest.raises(ValueError, match="needs sequence_parallel=True"):
        tpk.activation_elements(8, 96, 48, 60, 120, 12, tp=3, regather_in_backward=True)


def _sequence_reduce_scatter(shape, which):
    """Chapter 4's reduce-scatter along T (chapter 3's all-to-all + sum), or gloo's own."""
    from labkit.memory.zero import reduce_scatter
    rank, tp = dist.get_rank(), dist.get_world_size()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(rank))        # [T, B, H]
    if which == "all_to_all":
        return reduce_scatter(x.view(-1), torch.empty_like(x).view(-1)).view(shape[0] // tp, *shape[1:])
    out = torch.empty(shape[0] // tp, *shape[1:])
    dist.reduce_scatter_single(out, x)
    return out


def test_the_chapters_reduce_scatter_sends_a_ring_share_and_gloos_sends_an_all_reduce(world3):
    # world3 keeps teaching mode on (its checks add a few small messages): 2% covers them; the
    # two reduce-scatters differ by 2x
    shape, n = (96, 8, 48), 96 * 8 * 48 * 4                                      # [T, B, H] float32
    sent, values = {}, {}
    for which in ("all_to_all", "gloo"):
        with world3.traffic() as traffic:
            values[which] = world3.run(_sequence_reduce_scatter, shape, which)
        sent[which] = traffic.sent
    for r in range(3):
        torch.testing.assert_close(values["all_to_all"][r], values["gloo"][r])
        assert math.isclose(sent["all_to_all"][r], tpk.all_gather_bytes(n, 3), rel_tol=0.02), sent
        assert math.isclose(sent["gloo"][r], tpk.all_reduce_bytes(n, 3), rel_tol=0.02), sent


def test_gqa_layout_splits_shares_or_refuses_like_megatron_core_and_vllm():
    from labkit.tensor_parallel import scaling
    assert scaling.gqa_layout(32, 8, 4) == {"q_heads": 8, "kv_heads": 2, "kv_replicas": 1}
    # kv heads divide t: Megatron-Core (all-gathered q/k/v) and vLLM (replicated weights) accept it
    assert scaling.gqa_layout(32, 8, 16) == {"q_heads": 2, "kv_heads": 1, "kv_replicas": 2}
    with pytest.raises(ValueError, match=r"plain head split needs tp \| kv_heads"):
        scaling.gqa_layout(32, 8, 16, replicate=False)
    with pytest.raises(ValueError, match="neither divides the other"):
        scaling.gqa_layout(12, 2, 3)
    with pytest.raises(ValueError, match=r"heads \(12\) is not divisible by tp \(8\)"):
        scaling.gqa_layout(12, 4, 8)


def test_chapter_states_megatron_cores_gqa_rule_of_today():
    """Megatron-Core accepts kv heads that divide t (PR #2565: q/k/v all-gathered) and refuses only
    a t that neither divides nor is divided by them; the chapter must not say it refuses more, and
    must not print lab 4 task 2's placement."""
    import nbformat
    cells = nbformat.read(str(ROOT / "course" / "04_tensor_parallel.ipynb"), as_version=4).cells
    prose = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    code = "\n".join(c.source for c in cells if c.cell_type == "code")
    assert "must be a multiple or divisor" in prose and "PR #2565" in prose
    assert "get_query_key_value_tensors" in prose
    assert "Megatron refuses" not in prose and "no (refused)" not in code
    assert "gqa_placement" not in code and "tp_gqa_attention" not in code


def test_block_flops_is_what_torchs_flop_counter_counts():
    from torch.utils.flop_counter import FlopCounterMode
    from labkit.tensor_parallel import scaling
    block = tpk.make_block(0, hidden=20, heads=4, head_dim=3, ffn=36)
    x = torch.randn(2, 6, 20, dtype=torch.float64, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        block(x).sum().backward()
    assert counter.get_total_flops() == scaling.block_flops(2, 6, 20, 12, 36)
    assert scaling.block_flops(2, 6, 20, 12, 36, tp=4) * 4 == scaling.block_flops(2, 6, 20, 12, 36)


def test_crossover_is_where_bytes_take_as_long_as_the_matmuls():
    from labkit.tensor_parallel import scaling
    H, R, bw = 4096, 1e15, 50e9
    t = scaling.crossover_tp(H, R, bw, itemsize=2)
    compute = 6 * 1024 * (4 * H * H + 2 * H * 4 * H) / t / R
    comm = tpk.tp_layer_bytes(1, 1024, H, t, itemsize=2) / bw
    assert math.isclose(compute, comm, rel_tol=1e-9)


def test_padded_vocab_is_megatrons():
    from labkit.tensor_parallel import scaling
    assert scaling.padded_vocab(50257, 1) == 50304 and scaling.padded_vocab(50257, 8) == 51200
    assert scaling.padded_vocab(128256, 8) == 129024 and scaling.padded_vocab(1024, 8) == 1024
    with pytest.raises(ValueError, match="must be >= 1"):
        scaling.padded_vocab(50257, 0)


def _course_vocab_loss_peak(n, vocab):
    """Chapter 4's forward-only vocabulary-parallel loss (section 5), its peak under peak_bytes."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    start, end = rank * vocab // tp, (rank + 1) * vocab // tp
    g = torch.Generator().manual_seed(rank)
    targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0))
    h, E_local = torch.randn(n, 16, generator=g), torch.randn(end - start, 16, generator=g)

    def loss():
        local_logits = h @ E_local.T                                     # [N, V/t]
        m = local_logits.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        shifted = local_logits - m.unsqueeze(-1)
        sum_exp = shifted.exp().sum(dim=-1)
        dist.all_reduce(sum_exp)
        mine = (targets >= start) & (targets < end)
        target_logit = torch.zeros_like(sum_exp)
        rows = mine.nonzero().squeeze(-1)
        target_logit[rows] = shifted[rows, targets[rows] - start]
        dist.all_reduce(target_logit)
        return (sum_exp.log() - target_logit).mean()

    return end - start, measure.peak_bytes(loss)[0]


@pytest.mark.parametrize("vocab", [3072, 1000])                 # 1000: uneven shards over 3 ranks
def test_vocab_parallel_loss_peak_is_exactly_three_logit_shards_and_two_vectors(world3, vocab):
    n = 96
    for width, peak in world3.run(_course_vocab_loss_peak, n, vocab):
        assert peak == 3 * n * width * 4 + 8 * n, (width, peak)


# ---- issue 26: every point needs the work, through the lab's own test cells ---------------------

WRONG = lab_notebooks.wrong_answers(LAB)
TASK_CELLS = {"task1_parallel_linear": ["test_task1_column", "test_task1_row"],
              "task2_gqa": ["test_task2_placement", "test_task2_gqa_values",
                            "test_task2_gqa_traffic"],
              "task3_vocab_parallel_ce": ["test_task3_ce_values", "test_task3_ce_traffic"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, fails", [
    # t written as 2: right at the locked WORLD_SIZE = 2, wrong at the hidden t = 3
    ("half_column", {"test_task1_column"}),
    # values without the construction: the whole weight gathered, the dense product taken
    ("dense_column", {"test_task1_column"}),
    ("dense_row", {"test_task1_row"}),
    # ... only on the shapes the traffic cell does not measure
    ("narrow_gather", {"test_task3_ce_values"}),
    # task 2: Megatron-Core's refusal, replicas not summed, summed over the world, groups made
    # every step, f forgotten
    ("refuse_chain", {"test_task2_placement"}),
    ("unsummed_replicas", {"test_task2_gqa_values", "test_task2_gqa_traffic"}),
    ("world_sum", {"test_task2_gqa_traffic"}),
    ("groups_every_step", {"test_task2_gqa_traffic"}),
    ("no_f", {"test_task2_gqa_values", "test_task2_gqa_traffic"}),
    # a backward that communicates
    ("recompute_in_backward", {"test_task3_ce_traffic"}),
])
def test_each_wrong_answer_loses_exactly_the_cells_of_its_requirement(name, fails):
    grade_id = WRONG.EDITS[name][0]
    source = WRONG.edited(name, lab_notebooks.answer(LAB, grade_id))
    outcome = lab_notebooks.run_lab(LAB, TASK_CELLS[grade_id], {grade_id: source})
    failed = {cell for cell, error in outcome.items() if error is not None}
    assert failed == fails, f"{name}: failed {sorted(failed)}, expected {sorted(fails)}: {outcome}"
