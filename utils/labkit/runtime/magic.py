"""The `%%ranks` cell magic: run a cell's source on every rank of the current world.

    %load_ext labkit
    %%ranks [--ranks 0,1] [--timeout 5] [--quiet]
    x = torch.full((2,), float(rank))
    dist.all_reduce(x)
    x                      # the last expression's value is shown per rank

Each rank keeps its own namespace across cells; `rank`, `world_size`, `dist`, `torch`,
`device` and `labkit` are defined in it.
"""

import argparse
import shlex


def _parser():
    parser = argparse.ArgumentParser(prog="%%ranks", add_help=False)
    parser.add_argument("--ranks", "-r", default=None,
                        help="comma-separated ranks to run on (default: all)")
    parser.add_argument("--timeout", "-t", type=float, default=None,
                        help="seconds before the cell is diagnosed as a hang")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="do not show the last expression's value")
    return parser


def ranks_magic(line, cell, ipython=None):
    __tracebackhide__ = True   # IPython: show the diagnosis, not labkit's frames
    from labkit.errors import WorldError
    from labkit.runtime.launcher import current
    try:
        options = _parser().parse_args(shlex.split(line))
    except SystemExit:
        raise WorldError(f"%%ranks: cannot read the options {line!r}; "
                         f"use e.g. %%ranks --ranks 0,1 --timeout 5") from None
    world = current()
    if world is None:
        raise WorldError("%%ranks runs on the current world, and there is none: create one "
                         "first, e.g. `world = labkit.world(4)`")
    ranks = None
    if options.ranks:
        ranks = [int(r) for r in options.ranks.replace(" ", "").split(",") if r]
    filename = None
    if ipython is not None:
        # register the cell like IPython does, so tracebacks on the ranks show its lines
        filename = ipython.compile.cache(cell, ipython.execution_count)
    values = world.run_source(cell, ranks=ranks, timeout=options.timeout, filename=filename)
    targets = ranks if ranks is not None else list(range(world.size))
    if not options.quiet:
        for rank, value in zip(targets, values):
            if value is not None:
                print(f"[rank {rank}] Out: {value!r}")


def register(ipython):
    def magic(line, cell):
        __tracebackhide__ = True
        return ranks_magic(line, cell, ipython)
    magic.__doc__ = __doc__
    ipython.register_magic_function(magic, magic_kind="cell", magic_name="ranks")
