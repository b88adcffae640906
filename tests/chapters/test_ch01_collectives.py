"""Chapter 1: labkit.collectives (cost model, fit), labkit.collectives.checks on real ranks, and
the lab's hidden tests rejecting three bad rings when autograded."""
import importlib.util
import math
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit
from labkit.collectives import checks
from labkit import collectives

ROOT = Path(__file__).resolve().parents[2]
LAB = "lab01_collectives"
SOLUTION = ROOT / "solutions" / LAB / f"{LAB}.ipynb"

ranks = st.integers(min_value=1, max_value=4096)
sizes = st.floats(min_value=0, max_value=1e12, allow_nan=False)
alphas = st.floats(min_value=1e-7, max_value=1e-2)
betas = st.floats(min_value=1e-12, max_value=1e-7)


# ---- the cost model ----

@given(sizes, ranks, alphas, betas)
def test_ring_all_reduce_is_reduce_scatter_plus_all_gather(n, P, alpha, beta):
    both = (collectives.ring_reduce_scatter_time(n, P, alpha, beta)
            + collectives.ring_all_gather_time(n, P, alpha, beta))
    assert math.isclose(collectives.ring_all_reduce_time(n, P, alpha, beta), both, rel_tol=1e-12)


@given(sizes, ranks)
def test_ring_bytes_per_rank_never_reach_twice_the_message(n, P):
    sent = collectives.ring_bytes_sent("all_reduce", n, P)
    assert sent <= 2 * n and math.isclose(sent, 2 * (P - 1) / P * n, rel_tol=1e-12)


@given(st.floats(1.0, 1e12), ranks.filter(lambda P: P > 1), st.floats(1e-6, 1e3))
def test_busbw_times_time_is_the_bytes_a_link_carries(n, P, seconds):
    carried = collectives.busbw("all_reduce", n, seconds, P) * seconds
    assert math.isclose(carried, collectives.ring_bytes_sent("all_reduce", n, P), rel_tol=1e-9)


@given(st.integers(0, 12))
def test_recursive_doubling_steps(k):
    assert collectives.recursive_doubling_steps(2 ** k) == k
    if k >= 2:
        assert collectives.recursive_doubling_steps(2 ** k + 1) == k + 2


@settings(max_examples=50)
@given(st.integers(2, 64), alphas, betas,
       st.sampled_from([collectives.ring_all_reduce_time, collectives.ring_all_gather_time,
                        collectives.recursive_doubling_all_reduce_time]))
def test_fit_recovers_alpha_and_beta_from_exact_times(P, alpha, beta, formula):
    n_bytes = [4 ** k for k in range(5, 14)]
    seconds = [formula(n, P, alpha, beta) for n in n_bytes]
    fitted_alpha, fitted_beta = collectives.fit_alpha_beta(n_bytes, seconds, P, formula)
    assert math.isclose(fitted_alpha, alpha, rel_tol=1e-5)
    assert math.isclose(fitted_beta, beta, rel_tol=1e-5)


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


# ---- the checkers, on real ranks, against the reference ring and bad rings ----

def _reference(grade_id, name):
    """A function from an answer cell of the lab's solution notebook (instructor side)."""
    import nbformat
    import torch
    import torch.distributed as dist
    cell = next(c for c in nbformat.read(str(SOLUTION), as_version=4).cells
                if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)
    namespace = {"torch": torch, "dist": dist, "math": math, "collectives": collectives,
                 "__name__": "__main__"}
    exec(compile(cell.source, f"{SOLUTION.name}:{grade_id}", "exec"), namespace)
    return namespace[name]


def ring_calling_all_reduce(tensor, op="sum"):
    import torch.distributed as dist
    if op not in ("sum", "max"):
        raise ValueError(op)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


@pytest.fixture(scope="module", autouse=True)
def _close_worlds():
    yield
    labkit.shutdown_all()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_reference_ring_passes_every_check(size):
    ring = _reference("task1_ring_all_reduce", "ring_all_reduce")
    doubling = _reference("task2_recursive_doubling", "recursive_doubling_all_reduce")
    world = labkit.world(size, timeout=20)
    for length in [0, 1, size + 1, 1001]:
        for dtype in checks.DTYPES:
            for op in ["sum", "max"]:
                checks.check_all_reduce(world, ring, length, dtype, op, timeout=20)
                checks.check_all_reduce(world, doubling, length, dtype, op, timeout=20)
    sent = checks.check_ring_traffic(world, ring, 1001, "float32", timeout=20)
    assert sum(sent.values()) == 2 * (size - 1) * 1001 * 4


@pytest.mark.timeout(120)
def test_checkers_reject_a_collective_and_a_ring_that_drops_the_remainder():
    world = labkit.world(3, timeout=20)
    with pytest.raises(AssertionError, match=r"called \['all_reduce'\]"):
        checks.check_point_to_point_only(world, ring_calling_all_reduce, 100, timeout=20)
    checks.check_all_reduce(world, ring_calling_all_reduce, 100, timeout=20)   # values are right
    source = _source("task1_ring_all_reduce").replace(*DROP_REMAINDER)
    namespace = {}
    import torch
    import torch.distributed as dist
    exec(source, {"torch": torch, "dist": dist}, namespace)
    with pytest.raises(AssertionError, match="P does not divide the length"):
        checks.check_all_reduce(world, namespace["ring_all_reduce"], 100, timeout=20)


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


# ---- autograding: the hidden tests take points from three bad rings ----

DROP_REMAINDER = ("base, extra = divmod(N, P)", "base, extra = N // P, 0   # drops N % P")
HANG_FOR_ONE = ("    if P == 1 or N == 0:\n        return tensor\n",
                "    if N == 0:\n        return tensor\n"
                "    if P == 1:   # waits for a neighbour that does not exist\n"
                "        import threading\n        threading.Event().wait(600)\n")


def _source(grade_id):
    import nbformat
    return next(c.source for c in nbformat.read(str(SOLUTION), as_version=4).cells
                if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def _autograde_module():
    spec = importlib.util.spec_from_file_location("_autograde", ROOT / "tests" / "test_autograde.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")
def test_hidden_tests_reject_three_bad_rings(tmp_path):
    grading = _autograde_module()
    ring = _source("task1_ring_all_reduce")
    for old, _ in (DROP_REMAINDER, HANG_FOR_ONE):
        assert old in ring, f"the solution changed: {old!r} is gone; update this test"
    bad = {   # name: (answer source, points it must lose: values cell 3, traffic cell 2)
        "calls-all-reduce": ('def ring_all_reduce(tensor, op="sum"):\n'
                             '    if op not in ("sum", "max"):\n'
                             '        raise ValueError(op)\n'
                             '    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" '
                             'else dist.ReduceOp.MAX)\n    return tensor\n', 2),
        "drops-remainder": (ring.replace(*DROP_REMAINDER), 5),
        "hangs-for-one-rank": (ring.replace(*HANG_FOR_ONE), 3),
    }
    submissions = {name: grading.with_answer(SOLUTION, "task1_ring_all_reduce", source,
                                             tmp_path / name)
                   for name, (source, _) in bad.items()}
    scores = grading.autograde(tmp_path / "course", LAB, submissions)
    for name, (_, lost) in bad.items():
        score, max_score = scores[name]
        # at least these points (task 3 times a collective, and a loaded machine can cost it too)
        assert score <= max_score - lost, f"{name}: scored {score} of {max_score}, expected to lose {lost}"


def test_a_flat_or_falling_sweep_still_fits_a_positive_beta():
    """Noisy small messages can make times fall with size; the fit must not return beta = 0
    (a free link), which later divides by zero."""
    n_bytes = [256, 4096, 65536, 1 << 20]
    seconds = [3e-3, 2.6e-3, 2.3e-3, 2.1e-3]        # latency-bound noise: falling with size
    alpha, beta = collectives.fit_alpha_beta(n_bytes, seconds, 4)
    assert beta > 0 and alpha >= 0
    largest = collectives.ring_all_reduce_time(n_bytes[-1], 4, alpha, beta)
    assert largest == pytest.approx(seconds[-1], rel=0.5)
