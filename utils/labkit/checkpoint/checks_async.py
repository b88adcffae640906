"""Lab 8, tasks 3 and 4's checkers: an asynchronous checkpointer, and its interval.

Task 3:  AsyncCheckpointer(write) with save(step, state) and wait(), double-buffered: two sets of
host buffers, one writer thread; `write(step, tensors)` is the storage, called from that thread. The checker's storage can hold a write
(a gate), fail one, and records every call; the state's tensors are `Watched`: a read from another
thread than the one that called save() is recorded, and, once save() has returned, held until
the checker has run the next training step. So "copies after the next step mutated the tensors"
is caught every time, not by luck, and no verdict depends on a timing.

Task 4:  simulate_async(work, tau, stall, write, restart, failures) -> wall time, and
async_interval(stall, write, mtbf) -> tau*. Checked against the checker's closed form for
runs with at most one failure (a reference that stays with the grader:
`labkit.grading.references.checkpoint`; the student copy has the visible cases' values), against
Daly's formula (write = 0) over random failure traces,
and against the first-order waste (course, section 7): tau* = max(write, sqrt(2 stall M)).
"""
from __future__ import annotations

import math
import threading

import torch

from labkit import checks as base
from labkit import released
from labkit.checkpoint import interval
from labkit.checkpoint.checks import call

WATCH_DTYPES = ("float32", "bfloat16", "int64")


class Watched(torch.Tensor):
    """A tensor whose reads from other threads are seen (and, after save() returned, held)."""
    lock = threading.Lock()
    owner = None                 # the thread that trains (and calls save)
    returned = False             # save() has returned
    released = threading.Event() # the next step has run: held reads may go on
    in_flight = 0
    late_reads = 0               # reads by another thread that began after save() returned
    reads_at_return = 0          # reads by another thread still running when save() returned

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        other = threading.get_ident() != cls.owner
        if other:
            with cls.lock:
                late = cls.returned
                cls.late_reads += late
                cls.in_flight += 1
            if late:
                cls.released.wait(30)
        try:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
        finally:
            if other:
                with cls.lock:
                    cls.in_flight -= 1
        return _unwatch(out)

    @classmethod
    def reset(cls, owner):
        cls.owner, cls.returned, cls.in_flight, cls.late_reads, cls.reads_at_return = \
            owner, False, 0, 0, 0
        cls.released = threading.Event()

    @classmethod
    def save_returned(cls):
        with cls.lock:
            cls.returned = True
            cls.reads_at_return += cls.in_flight


def _unwatch(out):
    if isinstance(out, Watched):
        return out.as_subclass(torch.Tensor)
    if isinstance(out, (list, tuple)):
        return type(out)(_unwatch(o) for o in out)
    return out


class _Storage:
    """The `write` handed to the checkpointer: records calls, holds steps, fails steps."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active = self.most_active = 0
        self.calls, self.order, self.gates, self.fail, self.entered = [], [], {}, set(), {}

    def entered_event(self, step):
        return self.entered.setdefault(step, threading.Event())

    def write(self, step, tensors):
        with self.lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            self.order.append(["start", step])
        self.entered_event(step).set()
        if step in self.gates:
            self.gates[step].wait(30)
        try:
            record = {"step": step, "thread": threading.get_ident(),
                      "values": {k: v.clone() for k, v in tensors.items()},
                      "ptrs": {k: v.data_ptr() for k, v in tensors.items()}}
        finally:
            with self.lock:
                self.active -= 1
                self.order.append(["end", step])
        self.calls.append(record)
        if step in self.fail:
            raise OSError(f"disk full while writing step {step} (a failure the test made)")


def _next_step(state):
    for tensor in state.values():
        with torch._C.DisableTorchFunctionSubclass():
            tensor.add_(1)                              # the optimizer's in-place update


def _async_program(share, Checkpointer):
    """Scenarios 1-3 of task 3 on this rank; plain observations back."""
    owner = threading.get_ident()
    Watched.reset(owner)
    state = {k: v.clone().as_subclass(Watched) for k, v in share.items()}
    sources = {k: v.data_ptr() for k, v in state.items()}
    storage = _Storage()
    out = {"sources": sources}
    ck = Checkpointer(storage.write)
    # 1. save returns while its write is held; the copy is of step 1's values
    storage.gates[1] = threading.Event()
    watchdog = threading.Timer(5, storage.gates[1].set)       # only a save that waits needs it
    watchdog.start()
    ck.save(1, state)
    Watched.save_returned()
    out["returned_while_held"] = not storage.gates[1].is_set()
    watchdog.cancel()
    out["reads_at_return"] = Watched.reads_at_return
    _next_step(state)
    Watched.released.set()
    storage.gates[1].set()
    ck.wait()
    out["late_reads_1"] = Watched.late_reads
    if not out["returned_while_held"]:            # it waits for its own writes: nothing more
        return dict(out, calls=[{"step": c["step"], "values": c["values"], "ptrs": c["ptrs"],
                                 "from_owner": c["thread"] == owner} for c in storage.calls])
    # 2. double buffering: while write 2 is held, save(3) copies into the other buffer set and
    #    returns; write 3 waits for write 2; save(4) then finds no free buffer set and waits
    Watched.reset(owner)
    storage.gates[2] = threading.Event()
    watchdog = threading.Timer(12, storage.gates[2].set)     # frees a save stuck on write 2
    watchdog.start()
    ck.save(2, state)
    Watched.save_returned()
    _next_step(state)
    Watched.released.set()
    done = {3: threading.Event(), 4: threading.Event()}

    def save_in_a_thread(step):
        Watched.reset(threading.get_ident())
        ck.save(step, state)
        Watched.save_returned()
        Watched.released.set()
        done[step].set()
    threads = {}
    for step, grace in ((3, 5.0), (4, 1.0)):
        threads[step] = threading.Thread(target=save_in_a_thread, args=(step,), daemon=True)
        threads[step].start()
        out[f"save{step}_returned_while_2_held"] = done[step].wait(grace) and \
            not storage.gates[2].is_set()
        if step == 3:
            if not out["save3_returned_while_2_held"]:
                # one buffer set: save(3) waits for write 2. Training cannot step while its
                # save() has not returned, so neither does the checker: free write 2 and wait
                # for save(3), then step. Only the buffering cell is lost, never the copy's.
                storage.gates[2].set()
                threads[3].join(30)
            _next_step(state)
    if out["save4_returned_while_2_held"]:
        storage.entered_event(4).wait(2)          # a fourth copy: let its write show itself
    storage.gates[2].set()
    watchdog.cancel()
    for thread in threads.values():
        thread.join(30)
    Watched.reset(owner)
    ck.wait()
    # 3. a failed write surfaces at the next wait() or save(); the checkpointer goes on
    _next_step(state)
    storage.fail.add(5)
    raised = None
    ck.save(5, state)
    for where, call in (("wait", ck.wait), ("save", lambda: ck.save(6, state))):
        try:
            call()
        except BaseException as error:  # noqa: BLE001 (an observation)
            raised = [where, type(error).__name__]
            break
    out["failure_raised"] = raised
    _next_step(state)
    try:
        ck.save(7, state)
        ck.wait()
        out["after_failure"] = "ok"
    except BaseException as error:  # noqa: BLE001
        out["after_failure"] = f"{type(error).__name__}: {error}"
    out["most_active"] = storage.most_active
    out["order"] = storage.order
    out["calls"] = [{"step": c["step"], "values": c["values"], "ptrs": c["ptrs"],
                     "from_owner": c["thread"] == owner} for c in storage.calls]
    return out


ASPECTS = ("copy", "flight")
SAVED = (1, 2, 3, 4, 7)                           # the steps whose writes must have happened


def check_async_checkpointer(world, Checkpointer, aspects=ASPECTS, timeout=120, case=None):
    """Task 3: the contract of AsyncCheckpointer, on every rank (see the module's docstring).
    aspects: "copy" (save returns while its write runs; the snapshot holds the values the
    tensors had at save(), copied in save(), handed to a background write) and/or "flight"
    (double buffering: with a write in flight, the next save copies into the other buffer set
    and returns, its write waits; a third save waits for a free set; one write at a time; a
    failed write surfaces at the next wait() or save(), which then go on; two buffer sets,
    allocated once).

    Waits bound wrong answers only: a save() still blocked 5 s after it began is released (one
    that waits for its own write); a save() with a free buffer set gets 5 s to return (a right
    one takes milliseconds); a third save() that returns within a second while both sets are
    busy did not wait (a right one is still blocked then). The checker never runs a training
    step while a save() it made has not returned (as training cannot): a save that blocks for
    the wrong reason costs the buffering cell, not the copy cell."""
    unknown = set(aspects) - set(ASPECTS)
    if unknown:
        raise ValueError(f"aspects must be among {ASPECTS}, got {sorted(unknown)}")
    case = case or base.Case("lab 8, task 3: asynchronous checkpointer")
    state = {f"t_{dtype}": case.exact_values((case.integer(1, 300),), dtype)
             for dtype in WATCH_DTYPES}
    state["matrix"] = case.exact_values((7, 5), "float32")
    results = call(world, _async_program, (state, Checkpointer), timeout=timeout)
    base.one_result_per_rank(results, world.size, case)
    values, current = {}, {k: v.clone() for k, v in state.items()}
    for step in (1, 2, 3, 4, 5, 7):               # one training step between two saves
        values[step] = {k: v.clone() for k, v in current.items()}
        for tensor in current.values():
            tensor.add_(1)
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        calls = {c["step"]: c for c in out["calls"]}
        if not out["returned_while_held"]:       # the program stopped after scenario 1
            if "copy" in aspects:
                _judge_copy(out, calls, values, where, case)
            _judge_flight(out, calls, where, case)
        for step in SAVED:
            if step not in calls:
                raise AssertionError(f"{where}: write was never called for step {step} "
                                     f"(calls: {sorted(calls)}) [{case}]")
        if "copy" in aspects:
            _judge_copy(out, calls, values, where, case)
        if "flight" in aspects:
            _judge_flight(out, calls, where, case)


def _judge_copy(out, calls, values, where, case):
    if not out["returned_while_held"]:
        raise AssertionError(f"{where}: save() did not return while its write was still "
                             f"running [{case}]: copy, start the write in a background "
                             "thread, and return; the training step must not wait")
    if out["reads_at_return"] or out["late_reads_1"]:
        raise AssertionError(f"{where}: the live tensors were read by another thread after "
                             f"save() returned [{case}]: take the copy in save() itself, "
                             "before it returns; the next training step changes the tensors")
    for step in SAVED:
        base.check(calls[step]["values"], values[step], f"{where}: the snapshot of step {step}",
                   case=case, hint="a snapshot holds the values the tensors had when save() "
                   "was called (copy them, with their dtypes and shapes)")
        if set(calls[step]["ptrs"].values()) & set(out["sources"].values()):
            raise AssertionError(f"{where}: write received the live tensors at step {step} "
                                 f"[{case}]: hand it the copies")
        if calls[step]["from_owner"]:
            raise AssertionError(f"{where}: write ran in the thread that called save() "
                                 f"[{case}]: run it in a background thread")


def _judge_flight(out, calls, where, case):
    if not out["returned_while_held"]:
        raise AssertionError(f"{where}: save() waited for its own write [{case}]: queue the "
                             "write for the background thread and return")
    if not out["save3_returned_while_2_held"]:
        raise AssertionError(f"{where}: while a write was in flight, save() waited for it "
                             f"although the second set of host buffers was free [{case}]: "
                             "double-buffer (copy into the free set, queue its write, return)")
    if out["most_active"] > 1:
        raise AssertionError(f"{where}: two writes ran at once [{case}]: one writer, one write "
                             "in flight; a queued snapshot waits for the write before it")
    if out["save4_returned_while_2_held"]:
        raise AssertionError(f"{where}: save() took a third copy while one snapshot was being "
                             f"written and another waited [{case}]: two sets of host buffers "
                             "at most; with both busy, save() waits for the write in flight")
    if out["failure_raised"] is None:
        raise AssertionError(f"{where}: a write that raised went unnoticed [{case}]: the "
                             "next wait() or save() must raise (keep the error)")
    if out["after_failure"] != "ok":
        raise AssertionError(f"{where}: after a failed write was reported, the next save "
                             f"failed: {out['after_failure']} [{case}]")
    sets = {tuple(sorted(calls[s]["ptrs"].items())) for s in SAVED}
    if len(sets) != 2:
        raise AssertionError(f"{where}: the writes used {len(sets)} different sets of host "
                             f"buffers [{case}]: allocate two sets once and reuse them")


# ---- task 4 ------------------------------------------------------------------------------------

def _simulate_many(rows, simulate):
    """On a rank: simulate(*row) for every row; a result or the error's text per row."""
    out = []
    for row in rows:
        try:
            out.append(float(simulate(*row)))
        except BaseException as error:  # noqa: BLE001 (an observation)
            out.append(f"{type(error).__name__}: {error}"[:300])
    return out


def check_simulate_examples(world, simulate, examples, timeout=120):
    """simulate(*arguments) == expected for each (arguments, expected) of `examples`."""
    got = call(world, _simulate_many, ([list(a) for a, _ in examples], simulate), ranks=[0],
               timeout=timeout)[0]
    for (arguments, expected), value in zip(examples, got):
        if not isinstance(value, float) or not math.isclose(value, expected, rel_tol=1e-9):
            raise AssertionError(f"simulate_async{tuple(arguments)} = {value!r}, expected "
                                 f"{expected}")


def check_simulate_async(world, simulate, cases=12, timeout=120, case=None):
    """Task 4: simulate_async against runs with no failure and with one failure (anywhere:
    computing, copying, waiting for a write, with a write in flight, restarting)."""
    reference = released.reference("checkpoint")
    if reference is not None:
        case = case or base.Case("lab 8, task 4: simulate_async")
        rows, expected = reference.simulate_cases(case, cases)
    else:                    # the student copy: the visible cases, as `labkit release` wrote them
        table = released.load("lab08_checkpoints")["simulate_async"]
        case = base.Case("lab 8, task 4: simulate_async", seed=table["seed"])
        rows, expected = table["rows"], table["expected"]
    got = call(world, _simulate_many, (rows, simulate), ranks=[0], timeout=timeout)[0]
    for row, value, want in zip(rows, got, expected):
        if not isinstance(value, float) or not math.isclose(value, want, rel_tol=1e-9,
                                                            abs_tol=1e-6):
            work, tau, stall, write, restart, failures = row
            raise AssertionError(
                f"simulate_async(work={work}, tau={tau}, stall={stall}, write={write}, "
                f"restart={restart}, failures={failures}) = {value!r}, expected {want} "
                f"[{case}]; a failure loses what was done since the newest snapshot whose "
                "write had finished (a write in flight is lost), then the restart takes "
                "`restart` and the next checkpoint is due tau of compute later")


def check_simulate_matches_daly(world, simulate, traces=300, timeout=120, case=None):
    """With write = 0 the model is Daly's: the mean wall time over exponential failure traces
    matches his expected wall time within 4 standard errors (his model also checkpoints after
    the last segment: that segment's share is taken off)."""
    import numpy as np
    case = case or base.Case("lab 8, task 4: simulate_async against Daly")
    rng = np.random.default_rng(case.seed % (2 ** 32))
    work, tau, stall, restart, mtbf = 2000.0, 100.0, 5.0, 10.0, 400.0
    rows = [[work, tau, stall, 0.0, restart, np.cumsum(rng.exponential(mtbf, 200)).tolist()]
            for _ in range(traces)]
    walls = call(world, _simulate_many, (rows, simulate), ranks=[0], timeout=timeout)[0]
    bad = [w for w in walls if not isinstance(w, float)]
    if bad:
        raise AssertionError(f"simulate_async raised on a random failure trace: {bad[0]} [{case}]")
    mean, error = float(np.mean(walls)), float(np.std(walls) / math.sqrt(traces))
    segment = lambda length: mtbf * math.exp(restart / mtbf) * math.expm1(length / mtbf)
    expected = interval.daly_wall_time(tau, stall, mtbf, restart, work) \
        - segment(tau + stall) + segment(tau)
    if abs(mean - expected) > 4 * error:
        raise AssertionError(f"simulate_async with write = 0 over {traces} exponential failure "
                             f"traces (M = {mtbf}): mean wall time {mean:.1f} +- {error:.1f}, "
                             f"Daly's formula gives {expected:.1f} [{case}]; check failures "
                             "during checkpoints, during restarts, and several in one run")
    return mean, expected


def interval_cases(case, draws: int) -> list:
    """check_async_interval's cases [stall, write, mtbf], half with the write shorter than
    sqrt(2 stall M), half longer, drawn from `case`."""
    rows = []
    for i in range(draws):
        stall = float(case.integer(1, 60))
        mtbf = float(case.integer(600, 50_000))
        young = math.sqrt(2 * stall * mtbf)
        write = float(case.integer(0, int(0.9 * young))) if i % 2 == 0 else \
            float(case.integer(int(young) + 1, int(3 * young) + 2))
        rows.append([stall, write, mtbf])
    return rows


def check_async_interval(async_interval, draws=8, case=None):
    """Task 4: the interval the lab's model implies, over draws in both regimes: half with the
    write shorter than sqrt(2 stall M), half with it longer (training waits for the write at
    every checkpoint). The expected values come from the grader's reference
    (`labkit.grading.references.checkpoint`), or in the student copy from the visible cases that
    `labkit release` wrote; tests/chapters checks that reference against simulate_async."""
    reference = released.reference("checkpoint")
    if reference is not None:
        case = case or base.Case("lab 8, task 4: async_interval")
        rows = interval_cases(case, draws)
        expected_values = [reference.async_interval(*row) for row in rows]
    else:
        table = released.load("lab08_checkpoints")["async_interval"]
        case = base.Case("lab 8, task 4: async_interval", seed=table["seed"])
        rows, expected_values = table["rows"], table["expected"]
    for (stall, write, mtbf), expected in zip(rows, expected_values):
        got = async_interval(stall, write, mtbf)
        if not isinstance(got, (int, float)) or not math.isclose(got, expected, rel_tol=1e-6):
            raise AssertionError(
                f"async_interval(stall={stall}, write={write}, mtbf={mtbf}) = {got!r}, expected "
                f"{expected:.4f} [{case}]; write the lost fraction as a function of tau first: "
                "how long does a cycle last when the write takes longer than tau (training "
                "waits for it before the next copy)? Which terms depend on tau?")
