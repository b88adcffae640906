"""Stress of the rank life cycle: how often a rank aborts (SIGABRT, exit -6, "terminate called
without an active exception") while a world or a torchrun job starts, talks and ends.

    .venv/bin/python tests/stress/stress_lifecycle.py world    --rounds 200 --copies 2
    .venv/bin/python tests/stress/stress_lifecycle.py torchrun --rounds 60  --copies 2 --burn 1
    .venv/bin/python tests/stress/stress_lifecycle.py elastic  --rounds 10  --copies 2
    .venv/bin/python tests/stress/stress_lifecycle.py exit --entry plain  --job inflight --rounds 40
    .venv/bin/python tests/stress/stress_lifecycle.py exit --entry labkit --job inflight --rounds 40

Modes (each round, in each of `--copies` processes running at once; `--burn K` adds K busy
loops on the CPUs, the load under which the abort was seen):
- `world`: labkit.world(3) created, an all_reduce, a broadcast, one DDP step, a barrier, then
  closed; the
  ranks' exit codes at close come from `world.last_exit` (also in the world-close debug log);
- `torchrun`: the exit path of chapter 9's elastic job without its training: torchrun starts 3
  ranks with labkit's entry (`labkit.runtime.torchrun`, env:// rendezvous, rank 0 hosting the
  store, as under elastic.launch), each runs `job` (collectives, an all_gather_object and a
  barrier, rank 0 a little later than the others, as when it commits a snapshot) and ends;
- `exit`: the abort's mechanism, isolated. torchrun starts 3 ranks that run `job_inflight` (an
  all_gather issued with async_op=True and never waited, pytorch issue #190489's repro) or
  `job_sync` (waited all_reduces of temporary tensors, the chapter's pattern), under `--entry
  labkit` (labkit.runtime.torchrun: leave_group, then os._exit) or `--entry plain` (the entry
  before the fix: the function, destroy_process_group, the interpreter's normal exit);
- `elastic`: chapter 9's job itself (`labkit.faults.elastic.launch(nproc=3, ...)`, with the
  planned SIGKILL and torchrun's restart), 25 s a round on 2 cores.

Counts a round as an abort when a rank's exit code is -6 or its output says "terminate called",
as a failure when anything else went wrong; prints the counts and every abort's output.
Not collected by pytest (tests/stress/conftest.py).
"""
import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "utils"))

ABORT_SIGNS = ("terminate called", "exitcode: -6", "Signal 6", "SIGABRT")


def job(rounds=20):
    """The rank program of the `torchrun` mode (runs under labkit's torchrun entry)."""
    import torch
    import torch.distributed as dist
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.ones(256)
    for _ in range(rounds):
        dist.all_reduce(t)
    entries = [None] * size
    dist.all_gather_object(entries, {"rank": rank})
    if rank == 0:
        time.sleep(0.05)          # rank 0 commits the manifest while the others wait
    dist.barrier()
    return rank


def _as_a_trainer_does():
    """What chapter 9's trainer does after init_process_group: build torch's AdamW. Its first
    construction imports torch._dynamo, and that import takes 10 references to the default process
    group that destroy_process_group does not drop (sys.getrefcount 12 against 2, none of them
    visible to gc.get_referrers; torch 2.13.0): gloo's worker threads outlive the destroy and run
    into the interpreter's finalization."""
    import torch
    torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())


def job_inflight():
    """A rank that returns while its last collective is still in gloo's hands: the work (and the
    tensors it holds) is released by gloo's worker thread, possibly after the interpreter has begun
    to finalize."""
    import torch
    import torch.distributed as dist
    _as_a_trainer_does()
    size = dist.get_world_size()
    out = [torch.empty(1024) for _ in range(size)]
    dist.all_gather(out, torch.full((1024,), float(dist.get_rank())), async_op=True)
    return dist.get_rank()


def job_sync(rounds=20):
    """Waited collectives only, on temporaries that die as soon as each call returns."""
    import torch
    import torch.distributed as dist
    _as_a_trainer_does()
    for _ in range(rounds):
        dist.all_reduce(torch.ones(4096))
    return dist.get_rank()


def plain_entry(job_name):
    """labkit's torchrun entry before issue 25's fix: init, the function, destroy_process_group,
    then the interpreter's own exit (finalization runs)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    try:
        result = globals()[job_name]()
        print(f"[rank {dist.get_rank()}] result: {result!r}", flush=True)
    finally:
        dist.destroy_process_group()


def _exit_round(size, entry, job_name):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={size}", "--monitor-interval=0.1"]
    if entry == "labkit":
        command += ["-m", "labkit.runtime.torchrun", "--entry", f"stress_lifecycle:job_{job_name}",
                    "--backend", "gloo"]
    else:
        command += [os.path.abspath(__file__), "--plain-entry", f"job_{job_name}"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    text = done.stdout + done.stderr
    aborted = any(sign in text for sign in ABORT_SIGNS)
    return aborted, done.returncode != 0 and not aborted, text


def _world_round(size):
    import labkit

    def program():
        import torch
        import torch.distributed as dist
        t = torch.ones(64) * dist.get_rank()
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
        model(torch.randn(4, 8)).sum().backward()       # the peer suite's DDP test: one step
        dist.barrier()
        return float(t[0])
    world = labkit.world(size, timeout=60, teaching=False)   # DDP needs it off (dp.checks)
    try:
        world.run(program)
    finally:
        world.close()
    codes = dict(getattr(world, "last_exit", {}) or {})
    text = "\n".join(f"rank {r}: exit {c}" for r, c in sorted(codes.items()))
    aborted = any(c == -6 for c in codes.values())
    failed = any(c not in (0, None, -6) for c in codes.values())
    return aborted, failed, text


def _torchrun_round(size):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={size}", "--monitor-interval=0.1",
               "-m", "labkit.runtime.torchrun", "--entry", "stress_lifecycle:job",
               "--backend", "gloo"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    text = done.stdout + done.stderr
    aborted = any(sign in text for sign in ABORT_SIGNS)
    return aborted, done.returncode != 0 and not aborted, text


def _elastic_round(size):
    from labkit.faults import elastic
    with tempfile.TemporaryDirectory() as folder:
        run = elastic.launch(nproc=size, steps=10, every=4, kill_at=7, folder=folder)
    text = run["output"]
    aborted = any(sign in text for sign in ABORT_SIGNS)
    return aborted, run["returncode"] != 0 and not aborted, text


ROUNDS = {"world": _world_round, "torchrun": _torchrun_round, "elastic": _elastic_round,
          "exit": _exit_round}


def _copy(mode, rounds, size, queue, extra=()):
    function = ROUNDS[mode]
    for _ in range(rounds):
        try:
            aborted, failed, text = function(size, *extra)
        except Exception as error:  # noqa: BLE001 - counted, shown
            aborted, failed, text = False, True, f"{type(error).__name__}: {error}"
        queue.put((aborted, failed, text[-3000:]))
    queue.put(None)


def _burn():
    while True:
        pass


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=sorted(ROUNDS))
    parser.add_argument("--rounds", type=int, default=100, help="rounds per copy")
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--burn", type=int, default=0)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--entry", choices=("labkit", "plain"), default="labkit",
                        help="exit mode: the rank entry")
    parser.add_argument("--job", choices=("inflight", "sync"), default="inflight",
                        help="exit mode: the rank program")
    options = parser.parse_args()
    extra = (options.entry, options.job) if options.mode == "exit" else ()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    burners = [context.Process(target=_burn, daemon=True) for _ in range(options.burn)]
    for b in burners:
        b.start()
    copies = [context.Process(target=_copy, args=(options.mode, options.rounds, options.world,
                                                  queue, extra)) for _ in range(options.copies)]
    started = time.monotonic()
    for c in copies:
        c.start()
    rounds = aborts = failures = 0
    running = len(copies)
    while running:
        item = queue.get()
        if item is None:
            running -= 1
            continue
        aborted, failed, text = item
        rounds += 1
        aborts += aborted
        failures += failed
        if aborted or (failed and failures <= 5):
            print(f"--- round {rounds}: {'ABORT' if aborted else 'FAILED'}\n{text}\n---",
                  flush=True)
        if rounds % 20 == 0:
            print(f"{rounds} rounds: {aborts} aborts, {failures} other failures "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    for c in copies:
        c.join()
    for b in burners:
        b.kill()
    label = options.mode + (f" --entry {options.entry} --job {options.job}" if extra else "")
    print(f"{label}: {rounds} rounds of a world of {options.world} "
          f"({options.copies} copies at once, {options.burn} burners): {aborts} aborts, "
          f"{failures} other failures, {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plain-entry"]:
        plain_entry(sys.argv[2])
    else:
        main()
