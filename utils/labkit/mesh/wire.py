"""Bytes on the wire of a 3D mesh, by how the two ranks of each pair relate (chapter 6, sections
2 and 3): the plumbing the chapter's byte checks share, kept out of the lesson.

    world.run(wire.make_mesh, dims)                     # groups made before a measured call
    with world.traffic() as traffic:
        world.run(program, dims, ...)
    wire.bytes_by_relation(traffic, dims)               # {"tp": B, "pp": B, "dp": B, "none": B}
    wire.bytes_by_relation(wire.between(traffic, "begin", "end"), dims)   # between two marks
    wire.per_rank(wire.between(traffic, "begin", "end"))                 # all of it, per rank

Two ranks of a dp x pp x tp mesh (the course's order, `layout.coordinates`) are related along an
axis when they differ in that coordinate only (they share that axis's group); any other pair is
"none", and a correct step sends nothing there. The counts are the kernel's socket counters read
outside the ranks (`runtime/traffic.py`), so what a rank sends by any route is in them.
"""
from __future__ import annotations

import math

from labkit.mesh import layout

RELATIONS = ("tp", "pp", "dp", "none")


def relation(a: int, b: int, dims) -> str:
    """"tp", "pp" or "dp" when ranks a and b differ only in that coordinate, else "none"."""
    ca, cb = layout.coordinates(a, *dims), layout.coordinates(b, *dims)
    differ = [axis for axis in layout.AXES if ca[axis] != cb[axis]]
    return differ[0] if len(differ) == 1 else "none"


def bytes_by_relation(traffic, dims) -> dict:
    """Bytes per rank (the mean over the W ranks) sent to a rank of the same tp, pp or dp group, or
    to a rank that shares none. `traffic`: a `world.traffic()` result or a W x W matrix
    (traffic.marks[label]["matrix"])."""
    matrix = traffic if isinstance(traffic, (list, tuple)) else traffic.matrix
    size = math.prod(dims)
    if len(matrix) != size:
        raise ValueError(f"a traffic matrix of {len(matrix)} ranks for a mesh {tuple(dims)} of "
                         f"{size} ranks: count on the mesh's own world")
    totals = dict.fromkeys(RELATIONS, 0)
    for a in range(size):
        for b in range(size):
            if a != b:
                totals[relation(a, b, dims)] += matrix[a][b]
    return {k: v / size for k, v in totals.items()}


def make_mesh(dims):
    """Rank side: torch's DeviceMesh of `dims` made (and kept, `model.device_mesh`), so that a
    measured call that follows opens no connection and creates no group."""
    from labkit.mesh.model import device_mesh
    device_mesh(dims)


def between(traffic, start: str, end: str) -> list:
    """The W x W matrix of bytes sent between two marks of one call (`labkit.mark(start)` ..
    `labkit.mark(end)` on the ranks): traffic.marks[end] - traffic.marks[start], pair by pair."""
    missing = [label for label in (start, end) if label not in traffic.marks]
    if missing:
        raise KeyError(f"no mark {missing} in this count; the marks are {sorted(traffic.marks)}")
    first, last = traffic.marks[start]["matrix"], traffic.marks[end]["matrix"]
    return [[b - a for a, b in zip(row_a, row_b)] for row_a, row_b in zip(first, last)]


def per_rank(matrix) -> float:
    """Bytes per rank (the mean over the ranks) that a W x W matrix holds."""
    return sum(map(sum, matrix)) / len(matrix)
