"""The 3D mesh as plain data: world size, a rank's coordinates, the groups of each axis, and the
nodes a group spans (chapter 6, `course/06_3d_parallelism.ipynb`, section 1). No torch here: the
interview drill and the cost model call these as plain functions.

    check_world_size(8, dp=2, tp=2, pp=2)          # 8, or a ValueError that lists every factor
    coordinates(5, dp=2, pp=2, tp=2)               # {"dp": 1, "pp": 0, "tp": 1}
    axis_groups(dp=2, pp=2, tp=2)["tp"]            # [[0, 1], [2, 3], [4, 5], [6, 7]]
    nodes_spanned([0, 4], gpus_per_node=4)         # [0, 1]: this group crosses a node boundary

The course's order, outermost first, is (dp, pp, tp), torch's `init_device_mesh(..., (dp, pp, tp),
mesh_dim_names=("dp", "pp", "tp"))`: the mesh is the ranks 0 .. W-1 laid out row-major in a
[dp, pp, tp] array, so tp, the last axis, varies fastest:

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank

and a tp group is tp consecutive ranks: on nodes of G GPUs numbered in order (ranks r G .. r G + G-1
on node r), a tp group stays inside one node whenever tp divides G. A pp group has stride tp, a
dp group stride pp tp: the outer axes are the ones that cross nodes. Megatron-LM names the same
kind of layout innermost first ("tp-cp-ep-dp-pp": pp outermost); torchtitan's mesh is
("pp", "dp", "tp"). In both, as here, tp is innermost.

Expert parallelism (chapter 7) is not a fourth factor of the world: Megatron-Core, torchtitan and
DeepSpeed carve it out of the data-parallel ranks (`expert_groups`), so world = dp x pp x tp with
ep dividing dp. `world_size` and `check_world_size` take the degrees as keywords only; the rest of
the module takes them positionally in the course's order (dp, pp, tp).
"""
from __future__ import annotations

import math

AXES = ("dp", "pp", "tp")          # the course's order, outermost first


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def world_size(*, dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1) -> int:
    """World size = dp x pp x tp (keywords only: the positional order of the rest of this module
    is (dp, pp, tp), and a silent swap of two degrees would give the same product anyway).

    ep, chapter 7's expert parallelism, is *folded into* the data-parallel ranks, as
    Megatron-Core, torchtitan and DeepSpeed lay it out: the experts of an MoE layer are spread
    over ep of the dp replicas, which hold the same dense layers; the world is still dp x pp x tp
    and ep must divide dp (each expert then has dp / ep data-parallel copies)."""
    size = _positive("dp", dp) * _positive("pp", pp) * _positive("tp", tp)
    _positive("ep", ep)
    if dp % ep:
        raise ValueError(f"ep ({ep}) must divide dp ({dp}): expert parallelism is carved out of "
                         f"the data-parallel ranks, not multiplied into the world; choose ep "
                         f"among {divisors(dp)}")
    return size


def check_world_size(size: int, *, dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1) -> int:
    """`size` if it equals dp x tp x pp (ep folded into dp, see `world_size`); else a ValueError
    that prints every factor and a fix: "world size (8) != dp (2) x tp (2) x pp (3) = 12: ..."."""
    _positive("world size", size)
    product = world_size(dp=dp, pp=pp, tp=tp, ep=ep)
    if product == size:
        return size
    factors = [("dp", dp), ("tp", tp), ("pp", pp)]
    shown = " x ".join(f"{name} ({value})" for name, value in factors)
    model = product // dp
    fix = (f"with tp x pp = {model}, use dp = {size // model}" if size % model == 0 else
           f"tp x pp = {model} does not divide {size}: change tp or pp")
    folded = f" (ep ({ep}) is folded into dp, not multiplied)" if ep != 1 else ""
    raise ValueError(f"world size ({size}) != {shown} = {product}{folded}: {fix}")


def expert_groups(dp: int, pp: int, tp: int, ep: int) -> dict:
    """Chapter 7's axis folded into dp: {"ep": [...], "edp": [...]}. Each dp group [r_0 ..
    r_{dp-1}] is cut into dp/ep blocks of ep consecutive dp ranks: an ep group (the ranks that
    exchange tokens by all-to-all and hold different experts) is one block; an expert's
    data-parallel group ("edp", the ranks that hold the same experts and reduce their gradients)
    takes the same place in every block. The dense layers still reduce over the whole dp group."""
    world_size(dp=dp, pp=pp, tp=tp, ep=ep)
    ep_groups, edp_groups = [], []
    for group in axis_groups(dp, pp, tp)["dp"]:
        blocks = [group[i:i + ep] for i in range(0, dp, ep)]       # [dp/ep, ep]
        ep_groups += blocks
        edp_groups += [[block[j] for block in blocks] for j in range(ep)]
    return {"ep": sorted(ep_groups), "edp": sorted(edp_groups)}


def coordinates(rank: int, dp: int, pp: int, tp: int) -> dict:
    """Rank -> {"dp": i, "pp": j, "tp": k} in the course's order (dp, pp, tp)."""
    size = world_size(dp=dp, pp=pp, tp=tp)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}) for dp ({dp}) x pp ({pp}) x tp ({tp}), "
                         f"got {rank!r}")
    rest, tp_rank = divmod(rank, tp)
    dp_rank, pp_rank = divmod(rest, pp)
    return {"dp": dp_rank, "pp": pp_rank, "tp": tp_rank}


def rank_of(coords: dict, dp: int, pp: int, tp: int) -> int:
    """{"dp": i, "pp": j, "tp": k} -> rank = (i pp + j) tp + k."""
    for axis, size in (("dp", dp), ("pp", pp), ("tp", tp)):
        if not 0 <= coords[axis] < size:
            raise ValueError(f"{axis} coordinate {coords[axis]} is outside [0, {size})")
    return (coords["dp"] * pp + coords["pp"]) * tp + coords["tp"]


def axis_groups(dp: int, pp: int, tp: int) -> dict:
    """{axis: [group, ...]}: for each axis, the groups of ranks that differ only in that axis's
    coordinate, each listed in the order of that coordinate, the groups in order of their first
    rank. Every rank is in exactly one group of each axis."""
    size = world_size(dp=dp, pp=pp, tp=tp)
    groups = {axis: {} for axis in AXES}
    for rank in range(size):
        c = coordinates(rank, dp, pp, tp)
        for axis in AXES:
            key = tuple(c[a] for a in AXES if a != axis)
            groups[axis].setdefault(key, []).append(rank)
    return {axis: sorted(found.values()) for axis, found in groups.items()}


def my_groups(rank: int, dp: int, pp: int, tp: int) -> dict:
    """{axis: the group of `rank` along that axis}."""
    return {axis: next(g for g in groups if rank in g)
            for axis, groups in axis_groups(dp, pp, tp).items()}


def node_of(rank: int, gpus_per_node: int) -> int:
    """Ranks are numbered node by node: ranks n G .. n G + G - 1 live on node n."""
    return rank // _positive("gpus_per_node", gpus_per_node)


def nodes_spanned(group, gpus_per_node: int) -> list:
    """The nodes a group of ranks occupies, sorted."""
    return sorted({node_of(rank, gpus_per_node) for rank in group})


def crosses_nodes(group, gpus_per_node: int) -> bool:
    return len(nodes_spanned(group, gpus_per_node)) > 1


def inside_node(axis: str, dp: int, pp: int, tp: int, gpus_per_node: int) -> bool:
    """Whether every group of `axis` stays inside one node, in the course's order: an axis of
    size n and stride s (tp: 1, pp: tp, dp: pp tp) fits when s n <= G and s n divides G."""
    stride = {"tp": 1, "pp": tp, "dp": pp * tp}[axis]
    size = {"tp": tp, "pp": pp, "dp": dp}[axis]
    span = stride * size
    return size == 1 or (span <= gpus_per_node and gpus_per_node % span == 0)


def describe(dp: int, pp: int, tp: int, gpus_per_node: int | None = None) -> str:
    """A table, one line per rank: rank, coordinates, node, and its tp, pp and dp groups."""
    lines = [f"{'rank':>4}  {'dp':>2} {'pp':>2} {'tp':>2}" + ("  node" if gpus_per_node else "")
             + "   tp group       pp group       dp group"]
    for rank in range(world_size(dp=dp, pp=pp, tp=tp)):
        c = coordinates(rank, dp, pp, tp)
        mine = my_groups(rank, dp, pp, tp)
        node = f"  {node_of(rank, gpus_per_node):>4}" if gpus_per_node else ""
        lines.append(f"{rank:>4}  {c['dp']:>2} {c['pp']:>2} {c['tp']:>2}{node}   "
                     + "".join(f"{str(mine[a]):<15}" for a in ("tp", "pp", "dp")))
    return "\n".join(lines)


def divisors(n: int) -> list:
    """The positive divisors of n, ascending."""
    _positive("n", n)
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
