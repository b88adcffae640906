"""Chapter 8: checkpoints that survive crashes, resume exactly, and do not stall training.

    from labkit import checkpoint
    from labkit.checkpoint import store, crash, layout      # no torch: quick to import anywhere

| module | what | course section |
|---|---|---|
| `layout` | snapshot ids, paths, the manifest format, SHA-256, `CheckpointError` | 1 |
| `store` | write_shard, commit, commit_folder, verify, load_latest: atomic publication | 1-3; ch. 9 |
| `crash` | crash trials: a lean helper forks victims and SIGKILLs them at chosen points | 1, 2, 3 |
| `trials` | crash trials of a save: kill at every point, reload, judge against the bytes saved (one process, victims on ranks, real ranks), the table by phase | 1, 2 |
| `dcp_trials` | DCP under the crash harness: victims with a killing FileSystemWriter, loads as one line | 3 |
| `dcp_files` | which rank's DCP file holds each key or piece (read from `.metadata`), `check_writers` (a predicted writer per key against it), file sizes | 3, 4 |
| `bench` | the training bench: model, AdamW, scheduler, scaler, RNGs, data cursor, hashes | 4, 5 |
| `resume` | capture / restore of the bench's full state (replicated trainer) | 4; ch. 9 |
| `zero` | the ZeRO-1 layout: flat buffer, per-rank ranges, global shapes and offsets | 5 |
| `interval` | Young's and Daly's intervals, the waste model, a Monte-Carlo failure simulator | 7 |
| `killclock` | a real job SIGKILLed on an exponential clock (virtual step time), its replay in arithmetic | 7 |
| `selfcheck` | the chapter's self-checks, answered after an attempt | 1, 7 |
| `checks`, `checks_resume`, `checks_async` | lab 8's checkers (tasks 1, 2, 3-4) | lab 8 |

Lab 8 asks for a retention policy on top of `store` (task 1) and for a sharded resume (task 2;
`resume` handles the replicated trainer only and refuses a ZeRO-1 one).
"""
from labkit.checkpoint.layout import (CheckpointError, check_name, manifest_path,  # noqa: F401
                                      published_ids, sha256_bytes, sha256_file, shard_folder,
                                      snapshot_id)

_SUBMODULES = ("layout", "store", "crash", "bench", "resume", "zero", "interval", "killclock",
               "checks")


def __getattr__(name):
    if name in _SUBMODULES:
        import importlib
        return importlib.import_module(f"labkit.checkpoint.{name}")
    raise AttributeError(f"module 'labkit.checkpoint' has no attribute {name!r}")
