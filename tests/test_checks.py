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
