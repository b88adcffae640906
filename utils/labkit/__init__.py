"""labkit: run notebook code on real torch.distributed ranks, and check it.

    import labkit
    world = labkit.world(4)          # 4 long-lived rank processes, one process group
    world.run(fn, *args)             # fn runs on every rank; one result per rank

See README.md beside this file for the whole API in one page.
"""

from labkit.errors import (CallInterrupted, CallTimeout, LabkitError, PicklingError, RankDied,
                           RankError, WorldError)

__all__ = ["world", "World", "current", "shutdown_all", "device", "mark", "LabkitError", "WorldError",
           "RankError", "RankDied", "CallTimeout", "CallInterrupted", "PicklingError",
           "load_ipython_extension"]


# One module per chapter topic, in course order (see README.md beside this file).
TOPICS = ("collectives", "dp", "memory", "tensor_parallel", "pipeline", "mesh", "moe", "checkpoint",
          "faults", "context", "drill")


def __getattr__(name):
    # The launcher imports torch: load it on first use, so `labkit --help` stays quick.
    if name in ("world", "World", "current", "shutdown_all", "max_world_size", "gpu_count"):
        from labkit.runtime import launcher as _launcher
        if name == "world":
            _ranks_magic_where_a_world_is()
        return getattr(_launcher, name)
    if name in TOPICS or name in ("basics", "checks", "formulas", "errors", "runtime", "tools",
                                  "grading"):
        import importlib
        return importlib.import_module(f"labkit.{name}")
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def device():
    """Inside a rank: this rank's device (`cuda:<rank>` under NCCL, else `cpu`)."""
    import sys
    worker = sys.modules.get("labkit.runtime.worker")
    if worker is None or worker.STATE.rank is None:
        import torch
        return torch.device("cpu")
    return worker.STATE.device


def mark(label):
    """Inside a rank: a point at which a measuring `world.traffic()` snapshots the bytes every
    rank has sent so far (`traffic.marks[label]`); returns once it is taken. Does nothing when
    not called from a rank's task."""
    import sys
    worker = sys.modules.get("labkit.runtime.worker")
    if worker is not None:
        worker.mark(label)


def _ranks_magic_where_a_world_is():
    """`%%ranks` works in every notebook that makes a world (`labkit.world`), not only where
    `%load_ext labkit` was run (chapter 0): registered in the running IPython on first use."""
    import sys
    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython
    ipython = get_ipython()
    if ipython is not None and "ranks" not in ipython.magics_manager.magics.get("cell", {}):
        load_ipython_extension(ipython)


def load_ipython_extension(ipython):
    """`%load_ext labkit` registers the `%%ranks` cell magic."""
    from labkit.runtime.magic import register
    register(ipython)
