"""The self-check of chapter 2: the reader answers first, then `labkit.collectives.selfcheck.check`
says which answers are right and why. The answers are computed from the chapter's formulas and the
bench when the check runs.

    from labkit.dp import selfcheck
    selfcheck.check({"token weight ratio": 3, ...})
"""
from __future__ import annotations

import torch

from labkit.collectives import selfcheck as _selfcheck
from labkit.dp import placement


def _naive_and_true_norm():
    case = {"full": [torch.full((1,), 3.0), torch.tensor([4.0, 0.0, 0.0])],
            "where": [{"kind": "replicate", "ranks": [0, 1, 2]}, {"kind": "shard"}]}
    held = [placement.local_grads(case, rank, 3)[0] for rank in range(3)]
    naive = sum(g.square().sum().item() for grads in held for g in grads) ** 0.5
    return naive, placement.full_norm(case)


def questions() -> dict:
    naive, true = _naive_and_true_norm()
    counts = [30, 10]
    weights = [1 / (len(counts) * n) for n in counts]     # a token's weight, mean of means
    return {
        "token weight ratio": (
            weights[1] / weights[0],
            "under the mean of per-rank means a token of rank r weighs 1/(R n_r): 1/20 on rank 1 "
            "against 1/60 on rank 0, three times more; the token loss weighs every token 1/40"),
        "loss to backpropagate": (
            4 * 50 / 1000,
            "R S_r / sum_j n_j = 4 x 50 / 1000 = 0.2: after DDP divides the summed gradients by R, "
            "each token counts 1/1000"),
        "naive norm": (
            naive,
            "each of the 3 ranks adds the replica's 9, and the shards add 16 once: sqrt(3 x 9 + "
            "16) = sqrt(43)"),
        "true norm": (
            true,
            "count the replica once: sqrt(9 + 16) = 5"),
        "bf16 256 + 1": (
            (torch.tensor(256.0, dtype=torch.bfloat16) + 1).item(),
            "BF16 keeps 8 significant bits, so between 256 and 512 its numbers are 2 apart; 257 "
            "lies halfway and rounds to the even neighbour, 256"),
        "syncs without no_sync": (
            4,
            "every backward outside no_sync fires the hooks and all-reduces every bucket: 4 "
            "microbatches, 4 synchronisations (the values still come out right, the bytes are "
            "4 times those of one)"),
    }


def check(answers: dict) -> int:
    """Print a verdict (and why) for every answered question; return how many are right."""
    return _selfcheck.check(answers, questions())
