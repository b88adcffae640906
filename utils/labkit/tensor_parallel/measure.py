"""Measuring a tensor-parallel layer on CPU: activation bytes, peak memory, bytes written.

    kept = saved_activation_bytes(lambda: block(x), exclude=block.parameters())
    peak = peak_bytes(lambda: loss_fn(logits, targets))
    before = bytes_written(); ...; sent = bytes_written() - before     # rank side, Linux

- `saved_activation_bytes`: what autograd keeps for backward, read through
  torch.autograd.graph.saved_tensors_hooks; every storage counted once (q, k and v may be views
  of one tensor), parameters left out. This is the "activation memory" of chapter 3.
- `peak_bytes`: the most bytes of tensors alive at once during a call, above what was alive
  before it; every tensor an op creates is seen through a TorchDispatchMode and forgotten when
  Python frees it. On GPUs, torch.cuda.max_memory_allocated() measures the same (plus the
  allocator's rounding).
- `bytes_written`: this process's write counter (`wchar` in /proc/self/io): socket writes, and
  also anything the rank prints. Read inside a rank, it is a hint; the lab's checkers count
  from outside the ranks.
"""
from __future__ import annotations

import weakref

import torch
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode


def _storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), t.device.type)


def saved_activation_bytes(fn, exclude=(), details=False):
    """Bytes autograd saves for backward while `fn()` runs (each storage once, `exclude` not).

    Returns the byte count, or (bytes, [(shape, dtype, bytes) per storage]) with details=True.
    The output of fn() is dropped: call backward in a separate run if you need gradients."""
    excluded = {_storage_key(t) for t in exclude}
    kept = {}

    def pack(t):
        key = _storage_key(t)
        if key not in excluded and key not in kept:
            kept[key] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), key[1])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    total = sum(nbytes for _, _, nbytes in kept.values())
    return (total, sorted(kept.values(), key=lambda row: -row[2])) if details else total


class _LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()

    def _track(self, t):
        key = _storage_key(t)
        if key in self.seen or key[1] == 0:
            return
        self.seen.add(key)
        self.live += key[1]
        self.peak = max(self.peak, self.live)
        weakref.finalize(t.untyped_storage(), self._free, key)

    def _free(self, key):
        self.seen.discard(key)
        self.live -= key[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            # views and in-place results share an input's storage: nothing new was allocated
            if isinstance(t, torch.Tensor) and t.device.type != "meta" \
                    and _storage_key(t) not in inputs:
                self._track(t)
        return out


def peak_bytes(fn):
    """The most bytes of tensors created during `fn()` alive at the same time. Returns
    (peak, result of fn)."""
    mode = _LiveBytes()
    with mode:
        result = fn()
    return mode.peak, result


def bytes_written() -> int:
    """This process's bytes written so far (`wchar` in /proc/self/io); Linux only."""
    with open("/proc/self/io") as counters:
        for line in counters:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")
