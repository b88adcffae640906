"""Chapter 8's measured figures, side by side in one run: how long a checkpoint stops training,
synchronously and asynchronously (ours and torch's), what the asynchronous one costs in host
memory, and what one crash trial costs as a victim process or as a real rank restart.

    .venv/bin/python benchmarks/bench_checkpoint.py                 # 2 ranks, 16 and 64 MiB per rank
    .venv/bin/python benchmarks/bench_checkpoint.py --world 4 --mib 16 256 --repeats 5 --ram

Timings depend on the machine and its load (shared 2-core machines vary 2-5x): read the ratios
of one run, never a single number. Checkpoints go to a folder on disk (the default temp folder),
or to /dev/shm with --ram (no disk: the copy and serialisation alone).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import threading
import time


def _state(mib: int) -> dict:
    import torch
    n = mib * (1 << 20) // 4 // 3
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(n, generator=generator) for name in ("w", "m", "v")}


def _step(state) -> None:
    for tensor in state.values():
        tensor.mul_(0.999).add_(1e-3)


def _rss() -> int:
    with open("/proc/self/statm") as stream:
        return int(stream.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pauses(folder: str, mib: int, repeats: int) -> dict:
    """On a rank: median step pause of a synchronous save, of an asynchronous one (copy, then a
    background write), of dcp.save and of dcp.async_save; the async save's extra host memory."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    rank = dist.get_rank()
    state = _state(mib)
    sync, copy, dcp_sync, dcp_async, writes = [], [], [], [], []
    buffers = None
    for i in range(repeats):
        _step(state)
        start = time.perf_counter()
        with open(os.path.join(folder, f"sync-{rank}-{i}.pt"), "wb") as stream:
            torch.save(state, stream)
            stream.flush()
            os.fsync(stream.fileno())
        sync.append(time.perf_counter() - start)
    before = _rss()
    for i in range(repeats):
        _step(state)
        start = time.perf_counter()
        if buffers is None:
            buffers = {k: torch.empty_like(v) for k, v in state.items()}
        for name, tensor in state.items():
            buffers[name].copy_(tensor)

        def write(i=i):
            began = time.perf_counter()
            with open(os.path.join(folder, f"async-{rank}-{i}.pt"), "wb") as stream:
                torch.save(buffers, stream)
                stream.flush()
                os.fsync(stream.fileno())
            writes.append(time.perf_counter() - began)
        thread = threading.Thread(target=write)
        thread.start()
        copy.append(time.perf_counter() - start)
        thread.join()                      # saves are far apart in training: the write is done
    grown = _rss() - before
    keyed = {f"{k}{rank}": v for k, v in state.items()}
    for i in range(repeats):
        _step(state)
        start = time.perf_counter()
        dcp.save(keyed, checkpoint_id=os.path.join(folder, f"dcp-{i}"))
        dcp_sync.append(time.perf_counter() - start)
        start = time.perf_counter()
        future = dcp.async_save(keyed, checkpoint_id=os.path.join(folder, f"dcpa-{i}"))
        dcp_async.append(time.perf_counter() - start)
        future.result()
    median = statistics.median
    return {"sync": median(sync), "async": median(copy), "write": median(writes),
            "dcp": median(dcp_sync), "dcp_async": median(dcp_async), "grown": grown,
            "bytes": sum(t.numel() * t.element_size() for t in state.values())}


def crash_costs(folder: str, trials: int) -> dict:
    """On a rank: seconds per victim trial (fork, write a 64 KiB shard, kill at a random point)."""
    from labkit.checkpoint import crash, store
    import torch.distributed as dist
    victims = crash.shared()
    rng = random.Random(dist.get_rank())
    data = os.urandom(1 << 16)
    start = time.perf_counter()
    for i in range(trials):
        victims.run(store.write_shard, folder, f"step-{i:09d}", f"rank{dist.get_rank()}.bin",
                    data, plan={"kill_before": rng.randint(1, 4)})
    return {"victim": (time.perf_counter() - start) / trials}


def _die(rank):
    import torch.distributed as dist
    if dist.get_rank() == rank:
        os.kill(os.getpid(), 9)
    dist.barrier()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mib", type=int, nargs="+", default=[16, 64],
                        help="state size per rank, MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--ram", action="store_true", help="write to /dev/shm, not to disk")
    args = parser.parse_args()
    import labkit
    world = labkit.world(args.world, teaching=False)
    folder = tempfile.mkdtemp(prefix="bench-ckpt-", dir="/dev/shm" if args.ram else None)
    try:
        print(f"{args.world} ranks, gloo, checkpoints in {folder} "
              f"({'RAM disk' if args.ram else 'disk'}), medians of {args.repeats}")
        print(f"{'state/rank':>11} {'sync save':>10} {'async pause':>12} {'ratio':>6} "
              f"{'bg write':>9} {'dcp.save':>9} {'async_save':>11} {'ratio':>6} {'extra RAM':>10}")
        for mib in args.mib:
            rows = world.run(pauses, folder, mib, args.repeats)
            row = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"{mib:>8} MiB {row['sync'] * 1e3:>8.0f} ms {row['async'] * 1e3:>9.1f} ms "
                  f"{row['sync'] / row['async']:>5.0f}x {row['write'] * 1e3:>6.0f} ms "
                  f"{row['dcp'] * 1e3:>6.0f} ms {row['dcp_async'] * 1e3:>8.0f} ms "
                  f"{row['dcp'] / row['dcp_async']:>5.0f}x {row['grown'] / row['bytes']:>9.2f}x")
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        victim = statistics.median(r["victim"] for r in world.run(crash_costs, folder,
                                                                    args.trials))
        start = time.perf_counter()
        for _ in range(3):
            try:
                world.run(_die, args.world - 1)
            except labkit.RankDied:
                pass
            world.run(os.getpid)                  # the restart
        restart = (time.perf_counter() - start) / 3
        print(f"one crash trial: {victim * 1e3:.0f} ms as a victim process (fork + write + "
              f"kill), {restart * 1e3:.0f} ms as a real rank killed and the world restarted "
              f"({restart / victim:.0f}x)")
    finally:
        labkit.shutdown_all()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
