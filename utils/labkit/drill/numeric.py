"""The numeric drills: each draws its parameters from a seed and computes its answer with the
function the chapter teaches and checks against measurements (never a copy of it).

    from labkit.drill import numeric
    numeric.DRILLS["ring-bytes"].problem(seed=7)          # a Problem: question, answer, solution
    numeric.DRILLS["ring-bytes"].problem(params={...})    # the same drill at chosen parameters
    numeric.DRILLS["ring-bytes"].missing()                # chapter functions not in labkit yet

A drill names the functions it uses by their dotted names (`labkit.collectives.ring_bytes_sent`);
they are imported when a problem is posed, so a drill whose module or function is absent (an
older copy of labkit) is skipped with the name of what it waits for. The drills of one topic live in one module: `numeric_comm.py`
(chapters 1, 3, 4, 5), `numeric_scale.py` (chapters 6-9), `numeric_mesh.py` (the decisions of
chapter 6: memory per rank, which axis on which link, choosing tp/pp/dp among four),
`numeric_recovery.py` (the decisions of chapters 8 and 9: snapshot size, a job's MTBF, steps
lost) and `numeric_context.py`
(chapter 10: causal work per rank, ring attention and Ulysses bytes).
"""
from __future__ import annotations

import dataclasses
import importlib
import random
from typing import Callable

from labkit.drill.base import MissingFormula, Problem

DRILLS: dict = {}                  # id -> NumericDrill, in course order


def formula(name: str):
    """The chapter function (or constant) `name` ("labkit.collectives.ring_bytes_sent"), or
    MissingFormula saying why it cannot be had."""
    module, _, attr = name.rpartition(".")
    try:
        found = importlib.import_module(module)
    except Exception as exc:          # absent, or half-written by its author right now
        raise MissingFormula(name, f"cannot import {module} ({type(exc).__name__}: {exc})") \
            from None
    if not hasattr(found, attr):
        raise MissingFormula(name, f"{module} has no {attr} yet")
    return getattr(found, attr)


@dataclasses.dataclass(frozen=True)
class NumericDrill:
    """A numeric drill: `draw(rng) -> params`, `pose(params, formula) -> dict` with question,
    answer, unit, solution (and kind, rel_tol, abs_tol where not the defaults)."""
    id: str
    topic: str                        # a labkit topic package: "collectives", "moe", ...
    title: str
    chapter: int
    section: str
    uses: tuple                       # dotted names of the chapter functions the answer uses
    draw: Callable
    pose: Callable
    source: str = ""                  # where the question comes from, when not the course

    def problem(self, seed=0, params: dict | None = None) -> Problem:
        """The drill with parameters drawn from `seed` (or given as `params`)."""
        if params is None:
            params = self.draw(random.Random(f"{self.id}/{seed}"))
        posed = self.pose(dict(params), formula)
        return Problem(drill_id=self.id, topic=self.topic, title=self.title,
                       chapter=self.chapter, section=self.section, uses=self.uses,
                       params=dict(params), seed=seed, source=self.source, **posed)

    def missing(self) -> list:
        """The MissingFormula of every function this drill uses that labkit lacks (empty: ready)."""
        absent = []
        for name in self.uses:
            try:
                formula(name)
            except MissingFormula as exc:
                absent.append(exc)
        return absent


def register(id, topic, title, chapter, section, uses, source=""):
    """Decorator for `pose(params, formula)`; the draw function is given as `pose.draw`."""
    def add(pose):
        DRILLS[id] = NumericDrill(id, topic, title, chapter, section, tuple(uses),
                                  pose.draw, pose, source)
        return pose
    return add


def draws(draw):
    """Attach a draw function to a pose function: `@draws(lambda rng: {...})`."""
    def attach(pose):
        pose.draw = draw
        return pose
    return attach


from labkit.drill import numeric_comm, numeric_recovery, numeric_scale  # noqa: E402,F401  (they register)
from labkit.drill import numeric_mesh  # noqa: E402,F401  (chapter 6's decisions register)
from labkit.drill import numeric_context  # noqa: E402,F401  (chapter 10's drills register)
