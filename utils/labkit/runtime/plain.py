"""Plain data: what crosses from code that is not trusted to code that is.

Tensors, numbers, strings, bytes, None, and lists, tuples and dicts of them. `dumps`/`loads` use
`torch.save` and `torch.load(weights_only=True)`, which rebuild nothing else: reading a value sent
this way runs none of the sender's code (pickle would).
"""
from __future__ import annotations

import io

MAX_DEPTH = 20


def plain(value, depth: int = 0):
    """`value` as plain data (tensors detached, on CPU, contiguous), or TypeError naming what is
    not plain."""
    import torch
    if depth > MAX_DEPTH:
        raise TypeError("the value is nested too deeply")
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone().contiguous()
    if isinstance(value, torch.Size):
        return tuple(int(v) for v in value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if type(value).__module__ == "numpy":
        import numpy
        if isinstance(value, numpy.ndarray):
            return torch.from_numpy(value.copy())
        if isinstance(value, numpy.generic):
            return value.item()
    if isinstance(value, (list, tuple)):
        items = [plain(v, depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {plain(k, depth + 1): plain(v, depth + 1) for k, v in value.items()}
    raise TypeError(f"a value of type {type(value).__name__} cannot be graded; "
                    "return tensors, numbers, strings, lists, tuples or dicts")


def dumps(value) -> bytes:
    import torch
    buffer = io.BytesIO()
    torch.save(plain(value), buffer)
    return buffer.getvalue()


def loads(data: bytes):
    import torch
    return torch.load(io.BytesIO(data), weights_only=True)
