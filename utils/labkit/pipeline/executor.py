"""A reference executor: one model piece per rank (v = 1) runs its list of actions, with
point-to-point messages to its neighbours (chapter 5, section 3; chapter 6 runs it on the pipeline
axis of a 3D mesh through `group`).

    result = run_actions(actions, piece, activation_shape, tokens=..., targets=...)
    piece.gradients()        # the weight gradients, accumulated over the step's microbatches

Rank k of the pipeline group holds virtual stage k. For microbatch i:
    F(i)  receive the activation [b, T, H] from stage k-1 (stage 0 embeds tokens[i]), run the
          piece, send the output to stage k+1; the last stage computes S_i (summed token loss).
    B(i)  receive the output gradient from stage k+1 (the last stage starts from S_i / N, N the
          valid tokens of the whole step), backward through the piece, send the input gradient
          to stage k-1. The weight gradients accumulate in p.grad.
    I(i), W(i)  the two halves of B(i): input gradient first (sent at once), weight gradient later.
A receive blocks (`dist.recv`); a send does not (`dist.isend`, waited at the end of the step):
the "buffered sends" of labkit.pipeline.analysis. With sends="blocking" every send is `dist.send`,
which under gloo returns only once the receiver has posted its receive: for showing deadlocks.

Not here: more than one chunk per rank (interleaving; lab 5, task 3).
"""
from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist

from labkit.pipeline.bench import loss_sum, token_count
from labkit.pipeline.schedules import normalise


class ActivationMeter:
    """Bytes autograd holds for backward, counted as they are saved and freed.

    Used as the pack/unpack pair of `torch.autograd.graph.saved_tensors_hooks` around a
    forward. Each storage is counted once however many ops save it; the pipeline piece's own
    parameters (saved by every matrix multiply) are not activations and are left out.
    """

    def __init__(self, parameters=()):
        self.parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self.live = {}                   # storage pointer -> [bytes, saved copies alive]
        self.current = self.peak = 0

    def pack(self, tensor):
        key = tensor.untyped_storage().data_ptr()
        if key in self.parameters or not key:
            return tensor
        entry = self.live.setdefault(key, [tensor.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        return _Held(tensor, self, key)

    def unpack(self, held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key):
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    """A saved tensor; when autograd lets go of it, the meter is told."""

    def __init__(self, tensor, meter, key):
        self.tensor = tensor
        weakref.finalize(self, meter._release, key)


def _tag(kind: str, microbatch: int) -> int:
    """Message tag: gloo matches by tag, so a message cannot land in another's buffer."""
    return 2 * microbatch + (kind != "activation")


CLOCK_TAG = 1 << 20          # added to a message's tag for the clock value that follows it


def run_actions(actions, piece, activation_shape, tokens=None, targets=None, *, group=None,
                dtype=torch.float64, costs=None, sends="buffered", clock=False,
                clock_costs=None, measure_memory=False):
    """Run this rank's `actions` (F, B, I, W of microbatches, one chunk) on `piece`.

    actions: this rank's list from a schedule. piece: its nn.Module (stage k of the group's p).
    activation_shape: [b, T, H] of the activation every stage boundary carries. tokens: [m, b, T]
    on stage 0; targets: [m, b, T] on the last stage (None elsewhere). group: the pipeline's
    process group (default: the whole world). costs: {"F": s, "B": s, "I": s, "W": s} seconds;
    each action then takes at least that long (a sleep pads it before its sends), so that timing
    runs on a shared CPU show the schedule rather than the contention for cores.
    sends: "buffered" (isend) or "blocking" (send). clock: every message is followed by a one-number
    message, its sender's *virtual clock*: each rank starts an action at max(its own clock, the
    clocks its inputs arrived with) and advances by the action's cost on that clock: clock_costs
    {"F": 1, "B": 2, "I": 1, "W": 1} by default (unit costs). A timeline on that clock is what the
    schedule costs, free of the noise of a shared machine.

    Returns {"events": [(kind, microbatch, start, end, virtual start, virtual end)], "loss": L on
    the last stage, "peak_bytes", "bytes_after_first_forward"} (memory figures when
    measure_memory; virtual times None without clock). The weight gradients accumulate into the
    piece's p.grad, as any backward does: zero them between steps. Frozen parameters
    (requires_grad False) get none.
    """
    from labkit.pipeline.schedules import unit_cost
    actions = normalise([actions])[0]
    if any(a.chunk for a in actions):
        raise ValueError("run_actions runs one chunk per rank (v = 1); interleaved schedules "
                         "are lab 5, task 3")
    if sends not in ("buffered", "blocking"):
        raise ValueError(f"sends must be 'buffered' or 'blocking', got {sends!r}")
    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    k, p = ranks.index(dist.get_rank()), len(ranks)
    first, last = k == 0, k == p - 1
    previous = ranks[k - 1] if not first else None
    following = ranks[k + 1] if not last else None
    device = next(piece.parameters()).device
    use_tags = dist.get_backend(group) == "gloo"
    if first and tokens is None or last and targets is None:
        raise ValueError(f"stage {k} of {p}: stage 0 needs tokens and the last stage targets")
    total_tokens = token_count(targets) if last else None
    meter = ActivationMeter(piece.parameters()) if measure_memory else None
    held, pending, events = {}, [], []    # held[i] = [input, output or loss, output gradient]
    arrived = {}                          # (what, i) -> the clock the message came with
    loss_total, first_forward_bytes, now = 0.0, None, 0.0

    def send(tensor, to, what, i):
        tag = _tag(what, i) if use_tags else 0
        messages = [tensor.contiguous()]
        if clock:
            messages.append(torch.tensor([now], dtype=torch.float64, device=device))
        for n, message in enumerate(messages):
            if sends == "blocking":
                dist.send(message, to, group=group, tag=tag + n * CLOCK_TAG * use_tags)
            else:
                pending.append(dist.isend(message, to, group=group,
                                          tag=tag + n * CLOCK_TAG * use_tags))

    def receive(frm, what, i):
        tag = _tag(what, i) if use_tags else 0
        buffer = torch.empty(activation_shape, dtype=dtype, device=device)     # [b, T, H]
        dist.recv(buffer, frm, group=group, tag=tag)
        if clock:
            stamp = torch.empty(1, dtype=torch.float64, device=device)
            dist.recv(stamp, frm, group=group, tag=tag + CLOCK_TAG * use_tags)
            arrived[(what, i)] = stamp.item()
        return buffer

    for a in actions:
        i = a.microbatch
        if a.kind == "F" and not first:
            incoming = receive(previous, "activation", i)
        if a.kind in "BI" and not last and held[i][2] is None:
            held[i][2] = receive(following, "gradient", i)
        what = {"F": "activation", "B": "gradient", "I": "gradient"}.get(a.kind)
        stamp = arrived.pop((what, i), None)       # the clock its remote input came with
        virtual_start = now if stamp is None else max(now, stamp)
        start = time.time()
        outgoing = None
        if a.kind == "F":
            x = tokens[i].to(device).clone() if first else incoming.requires_grad_()
            with meter.hooks() if meter else _nothing():           # x: [b, T] | [b, T, H]
                out = piece(x)                                     # out: [b, T, H | V]
                if last:
                    total, _ = loss_sum(out, targets[i].to(device).clone())
                    out = total / total_tokens                     # S_i / N
                    loss_total += out.item()
            held[i] = [x, out, None]
            if meter and first_forward_bytes is None:
                first_forward_bytes = meter.current
            if not last:
                outgoing = (out.detach(), following, "activation")
        elif a.kind in "BI":
            x, out, grad = held[i]
            if a.kind == "B":
                torch.autograd.backward(out, grad)
                held.pop(i)
                input_grad = None if first else x.grad
            else:                                   # I: the input gradient only, graph kept
                input_grad = None if first else torch.autograd.grad(
                    out, x, grad, retain_graph=True)[0]
            if not first:
                outgoing = (input_grad, previous, "gradient")
        elif a.kind == "W":
            x, out, grad = held.pop(i)
            params = [q for q in piece.parameters() if q.requires_grad]
            for q, g in zip(params, torch.autograd.grad(out, params, grad, allow_unused=True)):
                if g is not None:
                    q.grad = g if q.grad is None else q.grad + g
            del x, out
        if costs and costs.get(a.kind):
            time.sleep(max(0.0, start + costs[a.kind] - time.time()))
        now = virtual_start + float((clock_costs or {}).get(a.kind, unit_cost(a.kind)))
        if outgoing is not None:
            send(outgoing[0], outgoing[1], outgoing[2], i)
        events.append((a.kind, i, start, time.time(), virtual_start if clock else None,
                       now if clock else None))
    for work in pending:
        work.wait()
    return {"events": events, "loss": loss_total if last else None,
            "peak_bytes": meter.peak if meter else None,
            "bytes_after_first_forward": first_forward_bytes}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def pipeline_step(schedule, case: dict, costs=None, sends="buffered", clock=False,
                  clock_costs=None, measure_memory=False):
    """On every rank of the world: one step of `schedule` on the bench model of `case`.

    case: {"model_seed", "data_seed", "m"} and optionally "b", "T", "layers", "hidden", "dtype"
    ("float64" by default) and "weights" (relative stage sizes). Each rank builds the same model,
    keeps its piece (stage = rank), and runs its actions; stage 0 sees the tokens, the last stage
    the targets. costs: one dict for every stage, or a list of dicts, one per stage (unbalanced
    stages); clock_costs likewise. Returns run_actions' result plus "grads".
    """
    from labkit.pipeline import bench
    rank, p = dist.get_rank(), dist.get_world_size()
    schedule = normalise(schedule)
    if len(schedule) != p:
        raise ValueError(f"the schedule has {len(schedule)} stages, the world {p} ranks")
    from labkit import device
    dtype = getattr(torch, case.get("dtype", "float64"))
    model = bench.make_model(case["model_seed"], case.get("layers", bench.LAYERS),
                             case.get("hidden", bench.HIDDEN), dtype=dtype)
    piece = bench.cut(model, p, case.get("weights"))[rank].to(device())
    tokens, targets = bench.microbatches(case["data_seed"], case["m"], case.get("b", 2),
                                         case.get("T", 6))
    mine = costs[rank] if isinstance(costs, (list, tuple)) else costs
    my_clock = clock_costs[rank] if isinstance(clock_costs, (list, tuple)) else clock_costs
    result = run_actions(schedule[rank], piece,
                         bench.activation_shape(tokens, case.get("hidden", bench.HIDDEN)),
                         tokens if rank == 0 else None, targets if rank == p - 1 else None,
                         dtype=dtype, costs=mine, sends=sends, clock=clock, clock_costs=my_clock,
                         measure_memory=measure_memory)
    result["grads"] = piece.gradients()
    return result


def pipeline_steps(runs: list, keep_grads: bool = False) -> list:
    """On every rank: pipeline_step for each (schedule, case, options) of `runs`, one after the
    other, with a barrier between steps so that each one's timeline starts from idle ranks.
    One call for a whole sweep saves a round trip to the kernel per step. Returns one result per
    run (without "grads" unless keep_grads)."""
    out = []
    for schedule, case, options in runs:
        dist.barrier()
        result = pipeline_step(schedule, case, **options)
        if not keep_grads:
            result.pop("grads")
        out.append(result)
    return out
