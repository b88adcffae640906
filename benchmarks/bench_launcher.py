"""Launcher figures, measured side by side in one run (world of 4, gloo, this machine).

    .venv/bin/python benchmarks/bench_launcher.py [--world 4] [--calls 200] [--skip-ipyparallel]

Prints: the one-time warm-up; a cold world ready; a no-op call on a warm world, vs. ipyparallel's
`apply_sync` and vs. starting ranks per call with `torch.multiprocessing.spawn`; and the cost of
the teaching mode per collective.
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
    dist.destroy_process_group()


def spawn_per_call(size):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    mp.spawn(_spawned_rank, args=(size, port), nprocs=size)
    return time.perf_counter() - start


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

    spawn = statistics.median(spawn_per_call(n) for _ in range(3))
    ipp = None if options.skip_ipyparallel else ipyparallel_noop(n, options.calls)
    ipp_2 = None if options.skip_ipyparallel else ipyparallel_noop(2, options.calls)

    print(f"one-time warm-up (forkserver imports torch) + first world: {warm_up:7.3f} s")
    print(f"cold world of {n} ready (median of 5, after warm-up):     {cold:7.3f} s")
    print(f"no-op call, warm labkit world (median of {options.calls}):       "
          f"{labkit_call * 1e3:7.3f} ms")
    if ipp is not None:
        print(f"no-op call, ipyparallel apply_sync on {n} engines:          {ipp * 1e3:7.3f} ms"
              f"   -> labkit is {ipp / labkit_call:6.1f}x cheaper")
    print(f"no-op call, warm labkit world of 2:                      {labkit_call_2 * 1e3:7.3f} ms")
    if ipp_2 is not None:
        print(f"no-op call, ipyparallel apply_sync on 2 engines:          {ipp_2 * 1e3:7.3f} ms"
              f"   -> labkit is {ipp_2 / labkit_call_2:6.1f}x cheaper")
    print(f"no-op call, torch.multiprocessing.spawn per call:        {spawn * 1e3:7.1f} ms"
          f"   -> labkit is {spawn / labkit_call:6.0f}x cheaper")
    print(f"all_reduce of 1024 floats, teaching mode on:             {teaching_on * 1e3:7.3f} ms")
    print(f"all_reduce of 1024 floats, teaching mode off:            {teaching_off * 1e3:7.3f} ms"
          f"   -> teaching costs {(teaching_on - teaching_off) * 1e3:.3f} ms per collective")


if __name__ == "__main__":
    main()
