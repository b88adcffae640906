"""Where a peak comes from: an allocator snapshot read back to its highest point.

On a GPU the tool people reach for is the CUDA caching allocator's own history:

    torch.cuda.memory._record_memory_history(max_entries=100_000)   # start recording
    step()
    snap = torch.cuda.memory._snapshot()                           # or _dump_snapshot("x.pickle")
    torch.cuda.memory._record_memory_history(enabled=None)          # stop

and the pickle dragged into https://pytorch.org/memory_viz (PyTorch documentation, "Understanding
CUDA Memory Usage"). The snapshot's format is the docstring of `torch.cuda.memory._snapshot`
(torch 2.13): `segments` (what cudaMalloc returned, split into blocks, each `active_allocated`,
`active_awaiting_free` or `inactive`, with the Python frames that allocated it) and
`device_traces`, one list per device of the allocator's actions since recording began (`alloc`,
`free_requested`, `free_completed`, `segment_alloc`, ...), each with its address, size and frames.

On a CPU there is no caching allocator to ask, but torch converts a memory profile
(`torch.profiler.profile(profile_memory=True, with_stack=True)`) into the same format:
`torch.cuda._memory_viz._profile_to_snapshot`, which `profile_plot` uses; the CPU's trace is the
last of `device_traces`. `record(step)` takes whichever the device offers, and `peak` reads either.

`peak` replays one device's trace: the bytes allocated start from what was already allocated when
recording began (the blocks allocated at the end, less the trace's net change) and move with every
`alloc` and `free_requested` (the point where `torch.cuda.memory_allocated` drops: the caching
allocator decrements its count in `free`, before a block used by another stream completes its
free). At the highest point it groups the blocks then alive by the first frame outside torch.
"""
from __future__ import annotations

import dataclasses
import os

_TORCH_DIR = os.sep + "torch" + os.sep


@dataclasses.dataclass
class Peak:
    """The highest point of one device's trace."""
    bytes: int                   # allocated at the peak
    baseline: int                # allocated before the first recorded action
    index: int                   # the trace entry that reached it (-1: the baseline itself)
    entries: int                 # entries in the trace
    live: list                   # [(bytes, blocks, where)] alive at the peak and recorded, largest first

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Peak":
        return cls(d["bytes"], d["baseline"], d["index"], d["entries"],
                   [tuple(row) for row in d["live"]])

    def table(self, top: int = 5) -> str:
        lines = [f"peak {self.bytes:,} B allocated at trace entry {self.index} of {self.entries} "
                 f"({self.baseline:,} B were allocated before recording began)",
                 f"{'bytes':>12} {'blocks':>6}  allocated at (first frame outside torch)"]
        lines += [f"{nbytes:>12,} {blocks:>6}  {where}" for nbytes, blocks, where in self.live[:top]]
        rest = self.live[top:]
        if rest:
            lines.append(f"{sum(r[0] for r in rest):>12,} {sum(r[1] for r in rest):>6}  "
                         f"({len(rest)} more places)")
        return "\n".join(lines)


def _is_torch(frame) -> bool:
    filename, name = frame.get("filename", ""), frame.get("name", "")
    if filename == "none":              # a profile's frame: the "path(line): function" is its name
        return (name.startswith(("torch/", "<built-in")) or _TORCH_DIR in name
                or name.startswith("nn.Module:"))
    return _TORCH_DIR in filename or filename.startswith("<frozen")


def _label(frame) -> str:
    if frame.get("filename", "") == "none":
        return frame.get("name", "?")
    return f"{os.path.basename(frame.get('filename', '')) or '?'}:{frame.get('line', '?')} in {frame.get('name', '?')}"


def where(frames) -> str:
    """Where a block was allocated: the innermost frame outside torch's own files ('file.py:line in
    function', or a profile's 'path(line): function'); the innermost frame, marked (torch), when
    every frame is torch's; '(no frames)' when none was recorded (an allocation the profiler could
    not tie to a Python call, or a CUDA history recorded with stacks off)."""
    for frame in frames or ():
        if not _is_torch(frame):
            return _label(frame)
    if frames:
        return _label(frames[0]) + " (torch)"
    return "(no frames)"


def _allocated_at_end(snapshot: dict, device: int, n_devices: int) -> int:
    total = 0
    for segment in snapshot.get("segments", []):
        if segment.get("device", device if n_devices == 1 else None) != device:
            continue
        total += sum(b["size"] for b in segment.get("blocks", []) if b.get("state") == "active_allocated")
    return total


def peak(snapshot: dict, device: int = -1) -> Peak:
    """The highest allocated total of `device`'s trace (-1: the last list, the CPU's in a profile's
    snapshot; a CUDA snapshot lists one per GPU, indexed by device number)."""
    traces = snapshot.get("device_traces")
    if not isinstance(traces, list) or not traces:
        raise ValueError("not an allocator snapshot: it has no 'device_traces' list (record the "
                         "history before the step: torch.cuda.memory._record_memory_history())")
    if not -len(traces) <= device < len(traces):
        raise ValueError(f"device {device}: the snapshot has traces for devices 0..{len(traces) - 1}")
    index_of_device = device % len(traces)
    trace = traces[index_of_device]
    net = 0
    for entry in trace:
        if entry["action"] == "alloc":
            net += entry["size"]
        elif entry["action"] == "free_requested":
            net -= entry["size"]
    baseline = _allocated_at_end(snapshot, index_of_device, len(traces)) - net
    alive, now, best, best_index, best_alive = {}, baseline, baseline, -1, {}
    for i, entry in enumerate(trace):
        action = entry["action"]
        if action == "alloc":
            alive[entry["addr"]] = (entry["size"], entry.get("frames") or [])
            now += entry["size"]
        elif action == "free_requested":
            alive.pop(entry["addr"], None)
            now -= entry["size"]
        else:
            continue
        if now > best:
            best, best_index, best_alive = now, i, dict(alive)
    groups = {}
    for size, frames in best_alive.values():
        key = where(frames)
        nbytes, blocks = groups.get(key, (0, 0))
        groups[key] = (nbytes + size, blocks + 1)
    live = sorted(((b, n, k) for k, (b, n) in groups.items()), key=lambda row: (-row[0], row[2]))
    return Peak(best, baseline, best_index, len(trace), live)


def record(fn, *args, device=None, **kwargs) -> tuple[dict, int]:
    """Run fn(*args, **kwargs) once while recording; returns (snapshot, the trace index `peak`
    wants). On a CUDA device: the caching allocator's history (`_record_memory_history`, then
    `_snapshot`). Elsewhere: torch's memory profiler, converted by
    `torch.cuda._memory_viz._profile_to_snapshot` (the CPU's trace is the last)."""
    import torch
    if device is None:
        import labkit
        device = labkit.device()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        try:
            fn(*args, **kwargs)
            torch.cuda.synchronize(device)
            snap = torch.cuda.memory._snapshot(device)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        return snap, device.index if device.index is not None else torch.cuda.current_device()
    import warnings
    from torch.cuda import _memory_viz
    from labkit.memory.measure import run_under
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                      profile_memory=True, record_shapes=True, with_stack=True)
        run_under(prof, fn, *args, **kwargs)
        return _memory_viz._profile_to_snapshot(prof), -1
