"""Functions the launcher tests run on ranks (a module, so tracebacks have real lines)."""
import ctypes
import os
import time

import torch
import torch.distributed as dist


def rank_and_size():
    return dist.get_rank(), dist.get_world_size()


def summed(x):
    t = torch.tensor([float(x + dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def chatty(lines):
    for i in range(lines):
        print(f"line {i}")
    os.write(1, b"from the file descriptor\n")
    ctypes.CDLL(None).printf(b"from C printf\n")
    print("to stderr", file=__import__("sys").stderr)
    return dist.get_rank()


def floods(lines, width, unbroken):
    """`lines` lines of `width` characters, then `unbroken` characters with no newline."""
    import sys
    for i in range(lines):
        print(f"{i:08d}" + "x" * (width - 8))
    sys.stdout.write("y" * unbroken)
    sys.stdout.flush()
    return lines


def raises_on(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"rank {bad_rank} fails on purpose")
    t = torch.ones(3)
    dist.all_reduce(t)
    return t


def sizes_differ():
    t = torch.ones(4 if dist.get_rank() == 0 else 5)
    dist.all_reduce(t)


def dtypes_differ(same_bytes):
    other = torch.int32 if same_bytes else torch.float64
    t = torch.ones(4, dtype=torch.float32 if dist.get_rank() == 0 else other)
    dist.all_reduce(t)


def order_swapped():
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
        dist.broadcast(t, 0)
    else:
        dist.broadcast(t, 0)
        dist.all_reduce(t)


def skips_collective(lazy_rank):
    t = torch.ones(4)
    dist.broadcast(t, 0)
    if dist.get_rank() != lazy_rank:
        dist.all_reduce(t)
    else:
        time.sleep(120)


def never_returns():
    while True:
        time.sleep(0.01)


def exits_hard(bad_rank, how):
    if dist.get_rank() == bad_rank:
        if how == "exit":
            os._exit(9)
        os.kill(os.getpid(), 9)
    t = torch.ones(2)
    dist.all_reduce(t)


def returns_unpicklable():
    return (i for i in range(3))


def traffic(n):
    x = torch.ones(n)
    dist.all_reduce(x)
    out = torch.empty(n * dist.get_world_size())
    dist.all_gather_into_tensor(out, x)
    if dist.get_rank() == 0:
        dist.send(x, 1)
    elif dist.get_rank() == 1:
        dist.recv(x, 0)
    return x.sum().item()


def collectives(k):
    t = torch.ones(2)
    for _ in range(k):
        dist.all_reduce(t)
    return t[0].item()


def pids():
    return os.getpid()


def ring_exchange(n):
    """Every rank isends to the next and irecvs from the previous, both in flight together."""
    rank, size = dist.get_rank(), dist.get_world_size()
    out, into = torch.ones(n), torch.empty(n)
    sending = dist.isend(out, (rank + 1) % size)
    receiving = dist.irecv(into, (rank - 1) % size)
    sending.wait()
    receiving.wait()
    return into.sum().item()


def c10d_direct():
    from torch.distributed import distributed_c10d
    t = torch.ones(2)
    distributed_c10d.all_reduce(t)
    dist.all_gather_object([None] * dist.get_world_size(), dist.get_rank())
    return t[0].item()


def rank0_waits_alone():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def own_share_only(share, scale):
    """run_each: a rank sees its own share; it must communicate to learn the others'."""
    total = share.clone() * scale
    dist.all_reduce(total)
    return {"mine": share, "total": total}


def ring_send(share):
    rank, size = dist.get_rank(), dist.get_world_size()
    into = torch.empty_like(share)
    sending = dist.isend(share, (rank + 1) % size)
    dist.irecv(into, (rank - 1) % size).wait()
    sending.wait()
    return into


def overlapped(share, asynchronous):
    """A collective started before the mark (asynchronous) or only after it."""
    import labkit
    work = dist.all_reduce(share, async_op=True) if asynchronous else None
    labkit.mark("middle")
    if work is None:
        dist.all_reduce(share)
    else:
        work.wait()
    return share


def p2p_between_some_then_collective():
    """Rank 0 sends to rank 1, rank 2 takes no part, then everybody all-reduces: correct."""
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.send(t, 1)
    elif dist.get_rank() == 1:
        dist.recv(t, 0)
    dist.all_reduce(t)
    group = dist.new_group([0, 1, 2])
    if dist.get_rank() == 2:
        dist.send(t, group_dst=0, group=group)
    elif dist.get_rank() == 0:
        dist.recv(t, group_src=2, group=group)
    dist.all_reduce(t, group=group)
    return t.sum().item()


def world_inside_a_rank():
    import labkit
    labkit.world(2)


def destroys_group():
    dist.destroy_process_group()
    return "gone"
