"""Lab 6's checkers: the mesh layout (task 1), the 3D training step (task 2) and the choice of a
configuration (task 3). The notebook's test cells and the chapter's pytest suite call these.

    check_layout(mesh_layout, 8, {"dp": 2, "pp": 2, "tp": 2}, ("dp", "pp", "tp"))
    check_train_3d(world, train_3d, dims=(2, 2, 1), tied=True)          # a world of 4 ranks
    check_choice(choose_config, model, cluster, global_batch=512)

Task 1 is checked by properties (every rank has distinct coordinates, the last axis of the order
varies fastest, each group is one line of the mesh), task 2 against one process training the whole
global batch (each rank's own tensors, its tp shard or the whole replicated tensor) and by the
bytes between every pair of ranks counted outside the ranks, task 3 against every configuration
(`labkit.grading.references.mesh`, which stays with the grader) under the course's cost model (`labkit.mesh.cost`).
"""
from __future__ import annotations

import math

from labkit import checks, released
from labkit.mesh import cost
from labkit.mesh.figures import Cluster, Model

# ---- task 1: the layout -------------------------------------------------------------------------


def _returned_layout(value, size, degrees):
    if not isinstance(value, dict) or set(value) != {"coords", "groups"}:
        raise AssertionError(f"mesh_layout should return a dict with keys 'coords' and 'groups', "
                             f"got {type(value).__name__}"
                             + (f" with keys {sorted(value)}" if isinstance(value, dict) else ""))
    coords, groups = value["coords"], value["groups"]
    if not isinstance(coords, (list, tuple)) or len(coords) != size:
        raise AssertionError(f"'coords' should list one dict per rank ({size}), got "
                             f"{len(coords) if isinstance(coords, (list, tuple)) else coords!r}")
    for rank, c in enumerate(coords):
        if not isinstance(c, dict) or set(c) != set(degrees):
            raise AssertionError(f"coords[{rank}] should be a dict with keys {sorted(degrees)}, "
                                 f"got {c!r}")
    if not isinstance(groups, dict) or set(groups) != set(degrees):
        raise AssertionError(f"'groups' should be a dict with keys {sorted(degrees)}, got "
                             f"{sorted(groups) if isinstance(groups, dict) else groups!r}")
    return [{a: int(i) for a, i in c.items()} for c in coords], {
        a: [[int(r) for r in g] for g in gs] for a, gs in groups.items()}


def _strides(degrees, order):
    strides, step = {}, 1
    for axis in reversed(order):
        strides[axis] = step
        step *= degrees[axis]
    return strides


def check_layout(fn, size, degrees, order, gpus_per_node=None, what="") -> dict:
    """fn(size, degrees, order, gpus_per_node) is a valid layout: coordinates in range and
    distinct, row-major in `order` (its last axis varies fastest), each axis's groups the lines of
    the mesh along it. Returns the layout."""
    what = what or f"mesh_layout({size}, {degrees}, {list(order)})"
    coords, groups = _returned_layout(fn(size, dict(degrees), list(order), gpus_per_node), size,
                                      degrees)
    for rank, c in enumerate(coords):
        for axis, index in c.items():
            if not 0 <= index < degrees[axis]:
                raise AssertionError(f"{what}: rank {rank}'s {axis} coordinate is {index}, outside "
                                     f"[0, {degrees[axis]})")
    strides = _strides(degrees, order)
    for rank, c in enumerate(coords):
        expected = sum(c[a] * strides[a] for a in degrees)
        if expected != rank:
            backwards = _strides(degrees, list(reversed(order)))
            hint = (" The first axis of the order varies fastest in yours; in the course's "
                    "convention (torch's init_device_mesh) the *last* one does."
                    if all(sum(cc[a] * backwards[a] for a in degrees) == r
                           for r, cc in enumerate(coords)) else
                    " Lay the ranks out row-major: rank = sum of coordinate x stride, the stride "
                    "of an axis being the product of the sizes of the axes after it in the order.")
            raise AssertionError(f"{what}: rank {rank} has coordinates {c}, which belong to rank "
                                 f"{expected} in order {list(order)}.{hint}")
    for axis, found in groups.items():
        for group in found:
            if [coords[r][axis] for r in group] != list(range(degrees[axis])):
                raise AssertionError(f"{what}: the {axis} group {group} should hold one rank for "
                                     f"each {axis} coordinate 0..{degrees[axis] - 1}, in order")
            others = {tuple(coords[r][a] for a in degrees if a != axis) for r in group}
            if len(others) != 1:
                raise AssertionError(f"{what}: the {axis} group {group} mixes ranks that differ in "
                                     f"another axis's coordinate")
        if sorted(r for g in found for r in g) != list(range(size)):
            raise AssertionError(f"{what}: the {axis} groups {found} should cover every rank "
                                 f"exactly once")
        if found != sorted(found):
            raise AssertionError(f"{what}: list the {axis} groups in order of their first rank")
    return {"coords": coords, "groups": groups}


def _expect_value_error(fn, args, what, must_mention=()):
    try:
        fn(*args)
    except ValueError as error:
        text = str(error)
        missing = [m for m in must_mention if m not in text]
        if missing:
            raise AssertionError(f"{what}: the ValueError says {text!r}, which should mention "
                                 f"{missing}") from None
        return text
    except Exception as error:
        raise AssertionError(f"{what}: raised {type(error).__name__}: {error}; expected a "
                             "ValueError") from None
    raise AssertionError(f"{what}: no error; expected a ValueError")


def check_layout_errors(fn, case=None) -> None:
    """Bad inputs raise ValueError: a world size that is not the product (the message names every
    factor, "world size (8) != dp (2) x tp (2) x pp (3)"), a degree that is not a positive int, an
    order that is not the axes once each, nodes that do not divide the world. Each bad degree and
    order but the first comes with the *right* product (a float 2.0, two negative degrees, an axis
    of size 1 left out or named twice), so a validator that only compares the product with the
    world size is caught; and the same degrees, laid out right, are accepted (a function that
    always raises earns nothing here)."""
    case = case or checks.Case("lab 6, task 1: errors")
    dp, tp, pp = (case.integer(2, 4) for _ in range(3))
    degrees = {"dp": dp, "tp": tp, "pp": pp}
    wrong = dp * tp * pp + case.integer(1, 3)
    _expect_value_error(fn, (wrong, degrees, ["dp", "pp", "tp"], None),
                        f"mesh_layout({wrong}, {degrees}, ...) [{case}]",
                        [f"({wrong})", f"dp ({dp})", f"tp ({tp})", f"pp ({pp})"])
    size = dp * tp * pp
    try:                                    # the ordinary case: accepted (its layout is cell 1's)
        fn(size, dict(degrees), ["tp", "dp", "pp"], None)
    except Exception as error:
        raise AssertionError(f"mesh_layout({size}, {degrees}, ['tp', 'dp', 'pp']) raised "
                             f"{type(error).__name__}: {error}, but that input is good: refuse "
                             f"only what is wrong [{case}]") from None
    _expect_value_error(fn, (size, dict(degrees, tp=0), ["dp", "pp", "tp"], None),
                        "a degree of 0")
    _expect_value_error(fn, (size, dict(degrees, tp=float(tp)), ["dp", "pp", "tp"], None),
                        f"mesh_layout({size}, tp={float(tp)}): a degree that is not an int, with "
                        f"the right product [{case}]")
    _expect_value_error(fn, (size, dict(degrees, dp=-dp, tp=-tp), ["dp", "pp", "tp"], None),
                        f"mesh_layout({size}, dp={-dp}, tp={-tp}): negative degrees whose product "
                        f"is the world size [{case}]")
    _expect_value_error(fn, (size, degrees, ["dp", "tp"], None), "an order without pp")
    _expect_value_error(fn, (dp * tp, dict(degrees, pp=1), ["dp", "tp"], None),
                        f"mesh_layout({dp * tp}, pp=1, order ['dp', 'tp']): an order without "
                        f"pp, with the right product [{case}]")
    _expect_value_error(fn, (size, degrees, ["dp", "pp", "tp", "tp"], None),
                        "tp twice in the order")
    _expect_value_error(fn, (dp * pp, dict(degrees, tp=1), ["dp", "pp", "tp", "tp"], None),
                        f"mesh_layout({dp * pp}, tp=1, order ['dp', 'pp', 'tp', 'tp']): an axis "
                        f"named twice, with the right product [{case}]")
    _expect_value_error(fn, (size, degrees, ["dp", "pp", "ep"], None), "an order naming ep, not tp")
    if size % 5:
        _expect_value_error(fn, (size, degrees, ["dp", "pp", "tp"], 5),
                            f"{size} ranks on nodes of 5 GPUs")


def check_tp_inside_nodes(fn, size, degrees, order, gpus_per_node):
    """With gpus_per_node, fn raises ValueError (naming tp) exactly when some tp group spans more
    than one node (ranks n G .. n G + G - 1 on node n); otherwise it returns the layout. Returns
    the error's message, or the layout."""
    strides = _strides(degrees, order)
    span = strides["tp"] * (degrees["tp"] - 1)
    crosses = any(r // gpus_per_node != (r + span) // gpus_per_node
                  for r in range(size) if (r // strides["tp"]) % degrees["tp"] == 0)
    what = (f"mesh_layout({size}, {degrees}, {list(order)}, gpus_per_node={gpus_per_node})")
    if crosses:
        return _expect_value_error(fn, (size, dict(degrees), list(order), gpus_per_node),
                                   f"{what}, whose tp groups cross nodes", ["tp"])
    try:
        value = fn(size, dict(degrees), list(order), gpus_per_node)
    except Exception as error:
        raise AssertionError(f"{what} raised {type(error).__name__}: {error}, but every tp group "
                             "lies inside a node") from None
    coords, groups = _returned_layout(value, size, degrees)
    # this cell judges which ranks share a tp group (what the node check is about); the order of
    # the groups and the other axes are the layout cell's
    expected = sorted([start + i * strides["tp"] for i in range(degrees["tp"])]
                      for start in range(size) if (start // strides["tp"]) % degrees["tp"] == 0)
    if sorted(sorted(g) for g in groups["tp"]) != expected:
        raise AssertionError(f"{what}: the tp groups are {groups['tp']}, expected {expected} "
                             "(in any order)")
    return {"coords": coords, "groups": groups}


def random_layouts(case, count=6, max_size=48):
    """(size, degrees, order) cases with 2 to 4 axes of sizes 1 to 4, in random orders."""
    names = ["dp", "tp", "pp", "ep", "cp"]
    found = []
    while len(found) < count:
        axes = [names[i] for i in case.permutation(len(names))[:case.integer(2, 4)]]
        if "tp" not in axes:
            axes[0] = "tp"
        degrees = {a: case.integer(1, 4) for a in axes}
        size = math.prod(degrees.values())
        if size <= max_size:
            order = [axes[i] for i in case.permutation(len(axes))]
            found.append((size, degrees, order))
    return found


# ---- task 2: the 3D training step ---------------------------------------------------------------


def _train_program(share, fn, dims, seed, optimizer, tied, max_norm=None):
    """fn on this rank, and what every torch optimizer it stepped held: {"weights": fn's result,
    "held": [parameter elements, per-element state elements]} summed over the optimizers (each
    counted at its last step; torch's global step hook sees every torch.optim optimizer)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from labkit.mesh.model import device_mesh
    held = {}

    def count(opt, args, kwargs):
        params = sum(p.numel() for g in opt.param_groups for p in g["params"])
        state = sum(t.numel() for s in opt.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        held[id(opt)] = (params, state)

    hook = register_optimizer_step_post_hook(count)
    try:
        extra = {} if max_norm is None else {"max_norm": max_norm}
        weights = fn(share, device_mesh(dims), seed, optimizer=optimizer, tied=tied, **extra)
    finally:
        hook.remove()
    return {"weights": weights, "held": [sum(h[0] for h in held.values()),
                                         sum(h[1] for h in held.values())]}


from labkit.mesh.train_checks import (check_train_3d, check_train_3d_traffic,  # noqa: E402,F401
                                      train_case)


# ---- task 3: choosing a configuration -----------------------------------------------------------

KEYS = ("dp", "tp", "pp", "zero_stage", "microbatches")


def _best(model: dict, cluster: dict, global_batch: int, memory_limit=None):
    """[config, step time] of the best fitting configuration, or None. The search is task 3's
    answer: it lives with the grader (`labkit.grading.references.mesh`); the student copy has
    the visible cases' values, written by `labkit release`."""
    reference = released.reference("mesh")
    if reference is not None:
        return reference.best(dict(model), dict(cluster), global_batch, memory_limit)
    return released.value("lab06_3d_parallelism", "best",
                          released.key(model, cluster, global_batch, memory_limit))


def _show(config) -> str:
    return ", ".join(f"{k}={config[k]}" for k in KEYS)


def check_choice(fn, model: dict, cluster: dict, global_batch: int, memory_limit=None) -> dict:
    """fn(model, cluster, global_batch, memory_limit) returns a configuration that runs, fits in
    memory and whose predicted step is as short as the best of every configuration's."""
    m, c = Model(**model), Cluster(**cluster)
    what = f"choose_config({m.name}, {c.nodes} x {c.gpus_per_node} GPUs, batch {global_batch})"
    got = fn(dict(model), dict(cluster), global_batch, memory_limit)
    if not isinstance(got, dict) or set(got) != set(KEYS):
        raise AssertionError(f"{what} should return a dict with keys {list(KEYS)}, got {got!r}")
    found = cost.problems(m, c, got, global_batch)
    if found:
        raise AssertionError(f"{what} returned {_show(got)}, which cannot run: {'; '.join(found)}")
    predicted = cost.predict(m, c, got, global_batch, memory_limit=memory_limit)
    if not predicted["fits"]:
        raise AssertionError(f"{what} returned {_show(got)}, which does not fit: "
                             f"{predicted['memory'] / 1e9:.1f} GB per rank at its peak, "
                             f"limit {predicted['limit'] / 1e9:.1f} GB. Did you keep only the "
                             "configurations whose cost['fits'] is True?")
    best = _best(model, cluster, global_batch, memory_limit)
    if best is None:
        raise AssertionError(f"{what} returned {_show(got)}, but no configuration fits")
    if predicted["step_time"] > best[1] * (1 + 1e-9):
        raise AssertionError(f"{what} returned {_show(got)}: a step of "
                             f"{predicted['step_time'] * 1e3:.2f} ms, but {_show(best[0])} fits "
                             f"and takes {best[1] * 1e3:.2f} ms. Did you try every "
                             "tp, pp, ZeRO stage and number of microbatches?")
    return got


def check_nothing_fits(fn, model: dict, cluster: dict, global_batch: int, memory_limit) -> None:
    """When no configuration fits in `memory_limit`, fn raises ValueError."""
    m, c = Model(**model), Cluster(**cluster)
    if _best(model, cluster, global_batch, memory_limit) is not None:
        raise ValueError("check_nothing_fits: this case has a configuration that fits")
    _expect_value_error(fn, (dict(model), dict(cluster), global_batch, memory_limit),
                        f"choose_config({m.name}, {c.gpus} GPUs, limit "
                        f"{memory_limit / 1e9:.0f} GB), where nothing fits")
