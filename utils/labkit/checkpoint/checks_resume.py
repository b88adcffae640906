"""Lab 8, task 2's checkers: a strict resume of the ZeRO-1 bench, at the same world size and at
another one (see bench.py for the state, zero.py for the layout).

    capture_zero1(trainer) -> dict            # this rank's part of a snapshot: plain data
    restore_zero1(trainer, parts) -> None     # parts: every old rank's capture, in rank order

The ranks train, capture, and hand their parts back as plain data; fresh trainers restore from
all the parts and go on. Right means: bit for bit the same as a run that never stopped (same
world size), or the same global state (another world size), compared here with the fingerprints
of `bench.fingerprint`, which the capture and restore code never sees.

Before the capture, the checker's run takes a detour that a replay of the training from the start
cannot know (`detour`: the three RNGs reseeded and the weights nudged, from the case's seed, as a
rollback after a loss spike would leave them): a restore that replays `steps` steps instead of
restoring the state is then told apart at every world size.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from labkit import checks as base
from labkit.checkpoint import bench
from labkit.checkpoint.checks import call
from labkit.checkpoint.zero import FlatLayout

TASK2 = "Lab 8, task 2"
ZERO1 = dict(bench.CONFIG, optimizer="zero1")
PIECES = {"weights": "the weights", "optimizer": "the ZeRO-1 moments or their step count",
          "lr": "the scheduler's state", "group_lr": "the optimizer's current learning rate "
          "(param_groups[0]['lr'], which the scheduler wrote and the next step reads)",
          "scaler": "the gradient scaler's state", "torch_rng": "torch's RNG state",
          "python_rng": "Python's random state", "numpy_rng": "NumPy's RNG state",
          "cursor": "the data cursor (epoch, position, order)", "steps": "the step count"}


def detour(trainer, seed: int) -> None:
    """What a replay cannot reproduce: the RNGs reseeded and every weight nudged (the same on
    every rank: the seed is the case's)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 1e-3)
    torch.manual_seed(seed + 1)
    random.seed(seed + 2)
    np.random.seed((seed + 3) % 2 ** 32)


def _straight(share):
    trainer = bench.Trainer(share["config"])
    trainer.train(share["k"])
    detour(trainer, share["detour"])
    trainer.train(share["steps"] - share["k"])
    return bench.fingerprint(trainer)


def _train_and_capture(share, capture):
    trainer = bench.Trainer(share["config"])
    trainer.train(share["steps"])
    detour(trainer, share["detour"])
    part = capture(trainer)
    return {"part": part, "fingerprint": bench.fingerprint(trainer)}


def _restore_and_go_on(share, restore):
    trainer = bench.Trainer(share["config"])
    before = bench.fingerprint(trainer)
    try:
        restore(trainer, share["parts"])
    except BaseException as error:  # noqa: BLE001 (an observation)
        return {"error": [type(error).__name__, str(error)[:300],
                          [c.__name__ for c in type(error).__mro__]],
                "changed": bench.differences(before, bench.fingerprint(trainer))}
    after = bench.fingerprint(trainer)
    trainer.train(share["more"])
    return {"after": after, "end": bench.fingerprint(trainer)}


def _explain(differing: list) -> str:
    return ", ".join(PIECES.get(key, key) for key in differing)


def check_zero1_resume(world, capture, restore, steps=6, k=3, timeout=120, case=None):
    """Same world size: k steps, capture, fresh trainers restore, steps - k more: every rank's
    fingerprint bit for bit that of `steps` straight steps; a snapshot from a run with another
    tokenizer is refused with ValueError and changes nothing."""
    case = case or base.Case("lab 8, task 2: ZeRO-1 resume")
    config = dict(ZERO1, seed=case.integer(0, 10_000))
    seed = case.integer(0, 10_000)
    straight = call(world, _straight, ({"config": config, "steps": steps, "k": k,
                                        "detour": seed},), timeout=timeout)
    base.one_result_per_rank(straight, world.size, case)
    captured = call(world, _train_and_capture, ({"config": config, "steps": k,
                                                 "detour": seed}, capture), timeout=timeout)
    base.one_result_per_rank(captured, world.size, case)
    parts = [c["part"] for c in captured]
    resumed = call(world, _restore_and_go_on, ({"config": config, "parts": parts,
                                              "more": steps - k}, restore), timeout=timeout)
    for rank, out in enumerate(resumed):
        if "error" in out:
            raise AssertionError(f"rank {rank}: restore_zero1 raised {out['error'][0]}: "
                                 f"{out['error'][1]} [{case}]")
        missing = bench.differences(captured[rank]["fingerprint"], out["after"])
        if missing:
            raise AssertionError(f"rank {rank}: right after restore_zero1, the trainer differs "
                                 f"from the captured one in {_explain(missing)} [{case}]: "
                                 "capture and restore every piece of state (the run was not "
                                 "the plain one from its seed: replaying its steps does not "
                                 "bring it back)")
        late = bench.differences(straight[rank], out["end"])
        if late:
            raise AssertionError(f"rank {rank}: {k} steps + resume + {steps - k} steps differ "
                                 f"from {steps} straight steps in {_explain(late)} [{case}]")
    other = dict(config, vocab=config["vocab"][::-1])
    refused = call(world, _restore_and_go_on, ({"config": other, "parts": parts, "more": 0},
                                             restore), timeout=timeout)
    for rank, out in enumerate(refused):
        if "error" not in out or "ValueError" not in out["error"][2]:
            raise AssertionError(f"rank {rank}: restore_zero1 of a snapshot made with another "
                                 "tokenizer should raise ValueError (compare the tokenizer, "
                                 f"config and code hashes of trainer.identity()) [{case}]")
        if out["changed"]:
            raise AssertionError(f"rank {rank}: the refused restore changed "
                                 f"{_explain(out['changed'])}: check the identity before "
                                 f"touching the trainer [{case}]")


def _global_moments(fingerprints: list, layout: FlatLayout) -> torch.Tensor:
    """[2, Psi]: the moments of every rank laid end to end, padding cut."""
    rows = [torch.cat([f["optimizer"][name] for f in fingerprints]) for name in
            ("exp_avg", "exp_avg_sq")]
    return torch.stack(rows)[:, :layout.numel]


def check_zero1_reshard(make_world, capture, restore, saved_on=4, loaded_on=(2, 3), k=3,
                        timeout=120, case=None):
    """Another world size: captured on `saved_on` ranks, restored on each of `loaded_on`: the
    global state (weights, every rank's moments laid end to end, step count, scheduler, scaler,
    RNG states, cursor) equals the saved one, and training goes on for 2 steps.
    `make_world(n)` is the test cell's labkit.world."""
    case = case or base.Case("lab 8, task 2: ZeRO-1 at another world size")
    config = dict(ZERO1, seed=case.integer(0, 10_000))
    world = make_world(saved_on)
    captured = call(world, _train_and_capture, ({"config": config, "steps": k,
                                                 "detour": case.integer(0, 10_000)}, capture),
                    timeout=timeout)
    base.one_result_per_rank(captured, saved_on, case)
    parts = [c["part"] for c in captured]
    saved = [c["fingerprint"] for c in captured]
    layout = FlatLayout([(n, tuple(p.shape)) for n, p in saved[0]["weights"].items()], saved_on)
    expected = _global_moments(saved, layout)
    for size in loaded_on:
        world = make_world(size)
        resumed = call(world, _restore_and_go_on, ({"config": config, "parts": parts,
                                                  "more": 2}, restore), timeout=timeout)
        base.one_result_per_rank(resumed, size, case)
        for rank, out in enumerate(resumed):
            if "error" in out:
                raise AssertionError(f"rank {rank} of {size}: restore_zero1 of a snapshot from "
                                     f"{saved_on} ranks raised {out['error'][0]}: "
                                     f"{out['error'][1]} [{case}]")
            replicated = {k: v for k, v in saved[0].items() if k != "optimizer"}
            differing = bench.differences(replicated, {k: out["after"][k] for k in replicated})
            if differing:
                raise AssertionError(f"rank {rank} of {size}: after restoring a snapshot from "
                                     f"{saved_on} ranks, {_explain(differing)} differ [{case}]")
            if out["after"]["optimizer"]["step"] != saved[0]["optimizer"]["step"]:
                raise AssertionError(f"rank {rank} of {size}: the optimizer's step count is "
                                     f"{out['after']['optimizer']['step']}, saved "
                                     f"{saved[0]['optimizer']['step']} [{case}]")
        moments = _global_moments([out["after"] for out in resumed], layout)
        if not torch.equal(moments, expected):
            wrong = (moments != expected).any(dim=0).nonzero().flatten()
            raise AssertionError(
                f"{size} ranks restoring a snapshot of {saved_on}: the moments laid end to end "
                f"differ from the saved ones at {len(wrong)} of {layout.numel} positions, the "
                f"first at {int(wrong[0])} [{case}]; rank r of {size} owns "
                f"[r * ceil(N / {size}), (r + 1) * ceil(N / {size})) of the flat vector: use the "
                "saved layout (offsets, chunk) to find those elements in the old ranks' parts")
