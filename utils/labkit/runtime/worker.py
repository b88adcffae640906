"""Rank side: the long-lived process behind one rank of a `World`.

The kernel talks to a rank over three channels:
- `commands`: a duplex Connection; the rank's main thread serves it (call, exec, trace, fault, stop).
  What the kernel sends is pickled; what the rank sends back never is: a JSON header, then the
  result's bytes (pickled, or, for a grader, `torch.save` of plain data read back with
  `weights_only=True`), so a process that reads a rank's replies runs none of the rank's code;
- `diagnostics`: a duplex Connection served by a small thread, so a rank stuck inside a
  collective can still say where it is (its stack and its last communication ops);
- its file descriptors 1 and 2, redirected into two pipes the kernel reads, so output printed by
  Python and by C++ alike reaches the cell. After each task the rank writes a marker to both, and
  the kernel returns only once it has read both markers: output is drained before a call returns.

This module is preloaded by the forkserver, so a new rank starts from a process that has already
imported torch. `python -m labkit.runtime.worker SETTINGS_JSON` starts a rank from inherited file
descriptors instead (the grader launches ranks that way, inside its sandbox).
"""

import array
import ast
import ctypes
import fcntl
import io
import json
import linecache
import os
import pickle
import signal
import sys
import termios
import threading
import traceback
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from labkit.runtime import hooks as _hooks

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
MARKER = "\x1elabkit-done:{}\x1e\n"
RECORD_HINTS = 2000       # records a grader's rank sends back per call (hints, never evidence)


class RankState:
    rank = None
    world_size = None
    device = torch.device("cpu")
    backend = None
    namespace = None
    commands = None          # the kernel's channel, while a task runs (labkit.mark uses it)
    task_id = None
    plain = False            # results as plain data (torch.save), for a grader
    records = False          # send this task's communication records with every reply
    store = None             # the TCPStore client (or server, on a store-hosting rank 0)
    store_host = False       # this rank hosts the store: it leaves last (leave_group)
    store_rank = None        # the rank hosting the store (0 or None: the kernel hosts it)


STATE = RankState()


def _die_with_parent():
    """Ask Linux to SIGKILL this rank when its parent (the forkserver) goes away."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _user_frames(frames):
    """Keep the frames of the student's code: drop labkit's, torch's and the stdlib runner's."""
    kept = [f for f in frames
            if not f.filename.startswith(PACKAGE_DIR) and not f.filename.startswith(TORCH_DIR)
            and "/multiprocessing/" not in f.filename and "/threading.py" not in f.filename
            and f.filename != "<string>"]
    return kept


def format_exception(error):
    frames = _user_frames(traceback.extract_tb(error.__traceback__))
    lines = ["Traceback (most recent call last, your code):\n"]
    lines += traceback.format_list(frames)
    lines += traceback.format_exception_only(type(error), error)
    return "".join(lines)


def current_stack(thread_id):
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "(no stack: the thread has ended)"
    frames = _user_frames(traceback.extract_stack(frame))
    if not frames:
        return "(no frame of your code: the rank is inside labkit or torch)"
    return "".join(traceback.format_list(frames))


try:
    _LIBC_FFLUSH = ctypes.CDLL(None).fflush
except (OSError, AttributeError):
    _LIBC_FFLUSH = None


def _pending_bytes(fd):
    """Bytes written to pipe `fd` that the kernel has not read yet (FIONREAD works on either end)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count)
    except OSError:
        return 1   # cannot tell: behave as if output were pending
    return count[0]


def _end_task_output(task_id):
    """Flush; return True if the kernel has already read everything (then no marker is needed),
    else write the end-of-task marker to both pipes and return False."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _LIBC_FFLUSH is not None:
        _LIBC_FFLUSH(None)
    if _pending_bytes(1) == 0 and _pending_bytes(2) == 0:
        return True
    _flush_all(MARKER.format(task_id))
    return False


def _flush_all(marker):
    sys.stdout.flush()
    sys.stderr.flush()
    if _LIBC_FFLUSH is not None:
        _LIBC_FFLUSH(None)  # C/C++ stdio buffers too
    data = marker.encode()
    os.write(1, data)
    os.write(2, data)


def _register_sources(sources):
    for filename, lines in (sources or {}).items():
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value.detach()
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    if isinstance(value, tuple):
        converted = [_to_cpu(v) for v in value]
        return type(value)(*converted) if hasattr(value, "_fields") else tuple(converted)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _run_source(source, filename):
    """Run a `%%ranks` cell in this rank's namespace; return the last expression's value."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tree = ast.parse(source, filename=filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), STATE.namespace)
    if last is not None:
        return eval(compile(last, filename, "eval"), STATE.namespace)
    return None


def send(connection, header, payload=None):
    """Rank -> kernel: a JSON header (and the payload's bytes, if any). Never pickled."""
    header = dict(header, payload=payload is not None)
    connection.send_bytes(json.dumps(header, default=str).encode())
    if payload is not None:
        connection.send_bytes(payload)


def _serve_diagnostics(connection, main_thread_id):
    while True:
        try:
            request = connection.recv()
        except (EOFError, OSError):
            return
        if request == "diag":
            reply = _hooks.snapshot()
            reply["stack"] = current_stack(main_thread_id)
            reply["pid"] = os.getpid()
            try:
                send(connection, reply)
            except (OSError, BrokenPipeError):
                return


def _init_process_group(settings):
    backend = settings["backend"]
    if backend == "nccl":
        gpus = torch.cuda.device_count()
        if gpus < settings["world_size"]:
            raise RuntimeError(
                f"backend 'nccl' needs one GPU per rank: world size {settings['world_size']}, "
                f"GPUs visible to rank {settings['rank']}: {gpus}")
        STATE.device = torch.device("cuda", settings["rank"])
        torch.cuda.set_device(STATE.device)
    dist.set_debug_level(dist.DebugLevel.DETAIL if settings["teaching"] else dist.DebugLevel.OFF)
    host_store = settings.get("store_on_rank_0", False) and settings["rank"] == 0
    store = dist.TCPStore(settings["host"], settings["port"], is_master=host_store,
                          world_size=settings["world_size"] if host_store else None,
                          wait_for_workers=False, timeout=timedelta(seconds=60))
    STATE.store_host = host_store
    STATE.store_rank = 0 if settings.get("store_on_rank_0", False) else None
    store = dist.PrefixStore(settings["prefix"], store)
    STATE.store = store
    kwargs = {"device_id": STATE.device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=settings["rank"],
                            world_size=settings["world_size"],
                            timeout=timedelta(seconds=settings["pg_timeout"]), **kwargs)


def main(settings, commands, diagnostics, out_writer, err_writer):
    if settings.get("die_with_parent", True):
        _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the kernel handles interrupts for us
    os.dup2(out_writer.fileno(), 1)
    os.dup2(err_writer.fileno(), 2)
    out_writer.close()
    err_writer.close()
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    os.environ["LABKIT_RANK"] = str(settings["rank"])
    torch.set_num_threads(settings["threads"])
    STATE.rank, STATE.world_size = settings["rank"], settings["world_size"]
    STATE.backend = settings["backend"]
    STATE.plain = bool(settings.get("plain", False))
    STATE.records = bool(settings.get("records", False))
    try:
        _init_process_group(settings)
        if settings["teaching"] and settings["world_size"] > 1:
            _hooks.make_p2p_group()
        _hooks.install(count_wire=settings["backend"] == "gloo")
    except BaseException as error:  # noqa: BLE001 - reported to the kernel, then exit
        send(commands, {"kind": "fail", "message": f"{type(error).__name__}: {error}"})
        _flush_all(MARKER.format("start"))
        os._exit(3)
    STATE.namespace = {"__name__": "__rank__", "rank": STATE.rank,
                       "world_size": STATE.world_size, "dist": dist, "torch": torch,
                       "device": STATE.device}
    exec("import labkit", STATE.namespace)
    threading.Thread(target=_serve_diagnostics, args=(diagnostics, threading.get_ident()),
                     daemon=True, name="labkit-diagnostics").start()
    send(commands, {"kind": "ready", "pid": os.getpid(), "device": str(STATE.device)})
    _flush_all(MARKER.format("start"))
    _serve(commands)


def _serve(commands):
    while True:
        try:
            message = commands.recv()
        except (EOFError, OSError):
            os._exit(0)  # the kernel went away
        kind = message[0]
        if kind in ("call", "exec"):
            _run_task(commands, message)
        elif kind == "trace":
            if message[1]:
                _hooks.start_tracing()
                send(commands, {"kind": "traced", "records": None})
            else:
                send(commands, {"kind": "traced", "records": _hooks.stop_tracing()})
        elif kind == "fault":
            _hooks.set_fault(message[1])
            send(commands, {"kind": "fault-set"})
        elif kind == "stop":
            waited_out = None
            try:
                # World.close kills what is left after 3 s: wait 2 s at most for the peers
                # every rank names the store's host: the host waits for the others' word, and
                # the others must give it (a host_rank of None on them left the host waiting
                # its whole bound: 2 s per close of every grader's world)
                waited_out = leave_group(STATE.store, STATE.rank, STATE.world_size,
                                         seconds=2.0, host_rank=STATE.store_rank)
            finally:
                send(commands, {"kind": "stopped", "waited_out": waited_out})
                _flush_all(MARKER.format("stop"))
                os._exit(0)


LEAVE_SECONDS = 10.0     # how long a rank's exit waits for its peers (barrier, store host)


def leave_group(store=None, rank=None, world_size=None, host_rank=None, key="labkit/left",
                seconds=LEAVE_SECONDS):
    """A rank's exit from its process group, in a defined order (issue 25's SIGABRT):

    1. a barrier (bounded by `seconds`): no rank tears its sockets down while a peer still
       talks to it (a gloo pair closed with data in flight resets the peer's connection);
    2. destroy_process_group: gloo's worker and loop threads are joined here, while the
       interpreter is whole, when nothing else holds the group (not always: see below);
    3. the rank that hosts the TCPStore (`host_rank`, rank 0 under torchrun) leaves last: the
       others add 1 to `key` in the store, the host waits (bounded) until all have.

    The caller then ends the process with `os._exit` after flushing (`exit_now`): the
    interpreter's finalization never runs. The abort it prevents (seen in a core dump, torch 2.13.0,
    Python 3.11): gloo's worker thread (`ProcessGroupGloo::runLoop`) drops its reference to a
    finished work, the work's destructor drops the last reference to a tensor that has a Python
    object, that needs the GIL, and a thread that asks for the GIL once finalization has begun is
    ended by `pthread_exit`; its forced unwind meets a noexcept C++ frame and calls
    std::terminate ("terminate called without an active exception", SIGABRT). The threads can
    still be there after destroy_process_group: importing torch._dynamo after init (torch's AdamW
    does, on its first construction) takes references to the default group that the destroy does
    not drop, so the group and its threads live on into finalization. Under load the worker is
    preempted between completing a work and releasing it, and the main thread gets there first.
    tests/stress/stress_lifecycle.py's `exit` mode counts it.
    Never raises: leaving is best effort, and the peers' own deadlines bound it. Returns whether
    it waited out a bound (a peer that never came: barrier failed, or the host's count short),
    which a clean exit of every rank never does."""
    from datetime import timedelta
    import time as _time
    waited_out = False
    if dist.is_initialized():
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
        try:
            store = dist.distributed_c10d._get_default_store() if store is None else store
        except (RuntimeError, ValueError, AttributeError):
            pass
        if world_size > 1:
            try:
                dist.barrier(async_op=True).wait(timedelta(seconds=seconds))
            except Exception:  # noqa: BLE001 - a peer gone: leave anyway
                waited_out = True
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    if store is None or host_rank is None or not world_size or world_size < 2:
        return waited_out
    try:
        if rank != host_rank:
            store.add(key, 1)
            return waited_out
        deadline = _time.monotonic() + seconds
        while store.add(key, 0) < world_size - 1:
            if _time.monotonic() >= deadline:
                return True
            _time.sleep(0.01)
    except Exception:  # noqa: BLE001 - the store gone: nothing left to wait for
        pass
    return waited_out


def exit_now(code=0):
    """Flush Python's and C's stdio, then end the process without the interpreter's
    finalization (see `leave_group`)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    if _LIBC_FFLUSH is not None:
        _LIBC_FFLUSH(None)
    os._exit(code)


def encode(result):
    """A task's result as bytes: pickled, or (plain mode) torch.save of plain data."""
    result = _to_cpu(result)
    if STATE.plain:
        from labkit.runtime.plain import plain
        buffer = io.BytesIO()
        torch.save(plain(result), buffer)
        return buffer.getvalue()
    try:
        return pickle.dumps(result)
    except Exception as error:  # noqa: BLE001
        raise TypeError(f"the value returned by rank {STATE.rank} cannot be sent back to "
                        f"the kernel ({type(result).__name__}): {error}. Return plain data: "
                        f"tensors, numbers, lists, dicts.") from None


def _run_task(commands, message):
    kind, task_id, payload, sources = message
    STATE.commands, STATE.task_id = commands, task_id
    if STATE.records:
        _hooks.start_tracing(limit=RECORD_HINTS)
    data = None
    try:
        _register_sources(sources)
        if kind == "call":
            function, args, kwargs = cloudpickle.loads(payload)
            result = function(*args, **kwargs)
        else:
            result = _run_source(payload, sources["__filename__"])
        data = encode(result)
        header = {"kind": "ok", "task": task_id}
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the kernel
        header = {"kind": "err", "task": task_id,
                  "error": {"type": type(error).__name__, "module": type(error).__module__,
                            "message": str(error)[:20000],
                            "traceback": format_exception(error)[-20000:],
                            "in_communication": _hooks.STATE.failed_op is not None}}
        _hooks.STATE.failed_op = None
    finally:
        STATE.commands = None
    if STATE.records:
        header["records"] = _hooks.stop_tracing()
    header["group_gone"] = not dist.is_initialized()
    header["drained"] = _end_task_output(task_id)   # True: the output is already drained
    send(commands, header, data)


def mark(label):
    """A point at which whoever measures this call (`world.traffic()`) takes a snapshot of the
    bytes every rank has sent so far; returns once it is taken. Asynchronous ops this rank started
    before the mark are let finish first (so their bytes are all counted, on any machine).
    Outside a call: does nothing. A label is marked at most once per rank per call (the first
    entry is the one measured), and a call marks at most MARK_LABELS labels; a mark the measuring
    side does not answer within MARK_RESUME_SECONDS fails the call."""
    import time
    commands = STATE.commands
    if commands is None:
        return
    label = str(label)[:200]
    seen = mark.__dict__.setdefault("seen", {"task": None, "labels": set()})
    if seen["task"] != STATE.task_id:
        seen["task"], seen["labels"] = STATE.task_id, set()
    if label in seen["labels"]:
        raise RuntimeError(f"rank {STATE.rank}: labkit.mark({label!r}) was called a second time "
                           "in this call; expected each label once per rank per call (the first "
                           "mark is the one measured). Marks belong to the program that measures "
                           "the call: do not call labkit.mark from your own code")
    if len(seen["labels"]) >= 64:          # MARK_LABELS: each mark costs a snapshot outside
        raise RuntimeError(f"rank {STATE.rank}: more than 64 labkit.mark labels in one call "
                           f"(received {label!r} after 64 others); expected a few marks per call")
    seen["labels"].add(label)
    _hooks.finish_in_flight()
    send(commands, {"kind": "mark", "task": STATE.task_id, "label": label})
    deadline = time.monotonic() + 120.0    # MARK_RESUME_SECONDS
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not commands.poll(left):
            raise RuntimeError(f"rank {STATE.rank}: labkit.mark({label!r}) was not answered "
                               "within 120 s (expected a resume once every rank reached it); "
                               "is the measuring side stuck?")
        message = commands.recv()
        if message[0] == "resume":
            return


def device():
    """This rank's device: `cuda:<rank>` under NCCL, `cpu` under gloo (and in the kernel)."""
    return STATE.device


def _main_from_fds():
    """`python -m labkit.runtime.worker SETTINGS_JSON`: a rank started with its channels as
    inherited file descriptors (settings["fds"]: commands, diagnostics, stdout, stderr)."""
    from multiprocessing.connection import Connection
    settings = json.loads(sys.argv[1])
    commands, diagnostics, out_fd, err_fd = settings["fds"]
    main(settings, Connection(commands), Connection(diagnostics), Connection(out_fd),
         Connection(err_fd))


if __name__ == "__main__":
    # run as labkit.runtime.worker, not as __main__: labkit.mark and labkit.device find the
    # rank's state in sys.modules["labkit.runtime.worker"]
    from labkit.runtime import worker as _worker
    _worker._main_from_fds()
