"""Lab 6, task 3's reference: every configuration, the fitting one with the shortest step.

This is the task's answer (choose_config by exhaustive search), so it stays with the grader. The
checkers of `labkit.mesh.checks` call it through `labkit.released.reference("mesh")`.
"""
from __future__ import annotations

import dataclasses
import itertools

from labkit import released as _released
from labkit.mesh import cost, layout
from labkit.mesh.figures import Cluster, Model

LAB = "lab06_3d_parallelism"


def configurations(model: Model, cluster: Cluster, global_batch: int):
    """Every configuration `cost.problems` accepts: dp x tp x pp = the GPUs, tp dividing the
    heads, pp the layers, m microbatches of a whole micro-batch, ZeRO stages 0-3."""
    for tp, pp in itertools.product(layout.divisors(cluster.gpus), layout.divisors(model.layers)):
        if cluster.gpus % (tp * pp) or model.heads % tp:
            continue
        dp = cluster.gpus // (tp * pp)
        if global_batch % dp:
            continue
        for m, stage in itertools.product(layout.divisors(global_batch // dp), range(4)):
            yield {"dp": dp, "tp": tp, "pp": pp, "zero_stage": stage, "microbatches": m}


def brute_force(model: Model, cluster: Cluster, global_batch: int, memory_limit=None):
    """(config, cost) of the fitting configuration with the shortest predicted step, or None."""
    best = None
    for config in configurations(model, cluster, global_batch):
        predicted = cost.predict(model, cluster, config, global_batch, memory_limit=memory_limit)
        if predicted["fits"] and (best is None or predicted["step_time"] < best[1]["step_time"]):
            best = (config, predicted)
    return best


def best(model: dict, cluster: dict, global_batch: int, memory_limit=None):
    """[config, step time] of the best configuration, or None: what expected.json holds."""
    found = brute_force(Model(**model), Cluster(**cluster), global_batch, memory_limit)
    return None if found is None else [found[0], found[1]["step_time"]]


def visible_cases() -> list:
    """The (model, cluster, global_batch, memory_limit) of lab 6's visible test cells."""
    from labkit.mesh import figures
    rows = figures.megatron_rows()
    model_36 = dataclasses.asdict(rows[1]["model"])
    a100_8 = dataclasses.asdict(figures.DGX_A100.with_nodes(8))
    return [(model_36, a100_8, 512, None), (model_36, a100_8, 512, 5e9),
            (dataclasses.asdict(rows[3]["model"]), dataclasses.asdict(figures.DGX_A100.with_nodes(1)),
             512, 20e9)]


def released() -> dict:
    return {"best": {released_key(*c): best(*c) for c in visible_cases()}}


def released_key(model, cluster, global_batch, memory_limit) -> str:
    return _released.key(model, cluster, global_batch, memory_limit)
