"""Lab 4, task 2's reference: which query and kv heads each tensor-parallel rank holds.

This is the answer of `gqa_placement`, so it stays with the grader. The checkers of
`labkit.tensor_parallel.gqa_checks` reach it through `labkit.released.reference(...)`; the
student copy gets the visible cases' placements from labs/lab04_tensor_parallel/expected.json.
"""
from __future__ import annotations

from labkit import released as _released

LAB = "lab04_tensor_parallel"


def placement(heads: int, kv_heads: int, tp: int):
    """[[q heads], [kv heads]] per rank, or the ValueError's text (a str) when impossible."""
    sizes = {"heads": heads, "kv_heads": kv_heads, "tp": tp}
    bad = [k for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        return f"{bad[0]} must be a positive int, got {sizes[bad[0]]!r}"
    if heads % kv_heads:
        return f"heads ({heads}) is not a multiple of kv_heads ({kv_heads})"
    if heads % tp:
        return f"heads ({heads}) is not divisible by tp ({tp})"
    per_rank, per_group = heads // tp, heads // kv_heads
    layout = []
    for rank in range(tp):
        queries = list(range(rank * per_rank, rank * per_rank + per_rank))
        first, last = queries[0] // per_group, queries[-1] // per_group
        layout.append([queries, list(range(first, last + 1))])
    return layout


def holders(layout) -> list:
    """holders[j]: the ranks whose placement lists kv head j (the replica group of head j)."""
    count = 1 + max(j for _, kv in layout for j in kv)
    return [[r for r, (_, kv) in enumerate(layout) if j in kv] for j in range(count)]


# the (heads, kv_heads) of the visible test cells, at every world size the lab runs
VISIBLE = [(12, 3), (12, 2), (12, 4), (32, 8)]
VISIBLE_TP = (1, 2, 3, 4, 16)


def released() -> dict:
    return {"gqa_placement": {_released.key(h, g, t): placement(h, g, t)
                              for h, g in VISIBLE for t in VISIBLE_TP}}
