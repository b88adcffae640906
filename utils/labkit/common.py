"""What every wing of labkit may import (runtime, tools, grading, the chapter packages): the course
root, the nbgrader markers, the runner of a subcommand module. Standard library only, and nothing
here imports another labkit module, so no wing reaches into another through it.
"""
from __future__ import annotations

import argparse
import os
import sys

# Spelled in pieces so that this file itself never matches a grep for the markers.
_B, _E = "BEGIN ", "END "
SOLUTION_BEGIN, SOLUTION_END = _B + "SOLUTION", _E + "SOLUTION"
HIDDEN_BEGIN, HIDDEN_END = _B + "HIDDEN TESTS", _E + "HIDDEN TESTS"
MARKERS = (SOLUTION_BEGIN, SOLUTION_END, HIDDEN_BEGIN, HIDDEN_END, _B + "MARK SCHEME")


def find_course_root(start: str | None = None) -> str:
    """The course repository (the folder holding solutions/) at or above `start` (the current
    folder by default)."""
    here = os.path.abspath(start or os.getcwd())
    while True:
        if os.path.isdir(os.path.join(here, "solutions")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            raise FileNotFoundError("no course repository here (a folder with solutions/): run "
                                    "`labkit grade` from the course repository or pass --course")
        here = parent


def run_module(module, argv=None, prog=None, description=None) -> int:
    """Parse `argv` with the module's `add_arguments` and call its `run`: what both `labkit NAME`
    and `python -m labkit.<wing>.NAME` do."""
    parser = argparse.ArgumentParser(
        prog=prog or f"python -m {getattr(module.__spec__, 'name', None) or module.__name__}",
        description=description or (module.__doc__ or "").split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(sys.argv[1:] if argv is None else argv)) or 0)
