"""Lab 6, task 2's checkers: a 3D training step against one process, and its bytes on the wire.

    check_train_3d(world, train_3d, dims=(2, 2, 1), optimizer="sgd", tied=True)
    check_train_3d_traffic(world, train_3d, dims=(1, 2, 2))

Each rank r of a world of dp x pp x tp ranks (the course's order: r = (d pp + p) tp + t) is sent
only its data-parallel replica's data, {"tokens", "targets"}: [steps, m, b, T]. The checker trains
the whole global batch in one process (float64) and compares every tensor each rank returns with
its share of the result: the tp shard (`model.local_shard`) or the whole replicated tensor.

The bytes between every pair of ranks are counted outside the ranks and summed by how the two
ranks relate: same tp group, same pp group, same dp group, or none (nothing may flow there).
Each sum must carry at least 97% of what the algorithm must move (chapter 4's tensor-parallel
all-reduces, chapter 5's activations and gradients, ZeRO-1's reduce-scatter and all-gather of the
stage's local parameters, the tied embedding's all-reduce) and not much more: the allowance is the
one-time scatter of the tp shards when the stage is split, gloo's framing (~0.6 KB per all-reduce
of two ranks, measured), 3%, and 16 KB per rank for creating process groups, which talks to the
rendezvous store (under `labkit grade` the store lives on rank 0, so those bytes go to a rank).
The 3% is the chapter's own tolerance: a correct step carries 100.5-108% of each payload (its
framing; measured on the lab's meshes, the same to four digits over repeated runs). Until the
counter kept the sockets of a rank's forked children and of connections closed inside a call
(`runtime/traffic.py`), a relation could come up half short, and this checker allowed that.
A dodge (no pipeline, no tensor parallelism, whole gradients exchanged) is off by far more.
ZeRO-1 moves the bytes plain data parallelism moves (ZeRO paper, section 7): traffic cannot tell
them apart, so the traffic check also judges the state each rank's optimizer held, on the same run
(`state_problems`: at most 1/dp of the rank's local tensors, and AdamW's two moments of those).
"""
from __future__ import annotations

import math

import torch

from labkit import checks
from labkit.mesh import layout, model

RTOL, ATOL = 1e-6, 1e-8        # float64: a correct step agrees to ~1e-10 after AdamW's division
ITEM = 8                       # float64 on the wire
FRAMING = 1024                 # bytes allowed per collective or message, both ways together
STORE = 16 * 1024              # bytes per rank allowed for talking to the rendezvous store
LOW = 0.97                     # a relation must carry at least this share of its payload,
HIGH = 1.03                    # and at most this share plus its allowance (the chapter's 3%)


def train_case(case, dims, steps=2, m=4, ragged=True, tied=False, optimizer="adamw",
               clip=None) -> dict:
    """Plain data for one checked run: seeds, the global batch, each rank's share. clip: None, or
    max_norm as a fraction of the first step's gradient norm (one process's), so that the clip
    is active at least there."""
    dp, pp, tp = dims
    if pp > m:
        raise ValueError(f"train_case: 1F1B needs m ({m}) >= pp ({pp})")
    seed, data_seed = case.integer(0, 10 ** 6), case.integer(0, 10 ** 6)
    tokens, targets = model.batches(data_seed, steps, dp, m, ragged=ragged)
    # ragged on purpose: two replicas with equal token counts in a step (a few % of draws) make
    # the mean of replica means exact there; redraw until every step's counts are all distinct
    while ragged and dp > 1 and any(
            len({int((targets[s, d] != model.IGNORE).sum()) for d in range(dp)}) < dp
            for s in range(steps)):
        data_seed += 1
        tokens, targets = model.batches(data_seed, steps, dp, m, ragged=ragged)
    shares = []
    for rank in range(dp * pp * tp):
        d = layout.coordinates(rank, dp, pp, tp)["dp"]
        shares.append({"tokens": tokens[:, d].clone(), "targets": targets[:, d].clone()})
    max_norm = None
    if clip is not None:
        first = model.reference_gradients((tokens, targets), 0, seed, tied=tied)
        max_norm = clip * float(torch.sqrt(sum(g.square().sum() for g in first.values())))
    return {"dims": tuple(dims), "seed": seed, "data": (tokens, targets), "shares": shares,
            "tied": tied, "optimizer": optimizer, "steps": steps, "m": m, "ragged": ragged,
            "max_norm": max_norm}


def _run(world, fn, run, timeout, case):
    from labkit.mesh.checks import _train_program
    dp, pp, tp = run["dims"]
    if world.size != dp * pp * tp:
        raise ValueError(f"world size ({world.size}) != dp ({dp}) x pp ({pp}) x tp ({tp})")
    with world.traffic() as traffic:
        results = world.run_each(_train_program, run["shares"], fn, run["dims"], run["seed"],
                                 run["optimizer"], run["tied"], run.get("max_norm"),
                                 timeout=timeout)
    results = checks.one_result_per_rank(results, world.size, case, "train_3d")
    run["held"] = [r["held"] for r in results]          # the optimizers' elements, per rank
    return [r["weights"] for r in results], traffic


def _diagnose(results, run, reference, initial) -> str:
    """The likely mistake, from how the ranks' results differ from the reference."""
    dp, pp, tp = run["dims"]
    for rank, got in enumerate(results):
        c = layout.coordinates(rank, dp, pp, tp)
        if c["dp"] == 0:
            continue
        twin = results[layout.rank_of(dict(c, dp=0), dp, pp, tp)]
        if any(not torch.allclose(got[n], twin[n], rtol=RTOL, atol=ATOL) for n in got if n in twin):
            return ("dp replicas hold different weights after the step: was every gradient "
                    "reduced over the dp group (Zero1.step reduce-scatters over the group it was "
                    "given)?")
    ratios = {"replicated": [], "split": [], "embed": []}
    for rank, got in enumerate(results):
        t = layout.coordinates(rank, dp, pp, tp)["tp"]
        for name, value in got.items():
            moved = (value - model.local_shard(name, initial[name], t, tp)).norm()
            due = (model.local_shard(name, reference[name], t, tp)
                   - model.local_shard(name, initial[name], t, tp)).norm()
            if due > 0:
                kind = ("embed" if name == "embed.weight" else
                        "replicated" if model.split_dim(name) is None else "split")
                ratios[kind].append(float(moved / due))
    mean = {k: sum(v) / len(v) for k, v in ratios.items() if v}
    off = {k: abs(v - 1) for k, v in mean.items()}
    if run.get("max_norm") is not None and _unclipped_ok(results, run):
        return ("without clipping your step is right, so the clip is wrong: the global norm counts "
                "every element of the gradient once (a tp shard on its rank, a replicated tensor "
                "on tp rank 0 only, the tied embedding's last-stage copy not at all: after the "
                "sum it holds stage 0's gradient), of the gradient summed over dp, with the "
                "squares summed over every rank; then scale by min(1, max_norm / (norm + 1e-6)) "
                "as torch.nn.utils.clip_grad_norm_ does")
    if tp > 1 and off.get("replicated", 0) > 0.05 and off.get("split", 0) < 0.05:
        return (f"the replicated parameters (LayerNorms, the biases of o and fc2, the embedding "
                f"and head) moved {mean['replicated']:.2f} times as far as they should, the split "
                "ones right: a replicated parameter's gradient is already whole on every tp rank; "
                "reduce it over dp only, never over tp as well")
    if run["tied"] and pp > 1 and abs(mean.get("embed", 1) - 1) > 0.01:
        return ("the tied embedding is wrong: stage 0's embedding and the last stage's head are "
                "one parameter, whose gradient is the sum of the two copies' gradients (an "
                "all-reduce between the first and last stage of each pipeline), before the step")
    if run["ragged"]:
        return ("the loss is the mean over every valid token of the global batch: replicas hold "
                "different token counts, so weight each replica's gradient by its share of the "
                "tokens (n_local / n_global) before the dp reduction")
    return "compare one step of yours with mesh.model.reference_training on the same data"


def _unclipped_ok(results, run) -> bool:
    """Whether the ranks' results would be right if the step had not been clipped at all, or
    clipped by a norm off by a constant factor: the other parts of the step are then right."""
    unclipped = model.reference_training(run["data"], run["seed"], tied=run["tied"],
                                         optimizer=run["optimizer"])[-1]
    initial = {n: p.detach() for n, p in
               model.make_model(run["seed"], tied=run["tied"]).named_parameters()}
    dp, pp, tp = run["dims"]
    moved, due = 0.0, 0.0
    for rank, got in enumerate(results):
        t = layout.coordinates(rank, dp, pp, tp)["tp"]
        for name, value in got.items():
            start = model.local_shard(name, initial[name], t, tp)
            moved += float((value.double() - start).norm())
            due += float((model.local_shard(name, unclipped[name], t, tp) - start).norm())
    return due > 0 and 0 < moved / due <= 1.0 + 1e-6


def check_train_3d(world, fn, dims, steps=2, m=4, optimizer="adamw", tied=False, ragged=True,
                   timeout=180, case=None, clip=None) -> list:
    """fn(batch, device_mesh, seed, optimizer=..., tied=...) on every rank (device_mesh: torch's
    DeviceMesh of shape dims, made once per shape by `model.device_mesh`) leaves every rank's
    tensors equal to one process training the whole global batch for `steps` steps. With `clip`
    (a fraction), fn is also given max_norm = clip x the first step's gradient norm, and one
    process clips with torch.nn.utils.clip_grad_norm_. Returns the results."""
    case = case or checks.Case(f"lab 6, task 2: train_3d at dims {tuple(dims)}"
                               + (f", clipped to {clip:g} of the first step's norm" if clip else ""))
    run = train_case(case, dims, steps, m, ragged, tied, optimizer, clip)
    results, _ = _run(world, fn, run, timeout, case)
    _check_values(results, run, case)
    return results


def _check_values(results, run, case):
    dp, pp, tp = run["dims"]
    layers = model.LAYERS
    reference = model.reference_training(run["data"], run["seed"], tied=run["tied"],
                                         optimizer=run["optimizer"],
                                         max_norm=run.get("max_norm"))[-1]
    initial = {n: p.detach() for n, p in
               model.make_model(run["seed"], tied=run["tied"]).named_parameters()}
    for rank, got in enumerate(results):
        c = layout.coordinates(rank, dp, pp, tp)
        names = model.stage_names(c["pp"], pp, layers, run["tied"])
        if not isinstance(got, dict) or sorted(got) != names:
            raise AssertionError(f"rank {rank} (pp stage {c['pp']}) returned "
                                 f"{sorted(got) if isinstance(got, dict) else type(got).__name__}"
                                 f", expected its stage's parameters {names} [{case}]; return "
                                 "mesh.local_weights(stage)")
        for name in names:
            expected = model.local_shard(name, reference[name], c["tp"], tp)
            if tuple(got[name].shape) != tuple(expected.shape):
                raise AssertionError(f"rank {rank}'s {name} has shape {tuple(got[name].shape)}, "
                                     f"its tp shard has {tuple(expected.shape)} [{case}]: return "
                                     "each rank's own tensor (a DTensor's to_local())")
    hint = None
    for rank, got in enumerate(results):
        c = layout.coordinates(rank, dp, pp, tp)
        for name in sorted(got):
            expected = model.local_shard(name, reference[name], c["tp"], tp)
            if not torch.allclose(got[name].double(), expected, rtol=RTOL, atol=ATOL):
                hint = hint or _diagnose(results, run, reference, initial)
                checks.check(got[name].double(), expected, f"rank {rank}'s {name} after "
                             f"{run['steps']} steps", rtol=RTOL, atol=ATOL, case=case, hint=hint)


def _relation(a, b, dims):
    dp, pp, tp = dims
    ca, cb = layout.coordinates(a, dp, pp, tp), layout.coordinates(b, dp, pp, tp)
    differ = [axis for axis in layout.AXES if ca[axis] != cb[axis]]
    return differ[0] if len(differ) == 1 else "none"


def expected_bytes(run) -> dict:
    """{relation: (payload bytes every rank together must send, allowance on top)}."""
    dp, pp, tp = run["dims"]
    steps, m = run["steps"], run["m"]
    b, T = run["shares"][0]["tokens"].shape[-2:]
    activation = b * T * model.HIDDEN * ITEM                        # one [b, T, H] float64
    out = {"tp": [0.0, 0.0], "pp": [0.0, 0.0], "dp": [0.0, 0.0], "none": [0.0, 0.0]}
    base = model.make_model(0, tied=run["tied"])
    for stage in range(pp):
        piece = model.Stage(base, stage, pp)
        ranks = dp * tp                                             # ranks holding this stage
        layers = len(piece.layers)
        if tp > 1:
            calls = 4 * layers * m * steps                          # f and g, forward and backward
            out["tp"][0] += ranks * calls * 2 * (tp - 1) / tp * activation
            numel = sum(p.numel() for _, p in piece.named())        # split from tp rank 0
            out["tp"][1] += dp * numel * ITEM + ranks * calls * FRAMING
        if dp > 1:
            numel = sum(p.numel() // (tp if model.split_dim(n) is not None else 1)
                        for n, p in piece.named())                  # a rank's local tensors
            shard = math.ceil(numel / dp)
            out["dp"][0] += ranks * steps * 2 * (dp - 1) * shard * ITEM   # scatter and gather
            out["dp"][1] += ranks * steps * (2 + 2) * dp * FRAMING
    if pp > 1:
        pipelines = dp * tp
        out["pp"][0] += pipelines * (pp - 1) * 2 * m * steps * activation
        out["pp"][1] += pipelines * (pp - 1) * 2 * m * steps * FRAMING * 2
        if run["tied"]:
            out["pp"][0] += pipelines * 2 * steps * model.VOCAB * model.HIDDEN * ITEM
            out["pp"][1] += pipelines * 2 * steps * FRAMING
    return {k: tuple(v) for k, v in out.items()}


def traffic_problems(measured: dict, expected: dict, size: int, outside: float) -> list:
    """What is wrong with the bytes `measured` by relation, against `expected_bytes` (empty when
    nothing is): a relation below LOW x its payload, or above HIGH x payload + its allowance + the
    store's STORE per rank; more than 64 KB from a rank to something other than a rank."""
    problems = []
    for relation, (payload, allowance) in expected.items():
        high = payload * HIGH + allowance + STORE * size
        got = measured[relation]
        if got < LOW * payload:
            problems.append(f"ranks in the same {relation} group sent {got} bytes in all, at least "
                            f"{LOW * payload:.0f} expected ({payload:.0f} of data)")
        elif got > high:
            what = "ranks that share no group" if relation == "none" else \
                f"ranks in the same {relation} group"
            problems.append(f"{what} sent {got} bytes in all, at most {high:.0f} expected "
                            f"({payload:.0f} of data)")
    if outside > 64 * 1024:
        problems.append(f"a rank sent {outside} bytes to something other than a rank (group "
                        "creation talks to the rendezvous store, a few KB)")
    return problems


def local_elements(dims, rank, tied=False) -> int:
    """N: the elements of rank's local tensors (its stage's parameters, tp shards by 1/tp)."""
    dp, pp, tp = dims
    stage = layout.coordinates(rank, dp, pp, tp)["pp"]
    piece = model.Stage(model.make_model(0, tied=tied), stage, pp)
    return sum(p.numel() // (tp if model.split_dim(n) is not None else 1)
               for n, p in piece.named())


def state_problems(run) -> list:
    """ZeRO-1 is the construction: each rank's optimizer holds 1/dp of its local tensors
    (ceil(N/dp) master elements, AdamW's m and v for those only; `Zero1.state_elements`). Plain
    data parallelism moves the same bytes and holds N and 2N: only the state tells them apart.
    The counts come from torch's optimizer step hook on each rank (`checks._train_program`)."""
    dp = run["dims"][0]
    problems = []
    for rank, (params, state) in enumerate(run["held"]):
        numel = local_elements(run["dims"], rank, run["tied"])
        shard = math.ceil(numel / dp)
        if params > shard or state > 2 * shard:
            problems.append(f"rank {rank}'s optimizer held {params} parameter elements and "
                            f"{state} of state, at most {shard} and {2 * shard} expected "
                            f"(1/dp = 1/{dp} of its {numel} local elements, rounded up)")
    return problems


def check_train_3d_traffic(world, fn, dims, steps=1, m=4, tied=False, ragged=True, timeout=180,
                           case=None):
    """The bytes of one run of fn between every pair of ranks, counted outside the ranks, by
    relation (see the module docstring); the values are checked on the same run."""
    case = case or checks.Case(f"lab 6, task 2: train_3d's traffic at dims {tuple(dims)}")
    run = train_case(case, dims, steps, m, ragged, tied, "adamw")
    results, traffic = _run(world, fn, run, timeout, case)
    _check_values(results, run, case)
    measured = _judge_traffic(traffic, run, world, case)
    held = state_problems(run)                # the bytes were right: was it ZeRO-1 or plain dp?
    if held:
        raise AssertionError(f"train_3d at dims {run['dims']}: not ZeRO-1 over dp [{case}]: "
                             + "; ".join(held) + ". Plain data parallelism (an all-reduce and a "
                             "whole optimizer on every rank) sends the same bytes; step with "
                             "mesh.Zero1(stage.parameters(), dp_group, optimizer), which keeps "
                             "1/dp of the optimizer state on each rank.")
    return traffic, measured


def _judge_traffic(traffic, run, world, case) -> dict:
    """The bytes by relation against `expected_bytes`; raises with the problems. Returns them."""
    if not getattr(traffic, "complete", False):
        raise AssertionError(f"the traffic of train_3d could not be counted [{case}]")
    measured = {"tp": 0, "pp": 0, "dp": 0, "none": 0}
    for a in range(world.size):
        for b in range(world.size):
            if a != b:
                measured[_relation(a, b, run["dims"])] += traffic.matrix[a][b]
    problems = traffic_problems(measured, expected_bytes(run), world.size, max(traffic.outside))
    if problems:
        raise AssertionError(f"train_3d at dims {run['dims']}: the traffic between ranks is not "
                             f"what a 3D step sends [{case}]: " + "; ".join(problems)
                             + ". Split each stage with mesh.tensor_parallel, run the schedule on "
                             "the pp group with pipeline.run_actions, and step with mesh.Zero1 "
                             "on the dp group.")
    return measured
