"""Chapter 1 / lab 1: labkit.collectives (cost model, fit, self-check), and lab 1's checkers on
real ranks: a correct ring written as the prompt suggests keeps every point of task 1, and each
wrong answer issue 12 names fails the test cells of its task (the lab's own cells, visible and
hidden lines, run outside nbgrader). The suite's `labkit grade` test gives the solution full marks."""
import math
import re
import statistics
import sys
import threading

import cloudpickle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lab_notebooks
import labkit
from labkit import collectives
from labkit.collectives import checks, selfcheck

LAB = "lab01_collectives"
cloudpickle.register_pickle_by_value(sys.modules[__name__])   # rank programs defined here

ranks = st.integers(min_value=1, max_value=4096)
sizes = st.floats(min_value=0, max_value=1e12, allow_nan=False)
alphas = st.floats(min_value=1e-7, max_value=1e-2)
betas = st.floats(min_value=1e-12, max_value=1e-7)


# ---- the cost model ----

@settings(deadline=None)
@given(sizes, ranks, alphas, betas)
def test_ring_all_reduce_is_reduce_scatter_plus_all_gather(n, P, alpha, beta):
    both = (collectives.ring_reduce_scatter_time(n, P, alpha, beta)
            + collectives.ring_all_gather_time(n, P, alpha, beta))
    assert math.isclose(collectives.ring_all_reduce_time(n, P, alpha, beta), both, rel_tol=1e-12)


@settings(deadline=None)
@given(sizes, ranks)
def test_ring_bytes_per_rank_never_reach_twice_the_message(n, P):
    sent = collectives.ring_bytes_sent("all_reduce", n, P)
    assert sent <= 2 * n and math.isclose(sent, 2 * (P - 1) / P * n, rel_tol=1e-12)


@settings(deadline=None)
@given(st.floats(1.0, 1e12), ranks.filter(lambda P: P > 1), st.floats(1e-6, 1e3))
def test_busbw_times_time_is_the_bytes_a_link_carries(n, P, seconds):
    carried = collectives.busbw("all_reduce", n, seconds, P) * seconds
    assert math.isclose(carried, collectives.ring_bytes_sent("all_reduce", n, P), rel_tol=1e-9)


@settings(deadline=None)
@given(st.integers(0, 12))
def test_recursive_doubling_steps(k):
    assert collectives.recursive_doubling_steps(2 ** k) == k
    if k >= 2:
        assert collectives.recursive_doubling_steps(2 ** k + 1) == k + 2


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 64), alphas, betas,
       st.sampled_from([collectives.ring_all_reduce_time, collectives.ring_all_gather_time,
                        collectives.recursive_doubling_all_reduce_time]))
def test_fit_recovers_alpha_and_beta_from_exact_times(P, alpha, beta, formula):
    n_bytes = [4 ** k for k in range(5, 14)]
    seconds = [formula(n, P, alpha, beta) for n in n_bytes]
    fitted_alpha, fitted_beta = collectives.fit_alpha_beta(n_bytes, seconds, P, formula)
    assert math.isclose(fitted_alpha, alpha, rel_tol=1e-5)
    assert math.isclose(fitted_beta, beta, rel_tol=1e-5)


def test_a_flat_or_falling_sweep_still_fits_a_positive_beta():
    """Noisy small messages can make times fall with size; the fit must not return beta = 0."""
    n_bytes = [256, 4096, 65536, 1 << 20]
    seconds = [3e-3, 2.6e-3, 2.3e-3, 2.1e-3]        # latency-bound noise: falling with size
    alpha, beta = collectives.fit_alpha_beta(n_bytes, seconds, 4)
    assert beta > 0 and alpha >= 0
    largest = collectives.ring_all_reduce_time(n_bytes[-1], 4, alpha, beta)
    assert largest == pytest.approx(seconds[-1], rel=0.5)


def test_bad_inputs_raise_with_the_values():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        collectives.ring_all_reduce_time(10, 0, 1e-6, 1e-9)
    with pytest.raises(ValueError, match="unknown collective 'gossip'"):
        collectives.bus_factor("gossip", 4)
    with pytest.raises(ValueError, match="nothing to fit"):
        collectives.fit_alpha_beta([1, 2], [1.0, 2.0], 1)


def test_explorer_compare_prefers_recursive_doubling_for_tiny_messages():
    from labkit.collectives.explorer import compare
    rows = compare(64, 1e2, 5e-6, 1e-10)
    assert rows["recursive doubling"]["seconds"] < rows["ring"]["seconds"]
    rows = compare(64, 1e9, 5e-6, 1e-10)
    assert rows["ring"]["seconds"] < rows["recursive doubling"]["seconds"]


def test_self_check_skips_unanswered_questions_and_accepts_the_right_answers(capsys):
    questions = selfcheck.chapter1()
    assert selfcheck.check({key: None for key in questions}, questions) == 0
    assert "not answered" in capsys.readouterr().out
    right = {key: value for key, (value, _) in questions.items()}
    right["ring time ms"] = round(right["ring time ms"], 2)          # typed by hand: rounded
    assert selfcheck.check(right, questions) == len(questions)
    assert selfcheck.check({"busbw": 1.75e9}, questions) == 0        # the bytes, not the rate
    with pytest.raises(KeyError, match="no question named"):
        selfcheck.check({"ring byte": 1}, questions)


def test_payload_tables_are_the_algorithms():
    data, messages = checks.ring_payload(10, 3, 4)             # chunks of 4, 3, 3 floats
    assert [sum(row) for row in data] == [56, 52, 52]           # 14, 13 and 13 floats
    for r in range(3):
        assert [q for q in range(3) if data[r][q]] == [(r + 1) % 3]
        assert sum(messages[r]) == 4
    assert sum(map(sum, data)) == 2 * 2 * 10 * 4               # 2(P-1) N items in all
    data, _ = checks.recursive_doubling_payload(5, 3, 8)
    assert data == [[0, 40, 40], [40, 0, 0], [40, 0, 0]]


# ---- lab 1 through its own test cells --------------------------------------------------------

def run_lab(test_ids, answers=None):
    """The lab's own test cells, visible and hidden lines, outside nbgrader (lab_notebooks)."""
    return lab_notebooks.run_lab(LAB, test_ids, answers)


def _answer(grade_id):
    return lab_notebooks.answer(LAB, grade_id)


TASK1 = ["test_task1_ring_values", "test_task1_ring_any_world", "test_task1_ring_traffic"]
TASK2 = ["test_task2_recursive_doubling_values", "test_task2_recursive_doubling_partners",
         "test_task2_crossover"]


@pytest.fixture(scope="module", autouse=True)
def _close_worlds():
    yield
    labkit.shutdown_all()


DIRECT_EXCHANGE = lab_notebooks.wrong_answers(LAB).DIRECT_EXCHANGE

CALLS_ALL_REDUCE = '''
def ring_all_reduce(tensor, op="sum"):
    if op not in ("sum", "max"):
        raise ValueError(op)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor
'''

NOT_IN_PLACE = '''
def ring_all_reduce(tensor, op="sum"):
    if op not in ("sum", "max"):
        raise ValueError(op)
    result = tensor.clone()
    dist.all_reduce(result, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return result                      # the tensor handed over is left as it was
'''

@pytest.mark.timeout(300)
def test_a_correct_ring_that_returns_at_once_for_one_rank_keeps_every_point():
    ring = _answer("task1_ring_all_reduce")
    check_op = '    if op not in ("sum", "max"):\n        raise ValueError(f"op must be \'sum\' or \'max\', got {op!r}")\n'
    assert check_op in ring, "the solution changed; update this test"
    moved = ring.replace(check_op, "").replace(
        "    if P == 1 or N == 0:\n        return tensor\n",
        "    if P == 1 or N == 0:\n        return tensor\n" + check_op)
    outcome = run_lab(TASK1, {"task1_ring_all_reduce": moved})
    assert all(error is None for error in outcome.values()), outcome


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, source, fails", [
    ("a direct exchange (the ring's total at P = 3)", DIRECT_EXCHANGE, {"test_task1_ring_traffic"}),
    ("dist.all_reduce inside", CALLS_ALL_REDUCE, {"test_task1_ring_traffic"}),
    ("a result returned, the tensor left alone", NOT_IN_PLACE,
     {"test_task1_ring_values", "test_task1_ring_any_world", "test_task1_ring_traffic"}),
])
def test_wrong_rings_lose_the_points_of_what_they_get_wrong(name, source, fails):
    outcome = run_lab(TASK1, {"task1_ring_all_reduce": source})
    failed = {test for test, error in outcome.items() if error is not None}
    assert failed == fails, f"{name}: failed {sorted(failed)}, expected {sorted(fails)}: {outcome}"


@pytest.mark.timeout(300)
def test_a_ring_that_drops_the_remainder_or_detours_through_float32_fails_its_values():
    ring = _answer("task1_ring_all_reduce")
    drop = ring.replace("base, extra = divmod(N, P)", "base, extra = N // P, 0   # drops N % P")
    outcome = run_lab(["test_task1_ring_values"], {"task1_ring_all_reduce": drop})
    assert "P does not divide the length" in str(outcome["test_task1_ring_values"])
    world = labkit.world(3, timeout=20)

    def float32_detour(tensor, op="sum"):
        import torch.distributed as dist
        as_float = tensor.to("cpu").float()             # int64 and float64 lose digits here
        dist.all_reduce(as_float)
        tensor.copy_(as_float)
        return tensor
    for dtype in ("int64", "float64"):
        with pytest.raises(AssertionError, match="case seed"):
            checks.check_all_reduce(world, float32_detour, 257, dtype, "sum")


@pytest.mark.timeout(120)
def test_a_ring_that_hangs_for_one_rank_fails_the_any_world_cell():
    ring = _answer("task1_ring_all_reduce")
    hang = ring.replace("    if P == 1 or N == 0:\n        return tensor\n",
                        "    if N == 0:\n        return tensor\n"
                        "    if P == 1:   # waits for a neighbour that does not exist\n"
                        "        import threading\n        threading.Event().wait(600)\n")
    assert hang != ring
    outcome = run_lab(["test_task1_ring_any_world"], {"task1_ring_all_reduce": hang})
    assert isinstance(outcome["test_task1_ring_any_world"], labkit.CallTimeout)


@pytest.mark.timeout(300)
def test_recursive_doubling_renamed_from_the_ring_fails_the_partners_cell():
    ring = _answer("task1_ring_all_reduce").replace("def ring_all_reduce(", "def recursive_doubling_all_reduce(")
    outcome = run_lab(TASK2[:2], {"task2_recursive_doubling": ring})
    assert outcome["test_task2_recursive_doubling_values"] is None
    assert isinstance(outcome["test_task2_recursive_doubling_partners"], AssertionError)
    assert "partner r XOR 2^k" in str(outcome["test_task2_recursive_doubling_partners"])


# lab 1, task 3 (the uneven all_to_all) is tested in test_lab01_collectives.py


@pytest.mark.timeout(60)
def test_a_hang_becomes_a_timeout_with_a_diagnosis():
    def hangs_alone(tensor, op="sum"):
        import torch.distributed as dist
        if dist.get_world_size() == 1:
            threading.Event().wait(60)
        return tensor
    world = labkit.world(1, timeout=20)
    with pytest.raises(labkit.CallTimeout):
        checks.check_all_reduce(world, hangs_alone, 10, timeout=3)


# ---- chapter 1, third edition (issue 32): Rabenseifner and the binomial broadcast ----------

@settings(deadline=None)
@given(st.integers(0, 12), st.floats(0, 1e12), alphas, betas)
def test_rabenseifner_has_the_rings_bytes_with_log2_p_latencies(k, n, alpha, beta):
    P = 2 ** k
    t = collectives.rabenseifner_all_reduce_time(n, P, alpha, beta)
    assert math.isclose(t, 2 * k * alpha + collectives.ring_bytes_sent("all_reduce", n, P) * beta,
                        rel_tol=1e-12, abs_tol=1e-300)
    if k >= 2:      # never slower than the ring, and strictly faster in latency
        assert t <= collectives.ring_all_reduce_time(n, P, alpha, beta) * (1 + 1e-12)


def test_rabenseifner_refuses_a_world_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two, got P = 6.*largest power of two below it \\(4\\)"):
        collectives.rabenseifner_all_reduce_time(1e6, 6, 1e-6, 1e-9)


def test_broadcast_bytes_are_per_rank_not_n_for_everyone():
    with pytest.raises(ValueError, match="broadcast_bytes_sent"):
        collectives.ring_bytes_sent("broadcast", 100, 4)
    assert collectives.broadcast_bytes_sent(100, 8) == [300, 200, 100, 100, 0, 0, 0, 0]
    assert collectives.broadcast_bytes_sent(100, 4, tree="chain") == [100, 100, 100, 0]
    with pytest.raises(ValueError, match="unknown broadcast tree 'star'"):
        collectives.broadcast_bytes_sent(100, 4, tree="star")


def _broadcast_ones(n):
    import torch
    import torch.distributed as dist
    dist.broadcast(torch.ones(n), src=0)


@pytest.mark.parametrize("P", [3, 5])
def test_gloo_broadcast_is_the_binomial_tree_on_the_wire(P):
    """Counted by the OS at P = 3 and 5 (not powers of two): the root sends ceil(log2 P) copies
    to ranks 1, 2, 4, ...; ranks >= P/2 send only gloo's 48-byte notices."""
    n_floats = 1 << 16
    world = labkit.world(P, backend="gloo", teaching=False)
    with world.traffic() as traffic:
        world.run(_broadcast_ones, n_floats)
    predicted = collectives.broadcast_bytes_sent(4 * n_floats, P)
    for r in range(P):
        assert abs(traffic.sent[r] - predicted[r]) <= 4 * collectives.GLOO_FRAMING_BYTES, (r, traffic.sent, predicted)
    assert traffic.peers(0, at_least=4 * n_floats) == [q for q in (1, 2, 4) if q < P]
    chain = collectives.broadcast_bytes_sent(4 * n_floats, P, tree="chain")
    assert any(abs(traffic.sent[r] - chain[r]) > 4 * n_floats // 2 for r in range(P))


# ---- chapter 1's own code and claims, on real ranks -------------------------------------------

CHAPTER = lab_notebooks.ROOT / "course" / "01_collectives.ipynb"


def _chapter_function(name):
    """A function defined in a code cell of chapter 1, compiled here (pickled by value)."""
    import json
    import torch
    import torch.distributed as dist
    for cell in json.loads(CHAPTER.read_text())["cells"]:
        lines = "".join(cell["source"]).splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith(f"def {name}(")]
        if cell["cell_type"] == "code" and starts:
            body = [lines[starts[0]]]
            for line in lines[starts[0] + 1:]:
                if line and not line[0].isspace():
                    break
                body.append(line)
            namespace = {"__name__": __name__, "torch": torch, "dist": dist}
            exec(compile("\n".join(body), str(CHAPTER), "exec"), namespace)
            return namespace[name]
    raise LookupError(f"chapter 1 defines no function {name!r}")


def _rabenseifner_run(fn, n):
    import torch
    import torch.distributed as dist
    x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(dist.get_rank()))
    reference = x.clone()
    dist.all_reduce(reference)
    out = fn(x)
    return out is x, (x - reference).abs().max().item()


@pytest.mark.parametrize("P", [2, 8])
def test_the_chapters_rabenseifner_is_an_all_reduce_with_the_rings_bytes(P):
    """Section 7's cell shows P = 4; the same code at P = 2 and 8: the values of dist.all_reduce,
    in place, 2(P-1)/P n bytes per rank in 2 log2 P messages, to the log2 P partners r XOR 2^k."""
    fn = _chapter_function("rabenseifner_all_reduce")
    world = labkit.world(P, backend="gloo", teaching=False)
    for in_place, error in world.run(_rabenseifner_run, fn, 8 * P):
        assert in_place and error <= 1e-12
    n = 1 << 16                                                   # float64: 512 KiB
    with world.traffic() as traffic:
        world.run(_rabenseifner_run, fn, n)
    # the run also does one dist.all_reduce (the reference): gloo's ring, 2(P-1)/P n more
    k = int(math.log2(P))
    predicted = collectives.ring_bytes_sent("all_reduce", 8 * n, P)
    for r in range(P):
        framing = (2 * k + 4 * (P - 1)) * collectives.GLOO_FRAMING_BYTES
        assert abs(traffic.sent[r] - 2 * predicted) <= framing, (r, traffic.sent[r], 2 * predicted)
    with world.traffic() as traffic:
        world.run(lambda n: fn(__import__("torch").ones(n, dtype=__import__("torch").float64)), n)
    for r in range(P):
        assert abs(traffic.sent[r] - predicted) <= 2 * k * collectives.GLOO_FRAMING_BYTES
        assert traffic.peers(r, at_least=8 * n // (2 * P)) == sorted(r ^ (1 << j) for j in range(k))


def test_the_chapters_rabenseifner_refuses_three_ranks_naming_the_rank():
    fn = _chapter_function("rabenseifner_all_reduce")
    world = labkit.world(3, backend="gloo", teaching=False)
    with pytest.raises(labkit.RankError, match="rank [012]: this version needs P a power of two.*got P = 3"):
        world.call(lambda: fn(__import__("torch").ones(6)), timeout=20)


def _overwrite_after_isend(n, receiver_late, overwrite_late=0.0):
    import time
    import torch
    import torch.distributed as dist
    x = torch.ones(n)
    dist.barrier()
    if dist.get_rank() == 0:
        request = dist.isend(x, dst=1)
        time.sleep(overwrite_late)
        x.fill_(-1.0)
        request.wait()
        return None
    time.sleep(receiver_late)
    dist.recv(x, src=0)
    return int((x == -1).sum())


def test_gloo_sends_from_the_buffer_when_the_receiver_is_ready_not_at_isend():
    """Chapter 1, rule 4: gloo copies nothing at isend; with the receiver a second late, the data
    leaves x after the overwrite, so every entry arrives overwritten (run after run); with the
    overwrite half a second late, the message has left before it and none is."""
    world = labkit.world(2, backend="gloo", teaching=False)
    n = 1 << 20
    for _ in range(2):
        assert world.run(_overwrite_after_isend, n, 1.0)[1] == n
    assert world.run(_overwrite_after_isend, n, 0.0, 0.5)[1] == 0


def _two_groups_of_the_same_ranks():
    import torch
    import torch.distributed as dist
    group_a, group_b = dist.new_group([0, 1]), dist.new_group([0, 1])
    dist.all_reduce(torch.ones(4), group=group_a if dist.get_rank() == 0 else group_b)


@pytest.mark.timeout(90)
def test_two_groups_of_the_same_ranks_hang_even_in_teaching_mode():
    """Chapter 1, rule 3: teaching mode (DETAIL) compares calls within a group, so a call on
    another group with the same members is not a mismatch error but a hang; the diagnosis shows
    both ranks waiting in the same call on ranks [0, 1]."""
    world = labkit.world(2, backend="gloo", teaching=True)
    with pytest.raises(labkit.CallTimeout) as hang:
        world.call(_two_groups_of_the_same_ranks, timeout=3)
    waiting = [line for line in str(hang.value).splitlines() if "waiting in all_reduce" in line]
    assert len(waiting) == 2 and all("on ranks [0, 1]" in line for line in waiting), str(hang.value)
    verdict = [line for line in str(hang.value).splitlines() if line.startswith("=>")]
    assert len(verdict) == 1 and "different process groups" in verdict[0], str(hang.value)
    names = re.findall(r"rank (\d) on group '([^']+)'", verdict[0])
    assert [r for r, _ in names] == ["0", "1"] and names[0][1] != names[1][1], verdict


def _snapshot(group_name, seq=1):
    record = {"op": "all_reduce", "seq": seq, "finished": False, "t_start": 0.0, "peer": None,
              "group": [0, 1], "group_name": group_name, "dtypes": ["float32"], "shapes": [[4]]}
    return {"now": 1.0, "stack": "", "current": [record], "recent": [record],
            "collective_counts": {"[0, 1]": seq}}


def test_the_hang_report_names_the_groups_only_when_they_differ():
    """labkit's diagnosis (chapter 1, rule 3): two ranks in the same call on the same ranks but
    on groups of different names are named with their groups; on one group (a real wait on each
    other) the verdict is the old one, without group names."""
    from labkit.runtime import diagnose
    two = diagnose.report({0: _snapshot("2"), 1: _snapshot("3")})
    assert "rank 0 on group '2'; rank 1 on group '3'" in two, two
    one = diagnose.report({0: _snapshot("2"), 1: _snapshot("2")})
    assert "every rank of [0, 1] issued all_reduce #1; they wait on each other" in one, one
    assert "different process groups" not in one
    unnamed = diagnose.report({0: _snapshot(None), 1: _snapshot(None)})   # an older snapshot
    assert "they wait on each other" in unnamed, unnamed


def test_the_held_out_band_rejects_a_constant_and_a_latency_free_model():
    """Section 5's band, |log2(measured / predicted)| <= 1 at held-out sizes, on exact ring times
    (alpha = 50 us, 1 GB/s, P = 2, the chapter's small sizes): the fitted ring is inside it, the two
    wrong models fitted to the same sizes (a constant, a line through zero) are outside."""
    P, alpha, beta = 2, 50e-6, 1e-9
    sizes = [4 * 2 ** k for k in range(8, 23, 2)]                  # 1 KB .. 16 MB, 16 MB held out
    times = [collectives.ring_all_reduce_time(n, P, alpha, beta) for n in sizes]
    fit, held = sizes[0::2], sizes[1::2]
    fit_t, held_t = times[0::2], times[1::2]
    a, b = collectives.fit_alpha_beta(fit, fit_t, P)
    ring = collectives.log2_ratios([collectives.ring_all_reduce_time(n, P, a, b) for n in held], held_t)
    assert max(abs(r) for r in ring) < 1e-9
    constant = collectives.log2_ratios([statistics.median(fit_t)] * len(held), held_t)
    assert max(abs(r) for r in constant) > 1, constant
    slope = sum(fit_t) / sum(collectives.ring_all_reduce_time(n, P, 0.0, 1.0) for n in fit)
    latency_free = collectives.log2_ratios([collectives.ring_all_reduce_time(n, P, 0.0, slope) for n in held], held_t)
    assert max(abs(r) for r in latency_free) > 1, latency_free
    with pytest.raises(ValueError, match="2 predictions for 3"):
        collectives.log2_ratios([1.0, 1.0], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="> 0"):
        collectives.log2_ratios([0.0], [1.0])


def _two_level_run(fn, n, G):
    import torch
    import torch.distributed as dist
    rank, P = dist.get_rank(), dist.get_world_size()
    intra = [dist.new_group(list(range(k * G, (k + 1) * G))) for k in range(P // G)]
    inter = [dist.new_group(list(range(j, P, G))) for j in range(G)]
    x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    reference = x.clone()
    dist.all_reduce(reference)
    labkit.mark("groups built")
    out = fn(x, intra[rank // G], inter[rank % G])
    return out is x, (x - reference).abs().max().item()


@pytest.mark.parametrize("G", [2, 3])
def test_the_chapters_two_level_all_reduce_has_the_formulas_bytes_inside_and_across(G):
    """Section 7 counts 2 nodes x 2 ranks; the same code on 6 ranks as 3 nodes of 2 and 2 nodes
    of 3: the values of dist.all_reduce, in place, 2(G-1)/G n per rank inside a node and
    2(N-1)/N n/G across (the factors 1 and 2/3 at N = 3, 4/3 and 1/3 at G = 3)."""
    fn = _chapter_function("hierarchical_all_reduce")
    P, n = 6, 6 * (1 << 13)                                        # float64: 384 KiB
    N = P // G
    world = labkit.world(P, backend="gloo", teaching=False)
    with world.traffic() as traffic:
        results = world.run(_two_level_run, fn, n, G)
    for in_place, error in results:
        assert in_place and error <= 1e-12
    start = traffic.marks["groups built"]["matrix"]
    framing = 20 * collectives.GLOO_FRAMING_BYTES
    for r in range(P):
        sent = [traffic.matrix[r][q] - start[r][q] for q in range(P)]
        intra = sum(sent[q] for q in range(P) if q != r and q // G == r // G)
        inter = sum(sent[q] for q in range(P) if q // G != r // G)
        assert abs(intra - 2 * (G - 1) / G * 8 * n) <= framing, (r, intra)
        assert abs(inter - 2 * (N - 1) / N * 8 * n / G) <= framing, (r, inter)
