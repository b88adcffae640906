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
    dp, cp, tp, pp, stage, m = (config[k] for k in ("dp", "cp", "tp", "pp", "zero_stage",
                                                    "microbatches"))
    short = dataclasses.replace(model, seq=model.seq // cp)              # s / cp tokens a rank
    plain = {"dp": dp, "tp": tp, "pp": pp, "zero_stage": stage, "microbatches": m}
    sent = cost.axis_bytes(short, plain, global_batch, recompute)
    replicas = dp * cp                                  # ranks that hold the same weights
    psi_rank = model.parameters / (tp * pp)
    dp_bytes = cost.dp_wire_bytes(psi_rank, replicas, stage, m) if replicas > 1 else 0.0
    b = global_batch // (dp * m)
    block = b * (model.seq // cp) * (model.hidden // tp) * cost.BYTES   # one K (or V) block
    forwards = 2 if recompute == "full" else 1
    cp_bytes = (model.layers // pp) * m * (2 * forwards + 4) * (cp - 1) * block
    peak = ledger.per_rank_ledger(
        model.layers, model.hidden, model.heads, model.seq // cp, b, vocab=model.vocab,
        dp=replicas, tp=tp, pp=pp, zero_stage=stage, recompute=recompute, schedule="1f1b",
        microbatches=m)["peak"]
    return {"bytes": {"dp": float(dp_bytes), "cp": float(cp_bytes), "tp": float(sent["tp"]),
                      "pp": float(sent["pp"])}, "memory": float(peak)}


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
