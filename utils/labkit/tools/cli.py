"""The `labkit` command: one entry point, one subcommand per module.

    labkit build [--world 2] [--backend auto] [--scale small] [--only PATTERN]
    labkit release [--check]
    labkit torchrun [--nproc-per-node N] [--nnodes ...] module:function [args...]

Each subcommand lives in its own module, imported only when that subcommand runs (so `labkit
release` never imports torch). To add one, add a row to SUBCOMMANDS: the module must define
`add_arguments(parser)` and `run(args) -> int` (the exit code); `module:Name` names an object of
the module that defines them (two subcommands of one module). A row whose module is not there
(the student copy has no labkit.grading) is left out of `--help`; typed, it says it is an
instructor command.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import sys

from labkit.common import run_module  # noqa: F401 (`labkit NAME` and `python -m` share it)

# name -> (module, one-line help). Keep it a plain table: other subcommands are added here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "build": ("labkit.tools.build", "execute every course notebook and lab solution headless"),
    "release": ("labkit.tools.release", "regenerate labs/ from solutions/ (or --check that they agree)"),
    "torchrun": ("labkit.runtime.torchrun", "run a module:function on ranks started by torchrun (env://)"),
    "grade": ("labkit.grading.cli", "autograde a folder of submissions of a lab (docs/INSTRUCTORS.md)"),
    "regrade": ("labkit.grading.regrade", "grade a lab again after a test was fixed: manual "
                "grades kept, the students whose score changed listed (docs/INSTRUCTORS.md)"),
    "dist": ("labkit.tools.dist", "build the student distribution (no solutions, hidden tests, gradebook)"),
    "drill": ("labkit.drill.terminal", "the interview drill: the chapters' derivations with fresh "
              "numbers, seed 004's questions as cards, Leitner boxes"),
    "report": ("labkit.grading.report", "class report of a lab from its gradebook: scores, failures, times (HTML)"),
    "import": ("labkit.grading.roster:ImportCommand", "sort a learning platform's export of "
               "submissions into <student_id>/ folders by a roster CSV, with a late column"),
    "export": ("labkit.grading.roster:ExportCommand", "after grading: one feedback archive per "
               "student and a grades CSV (id, score, max, late) for the platform"),
    "doctor": ("labkit.tools.doctor", "check this machine: Python, torch, gloo/NCCL, memory, grading sandbox"),
    "student-setup": ("labkit.tools.dist:StudentSetup", "the student copy's install step: "
                      "nbgrader's instructor panels off in this environment's JupyterLab"),
}


def available(module: str) -> bool:
    """Whether `module` (dotted) can be found, without importing it or its packages: the
    student copy ships without labkit.grading."""
    parts = module.split(":")[0].split(".")
    spec = importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]),
                                                        list(spec.submodule_search_locations))
    return spec is not None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="labkit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    here = {name: row for name, row in SUBCOMMANDS.items() if available(row[0])}
    for name, (_, help_text) in here.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if argv and argv[0] in SUBCOMMANDS and argv[0] not in here:
        print(f"labkit {argv[0]}: an instructor command, not in the student copy (its module "
              f"{SUBCOMMANDS[argv[0]][0].split(':')[0]} is not installed); run it from the "
              "course repository", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in here:
        parser.print_help()
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nlabkit: unknown command {argv[0]!r}; known: {', '.join(here)}",
                  file=sys.stderr)
            return 2
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    module_name, _, attribute = SUBCOMMANDS[name][0].partition(":")
    module = importlib.import_module(module_name)
    command = getattr(module, attribute) if attribute else module
    return run_module(command, rest, prog=f"labkit {name}", description=SUBCOMMANDS[name][1])


if __name__ == "__main__":
    sys.exit(main())
