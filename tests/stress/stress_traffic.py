"""Stress of the socket counters behind `world.traffic()`: how often a measured call's bytes
differ from what the call sends by more than gloo's framing.

    .venv/bin/python tests/stress/stress_traffic.py                  # 8 ranks, 300 calls
    .venv/bin/python tests/stress/stress_traffic.py --ranks 8 --calls 300 --fresh 10

Each call (chapter 6's pattern, 8 ranks on 2 cores) is an all_reduce of N float32 followed by a
send/recv ring of N float32 (rank r -> r+1). The bytes rank r sent rank q are compared with the
exact payload: the ring's N*4 bytes to the next rank, and gloo's ring all-reduce's share; a call
"misses" when an entry is off by more than FRAMING bytes per message, or when `outside` is not
0. `--fresh K` also measures the first p2p call of K fresh worlds (a store's first call).
Not collected by pytest (tests/stress/conftest.py); prints counts.
"""
import argparse
import collections
import os
import sys
import time

sys.path.append(os.path.join(os.path.dirname(__file__), "..", "..", "utils"))  # after PYTHONPATH

import labkit  # noqa: E402

FRAMING = 1024      # bytes per pair per call that gloo's headers may add (seen: ~100-300)


def program(n):
    import torch
    import torch.distributed as dist
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.ones(n)
    dist.all_reduce(x)
    out = torch.empty(n)
    send = dist.isend(torch.full((n,), float(rank)), (rank + 1) % size)
    dist.recv(out, (rank - 1) % size)
    send.wait()
    return float(x[0]) + float(out[0])


def ring_only(n):
    import torch
    import torch.distributed as dist
    rank, size = dist.get_rank(), dist.get_world_size()
    out = torch.empty(n)
    send = dist.isend(torch.full((n,), float(rank)), (rank + 1) % size)
    dist.recv(out, (rank - 1) % size)
    send.wait()
    return float(out[0])


GROUPS = []


def make_groups(k):
    """k more process groups of every rank, each one more full mesh of connections (chapter 6's
    meshes hold hundreds of sockets), each used once so that its connections exist."""
    import torch
    import torch.distributed as dist
    for _ in range(k):
        group = dist.new_group(list(range(dist.get_world_size())))
        dist.all_reduce(torch.ones(1), group=group)
        GROUPS.append(group)


CLOSING = 65536


def closing_listener():
    """Rank 1: a listener that reads every connection to its end and keeps it open; its port."""
    import socket
    import threading
    import torch.distributed as dist
    if dist.get_rank() != 1:
        return None
    server = socket.create_server(("127.0.0.1", 0))
    kept = []

    def serve():
        while True:
            conn, _ = server.accept()
            kept.append(conn)
            while conn.recv(1 << 16):
                pass
    threading.Thread(target=serve, daemon=True).start()
    GROUPS.append(server)
    return server.getsockname()[1]


def program_closing(n, port):
    """program, and rank 0 sends CLOSING bytes to rank 1 on a connection opened and closed
    inside the call (what a process group made and destroyed inside a call does)."""
    import socket
    import time
    import torch
    import torch.distributed as dist
    result = program(n)
    if dist.get_rank() == 0:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"x" * CLOSING)
    dist.barrier()
    time.sleep(0.01)                           # rank 1's reader drains its socket
    dist.all_reduce(torch.ones(1))
    return result


def ring_bytes(size, nbytes):
    """The send/recv ring: rank r sends nbytes to r+1."""
    m = [[0] * size for _ in range(size)]
    for r in range(size):
        m[r][(r + 1) % size] += nbytes
    return m


def judge(traffic, expected, reference):
    """Problems of one call: entries off by more than FRAMING from `reference` (the matrix most
    calls measured) and any byte outside; `expected` is the payload without framing."""
    problems = []
    size = len(expected)
    for r in range(size):
        for q in range(size):
            got = traffic.matrix[r][q]
            if got < expected[r][q]:
                problems.append(f"{r}->{q}: {got} < payload {expected[r][q]}")
            elif abs(got - reference[r][q]) > FRAMING:
                problems.append(f"{r}->{q}: {got}, usually {reference[r][q]}")
    if any(traffic.outside):
        problems.append(f"outside {traffic.outside}")
    if traffic.unaccounted:
        problems.append(f"unaccounted {traffic.unaccounted}")
    return problems


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--floats", type=int, default=16384)
    parser.add_argument("--fresh", type=int, default=0)
    parser.add_argument("--closing", action="store_true",
                        help="rank 0 also sends 64 KB on a connection it closes inside the call")
    parser.add_argument("--groups", type=int, default=0,
                        help="extra process groups of all ranks made first (more sockets)")
    args = parser.parse_args()
    P, n = args.ranks, args.floats
    world = labkit.world(P, backend="gloo", timeout=60)
    world.run(make_groups, args.groups)
    port = world.run(closing_listener)[1] if args.closing else None
    call = (program_closing, n, port) if args.closing else (program, n)
    world.run(*call)                                # connections made before any count
    measured, started = [], time.monotonic()
    for _ in range(args.calls):
        with world.traffic() as traffic:
            world.run(*call)
        if args.closing:           # the closed connection's bytes: rank 0's, or unaccounted
            traffic.matrix[0][1] += traffic.unaccounted or 0
            traffic.unaccounted = 0
        measured.append(traffic)
    common = collections.Counter(
        tuple(tuple(min(c // 512 * 512, c) for c in row) for row in t.matrix) for t in measured)
    reference = [list(row) for row in common.most_common(1)[0][0]]
    ring = ring_bytes(P, n * 4)
    if args.closing:
        ring[0][1] += CLOSING
    # the all-reduce's share (ring reduce-scatter + all-gather: 2 (P-1)/P n to the next rank);
    # gloo picks its own algorithm, so the payload floor is the ring only, the reference the mode
    misses = []
    for i, t in enumerate(measured):
        problems = judge(t, ring, reference)
        if problems:
            misses.append((i, problems))
    per_rank = sum(sum(row) for row in reference) / P
    print(f"{P} ranks, {args.calls} calls of all_reduce + send/recv ring of {n * 4} B: "
          f"{per_rank:.0f} B per rank usually (all_reduce 2(P-1)/P n = "
          f"{2 * (P - 1) / P * n * 4:.0f} + ring {n * 4}); {time.monotonic() - started:.0f} s")
    print(f"misses: {len(misses)} of {args.calls}")
    for i, problems in misses[:10]:
        print(f"  call {i}: " + "; ".join(problems[:4]))
    fresh_misses = []
    for k in range(args.fresh):
        labkit.shutdown_all()
        world = labkit.world(P, backend="gloo", timeout=60)
        world.run(lambda: None)
        with world.traffic() as traffic:
            world.run(ring_only, n)
        problems = [f"{r}->{q}: {traffic.matrix[r][q]}" for r in range(P) for q in range(P)
                    if abs(traffic.matrix[r][q] - ring[r][q]) > FRAMING]
        if any(traffic.outside):
            problems.append(f"outside {traffic.outside}")
        if problems:
            fresh_misses.append((k, problems))
    if args.fresh:
        print(f"first p2p call of a fresh world: misses {len(fresh_misses)} of {args.fresh}")
        for k, problems in fresh_misses[:5]:
            print(f"  world {k}: " + "; ".join(problems[:4]))
    labkit.shutdown_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
