"""Pictures of chapter 6: the mesh (ranks by node, each axis's groups coloured) and the timeline of
one 3D step (1F1B on the pp groups, tensor parallelism inside every action, ZeRO-1 over dp at the
end), drawn from what the ranks recorded.

    pictures.draw_mesh((2, 2, 2), gpus_per_node=4)          # three panels: tp, pp, dp groups
    pictures.draw_step(results, (2, 2, 2))                  # results of a step run with clock=True
"""
from __future__ import annotations

import math

from labkit.mesh import layout

GROUP_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3",
                 "#8C8C8C", "#CCB974", "#64B5CD"]
KIND_COLOURS = {"F": "#4C72B0", "B": "#55A868", "dp": "#DD8452"}


def _place(rank: int, gpus_per_node: int, per_row: int):
    """(x, y) of a rank's box: node n is a column block, its GPUs in rows of `per_row`."""
    node, slot = divmod(rank, gpus_per_node)
    row, col = divmod(slot, per_row)
    return node * (per_row + 0.8) + col, -row


def draw_mesh(dims, gpus_per_node: int, axes=None):
    """One panel per axis (tp, pp, dp, top to bottom): every rank a box at its place on its node, filled with the
    colour of its group along that axis and labelled with its coordinates (d, p, t); the panel's
    title says whether some group of the axis crosses a node boundary. Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle
    dp, pp, tp = dims
    size = dp * pp * tp
    per_row = min(gpus_per_node, 4)
    rows = math.ceil(gpus_per_node / per_row)
    nodes = math.ceil(size / gpus_per_node)
    if axes is None:
        units = nodes * (per_row + 0.8)
        _, axes = plt.subplots(3, 1, figsize=(min(9.0, 0.75 * units + 0.6), 3 * (0.7 * rows + 0.55)))
    groups = layout.axis_groups(dp, pp, tp)
    for ax, axis in zip(axes, ("tp", "pp", "dp")):
        for node in range(nodes):
            x0 = node * (per_row + 0.8) - 0.5
            ax.add_patch(Rectangle((x0, -rows + 0.45), per_row, rows + 0.1, facecolor="#F0F0F0",
                                   edgecolor="grey", linewidth=0.8))
            ax.text(x0 + per_row / 2, 0.62, f"node {node}", ha="center", fontsize=7, color="grey")
        for index, group in enumerate(groups[axis]):
            colour = GROUP_COLOURS[index % len(GROUP_COLOURS)]
            for rank in group:
                x, y = _place(rank, gpus_per_node, per_row)
                c = layout.coordinates(rank, dp, pp, tp)
                ax.add_patch(FancyBboxPatch((x - 0.38, y - 0.3), 0.76, 0.6,
                                            boxstyle="round,pad=0.02", facecolor=colour,
                                            edgecolor="black", linewidth=0.5))
                ax.text(x, y + 0.08, str(rank), ha="center", va="center", fontsize=8,
                        color="white", weight="bold")
                ax.text(x, y - 0.16, f"{c['dp']},{c['pp']},{c['tp']}", ha="center",
                        va="center", fontsize=5.5, color="white")
        crossing = any(layout.crosses_nodes(g, gpus_per_node) for g in groups[axis])
        ax.set_title(f"{axis}: {len(groups[axis])} groups of {len(groups[axis][0])} ranks, "
                     + ("cross nodes" if crossing else "inside a node"), fontsize=8)
        ax.set_xlim(-0.7, nodes * (per_row + 0.8) - 0.6)
        ax.set_ylim(-rows + 0.3, 0.85)
        ax.set_aspect("equal")
        ax.axis("off")
    axes[0].figure.suptitle(f"mesh dp x pp x tp = {dp} x {pp} x {tp} on nodes of {gpus_per_node} "
                            "GPUs\na box: rank and (d, p, t); a colour: one group", fontsize=8)
    return axes


def draw_step(results, dims, ax=None, zero1_width: float = 1.0):
    """The timeline of one 3D step, one row per rank, on the virtual clock the ranks carried
    (`pipeline.run_actions(..., clock=True)`: F costs 1, B 2): each rank's F and B of its
    microbatches where it ran them, and after its last action ZeRO-1's reduce-scatter, step and
    all-gather over dp (drawn `zero1_width` wide: a schematic, it has no virtual cost). Only the
    last step's events are drawn when several were run. Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    dp, pp, tp = dims
    size = dp * pp * tp
    if len(results) != size:
        raise ValueError(f"{len(results)} results for a mesh {tuple(dims)} of {size} ranks")
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.28 * size + 1.1))
    end = 0.0
    for rank, result in enumerate(results):
        events = [e for e in result["events"] if e[4] is not None]
        if not events:
            raise ValueError(f"rank {rank} recorded no virtual clock: run the step with clock=True")
        for kind, microbatch, _, _, start, stop in events:
            ax.barh(rank, stop - start, left=start, color=KIND_COLOURS.get(kind, "grey"),
                    edgecolor="black", linewidth=0.4)
            ax.text((start + stop) / 2, rank, f"{kind}{microbatch}", ha="center", va="center",
                    fontsize=6, color="white")
        end = max(end, max(e[5] for e in events))
    for rank in range(size):
        ax.barh(rank, zero1_width, left=end, color=KIND_COLOURS["dp"], edgecolor="black",
                linewidth=0.4)
    ax.text(end + zero1_width / 2, -0.9, "ZeRO-1\nover dp", ha="center", fontsize=6)
    labels = []
    for rank in range(size):
        c = layout.coordinates(rank, dp, pp, tp)
        labels.append(f"rank {rank} (d{c['dp']} p{c['pp']} t{c['tp']})")
    ax.set_yticks(range(size), labels, fontsize=7)
    ax.set_ylim(size - 0.5, -1.4)
    ax.set_xlabel("virtual time (F = 1, B = 2)")
    ax.legend(handles=[Patch(color=KIND_COLOURS["F"], label="forward (tp all-reduces inside)"),
                       Patch(color=KIND_COLOURS["B"], label="backward (tp all-reduces inside)"),
                       Patch(color=KIND_COLOURS["dp"], label="reduce-scatter, step, all-gather")],
              fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("one 3D step: the tp ranks of a stage run in lockstep, the stages in 1F1B, the "
                 "replicas side by side", fontsize=8)
    return ax
