"""labkit.checks: the checkers lab test cells call fail with a message that names the rank."""
import types

import pytest

from labkit import checks


def test_same_on_every_rank_names_the_rank_that_differs():
    checks.assert_same_on_every_rank([1.0, 1.0 + 1e-9], 1.0, "mean")
    checks.assert_same_on_every_rank([[1, 2], [1, 2]], [1.0, 2.0], "row")
    with pytest.raises(AssertionError, match=r"rank 1: mean is 2\.5, expected 2\.0; weight"):
        checks.assert_same_on_every_rank([2.0, 2.5], 2.0, "mean", hint="weight each rank")
    with pytest.raises(AssertionError, match="rank 0"):
        checks.assert_same_on_every_rank([[1, 2, 3]], [1, 2], "row")
    with pytest.raises(AssertionError, match="rank 0"):
        checks.assert_same_on_every_rank([None], 1.0, "mean")


def test_inputs_must_match_the_world_size():
    world = types.SimpleNamespace(size=2)
    with pytest.raises(ValueError, match="world has 2 ranks, got 3 inputs"):
        checks.run_with_rank_inputs(world, print, [1, 2, 3])
    with pytest.raises(ValueError, match="op must be one of"):
        checks.real_all_reduce(world, [[1], [2]], "mean")


def test_a_case_is_fresh_each_run_and_reproducible_by_its_seed():
    first, second = checks.Case("a"), checks.Case("a")
    assert first.seed != second.seed
    again = checks.Case("a", seed=first.seed)
    assert first.integers(0, 10 ** 9, (5,)).tolist() == again.integers(0, 10 ** 9, (5,)).tolist()
    assert f"case seed {first.seed}" in str(first)


@pytest.mark.parametrize("dtype, narrower", [("int64", "float64"), ("int32", "float32"),
                                             ("float64", "float32"), ("float32", "bfloat16")])
def test_exact_values_sum_exactly_and_a_narrower_detour_shows(dtype, narrower):
    import torch
    case = checks.Case("exact", seed=11)
    shares = [case.exact_values((2000,), dtype, terms=4) for _ in range(4)]
    total = checks.reduce(shares, "sum")
    wide = torch.float64 if total.is_floating_point() else torch.int64
    assert torch.equal(total.to(wide), torch.stack([s.to(wide) for s in shares]).sum(0))
    detour = torch.stack([s.to(getattr(torch, narrower)) for s in shares]).sum(0).to(total.dtype)
    assert not torch.equal(detour, total), "a narrower type must change some sums"
    assert (shares[0] < 0).any() and (shares[0] > 0).any()


def test_one_result_per_rank_rejects_empty_short_and_missing():
    checks.one_result_per_rank([1, 2], 2)
    for bad in ([], [1], [1, None], None):
        with pytest.raises(AssertionError):
            checks.one_result_per_rank(bad, 2, checks.Case("x", seed=1))


def _traffic(matrix, outside=None, unaccounted=None):
    return types.SimpleNamespace(size=len(matrix), matrix=matrix, complete=True,
                                 outside=outside or [0] * len(matrix), unaccounted=unaccounted)


def test_expect_traffic_judges_each_pair_not_only_totals():
    ring = [[0, 4000, 0], [0, 0, 4000], [4000, 0, 0]]
    checks.expect_traffic(_traffic([[0, 4096, 48], [48, 0, 4096], [4096, 48, 0]]), ring)
    direct = [[0, 2048, 2048], [2048, 0, 2048], [2048, 2048, 0]]      # same total per rank
    with pytest.raises(AssertionError, match="rank 0 sent 2048 bytes to rank 2, expected no data"):
        checks.expect_traffic(_traffic(direct), ring)
    with pytest.raises(AssertionError, match="at least 4000 expected"):
        checks.expect_traffic(_traffic([[0, 100, 0], [0, 0, 4096], [4096, 0, 0]]), ring)
    with pytest.raises(AssertionError, match="other than a rank"):
        checks.expect_traffic(_traffic([[0, 4096, 0], [0, 0, 4096], [4096, 0, 0]],
                                       outside=[0, 9000, 0]), ring)
    with pytest.raises(AssertionError, match="outside their process-group connections"):
        checks.expect_traffic(_traffic([[0, 4096, 0], [0, 0, 4096], [4096, 0, 0]],
                                       unaccounted=50000), ring)


def test_check_compares_dtype_shape_and_values_and_names_the_case():
    import torch
    case = checks.Case("c", seed=3)
    checks.check(torch.tensor([1, 2]), torch.tensor([1, 2]), "t")
    with pytest.raises(AssertionError, match=r"dtype torch.float32, expected torch.int64.*case seed 3"):
        checks.check(torch.tensor([1.0, 2.0]), torch.tensor([1, 2]), "t", case=case)
    with pytest.raises(AssertionError, match="shape"):
        checks.check(torch.tensor([1]), torch.tensor([1, 2]), "t")
    with pytest.raises(AssertionError, match="; divide once"):
        checks.check({"a": 1.0}, {"a": 2.0}, "t", hint="divide once")
