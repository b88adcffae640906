"""Run a rank function under `torchrun` (env:// rendezvous), on one node or several.

The functions you run with `world.run(fn, ...)` in a notebook run unchanged here:

    labkit torchrun --nproc-per-node 4 mypackage.mymodule:step 10 0.5
    labkit torchrun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29400 \\
        --nproc-per-node 8 mypackage.mymodule:step

Arguments after the function are read as Python literals where they parse (10 -> int), else
kept as strings. Each rank prints its return value as `[rank k] result: ...`.
Under the hood this is `torchrun ... -m labkit.runtime.torchrun --entry module:function args...`.
"""

import argparse
import ast
import importlib
import os
import subprocess
import sys
import traceback


def add_arguments(parser):
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=0,
                        help="0 (single node only): let torchrun pick a free port")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument("target", help="module:function to run on every rank")
    parser.add_argument("args", nargs=argparse.REMAINDER)


def main(argv=None):
    from labkit.common import run_module
    return run_module(sys.modules[__name__], argv, prog="labkit torchrun",
                      description=__doc__)


def run(options):
    """`labkit torchrun ...`: start torchrun with labkit's entry on every rank."""
    if ":" not in options.target:
        raise SystemExit(f"labkit torchrun: expected module:function, got {options.target!r}")
    if options.nnodes > 1 and options.master_port == 0:
        raise SystemExit("labkit torchrun: several nodes need an agreed --master-port")
    command = [sys.executable, "-m", "torch.distributed.run",
               f"--nproc-per-node={options.nproc_per_node}", f"--nnodes={options.nnodes}"]
    if options.nnodes == 1 and options.master_port == 0:
        command.append("--standalone")   # torchrun picks a free port itself
    else:
        command += [f"--node-rank={options.node_rank}", f"--master-addr={options.master_addr}",
                    f"--master-port={options.master_port}"]
    command += ["-m", "labkit.runtime.torchrun", "--entry", options.target,
                "--backend", options.backend, *options.args]
    return subprocess.call(command)


def job_command(target: str, args, nproc: int = 2, max_restarts: int = 0,
                backend: str = "gloo") -> list[str]:
    """The torchrun command line that `job` runs."""
    if ":" not in target:
        raise ValueError(f"target must be module:function, got {target!r}")
    if nproc < 1 or max_restarts < 0:
        raise ValueError(f"nproc >= 1 and max_restarts >= 0, got {nproc} and {max_restarts}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1", "-m", "labkit.runtime.torchrun",
            "--entry", target, "--backend", backend, *map(str, args)]


def job(target: str, args, nproc: int = 2, max_restarts: int = 0, timeout: float = 300.0,
        backend: str = "gloo") -> dict:
    """Run `target` (module:function) on `nproc` ranks of one node under torchrun, restarting all
    of them up to `max_restarts` times when one dies, as a training job is run; wait at most
    `timeout` s. Returns {"returncode", "seconds", "output" (its last 4000 characters)}.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: by default the workers' process group reuses the
    key-value store of torchrun's rendezvous, which outlives a restart, and the restarted workers
    can read the dead workers' addresses from it. Measured with torch 2.13.0 (CPU, gloo,
    --standalone): without the variable, 3 restarts out of 3 failed to form the process group (one
    hung until killed); with it, 3 out of 3 worked (pytorch issue #135712 is about the sharing).
    --monitor-interval 0.1: the agent looks at its workers ten times a second (the default is 5 s),
    so a restart starts within a tenth of a second of a death."""
    import signal
    import time
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    started = time.monotonic()
    process = subprocess.Popen(job_command(target, args, nproc, max_restarts, backend), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)        # the agent and every worker it started
        output, _ = process.communicate()
        output += f"\nlabkit: the job ran past {timeout:g} s and was killed"
    return {"returncode": process.returncode, "seconds": time.monotonic() - started,
            "output": output[-4000:]}


def _literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def entry(argv):
    """What each rank runs: init from env://, install labkit's hooks, call the function."""
    import torch
    import torch.distributed as dist
    from labkit.runtime import hooks as _hooks, worker as _worker
    parser = argparse.ArgumentParser(prog="labkit.runtime.torchrun --entry")
    parser.add_argument("--entry", required=True)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = options.backend
    if backend == "auto":
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        backend = "nccl" if torch.cuda.is_available() and \
            torch.cuda.device_count() >= local_size else "gloo"
    kwargs = {}
    if backend == "nccl":
        _worker.STATE.device = torch.device("cuda", local_rank)
        torch.cuda.set_device(_worker.STATE.device)
        kwargs["device_id"] = _worker.STATE.device
    dist.init_process_group(backend, init_method="env://", **kwargs)
    _worker.STATE.rank, _worker.STATE.world_size = dist.get_rank(), dist.get_world_size()
    _worker.STATE.backend = backend
    _hooks.install(count_wire=backend == "gloo")
    module_name, function_name = options.entry.split(":", 1)
    function = getattr(importlib.import_module(module_name), function_name)
    rank = dist.get_rank()
    try:
        result = function(*[_literal(a) for a in options.args])
    except BaseException:
        # the peers fail on their own; torchrun sees the traceback and exit code 1. No
        # interpreter finalization: it could abort with gloo's threads alive (worker.leave_group)
        traceback.print_exc()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        _worker.exit_now(1)
    print(f"[rank {rank}] result: {result!r}", flush=True)
    # the end in a defined order: a barrier, destroy_process_group, the store's host last (rank 0
    # hosts the TCPStore when TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as chapter 9's job sets; else
    # torchrun's agent does), then os._exit after flushing, never the interpreter's finalization,
    # which aborted rank 0 here under load (issue 25; the mechanism is in worker.leave_group)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    _worker.leave_group(rank=rank, world_size=dist.get_world_size(), host_rank=0,
                        key=f"labkit/left/{run_id}/{restart}")
    _worker.exit_now(0)


if __name__ == "__main__":
    if "--entry" in sys.argv[1:]:
        entry(sys.argv[1:])
    else:
        sys.exit(main())
