"""A strict resume of chapter 8's bench (replicated trainer): capture all of it, restore all of it.

    state = capture(trainer)                 # plain data: tensors, numbers, strings, lists, dicts
    blob = to_bytes(state)                   # what a rank writes as its shard
    restore(new_trainer, from_bytes(blob))   # checks identity first, then restores every piece

The pieces (chapter 8, section 4): weights, optimizer moments and step counts, the scheduler's
position, the gradient scaler's scale and growth tracker, torch's, Python's and NumPy's RNG states,
the data cursor, and the identity of the run (tokenizer, config, code version) plus its topology.
A resume that forgets any piece does not continue bit for bit; one with another tokenizer would
continue on garbage, so `restore` refuses it before touching anything.

Lab 8, task 2 asks for the ZeRO-1 (sharded) version; `capture` and `restore` refuse a ZeRO-1
trainer (its moments live in `Zero1AdamW.exp_avg`/`exp_avg_sq`, not in `state_dict()`), so they are
no shortcut to it. Chapter 9 imports them.
"""
from __future__ import annotations

import io
import random

import numpy as np
import torch

from labkit.checkpoint.layout import CheckpointError

FORMAT = "labkit-train/1"


def rng_states() -> dict:
    """The three global RNGs' states as plain data."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "python": [version, list(internal), gauss],
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}}


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = states["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached"]))


def capture(trainer) -> dict:
    """Everything the replicated trainer needs to continue bit for bit, as plain data."""
    if trainer.config["optimizer"] != "adamw":
        raise CheckpointError("resume.capture handles the replicated trainer (optimizer "
                              f"'adamw'); this one uses {trainer.config['optimizer']!r}, whose "
                              "moments are sharded over the ranks")
    return {"format": FORMAT,
            "identity": trainer.identity(),
            "topology": {"world_size": trainer.world_size, "rank": trainer.rank,
                         "optimizer": "adamw"},
            "steps": trainer.steps,
            "model": {n: p.detach().clone() for n, p in trainer.model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "scaler": trainer.scaler.state_dict(),
            "rng": rng_states(),
            "data": {"epoch": trainer.data.epoch, "position": trainer.data.position,
                     "order": list(trainer.data.order)}}


def check_identity(trainer, state: dict) -> None:
    """CheckpointError when the snapshot belongs to another run (nothing is changed)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"not a {FORMAT} training state: got "
                              f"{state.get('format') if isinstance(state, dict) else state!r}")
    mine, theirs = trainer.identity(), state["identity"]
    for key, why in (("tokenizer", "every token id would mean another character"),
                     ("config", "the run would continue with other hyperparameters"),
                     ("code", "the training code changed since the snapshot")):
        if mine[key] != theirs.get(key):
            raise CheckpointError(f"the snapshot's {key} hash {str(theirs.get(key))[:12]}... is "
                                  f"not this run's {mine[key][:12]}...: {why}. Refusing to "
                                  "resume; nothing was changed (start a new run, or resume "
                                  "with the snapshot's own " + key + ")")


def restore(trainer, state: dict) -> None:
    """Bring `trainer` to exactly the captured state (identity checked first)."""
    check_identity(trainer, state)
    if trainer.config["optimizer"] != "adamw":
        raise CheckpointError("resume.restore handles the replicated trainer only")
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.scaler.load_state_dict(state["scaler"])
    set_rng_states(state["rng"])
    trainer.data.epoch = state["data"]["epoch"]
    trainer.data.position = state["data"]["position"]
    trainer.data.order = list(state["data"]["order"])
    trainer.steps = state["steps"]


def to_bytes(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> dict:
    """The state back; weights_only: a snapshot can hold data, never code to run."""
    return torch.load(io.BytesIO(data), weights_only=True)
