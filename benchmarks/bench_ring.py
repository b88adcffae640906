"""Lab 1's reference ring all-reduce against gloo's own all_reduce, side by side in one run.

    .venv/bin/python benchmarks/bench_ring.py                 # 4 ranks, 16M floats
    .venv/bin/python benchmarks/bench_ring.py --ranks 2 --floats 1000000 --rounds 5

The ring is the lab's solution, read from solutions/lab01_collectives/lab01_collectives.ipynb (the
instructor side; it is not copied anywhere else). Worlds run with teaching mode off. Each round
times gloo then the ring (median of --repeats calls each, a call's time being that of its slowest
rank); the figure reported is the median over rounds, so both see the same machine load.
busbw = 4 N / t * 2(P-1)/P (nccl-tests' definition). Target: ring busbw >= 0.85x gloo's.
"""
import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab01_collectives" / "lab01_collectives.ipynb"


def load_reference_ring():
    """Execute the lab's ring_all_reduce answer cell and return the function."""
    import nbformat
    notebook = nbformat.read(str(SOLUTION), as_version=4)
    cell = next(c for c in notebook.cells
                if c.metadata.get("nbgrader", {}).get("grade_id") == "task1_ring_all_reduce")
    import torch
    import torch.distributed as dist
    namespace = {"torch": torch, "dist": dist, "__name__": "__main__"}
    exec(compile(cell.source, f"{SOLUTION.name}:task1_ring_all_reduce", "exec"), namespace)
    return namespace["ring_all_reduce"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--floats", type=int, default=16_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import labkit
    from labkit import collectives
    ring = load_reference_ring()
    world = labkit.world(args.ranks, backend="gloo", teaching=False)
    P, n_bytes = world.size, 4 * args.floats
    times = {"gloo all_reduce": [], "reference ring": []}
    for round_ in range(args.rounds):
        for name, op in (("gloo all_reduce", "all_reduce"), ("reference ring", ring)):
            times[name].append(collectives.time_op(world, op, args.floats, repeats=args.repeats,
                                                   timeout=600))
        print(f"round {round_ + 1}: gloo {times['gloo all_reduce'][-1] * 1e3:.1f} ms, "
              f"ring {times['reference ring'][-1] * 1e3:.1f} ms", flush=True)
    labkit.shutdown_all()
    print(f"\nall-reduce of {args.floats:,} floats ({n_bytes / 1e6:.0f} MB) on {P} ranks, gloo, "
          f"median of {args.rounds} rounds x {args.repeats} calls")
    busbw = {}
    for name, series in times.items():
        t = statistics.median(series)
        busbw[name] = collectives.busbw("all_reduce", n_bytes, t, P)
        print(f"  {name:<16} {t * 1e3:8.1f} ms   algbw {collectives.algbw(n_bytes, t) / 1e9:6.3f} GB/s"
              f"   busbw {busbw[name] / 1e9:6.3f} GB/s")
    ratio = busbw["reference ring"] / busbw["gloo all_reduce"]
    per_round = [g / r for g, r in zip(times["gloo all_reduce"], times["reference ring"])]
    print(f"  ratio ring / gloo busbw: {ratio:.2f} (per round: "
          f"{', '.join(f'{x:.2f}' for x in per_round)}); target >= 0.85: "
          f"{'met' if ratio >= 0.85 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
