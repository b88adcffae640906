"""Lab 10, task 3's reference: the bytes per axis and the peak memory of a dp x cp x tp x pp
configuration, chapter 6's model with a context-parallel axis.

This is the task's answer, so it stays with the grader; `labkit.context.checks` calls it through
`labkit.released.reference("context")` (the student copy reads the visible cases' values from
labs/lab10_long_sequences/expected.json).
"""
from __future__ import annotations

import dataclasses

from labkit import released as _released
from labkit.memory import ledger
from labkit.mesh import cost
from labkit.mesh.figures import Model

LAB = "lab10_long_sequences"


def predict(model: Model, config: dict, global_batch: int, recompute: str = "full") -> dict:
    """{"bytes": {"dp", "cp", "tp", "pp"}, "memory": peak bytes} of one rank, one step."""
    degrees = {axis: int(config[axis]) for axis in ("dp", "cp", "tp", "pp")}
    zero, micro = config["zero_stage"], config["microbatches"]
    tokens = model.seq // degrees["cp"]                        # what a rank of the cp group holds
    # chapter 6's tp and pp bytes, for a model whose sequence is the rank's tokens
    others = cost.axis_bytes(dataclasses.replace(model, seq=tokens),
                             {"dp": degrees["dp"], "tp": degrees["tp"], "pp": degrees["pp"],
                              "zero_stage": zero, "microbatches": micro}, global_batch, recompute)
    # gradients are reduced over every rank holding the same weights: dp x cp of them
    group = degrees["dp"] * degrees["cp"]
    weights = model.parameters / (degrees["pp"] * degrees["tp"])
    reduce_bytes = 0.0 if group == 1 else cost.dp_wire_bytes(weights, group, zero, micro)
    per_micro = global_batch // (micro * degrees["dp"])
    kv = cost.BYTES * per_micro * tokens * (model.hidden // degrees["tp"])   # one K or V block
    passes = 1 + (recompute == "full")                         # forwards run per microbatch
    hops = degrees["cp"] - 1
    ring_bytes = hops * kv * (2 * passes + 4) * micro * (model.layers // degrees["pp"])
    memory = ledger.per_rank_ledger(
        model.layers, model.hidden, model.heads, tokens, per_micro, vocab=model.vocab,
        dp=group, tp=degrees["tp"], pp=degrees["pp"], zero_stage=zero, recompute=recompute,
        schedule="1f1b", microbatches=micro)["peak"]
    return {"bytes": {"dp": float(reduce_bytes), "cp": float(ring_bytes),
                      "tp": float(others["tp"]), "pp": float(others["pp"])},
            "memory": float(memory)}


def expected(model: dict, config: dict, global_batch: int, recompute: str) -> dict:
    return predict(Model(**model), dict(config), global_batch, recompute)


def visible_cases() -> list:
    """(model, config, global_batch, recompute) of lab 10's visible test cells."""
    model = {"name": "7.5B, 32k tokens", "layers": 32, "hidden": 4096, "heads": 32,
             "seq": 32768, "vocab": 51200}
    return [(model, {"dp": 2, "cp": 4, "tp": 2, "pp": 2, "zero_stage": 1, "microbatches": 4},
             16, "full")]


def released() -> dict:
    return {"predict": {_released.key(*c): expected(*c) for c in visible_cases()}}
