"""Chapter 7 / lab 7: labkit.moe's formulas and references, the lab's reference answers used the
way a training loop uses them, and the lab's checkers rejecting the wrong answers issue 17 names
(a combine that loses the order, capacity that drops the wrong tokens, an EP layer that fails
with an empty expert, an all-to-all padded to equal splits, FP8 without scales), on real ranks
and through nbgrader's autograder."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st

import labkit
import lab_notebooks
from lab_notebooks import answer_cells
from labkit import checks as lab_checks
from labkit import moe
from labkit.moe import checks, ep, fp8

ROOT = Path(__file__).resolve().parents[2]
LAB = "lab07_mixture_of_experts"
SOLUTION = ROOT / "solutions" / LAB / f"{LAB}.ipynb"
FEW = settings(max_examples=12, derandomize=True, deadline=None, database=None,
               suppress_health_check=list(HealthCheck))


def _answer_cells() -> dict:
    """Every answer cell of the lab's solution notebook, executed in one namespace."""
    return answer_cells(LAB, torch=torch, dist=dist, labkit=labkit, moe=moe, ep=ep, fp8=fp8,
                        checks=checks)


REF = _answer_cells()


@pytest.fixture(scope="module", autouse=True)
def _close_worlds():
    yield
    labkit.shutdown_all()


# ---- labkit.moe: routing, capacity, bytes, imbalance (one process) ----------------------------

@FEW
@given(st.integers(0, 10_000), st.integers(1, 40), st.integers(1, 9), st.data())
def test_route_renormalises_over_k_and_the_bias_only_selects(seed, tokens, experts, data):
    top_k = data.draw(st.integers(1, experts))
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float64)
    weights, chosen = moe.route(logits, top_k, renormalise=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(tokens, dtype=torch.float64))
    assert torch.equal(chosen, logits.topk(top_k, dim=-1).indices)
    bias = torch.linspace(-0.3, 0.3, experts, dtype=torch.float64)
    biased_weights, biased = moe.route(logits, top_k, bias, renormalise=True)
    probs = logits.softmax(-1)
    assert torch.equal(biased, (probs + bias).topk(top_k, dim=-1).indices)
    picked = probs.gather(1, biased)
    torch.testing.assert_close(biased_weights, picked / picked.sum(-1, keepdim=True))
    kept, _ = moe.route(logits, top_k, renormalise=False)
    torch.testing.assert_close(kept, probs.gather(1, chosen))


def test_route_at_top_1_keeps_the_probability_so_the_router_learns():
    """Switch's top-1 gate is the chosen expert's probability: the router gets a gradient. A
    renormalised single choice is exactly 1, whatever the logits: no gradient (the default
    renormalises only for k > 1, as GShard's top-2 and Mixtral do)."""
    logits = torch.randn(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for renormalise, learns in ((None, True), (False, True), (True, False)):
        leaf = logits.clone().requires_grad_(True)
        weights, chosen = moe.route(leaf, 1, renormalise=renormalise)
        (weights.squeeze(1) * torch.arange(16.0, dtype=torch.float64)).sum().backward()
        assert (leaf.grad.abs().max().item() > 1e-3) is learns, (renormalise, leaf.grad.abs().max())
        if not learns:
            assert torch.equal(weights, torch.ones_like(weights))
    two, _ = moe.route(logits, 2)
    torch.testing.assert_close(two.sum(-1), torch.ones(16, dtype=torch.float64))


# Three routers as their models' code computes them (written here from those sources, not
# imported: transformers is not a dependency of this course), against moe.route.

def _switch_top1_router(logits):
    """transformers' SwitchTransformersTop1Router.forward (models/switch_transformers/
    modeling_switch_transformers.py): softmax in float32, the argmax, and the gate is that
    expert's probability (torch.max of the probabilities): nothing is renormalised."""
    probs = logits.float().softmax(dim=-1)
    gate, expert = probs.max(dim=-1)
    return gate.unsqueeze(-1), expert.unsqueeze(-1)


def _mixtral_router(logits, top_k=2):
    """transformers' MixtralSparseMoeBlock.forward (models/mixtral/modular_mixtral.py): softmax
    in float32, topk, then the k weights divided by their sum."""
    weights, experts = logits.float().softmax(dim=1).topk(top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def _deepseek_v3_gate(logits, bias, top_k=8, n_groups=8, topk_groups=4, route_scale=2.5):
    """DeepSeek-V3's Gate.forward (deepseek-ai/DeepSeek-V3, inference/model.py), sigmoid scores:
    the bias added for selection only; each group (a node) scored by the sum of its two best
    biased scores; the experts of all but the topk_groups best groups masked out; top-k; the
    chosen unbiased scores divided by their sum and multiplied by route_scale."""
    affinity = logits.sigmoid()                                       # [N, E]
    biased = (affinity + bias).view(logits.size(0), n_groups, -1)     # [N, groups, E / groups]
    best_groups = biased.topk(2, dim=-1).values.sum(-1).topk(topk_groups, dim=-1).indices
    outside = torch.ones(biased.shape[:2], dtype=torch.bool).scatter(1, best_groups, False)
    masked = biased.masked_fill(outside.unsqueeze(-1), float("-inf")).flatten(1)
    experts = masked.topk(top_k, dim=-1).indices
    weights = affinity.gather(1, experts)
    return weights / weights.sum(dim=-1, keepdim=True) * route_scale, experts


def test_route_matches_switch_mixtral_and_deepseek_v3_as_their_code_routes():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 8, generator=g, dtype=torch.float64)
    for reference, top_k in ((_switch_top1_router, 1), (_mixtral_router, 2)):
        want_weights, want_experts = reference(logits)
        got_weights, got_experts = moe.route(logits, top_k)            # the default
        assert torch.equal(got_experts, want_experts), reference.__name__
        torch.testing.assert_close(got_weights.float(), want_weights)
    # DeepSeek-V3 at its own size: E = 256 in 8 groups (nodes), 4 of them per token, top-8
    logits = torch.randn(512, 256, generator=g, dtype=torch.float64)
    bias = torch.randn(256, generator=g, dtype=torch.float64) * 0.05
    want_weights, want_experts = _deepseek_v3_gate(logits, bias)
    got_weights, got_experts = moe.route(logits, 8, bias, score="sigmoid", groups=8, top_groups=4)
    assert torch.equal(got_experts, want_experts)
    torch.testing.assert_close(got_weights * 2.5, want_weights, rtol=1e-12, atol=1e-12)
    nodes_per_token = [len(set(row)) for row in (got_experts // 32).tolist()]
    assert max(nodes_per_token) <= 4
    unlimited = moe.route(logits, 8, bias, score="sigmoid")[1]
    assert max(len(set(row)) for row in (unlimited // 32).tolist()) > 4   # the limit binds
    everything = moe.route(logits, 8, bias, score="sigmoid", groups=8, top_groups=8)[1]
    assert torch.equal(everything, unlimited)                  # all groups allowed: no limit


def test_group_limited_route_rejects_groups_that_do_not_fit():
    with pytest.raises(ValueError, match=r"groups \(3\) must divide the number of experts \(8\)"):
        moe.route(torch.zeros(2, 8), 2, groups=3, top_groups=1)
    with pytest.raises(ValueError, match=r"top_groups \* experts per group \(1 \* 2\) >= top_k"):
        moe.route(torch.zeros(2, 8), 3, groups=4, top_groups=1)
    with pytest.raises(ValueError, match="needs both groups and top_groups"):
        moe.route(torch.zeros(2, 8), 2, groups=4)
    with pytest.raises(ValueError, match="score must be 'softmax' or 'sigmoid'"):
        moe.route(torch.zeros(2, 8), 2, score="relu")


def test_route_and_capacity_reject_bad_arguments_with_the_values():
    with pytest.raises(ValueError, match=r"between 1 and the number of experts \(4\), got 5"):
        moe.route(torch.zeros(3, 4), 5)
    with pytest.raises(ValueError, match="capacity factor must be > 0, got 0"):
        moe.capacity(10, 2, 4, 0)
    with pytest.raises(ValueError, match="every expert has load 0"):
        moe.imbalance([0, 0, 0])


@FEW
@given(st.integers(0, 100_000), st.integers(1, 8), st.integers(1, 512),
       st.sampled_from([0.5, 1.0, 1.1, 1.25, 1.5, 2.0, 3.3]))
def test_capacity_is_the_ceiling_of_n_k_over_e_times_the_factor(tokens, top_k, experts, factor):
    cap = moe.capacity(tokens, top_k, experts, factor)
    exact = tokens * top_k * factor / experts
    assert cap - 1 < exact + 1e-6 and cap >= exact - 1e-6


def test_capacity_examples_and_the_float_artefact():
    assert moe.capacity(4096, 8, 256, 1.25) == 160
    assert moe.capacity(1000, 2, 8, 1.1) == 275           # 1000 * 2 * 1.1 / 8 is 275.00000000000006
    assert moe.capacity(64, 2, 4, 1.0) == 32


def test_ep_bytes_formulas_and_the_deepseek_v3_figures():
    assert moe.ep_bytes_per_rank(10, 2, 8, 4) == pytest.approx(4 * 3 / 4 * 2 * 10 * 8)
    total = moe.ep_bytes_per_rank(10, 2, 8, 4, backward=True)
    assert total == pytest.approx(8 * 3 / 4 * 2 * 10 * 8)
    assert moe.ep_bytes_per_rank(10, 2, 8, 1, backward=True) == 0.0           # one rank: all local
    v3 = moe.DEEPSEEK_V3
    per_token = moe.ep_bytes_per_rank(1, v3["top_k"], v3["hidden"], 10 ** 12, backward=True)
    assert per_token == pytest.approx(458_752, rel=1e-9)      # 8 K H; the source's 917.5 KB is 2x
    assert fp8.row_bytes(7168) == 7168 + 4 * 56 and fp8.row_bytes(200, 64) == 216
    assert fp8.ratio_to_bf16(512) == pytest.approx((512 + 16) / 1024)


@FEW
@given(st.integers(2, 6), st.integers(1, 4), st.integers(1, 64))
def test_exchange_bytes_of_even_counts_is_the_even_formula(P, top_k, hidden):
    tokens = P * 6
    per_peer = tokens * top_k // P
    counts = [[per_peer] * P for _ in range(P)]
    exact = moe.exchange_bytes(counts, hidden, 2)
    formula = moe.ep_bytes_per_rank(tokens, top_k, hidden, P)
    per_rank = [d + c for d, c in zip(exact["dispatch"], exact["combine"])]
    assert per_rank == [pytest.approx(formula)] * P


@FEW
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=12).filter(lambda v: sum(v) > 0),
       st.integers(1, 50), st.randoms(use_true_random=False))
def test_imbalance_ignores_order_and_scale_and_meets_its_limits(load, factor, rng):
    base = moe.imbalance(load)
    shuffled = list(load)
    rng.shuffle(shuffled)
    for other in (moe.imbalance(shuffled), moe.imbalance([factor * n for n in load])):
        for key in base:
            assert other[key] == pytest.approx(base[key], rel=1e-9, abs=1e-12)
    E = len(load)
    assert 0 <= base["gini"] <= (E - 1) / E + 1e-12
    assert 1 - 1e-12 <= base["max_over_mean"] <= E + 1e-12
    assert base["cv"] <= math.sqrt(E - 1) + 1e-9


def test_balanced_and_hot_logits_do_what_they_say():
    _, chosen = moe.route(ep.balanced_logits(24, 6, 2, offset=1), 2)
    assert torch.bincount(chosen.reshape(-1), minlength=6).tolist() == [8] * 6
    _, chosen = moe.route(ep.hot_logits(2000, 4, hot_expert=2, share=0.6), 1)
    assert 0.55 < (chosen == 2).float().mean().item() < 0.65


# ---- task 1 and task 4a: the reference answers and the wrong ones, one process ------------------

@FEW
@given(st.integers(0, 10 ** 9), st.integers(1, 60), st.integers(1, 8), st.data())
def test_reference_dispatch_passes_both_checks_for_any_shape(seed, tokens, experts, data):
    top_k = data.draw(st.integers(1, experts), label="top_k")
    factor = data.draw(st.sampled_from(checks.FACTORS), label="capacity factor")
    dtype = data.draw(st.sampled_from(["float64", "float32"]), label="dtype")
    plan = checks.check_dispatch_plan(REF["dispatch"], tokens, experts, top_k, factor, dtype=dtype,
                                      seed=seed)
    checks.check_dispatch_combine(REF["dispatch"], REF["combine"], tokens, experts, top_k, factor,
                                  dtype=dtype, seed=seed)
    assert int(plan["tokens_per_expert"].sum()) + int(plan["dropped"].sum()) == tokens * top_k
    if factor is None:
        assert not plan["dropped"].any()


def test_dispatch_with_identical_tokens_keeps_either_of_a_tie():
    x = torch.ones(6, 4, dtype=torch.float64)
    logits = torch.tensor([[2.0, 1.0, 0.0]] * 6, dtype=torch.float64)      # every weight ties
    plan = REF["dispatch"](x, logits, 1, 1.0)
    assert plan["tokens_per_expert"].tolist() == [2, 0, 0] and int(plan["dropped"].sum()) == 4


def _combine_lost_order(expert_output, plan):
    n_tokens, top_k = plan["weights"].shape
    rows = expert_output.new_zeros(n_tokens * top_k, expert_output.size(-1))
    rows[:expert_output.size(0)] = expert_output          # packed order taken for token order
    return (rows.view(n_tokens, top_k, -1) * plan["weights"].unsqueeze(-1).to(rows.dtype)).sum(1)


def _dispatch_by_position(x, router_logits, top_k, capacity_factor=None):
    n_tokens, n_experts = router_logits.shape
    weights, chosen = moe.route(router_logits, top_k)
    flat = chosen.reshape(-1)
    queue = flat.argsort(stable=True)                      # token order within each expert
    load = torch.bincount(flat, minlength=n_experts)
    place = torch.arange(queue.numel()) - (torch.cumsum(load, 0) - load)[flat[queue]]
    if capacity_factor is not None:
        queue = queue[place < moe.capacity(n_tokens, top_k, n_experts, capacity_factor)]
    dropped = torch.ones(n_tokens * top_k, dtype=torch.bool)
    dropped[queue] = False
    return {"packed": x[queue // top_k], "dropped": dropped.view(n_tokens, top_k),
            "tokens_per_expert": torch.bincount(flat[queue], minlength=n_experts),
            "queue": queue, "weights": weights}


def test_checkers_reject_a_combine_that_loses_the_order_and_drops_by_position():
    with pytest.raises(AssertionError, match="undo the sort"):
        checks.check_dispatch_combine(REF["dispatch"], _combine_lost_order, seed=1)
    with pytest.raises(AssertionError, match="lowest-weight assignments, not the last ones"):
        checks.check_dispatch_plan(_dispatch_by_position, capacity_factor=1.0, seed=2)
    # one cell grades one thing: combine honours whatever mask dispatch chose
    checks.check_dispatch_combine(_dispatch_by_position, REF["combine"], seed=2)


def _quantize_without_scales(x, block=128):
    payload = x.float().to(torch.float8_e4m3fn).view(torch.uint8)
    return payload, torch.ones(x.size(0), fp8.blocks(x.size(1), block))


def test_fp8_reference_meets_the_bound_and_unscaled_fp8_does_not():
    for rows, hidden, block in [(12, 200, 64), (0, 16, 8), (3, 7, 4), (4, 256, 128)]:
        checks.check_quantize(REF["quantize_e4m3"], REF["dequantize_e4m3"], rows, hidden, block,
                              seed=3)
    with pytest.raises(AssertionError, match="off by more than FP8 with per-block scales allows"):
        checks.check_quantize(_quantize_without_scales, REF["dequantize_e4m3"], seed=3)


@FEW
@given(st.integers(0, 10 ** 6), st.integers(1, 300), st.sampled_from([4, 32, 128]),
       st.floats(-6, 4))
def test_fp8_error_bound_holds_over_magnitudes(seed, hidden, block, log_scale):
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(seed)) * 10 ** log_scale
    x[0, : min(block, hidden)] = 0.0                                       # an all-zero block
    payload, scales = REF["quantize_e4m3"](x, block)
    restored = REF["dequantize_e4m3"](payload, scales, block)
    assert bool(((restored - x).abs() <= fp8.error_bound(x, block)).all())


# ---- task 2: the EP layer on real ranks ----------------------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_reference_ep_layer_passes_every_check(size):
    world = labkit.world(size, timeout=90)
    checks.check_ep_layer(world, REF["ep_moe_layer"], experts_per_rank=2, top_k=2, seed=size)
    if size >= 3:
        checks.check_ep_layer(world, REF["ep_moe_layer"], experts_per_rank=3, top_k=3,
                              empty_experts=[1, 4], seed=5)
        checks.check_ep_layer(world, REF["ep_moe_layer"], idle_rank=True, no_tokens_rank=True,
                              dtype="float32", seed=6)


def _train_ep(case):
    """On every rank: SGD steps of an EP layer, two microbatches accumulated per step; the router
    frozen when case['freeze_router']. Returns the experts after each step."""
    rank, P = dist.get_rank(), dist.get_world_size()
    layer = case["layer"]
    router = case["router"].clone().requires_grad_(not case["freeze_router"])
    per_rank = case["experts"].size(0) // P
    mine = case["experts"][rank * per_rank:(rank + 1) * per_rank].clone().requires_grad_(True)
    history = []
    for batch in case["batches"]:
        for micro in batch[rank]:
            y = layer(micro, router, mine, case["top_k"])
            y.square().sum().backward()
        with torch.no_grad():
            if mine.grad is not None:                 # no row reached these experts this step
                mine -= case["lr"] * mine.grad
                mine.grad = None
            if router.requires_grad:
                dist.all_reduce(router.grad)            # the router is replicated: sum, then step
                router -= case["lr"] * router.grad
                router.grad = None
        history.append((mine.detach().clone(), router.detach().clone()))
    return history


def _train_reference(case, P):
    router = case["router"].clone().requires_grad_(not case["freeze_router"])
    experts = case["experts"].clone().requires_grad_(True)
    history = []
    for batch in case["batches"]:
        for rank in range(P):
            for micro in batch[rank]:
                ep.reference_layer(micro, router, experts, case["top_k"]).square().sum().backward()
        with torch.no_grad():
            experts -= case["lr"] * experts.grad
            experts.grad = None
            if router.requires_grad:
                router -= case["lr"] * router.grad
                router.grad = None
        history.append((experts.detach().clone(), router.detach().clone()))
    return history


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype,freeze_router", [(torch.float64, False), (torch.float32, True)])
def test_reference_ep_layer_trains_like_one_process(dtype, freeze_router):
    P, hidden, per_rank = 3, 8, 2
    g = torch.Generator().manual_seed(7)
    router, experts = ep.layer_weights(7, hidden, P * per_rank, dtype)
    sizes = [[5, 0], [3, 4], [0, 6]]                    # microbatches per rank; some empty
    draw = lambda n: torch.randn(n, hidden, generator=g, dtype=torch.float64).to(dtype)
    batches = [[[draw(n) for n in sizes[r]] for r in range(P)] for _ in range(3)]
    case = {"layer": REF["ep_moe_layer"], "router": router, "experts": experts, "top_k": 2,
            "batches": batches, "lr": 0.05, "freeze_router": freeze_router}
    world = labkit.world(P, timeout=90, teaching=False)   # the ranks import this module (and
    histories = world.run(_train_ep, case)              # nbformat): slow on a loaded machine
    reference = _train_reference(case, P)
    tol = {"rtol": 1e-9, "atol": 1e-11} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    for step, (experts_ref, router_ref) in enumerate(reference):
        for rank in range(P):
            mine, router_now = histories[rank][step]
            own = experts_ref[rank * per_rank:(rank + 1) * per_rank]
            torch.testing.assert_close(mine, own, **tol)
            torch.testing.assert_close(router_now, router_ref, **tol)


def _raise_then_run(share, layer):
    x = share["x"].clone().requires_grad_(True)
    return layer(x, share["router"], share["local_experts"], share["top_k"]).detach()


@pytest.mark.timeout(120)
def test_an_error_in_the_middle_of_a_step_leaves_the_next_call_right():
    world = labkit.world(3, timeout=90, teaching=False)
    case = lab_checks.Case("bad top_k", seed=8)
    shares, _, _ = checks.ep_case(case, 3)
    bad = [dict(share, top_k=99) for share in shares]   # every rank raises before communicating
    with pytest.raises(labkit.RankError) as raised:
        world.run_each(_raise_then_run, bad, REF["ep_moe_layer"], timeout=90)
    assert sorted(raised.value.errors) == [0, 1, 2] and "top_k" in str(raised.value)
    checks.check_ep_layer(world, REF["ep_moe_layer"], seed=9)


# The two wrong layers below repeat their routing lines on purpose: each is pasted whole, as its
# source, into a submission that `labkit grade` grades (a helper they shared would not be there).
def _ep_layer_grouped_by_unique(x, router, local_experts, top_k):
    """Groups the received rows with torch.unique: an expert with no row shifts the later ones."""
    P = dist.get_world_size()
    n_local = local_experts.size(0)
    weights, chosen = moe.route(x @ router, top_k)
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)
    per_expert = torch.bincount(flat, minlength=n_local * P)
    incoming = torch.empty_like(per_expert)
    dist.all_to_all_single(incoming, per_expert)
    incoming = incoming.view(P, n_local)
    send, recv = per_expert.view(P, n_local).sum(1).tolist(), incoming.sum(1).tolist()
    received = ep.all_to_all(x[order // top_k], send, recv)
    local = torch.arange(n_local).repeat(P).repeat_interleave(incoming.reshape(-1))
    grouping = local.argsort(stable=True)
    _, sizes = local.unique(return_counts=True)
    out = torch.cat([rows @ local_experts[i]
                     for i, rows in enumerate(received[grouping].split(sizes.tolist()))])
    back = ep.all_to_all(out[grouping.argsort()], recv, send)[order.argsort()]
    return (back.view(x.size(0), top_k, x.size(1)) * weights.unsqueeze(-1).to(x.dtype)).sum(1)


def _ep_layer_padded(x, router, local_experts, top_k):
    """Right values, but every split padded to the largest count (equal splits)."""
    P = dist.get_world_size()
    n_local, hidden = local_experts.size(0), x.size(1)
    weights, chosen = moe.route(x @ router, top_k)
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)
    per_expert = torch.bincount(flat, minlength=n_local * P)
    incoming = torch.empty_like(per_expert)
    dist.all_to_all_single(incoming, per_expert)
    incoming = incoming.view(P, n_local)
    send, recv = per_expert.view(P, n_local).sum(1).tolist(), incoming.sum(1).tolist()
    width = torch.tensor([max(send + recv)])
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    width = int(width)

    def exchange(rows, out_counts, in_counts):
        padded = torch.cat([torch.cat([p, p.new_zeros(width - p.size(0), hidden)])
                            for p in rows.split(out_counts)])
        got = ep.all_to_all(padded, [width] * P, [width] * P)
        return torch.cat([got[q * width:q * width + in_counts[q]] for q in range(P)])

    received = exchange(x[order // top_k], send, recv)
    local = torch.arange(n_local).repeat(P).repeat_interleave(incoming.reshape(-1))
    grouping = local.argsort(stable=True)
    sizes = torch.bincount(local, minlength=n_local).tolist()
    out = torch.cat([rows @ local_experts[i]
                     for i, rows in enumerate(received[grouping].split(sizes))])
    back = exchange(out[grouping.argsort()], recv, send)[order.argsort()]
    return (back.view(x.size(0), top_k, x.size(1)) * weights.unsqueeze(-1).to(x.dtype)).sum(1)


@pytest.mark.timeout(180)
def test_checkers_reject_an_empty_expert_bug_and_padded_splits():
    world = labkit.world(3, timeout=90, teaching=False)
    checks.check_ep_layer(world, _ep_layer_grouped_by_unique, seed=10)  # right: no expert is empty
    with pytest.raises(AssertionError, match=r"experts \[1, 4\] get no row at all"):
        checks.check_ep_layer(world, _ep_layer_grouped_by_unique, experts_per_rank=3,
                              empty_experts=[1, 4], seed=11)
    with pytest.raises(labkit.RankError, match="non-empty list of Tensors"):
        checks.check_ep_layer(world, _ep_layer_grouped_by_unique, idle_rank=True, seed=12)
    checks.check_ep_layer(world, _ep_layer_padded, idle_rank=True, no_tokens_rank=True,
                          seed=13)                                          # its values are right
    checks.check_ep_traffic(world, REF["ep_moe_layer"], seed=14)
    with pytest.raises(AssertionError, match="never pad every split to the largest one"):
        checks.check_ep_traffic(world, _ep_layer_padded, seed=14)


# ---- task 3 and task 4b on real ranks -----------------------------------------------------------

def _balance_from_local_batch(router_logits, top_k, bias, alpha, gamma):
    n_local, n_experts = router_logits.shape
    _, chosen = moe.route(router_logits.detach(), top_k, bias)
    load = torch.bincount(chosen.reshape(-1), minlength=n_experts)
    f = load.double() / (top_k * max(n_local, 1))
    aux = alpha * n_experts * (f * router_logits.softmax(-1).mean(0)).sum()
    return {"aux_loss": aux, "aux_value": aux.item(), "load": load, "imbalance": {},
            "bias": bias + gamma * torch.sign(load.double().mean() - load.double())}


@pytest.mark.timeout(120)
def test_balance_reference_passes_and_a_per_rank_balance_fails():
    world = labkit.world(3, timeout=90, teaching=False)
    checks.check_balance_step(world, REF["balance_step"], seed=15)
    checks.check_balance_step(world, REF["balance_step"], tokens=[0, 7, 0], top_k=3, seed=16)
    checks.check_balance_refuses_empty_batch(world, REF["balance_step"])
    with pytest.raises(AssertionError, match="the load is the global one"):
        checks.check_balance_step(world, _balance_from_local_batch, seed=15)


def _fp8_dispatch_without_scales(rows, send_counts, block=128):
    recv = ep.exchange_counts(send_counts)
    payload = rows.float().to(torch.float8_e4m3fn).view(torch.uint8)
    return ep.all_to_all(payload, send_counts, recv).view(torch.float8_e4m3fn).float()


def _fp8_dispatch_in_bf16(rows, send_counts, block=128):
    recv = ep.exchange_counts(send_counts)
    return ep.all_to_all(rows.bfloat16(), send_counts, recv).float()


@pytest.mark.timeout(120)
def test_fp8_dispatch_reference_passes_and_unscaled_or_bf16_fails():
    world = labkit.world(3, timeout=90, teaching=False)
    checks.check_fp8_dispatch(world, REF["fp8_dispatch"], seed=17)
    with pytest.raises(AssertionError, match="off by more than FP8"):
        checks.check_fp8_dispatch(world, _fp8_dispatch_without_scales, seed=17)
    with pytest.raises(AssertionError, match="BF16 would be two bytes per value"):
        checks.check_fp8_dispatch(world, _fp8_dispatch_in_bf16, seed=17)


@pytest.mark.timeout(180)
def test_top1_router_gradient_is_checked_where_it_exists_and_a_detached_gate_fails_it():
    """Lab 7's hidden top-1 case of task 2 (issue 26): the gate is the chosen expert's probability
    (moe.route keeps it at K = 1), so the reference's router gradient is not zero, and a layer
    whose gates are detached fails that case on its own (before the fix both sides were zero)."""
    world = labkit.world(3, timeout=90, teaching=False)
    results = checks.check_ep_layer(world, REF["ep_moe_layer"], experts_per_rank=1, top_k=1,
                                    seed=21)
    for rank, got in enumerate(results):
        assert got["router"].abs().max().item() > 1e-3, (rank, got["router"].abs().max())
    detached = lab_notebooks.answer_cells(
        LAB, {"task2_ep_moe_layer": WRONG7.router_detached(
            lab_notebooks.answer(LAB, "task2_ep_moe_layer"))},
        torch=torch, dist=dist, labkit=labkit, moe=moe, ep=ep, fp8=fp8, checks=checks)
    with pytest.raises(AssertionError, match=r"(?s)router gradient.*router got no gradient at all"):
        checks.check_ep_layer(world, detached["ep_moe_layer"], experts_per_rank=1, top_k=1,
                              seed=21)


# ---- issue 26: every test cell lost by a wrong answer that keeps the lab's other cells ----------
# The same wrong answers are graded by labkit grade, two to a submission, from
# tests/grading/wrong_answers/lab07_mixture_of_experts.py (tests/grading/test_labs.py).

WRONG7 = lab_notebooks.wrong_answers(LAB)
TASK_CELLS = {"task1_dispatch_combine": ["test_task1_dropped", "test_task1_combine"],
              "task2_ep_moe_layer": ["test_task2_values", "test_task2_bytes"],
              "task3_balance_step": ["test_task3_balance"],
              "task4_fp8": ["test_task4_quantize", "test_task4_dispatch"]}
EACH_LOSES = [("task1_dispatch_combine", "drop_by_position", {"test_task1_dropped"}),
              ("task1_dispatch_combine", "renormalise_kept", {"test_task1_combine"}),
              ("task2_ep_moe_layer", "router_detached", {"test_task2_values"}),
              ("task2_ep_moe_layer", "world_of_three", {"test_task2_values", "test_task2_bytes"}),
              ("task2_ep_moe_layer", "dense_off_the_bench", {"test_task2_bytes"}),
              ("task3_balance_step", "local_balance", {"test_task3_balance"}),
              ("task4_fp8", "float64_dequantize", {"test_task4_quantize"}),
              ("task4_fp8", "bf16_dispatch", {"test_task4_dispatch"})]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("grade_id, name, lost", EACH_LOSES, ids=[n for _, n, _ in EACH_LOSES])
def test_each_wrong_answer_loses_exactly_its_cells(grade_id, name, lost):
    wrong = getattr(WRONG7, name)(lab_notebooks.answer(LAB, grade_id))
    outcome = lab_notebooks.run_lab(LAB, TASK_CELLS[grade_id], {grade_id: wrong})
    assert {cell for cell, error in outcome.items() if error is not None} == lost, (name, outcome)


# ---- chapter 7's capacity and balance arithmetic (moved out of the formula ledger: both sides of
# those checks came from the same definition, so they are unit tests, not measurements) ----------

def _keep_by_position(chosen, cap, n_experts):
    """Chapter 7, section 2's rule (the notebook's cell): each expert keeps its first `cap`
    assignments in token order. chosen [N, K] -> kept [N, K] bool."""
    import torch.nn.functional as F
    one_hot = F.one_hot(chosen.reshape(-1), n_experts)              # [N*K, E], token-major
    place = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1       # [N*K]
    return (place < cap).view_as(chosen)


@pytest.mark.parametrize("tokens, experts, top_k", [(64, 4, 2), (512, 8, 2), (96, 6, 1)])
def test_capacity_keeps_min_of_load_and_c_and_the_drop_rate_is_the_excess(tokens, experts, top_k):
    for skew in (0.0, 0.5, 1.0, 2.0):
        for factor in (1.0, 1.25, 2.0):
            _, chosen = moe.route(moe.skewed_logits(tokens, experts, skew, seed=2), top_k)
            cap = moe.capacity(tokens, top_k, experts, factor)
            kept = _keep_by_position(chosen, cap, experts)
            load = torch.bincount(chosen.reshape(-1), minlength=experts)
            assert torch.bincount(chosen[kept], minlength=experts).tolist() == \
                [min(int(n), cap) for n in load]
            assert int((~kept).sum()) == moe.dropped_assignments(load.tolist(), cap)


def _switch_aux_loss(probs, chosen, alpha):
    """alpha * E * sum_i f_i * P_i (Switch Transformer eq. 4; chapter 7, section 3's cell)."""
    n_experts = probs.size(-1)
    f = torch.bincount(chosen.reshape(-1), minlength=n_experts).to(probs.dtype) / chosen.numel()
    return alpha * n_experts * (f * probs.mean(dim=0)).sum()


def test_switch_aux_loss_is_alpha_when_even_and_alpha_e_when_one_expert_takes_all():
    alpha, E = 0.01, 8
    for top_k in (1, 2):
        even = ep.balanced_logits(tokens=4 * E, experts=E, top_k=top_k)
        got = _switch_aux_loss(even.softmax(-1), moe.route(even, top_k)[1], alpha).item()
        assert math.isclose(got, alpha, rel_tol=1e-9), (top_k, got)
    collapsed = torch.zeros(64, E, dtype=torch.float64)
    collapsed[:, 0] = 40.0
    got = _switch_aux_loss(collapsed.softmax(-1), moe.route(collapsed, 1)[1], alpha).item()
    assert math.isclose(got, alpha * E, rel_tol=1e-9), got


# ---- node-limited dispatch (chapter 7, section 5): labkit.moe.nodes ----

def test_cross_node_rows_counts_copies_and_target_nodes():
    from labkit.moe import nodes
    # 3 nodes of 2 ranks; home rank 1 is on node 0
    owners = torch.tensor([[0, 1, 2, 3],     # node 0 twice, node 1 twice: 2 copies across, 1 node
                           [2, 3, 4, 5],     # nodes 1, 1, 2, 2: 4 copies, 2 nodes
                           [0, 0, 1, 1]])    # all at home: nothing crosses
    got = nodes.cross_node_rows(owners, home_rank=1, ranks_per_node=2)
    assert got == {"per_copy": 6, "per_node": 3}
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        nodes.cross_node_rows(torch.tensor([0, 1]), home_rank=0, ranks_per_node=2)


def test_expected_remote_nodes_matches_uniform_routing():
    from labkit.moe import nodes
    E, K, n_nodes, G = 16, 4, 4, 2                       # 8 ranks, 2 experts per rank
    generator = torch.Generator().manual_seed(0)
    logits = torch.rand(20000, E, generator=generator)   # uniform top-K: a random K-subset
    owners = moe.route(logits, K)[1] // (E // (n_nodes * G))
    got = nodes.cross_node_rows(owners, home_rank=0, ranks_per_node=G)
    expected = nodes.expected_remote_nodes(E, K, n_nodes)
    assert math.isclose(got["per_copy"] / 20000, expected["per_copy"], rel_tol=0.02)
    assert math.isclose(got["per_node"] / 20000, expected["per_node"], rel_tol=0.02)
    assert expected["per_node"] < expected["per_copy"]


# ---- section 5's grouped GEMM and section 8's self-check -----------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_the_loop_over_experts_with_an_empty_one(dtype):
    """The chapter relies on torch._grouped_mm(rows, w, offs=cumulative counts) being the loop."""
    counts = torch.tensor([3, 0, 7, 1, 0])
    generator = torch.Generator().manual_seed(5)
    rows = torch.randn(int(counts.sum()), 16, generator=generator).to(dtype)      # [R, H]
    w = torch.randn(len(counts), 16, 8, generator=generator).to(dtype)            # [E, H, H']
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    starts = (ends - counts).tolist()
    looped = torch.cat([rows[s:e] @ w[k] for k, (s, e) in enumerate(zip(starts, ends.tolist()))])
    torch.testing.assert_close(torch._grouped_mm(rows, w, offs=ends), looped)


def test_selfcheck_asks_first_and_agrees_with_the_formulas():
    from labkit.moe import selfcheck
    questions = selfcheck.questions()
    assert selfcheck.check({key: None for key in questions}) == 0
    right = {key: value for key, (value, _) in questions.items()}
    assert selfcheck.check(right) == len(questions)
    assert right["capacity"] == 160 and right["fp8 row bytes"] == 7168 + 4 * 56
    assert math.isclose(right["forward GB"], 4 * 63 / 64 * 8 * 4096 * 7168 / 1e9)
    assert right["rows across once per node"] == 2 and right["expert gradient group"] == 2
    assert selfcheck.check({"forward GB": 2 * right["forward GB"]}) == 0    # forward and backward
    assert selfcheck.check({"rows across once per node": 6}) == 0           # every copy, not per node
    with pytest.raises(KeyError, match="capacity"):
        selfcheck.check({"capacty": 160})


def test_chapter_self_check_keeps_its_answers_in_labkit():
    import json
    cells = json.loads((ROOT / "course" / "07_mixture_of_experts.ipynb").read_text())["cells"]
    sources = ["".join(cell["source"]) for cell in cells]
    at = next(i for i, s in enumerate(sources) if s.startswith("## 8. Check yourself"))
    after = "\n".join(sources[at + 1:])
    assert "selfcheck.check(answers)" in after
    for leaked in ("moe.capacity(4096", "row_bytes(7168)", "ep_bytes_per_rank(4096", "False, 0"):
        assert leaked not in after, leaked
