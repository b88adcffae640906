"""Launcher figures, measured side by side in one run (world of 4, gloo, this machine).

    .venv/bin/python benchmarks/bench_launcher.py [--world 4] [--calls 200] [--skip-ipyparallel]

Prints: the one-time warm-up; a cold world ready; a no-op call on a warm world, vs. ipyparallel's
`apply_sync` and vs. starting ranks per call with `torch.multiprocessing.spawn`; and the cost of
the teaching mode per collective. A baseline run that fails (e.g. gloo's "connectFullMesh
failed ... Connection closed by peer" in a spawned world on a loaded machine) is reported,
retried (3 times at most) and counted next to its figure; the other figures are kept.
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import labkit


def noop():
    return None


def all_reduce_loop(count):
    t = torch.ones(1024)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(count):
        dist.all_reduce(t)
    return (time.perf_counter() - start) / count


def _spawned_rank(rank, size, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    noop()
    # every rank has finished connecting before any leaves: a rank that destroys its group at
    # once can close its sockets while a slower peer is still in connectFullMesh with it
    dist.barrier()
    dist.destroy_process_group()


def spawn_per_call(size):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    mp.spawn(_spawned_rank, args=(size, port), nprocs=size)
    return time.perf_counter() - start


def attempts(name, function, runs, retries=3):
    """`runs` successful runs of `function` (seconds each), each retried up to `retries` times
    when it raises: a baseline that failed once (gloo's connectFullMesh refused by a peer that
    was slow to listen, on a loaded machine) is reported and retried, never the end of the
    benchmark. Returns (seconds of the runs that worked, failures as "ExcType: message")."""
    times, failures = [], []
    for _ in range(runs):
        for _ in range(1 + retries):
            try:
                times.append(function())
                break
            except Exception as error:  # noqa: BLE001 - a baseline's failure is a figure too
                failures.append(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                                if str(error) else type(error).__name__)
                print(f"{name}: a run failed ({failures[-1]}); retrying", flush=True)
    return times, failures


def failure_note(name, times, failures):
    """'' if every run worked, else how often the baseline failed."""
    if not failures:
        return ""
    return (f"   ({name}: {len(failures)} failed run(s) of {len(times) + len(failures)}, "
            f"retried; first: {failures[0]})")


def median_call_seconds(function, calls):
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ipyparallel_noop(size, calls):
    import ipyparallel as ipp
    cluster = ipp.Cluster(n=size, log_level=40)
    client = cluster.start_and_connect_sync()
    try:
        client.wait_for_engines(size, timeout=120)
        view = client[:]
        view.apply_sync(noop)
        return median_call_seconds(lambda: view.apply_sync(noop), max(10, calls // 10))
    finally:
        client.close()
        cluster.stop_cluster_sync()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--skip-ipyparallel", action="store_true")
    options = parser.parse_args()
    n = options.world
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, world of {n}, gloo")

    start = time.perf_counter()
    world = labkit.world(n)
    warm_up = time.perf_counter() - start
    world.close()
    colds = []
    for _ in range(5):
        start = time.perf_counter()
        world = labkit.world(n)
        world.run(noop)
        colds.append(time.perf_counter() - start)
        world.close()
    cold = statistics.median(colds)

    world = labkit.world(n)
    world.run(noop)
    labkit_call = median_call_seconds(lambda: world.run(noop), options.calls)
    teaching_on = statistics.median(max(world.run(all_reduce_loop, 200)) for _ in range(3))
    world = labkit.world(n, teaching=False)
    world.run(noop)
    teaching_off = statistics.median(max(world.run(all_reduce_loop, 200)) for _ in range(3))
    labkit.shutdown_all()

    small = labkit.world(2)
    small.run(noop)
    labkit_call_2 = median_call_seconds(lambda: small.run(noop), options.calls)
    labkit.shutdown_all()

    spawn_times, spawn_failures = attempts("torch.multiprocessing.spawn",
                                           lambda: spawn_per_call(n), 3)
    spawn = statistics.median(spawn_times) if spawn_times else None
    ipp = ipp_2 = None
    ipp_failures = []
    if not options.skip_ipyparallel:
        ipp_times, ipp_failures = attempts("ipyparallel", lambda: ipyparallel_noop(
            n, options.calls), 1)
        ipp_2_times, more = attempts("ipyparallel (2 engines)", lambda: ipyparallel_noop(
            2, options.calls), 1)
        ipp_failures += more
        ipp = ipp_times[0] if ipp_times else None
        ipp_2 = ipp_2_times[0] if ipp_2_times else None

    print(f"one-time warm-up (forkserver imports torch) + first world: {warm_up:7.3f} s")
    print(f"cold world of {n} ready (median of 5, after warm-up):     {cold:7.3f} s")
    print(f"no-op call, warm labkit world (median of {options.calls}):       "
          f"{labkit_call * 1e3:7.3f} ms")
    if ipp is not None:
        print(f"no-op call, ipyparallel apply_sync on {n} engines:          {ipp * 1e3:7.3f} ms"
              f"   -> labkit is {ipp / labkit_call:6.1f}x cheaper"
              + failure_note("ipyparallel", [ipp, ipp_2], ipp_failures))
    elif not options.skip_ipyparallel:
        print(f"no-op call, ipyparallel apply_sync on {n} engines:          failed "
              f"{len(ipp_failures)} time(s), no figure: {ipp_failures[0]}")
    print(f"no-op call, warm labkit world of 2:                      {labkit_call_2 * 1e3:7.3f} ms")
    if ipp_2 is not None:
        print(f"no-op call, ipyparallel apply_sync on 2 engines:          {ipp_2 * 1e3:7.3f} ms"
              f"   -> labkit is {ipp_2 / labkit_call_2:6.1f}x cheaper")
    if spawn is not None:
        print(f"no-op call, torch.multiprocessing.spawn per call:        {spawn * 1e3:7.1f} ms"
              f"   -> labkit is {spawn / labkit_call:6.0f}x cheaper"
              + failure_note("spawn", spawn_times, spawn_failures))
    else:
        print(f"no-op call, torch.multiprocessing.spawn per call:        failed "
              f"{len(spawn_failures)} time(s), no figure: {spawn_failures[0]}")
    print(f"all_reduce of 1024 floats, teaching mode on:             {teaching_on * 1e3:7.3f} ms")
    print(f"all_reduce of 1024 floats, teaching mode off:            {teaching_off * 1e3:7.3f} ms"
          f"   -> teaching costs {(teaching_on - teaching_off) * 1e3:.3f} ms per collective")


if __name__ == "__main__":
    main()
