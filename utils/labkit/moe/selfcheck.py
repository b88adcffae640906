"""The self-check of chapter 7 (`course/07_mixture_of_experts.ipynb`, section 8): the reader
answers first, then `labkit.collectives.selfcheck.check` says which answers are right and why.

    from labkit.moe import selfcheck
    selfcheck.check({"capacity": 160, "forward GB": None, ...})

The right answers are computed here from the chapter's formulas (`moe.capacity`,
`moe.ep_bytes_per_rank`, `fp8.row_bytes`, `nodes.cross_node_rows`) when the check runs, so the
check and the chapter cannot disagree; none of them answers a graded task of lab 7.
"""
from __future__ import annotations

import torch

from labkit import moe
from labkit.collectives import selfcheck as _selfcheck
from labkit.moe import fp8, nodes

# One token of question 6: its K = 8 experts' ranks, 8 ranks per node, the token on rank 3 (node 0).
_OWNERS = [[0, 5, 9, 14, 20, 21, 22, 23]]


def questions() -> dict:
    """{key: (right answer, how it is derived)} for chapter 7's questions."""
    crossed = nodes.cross_node_rows(torch.tensor(_OWNERS), home_rank=3, ranks_per_node=8)
    return {
        "capacity": (
            moe.capacity(4096, 8, 256, 1.25),
            "C = ceil(N K / E x factor) = ceil(4096 x 8 / 256 x 1.25) = 160"),
        "forward GB": (
            moe.ep_bytes_per_rank(4096, 8, 7168, 64) / 1e9,
            "4 (P - 1)/P K N H bytes = 4 x 63/64 x 8 x 4096 x 7168 (dispatch and combine, 2 bytes "
            "per BF16 value)"),
        "switch loss when even": (
            0.01,
            "even routing: f_i = P_i = 1/E, so alpha x E x E x 1/E^2 = alpha, whatever E is"),
        "fp8 row bytes": (
            fp8.row_bytes(7168),
            "H one-byte values + one 4-byte float32 scale per 128: 7168 + 4 x 56"),
        "bytes double with E": (
            False,
            "the bytes are (P - 1)/P K N H per direction: E does not appear, only K (how many "
            "copies of each token travel)"),
        "rows across once per node": (
            crossed["per_node"],
            "experts on ranks 0, 5 (node 0, home: no InfiniBand), 9, 14 (node 1), 20-23 (node 2): "
            f"once per other node is {crossed['per_node']} rows; every copy sent would be "
            f"{crossed['per_copy']}"),
        "expert gradient group": (
            2,
            "ep = 4 carved out of dp = 8: each expert is held by dp / ep = 2 ranks (its "
            "expert-data-parallel group), and its gradient is reduced over those 2; the dense "
            "weights over all 8"),
    }


def check(answers: dict) -> int:
    """Print a verdict (and why) for every answered question; return how many are right."""
    return _selfcheck.check(answers, questions())
