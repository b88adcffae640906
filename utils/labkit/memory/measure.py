"""Measuring memory on a rank: torch's memory profiler on CPU (the same timeline on GPU), and the
bytes autograd saves for backward (chapter 3, sections 2, 3 and 7).

    timeline = measure.profile(step)                  # runs step() once under torch's profiler
    timeline.peak, timeline.at_peak                   # largest total; {category: bytes} then
    timeline = measure.profile(step, roles=trainer.roles())   # the course's categories
    with measure.saved_bytes() as saved:              # what autograd keeps for backward
        loss = model(x).sum()
    saved.total

torch's profiler (profile_memory, record_shapes and with_stack on) records every allocation and
free with its size and time; its memory profile (`torch.profiler._memory_profiler`, a private API
stable since torch 2.1) then labels each tensor: PARAMETER and GRADIENT from what nn.Module calls
and optimizer steps hold, OPTIMIZER_STATE from `optimizer.state`, INPUT, ACTIVATION (computed from
inputs in forward), TEMPORARY (born and dead inside one op), AUTOGRAD_DETAIL (backward's own
buffers) and unknown. Sizes are the bytes requested: the CPU allocator adds no rounding.

With `roles` ({category: [tensors]}, tensors alive for the whole call), those tensors are filed
under the course's categories instead, by address: parameters, gradients, optimizer_states (the
paper's K: fp32 master weights, momentum, variance), buffers. The rest keeps the profiler's label,
folded into activations (ACTIVATION, INPUT) and temporaries (everything else).

On a GPU the same timeline is kept for the device; CUDA's caching allocator also rounds each block
up to a multiple of 512 bytes and keeps freed blocks reserved for reuse, so the process holds more
than the tensors: torch.cuda.max_memory_allocated() and max_memory_reserved() report both (PyTorch
documentation, "CUDA semantics", section "Memory management").
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings

import torch

PROFILER_CATEGORIES = ("parameter", "gradient", "optimizer_state", "activation", "input",
                       "temporary", "autograd_detail", "unknown")
COURSE_CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "buffers",
                     "temporaries")
_FOLD = {"parameter": "parameters", "gradient": "gradients", "optimizer_state": "optimizer_states",
         "activation": "activations", "input": "activations"}
_FOLD_WITH_ROLES = {"activation": "activations", "input": "activations"}


@dataclasses.dataclass
class Timeline:
    """Bytes alive per category over time, on one device."""
    times_us: list          # microseconds since an arbitrary origin
    rows: list              # rows[i] = {category: bytes} from times_us[i] on
    device: str
    categories: tuple

    @property
    def totals(self) -> list:
        return [sum(row.values()) for row in self.rows]

    @property
    def peak_index(self) -> int:
        totals = self.totals
        return max(range(len(totals)), key=totals.__getitem__) if totals else 0

    @property
    def peak(self) -> int:
        return max(self.totals, default=0)

    @property
    def at_peak(self) -> dict:
        return dict(self.rows[self.peak_index]) if self.rows else dict.fromkeys(self.categories, 0)

    @property
    def category_peaks(self) -> dict:
        return {c: max((row[c] for row in self.rows), default=0) for c in self.categories}

    @property
    def start(self) -> dict:
        """Bytes alive when the call began."""
        return dict(self.rows[0]) if self.rows else dict.fromkeys(self.categories, 0)

    def as_dict(self) -> dict:
        """Plain data, to send from a rank to the kernel."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Timeline":
        return cls(data["times_us"], data["rows"], data["device"], tuple(data["categories"]))

    def plot(self, ax=None, title=None, limit=None):
        """Stacked areas per category over the call; the peak dotted, a device limit in red."""
        import matplotlib.pyplot as plt
        if ax is None:
            _, ax = plt.subplots(figsize=(7, 3))
        t0 = self.times_us[0] if self.times_us else 0
        x = [(t - t0) / 1e3 for t in self.times_us]
        shown = [c for c in self.categories if any(row[c] for row in self.rows)]
        ax.stackplot(x, *[[row[c] / 2**20 for row in self.rows] for c in shown], labels=shown,
                     step="post", alpha=0.85)
        ax.axhline(self.peak / 2**20, color="black", linestyle=":", linewidth=1)
        if limit is not None:
            ax.axhline(limit / 2**20, color="red", linewidth=1, label="limit")
        ax.set_xlabel("time in the call (ms)")
        ax.set_ylabel("MiB")
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        if title:
            ax.set_title(title, fontsize="small")
        return ax


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for a moment (C++ code writes there directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run_under(prof, fn, *args, **kwargs) -> None:
    """fn(*args, **kwargs) inside the profiler `prof`; its start and stop lines (kineto prints
    "profiler_start/stop" to fd 2) silenced."""
    with _quiet_stderr():
        prof.__enter__()
    try:
        fn(*args, **kwargs)
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)


def _storage_ptr(tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def profile(fn, *args, roles=None, device=None, **kwargs) -> Timeline:
    """Run fn(*args, **kwargs) once under torch's memory profiler; the timeline on `device`
    (default: labkit.device() inside a rank, else cpu). `roles`: see the module docstring.

    torch.autograd.profiler.profile is used directly: torch.profiler.profile imports
    torch._inductor on first use (seconds per process) to read one of its settings."""
    from torch.autograd import profiler as autograd_profiler
    from torch.profiler._memory_profiler import Action, MemoryProfile
    if device is None:
        import labkit
        device = labkit.device()
    device = torch.device(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = autograd_profiler.profile(use_cpu=True, use_device="cuda" if device.type == "cuda"
                                         else None, record_shapes=True, profile_memory=True,
                                         with_stack=True)
        run_under(prof, fn, *args, **kwargs)
        memory = MemoryProfile(prof.kineto_results)
    by_address = {}
    for category, tensors in (roles or {}).items():
        if category not in COURSE_CATEGORIES:
            raise ValueError(f"roles: unknown category {category!r}; use {COURSE_CATEGORIES}")
        for tensor in tensors:
            by_address[_storage_ptr(tensor)] = category
    categories = COURSE_CATEGORIES if roles is not None else PROFILER_CATEGORIES
    fold = _FOLD_WITH_ROLES if roles is not None else {}

    def category_of(key, version):
        storage = getattr(key, "storage", None)       # allocations torch could not tie to a tensor
        if storage is not None and storage.ptr in by_address:
            return by_address[storage.ptr]
        label = memory._categories.get(key, version) if storage is not None else None
        name = "unknown" if label is None else label.name.lower()
        if roles is None:
            return name
        return fold.get(name, "temporaries")

    times, rows, row = [], [], dict.fromkeys(categories, 0)
    for t, action, (key, version), nbytes in memory.timeline:
        if key.device != device:
            continue
        if not times or t != times[-1]:
            times.append(t)
            rows.append(dict(row))
        if action in (Action.PREEXISTING, Action.CREATE):
            row[category_of(key, version)] += nbytes
        elif action == Action.INCREMENT_VERSION:
            row[category_of(key, version)] -= nbytes
            row[category_of(key, version + 1)] += nbytes
        elif action == Action.DESTROY:
            row[category_of(key, version)] -= nbytes
        rows[-1] = dict(row)
    start = min((t for t in times if t > 0), default=0)
    return Timeline([max(t, start) // 1000 for t in times], rows, str(device), categories)


class SavedBytes:
    """Bytes autograd saved for backward, each storage counted once."""

    def __init__(self):
        self.storages = {}            # storage address -> bytes
        self.tensors = []             # (shape, dtype) of every saved tensor, in order

    @property
    def total(self) -> int:
        return sum(self.storages.values())


@contextlib.contextmanager
def saved_bytes(exclude=()):
    """Within the block, record every tensor autograd saves for backward; `exclude`: tensors not to
    count (parameters, which are kept anyway). Yields a SavedBytes."""
    counter = SavedBytes()
    skip = {_storage_ptr(t) for t in exclude}

    def pack(tensor):
        address = _storage_ptr(tensor)
        if address not in skip:
            counter.storages.setdefault(address, tensor.untyped_storage().nbytes())
            counter.tensors.append((tuple(tensor.shape), str(tensor.dtype).replace("torch.", "")))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counter
