"""Rank side: wrap torch.distributed's communication functions to record and to inject faults.

Every call of a wrapped function (collective or point-to-point) becomes a record:
`seq` (per process group for collectives, per peer for point-to-point), `op`, `group` (global
ranks), `group_name` (torch's name of the group, for collectives), `peer`, `shapes`, `dtypes`, `tensor_bytes`, `wire_bytes_sent`, `t_start`, `t_end`,
`finished`. The last few records are always kept (the hang diagnosis reads them); all of them are
kept while tracing is on.

`wire_bytes_sent` is what this process wrote to the kernel during the op (`wchar` in
/proc/self/io): under gloo that is the bytes put on the sockets, whatever algorithm gloo picked.
The counter is per process, so ops in flight at the same time (isend + irecv) each see the
other's bytes too; `wchar_start`/`wchar_end` (the counter's values) let `Trace.bytes_sent`
count the union of those intervals, every byte once.
"""

import collections
import inspect
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "gather", "scatter", "barrier", "monitored_barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
)
POINT_TO_POINT = ("send", "recv", "isend", "irecv")
RECENT = 16


class _State:
    def __init__(self):
        self.recent = collections.deque(maxlen=RECENT)
        self.records = None          # a list while tracing is on
        self.record_limit = None     # keep at most this many (hints for a grader); None: all
        self.records_dropped = 0
        self.current = {}            # id -> record started and not finished (async ops too)
        self.collective_seq = collections.Counter()
        self.p2p_seq = collections.Counter()
        self.count_since_fault = 0
        self.fault = None            # {"at": k, "action": "exit"|"sleep", "seconds": s}
        self.count_wire = True
        self.failed_op = None        # the record of the last op that raised, until reported
        self.p2p_group = None        # teaching mode: point-to-point messages travel on this group


STATE = _State()
_INSIDE = threading.local()   # .active: inside a recorded op on this thread


def _wchar():
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _group_ranks(group):
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _group_name(group):
    """The process group's name (torch's `group.group_name`, "0" for the world), or None: two
    groups made by two `new_group` calls with the same ranks differ only by it."""
    try:
        return str((dist.group.WORLD if group is None else group).group_name)
    except Exception:              # a placeholder or a backend without names: no name to show
        return None


def _fire_fault():
    fault = STATE.fault
    STATE.count_since_fault += 1
    if fault is None or STATE.count_since_fault != fault["at"]:
        return
    STATE.fault = None
    rank = dist.get_rank()
    if fault["action"] == "exit":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(fault.get("exitcode", 17))
    print(f"labkit fault injection: rank {rank} sleeps {fault['seconds']} s before "
          f"its communication op #{fault['at']}", file=sys.stderr, flush=True)
    time.sleep(fault["seconds"])


class _TracedWork:
    """Wraps the Work an async op returns, so the record is finished when `wait()` returns."""

    def __init__(self, work, record):
        self._work = work
        self._record = record

    def wait(self, *args, **kwargs):
        try:
            result = self._work.wait(*args, **kwargs)
        except BaseException:
            self._record["failed"] = True
            STATE.failed_op = self._record
            _finish(self._record)
            raise
        _finish(self._record)
        return result

    def is_completed(self):
        done = self._work.is_completed()
        if done:
            _finish(self._record)
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def _finish(record):
    if record["finished"]:
        return
    record["t_end"] = time.time()
    start = record["wchar_start"]
    end = _wchar() if start is not None else None
    record["wchar_end"] = end
    record["wire_bytes_sent"] = None if end is None else end - start
    record["finished"] = True
    record.pop("_work", None)         # do not keep the op (and its tensors) alive in records
    STATE.current.pop(id(record), None)


def _wrap(name, function, point_to_point):
    signature = inspect.signature(function)

    def traced(*args, **kwargs):
        if getattr(_INSIDE, "active", False):   # torch calling its own collectives inside one we already record
            return function(*args, **kwargs)
        _fire_fault()
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:
            return function(*args, **kwargs)   # let torch raise its own message
        group = bound.get("group")
        ranks = _group_ranks(group)
        tensors = [t for value in bound.values() for t in _tensors(value)]
        if point_to_point:
            peer = bound.get("dst", bound.get("src"))
            if peer is None:
                peer = bound.get("group_dst", bound.get("group_src"))
            STATE.p2p_seq[peer] += 1
            seq = STATE.p2p_seq[peer]
        else:
            peer = None
            STATE.collective_seq[ranks] += 1
            seq = STATE.collective_seq[ranks]
        record = {
            "rank": dist.get_rank(), "seq": seq, "op": name, "group": ranks, "peer": peer,
            "group_name": None if point_to_point else _group_name(group),
            "shapes": [tuple(t.shape) for t in tensors],
            "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors],
            "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "wire_bytes_sent": None, "t_start": time.time(), "t_end": None, "finished": False,
            "failed": False, "wchar_start": _wchar() if STATE.count_wire else None,
            "wchar_end": None,
        }
        STATE.recent.append(record)
        STATE.current[id(record)] = record
        if STATE.records is not None:
            if STATE.record_limit is None or len(STATE.records) < STATE.record_limit:
                STATE.records.append(record)
            else:
                STATE.records_dropped += 1
        if point_to_point and STATE.p2p_group is not None:
            args, kwargs = _on_p2p_group(bound)
        _INSIDE.active = True
        try:
            result = function(*args, **kwargs)
        except BaseException:
            record["failed"] = True
            STATE.failed_op = record
            _finish(record)
            raise
        finally:
            _INSIDE.active = False
        if result is not None and hasattr(result, "wait") and hasattr(result, "is_completed"):
            record["_work"] = result         # labkit.mark lets it finish (not sent anywhere)
            return _TracedWork(result, record)
        _finish(record)
        return result

    traced.__wrapped__ = function
    traced.__name__ = name
    traced.__doc__ = function.__doc__
    return traced


def _on_p2p_group(bound):
    """The same point-to-point call, on the teaching-mode p2p group, with global ranks.

    torch's DETAIL check (teaching mode) compares each collective's sequence number across the
    ranks of its group, and send/recv advance that number on the two ranks that take part only:
    after rank 0 sends to rank 1, the next collective of ranks 0, 1 and 2 would be reported as a
    mismatch. Messages therefore travel on a second group spanning the world, made without the
    check; the groups the program uses count collectives only, and their checks stay exact."""
    kwargs = dict(bound)
    group = kwargs.pop("group", None)
    for local, plain in (("group_dst", "dst"), ("group_src", "src")):
        if kwargs.get(local) is not None:
            kwargs[plain] = dist.get_global_rank(group, kwargs.pop(local))
        else:
            kwargs.pop(local, None)
    kwargs["group"] = STATE.p2p_group
    return (), kwargs


def finish_in_flight(seconds=30.0):
    """Wait (at most `seconds` each) for the asynchronous ops this rank started and has not
    waited for yet: at a labkit.mark, the bytes of work started before it are then all sent,
    however loaded the machine. Waiting early changes no result."""
    from datetime import timedelta
    for record in list(STATE.current.values()):
        work = record.get("_work")
        if work is None:
            continue
        try:
            work.wait(timedelta(seconds=seconds))
        except Exception:  # noqa: BLE001 (a failed op is reported when the program waits)
            pass


def make_p2p_group():
    """Teaching mode: a world-spanning group without the DETAIL check, for send/recv (collective:
    every rank calls it once, at start)."""
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.OFF)
    try:
        STATE.p2p_group = dist.new_group(backend=dist.get_backend())
    finally:
        dist.set_debug_level(level)


def install(count_wire=True):
    """Replace torch.distributed's communication functions with traced ones, both where users
    reach them (`torch.distributed.X`) and where they live (`distributed_c10d.X`), so calling
    the second does not slip past the trace. Calls torch makes inside a recorded op (e.g.
    all_gather_object's all_gather) are not recorded again."""
    from torch.distributed import distributed_c10d
    STATE.count_wire = count_wire and _wchar() is not None
    for name in COLLECTIVES + POINT_TO_POINT:
        function = getattr(dist, name, None)
        if function is None or getattr(function, "_labkit", False):
            continue
        traced = _wrap(name, function, name in POINT_TO_POINT)
        traced._labkit = True
        setattr(dist, name, traced)
        if getattr(distributed_c10d, name, None) is function:
            setattr(distributed_c10d, name, traced)


def public(record):
    """A record as plain data (safe to send to the kernel)."""
    return {k: v for k, v in record.items() if not k.startswith("_")}


def start_tracing(limit=None):
    """Record every op from now on (at most `limit` of them: a grader's hints need a few, and a
    program that sends a million messages must not fill the rank's memory with their records)."""
    STATE.records, STATE.record_limit, STATE.records_dropped = [], limit, 0


def stop_tracing():
    records, STATE.records = STATE.records or [], None
    return [public(r) for r in records]


def snapshot():
    """What the hang diagnosis needs: the recent records and the ops still in flight."""
    return {
        "recent": [public(r) for r in list(STATE.recent)],
        "current": [public(r) for r in list(STATE.current.values())],
        "collective_counts": {str(list(k)): v for k, v in STATE.collective_seq.items()},
        "now": time.time(),
    }


def set_fault(plan):
    STATE.fault = plan
    STATE.count_since_fault = 0
