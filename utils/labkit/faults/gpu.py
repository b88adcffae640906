"""What NCCL and the driver say when a GPU job fails (chapter 9, section 6): runs on GPU runners.

    out = gpu.torchrun("labkit.faults.gpu:all_reduce_once", nproc=2, env={"NCCL_DEBUG": "INFO"})
    out = gpu.torchrun("labkit.faults.gpu:skip_one", nproc=2, args=[10],
                       env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                            "TORCH_FR_BUFFER_SIZE": "2000",
                            "TORCH_FR_DUMP_TEMP_FILE": folder + "/nccl_trace_rank_"})

NCCL reads its environment when a communicator is created, and a notebook's ranks are started
once, so each demonstration runs as a job of its own under `labkit torchrun` with the variables
it needs. Nothing here runs without one GPU per rank (`gpu.available(nproc)`).

The knobs (PyTorch's documentation, "Distributed communication package", environment variables,
and NCCL's "Environment Variables" page):

| variable | what it does |
|---|---|
| NCCL_DEBUG=INFO (WARN, TRACE), NCCL_DEBUG_SUBSYS=INIT,NET,COLL | NCCL prints its version, the transports it picked per peer (NVLink/P2P, SHM, IB, Socket), rings and trees; WARN shows errors only |
| TORCH_NCCL_ASYNC_ERROR_HANDLING=0 .. 3 | what the watchdog does when a collective times out or fails (`ASYNC_ERROR_HANDLING` below, from torch 2.13's ProcessGroupNCCL.hpp, `ErrorHandlingMode`): 0 does nothing; 1 aborts the communicators and tears the process down; 2 aborts the communicators and keeps the process; 3 tears the process down without aborting the communicators; 3 is torch's default when the variable is unset, and torchrun sets 1 for its workers unless it is set (local_elastic_agent.py) |
| TORCH_NCCL_BLOCKING_WAIT=1 | `work.wait()` blocks the caller until done or timed out and raises there (the timeout is the process group's `timeout=`) |
| TORCH_FR_BUFFER_SIZE=N (or TORCH_NCCL_TRACE_BUFFER_SIZE), TORCH_NCCL_DUMP_ON_TIMEOUT=1 | the flight recorder: the last N collectives per rank, dumped to TORCH_FR_DUMP_TEMP_FILE<rank> (or TORCH_NCCL_DEBUG_INFO_TEMP_FILE) when the watchdog fires; torch 2.13 recognises both spellings |
| TORCH_NCCL_DESYNC_DEBUG=1 | on a timeout, report which rank is behind (which never issued the collective) |
| NCCL_P2P_DISABLE=1, NCCL_IB_DISABLE=1 | bisection: no NVLink/PCIe peer-to-peer; no InfiniBand (sockets instead). A hang that goes away names the link |
"""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

# TORCH_NCCL_ASYNC_ERROR_HANDLING, as torch 2.13 defines it in
# torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp: the enum `ErrorHandlingMode`
# names the levels, the macros SHOULD_CLEAN_UP(a) (abort the communicators) and SHOULD_TEAR_DOWN(a)
# (end the process) say what each does, and the comment above the variable names the default
# ("the default value (3 - SkipCleanUp)"). tests/chapters/test_ch09_failures_at_scale.py reads the
# installed header and fails when torch's definition and this table part.
# level: (torch's name, aborts the communicators, tears the process down, in the course's words)
ASYNC_ERROR_HANDLING = {
    0: ("NoHandling", False, False, "does nothing"),
    1: ("TearDown", True, True, "aborts the communicators and tears the process down"),
    2: ("CleanUpOnly", True, False, "aborts the communicators and keeps the process"),
    3: ("SkipCleanUp", False, True, "tears the process down without aborting the communicators"),
}
ASYNC_ERROR_HANDLING_DEFAULT = 3        # when the variable is unset (torch 2.13)
TORCHRUN_ASYNC_ERROR_HANDLING = 1       # what torchrun's agent sets unless it is set
ASYNC_ERROR_HANDLING_SOURCE = ("torch 2.13, torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp "
                               "(ErrorHandlingMode, SHOULD_CLEAN_UP, SHOULD_TEAR_DOWN); "
                               "torch/distributed/elastic/agent/server/local_elastic_agent.py")


def error_handling(level: int) -> str:
    """One line: what TORCH_NCCL_ASYNC_ERROR_HANDLING=`level` does, in torch's name and ours."""
    if level not in ASYNC_ERROR_HANDLING:
        raise ValueError(f"TORCH_NCCL_ASYNC_ERROR_HANDLING is one of "
                         f"{sorted(ASYNC_ERROR_HANDLING)}, got {level!r}")
    name, _, _, words = ASYNC_ERROR_HANDLING[level]
    default = " (torch's default when unset)" if level == ASYNC_ERROR_HANDLING_DEFAULT else ""
    torchrun = " (what torchrun sets for its workers)" \
        if level == TORCHRUN_ASYNC_ERROR_HANDLING else ""
    return f"{level} ({name}){default}{torchrun}: {words}"


# NVIDIA, "Xid Errors" (docs.nvidia.com/deploy/xid-errors/), its catalog of Xid events: the
# driver's own description of the codes a training cluster meets most. The kernel log shows them
# as `NVRM: Xid (PCI:0000:xx:00): <code>, ...` (`dmesg -T | grep Xid`).
XID = {
    13: "graphics engine exception (often an application error such as an illegal address)",
    31: "GPU memory page fault (usually an application error: an invalid address)",
    43: "GPU stopped processing (the channel was reset; often follows an application fault)",
    45: "preemptive cleanup, due to previous errors (a consequence: read the Xid before it)",
    48: "double-bit ECC error (uncorrectable memory error; the application is killed)",
    63: "ECC page retirement or row remapping recording event (a reset applies it)",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLink error (a link between GPUs failed or is unstable)",
    79: "GPU has fallen off the bus (it no longer answers on PCIe: node to be drained)",
    92: "high single-bit ECC error rate",
    94: "contained ECC error (only the affected application is affected)",
    95: "uncontained ECC error (every application on the GPU is affected; reset needed)",
}
XID_SOURCE = "NVIDIA, Xid Errors and its Xid catalog, docs.nvidia.com/deploy/xid-errors/"


def available(nproc: int) -> bool:
    from labkit.runtime.launcher import gpu_count
    return gpu_count() >= nproc


def all_reduce_once():
    """Rank function: one all-reduce on this rank's GPU (NCCL prints its setup on the first)."""
    import torch
    import torch.distributed as dist
    import labkit
    tensor = torch.ones(1 << 20, device=labkit.device())
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    return float(tensor[0])


def skip_one(timeout_s: int = 10):
    """Rank function: on a group with a `timeout_s` timeout, the last rank skips the second
    all-reduce; the others wait in it until the watchdog acts."""
    import torch
    import torch.distributed as dist
    import labkit
    group = dist.new_group(list(range(dist.get_world_size())),
                           timeout=timedelta(seconds=timeout_s))
    tensor = torch.ones(1 << 10, device=labkit.device())
    dist.all_reduce(tensor, group=group)
    if dist.get_rank() != dist.get_world_size() - 1:
        dist.all_reduce(tensor, group=group)
    torch.cuda.synchronize()
    return "finished"


def torchrun(target: str, nproc: int = 2, args=(), env=None, timeout: float = 180.0) -> dict:
    """`labkit torchrun --nproc-per-node NPROC TARGET ARGS` with extra environment variables;
    returns {"returncode", "output"} (stdout and stderr together, the last 20000 characters)."""
    command = [sys.executable, "-m", "labkit", "torchrun", "--nproc-per-node", str(nproc),
               "--backend", "nccl", target, *map(str, args)]
    full_env = dict(os.environ, **(env or {}))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=full_env)
    except subprocess.TimeoutExpired as expired:
        text = (expired.stdout or b"").decode(errors="replace") if isinstance(
            expired.stdout, bytes) else (expired.stdout or "")
        return {"returncode": None, "output": text[-20000:] + f"\n(killed after {timeout:g} s)"}
    return {"returncode": done.returncode, "output": (done.stdout + done.stderr)[-20000:]}


def lines_with(output: str, *words: str, limit: int = 12) -> list[str]:
    """The lines of `output` that contain any of `words` (first `limit`)."""
    return [line for line in output.splitlines() if any(w in line for w in words)][:limit]
