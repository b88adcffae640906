"""The grader's helpers inside the sandboxed kernel (untrusted side).

Everything here runs next to student code, so nothing here decides a grade: it calls the
student's functions with the arguments the trusted grader sent, and hands the results back as
plain data (tensors, numbers, strings, lists, tuples, dicts) in a `torch.save` payload that the
grader reads with `torch.load(weights_only=True)`. A student may replace these helpers; the most
they can achieve is to return other plain values, which is no more than their own functions
could have returned.
"""
from __future__ import annotations

import base64
import io
import traceback

RESULT_MIME = "application/x-labkit-grading"
MARKER = "labkit-student:"
_STUDENT: dict = {}           # name -> student object, in the kernel and in its rank processes
_MAX_DEPTH = 20


def student_function(marker: str):
    """What a pickled proxy turns into on this side: the student's object of that name."""
    name = marker[len(MARKER):]
    if name in _STUDENT:
        return _STUDENT[name]
    try:
        return _user_ns()[name]
    except (KeyError, RuntimeError):
        raise NameError(f"name {name!r} is not defined (the task asks you to define it)")


def _user_ns() -> dict:
    from IPython import get_ipython
    shell = get_ipython()
    if shell is None:
        raise RuntimeError("no kernel here")
    return shell.user_ns


def _install(blob: bytes) -> None:
    """On a rank: make the student's functions resolvable by name (see student_function)."""
    import cloudpickle
    _STUDENT.update(cloudpickle.loads(blob))


def plain(value, depth=0):
    """value as plain data, or TypeError naming what is not plain."""
    import torch
    if depth > _MAX_DEPTH:
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


def _send(obj) -> None:
    import torch
    from IPython.display import publish_display_data
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    publish_display_data({RESULT_MIME: base64.b64encode(buffer.getvalue()).decode()})


def _error(error: BaseException) -> dict:
    info = {"type": type(error).__name__, "module": type(error).__module__,
            "message": str(error)[:5000],
            "traceback": "".join(traceback.format_exception(error))[-20000:]}
    for field in ("rank", "exitcode"):
        if isinstance(getattr(error, field, None), int):
            info[field] = getattr(error, field)
    if isinstance(getattr(error, "traceback", None), str):
        info["rank_traceback"] = error.traceback[-20000:]
    if isinstance(getattr(error, "errors", None), dict):
        info["errors"] = {int(k): str(v)[-20000:] for k, v in error.errors.items()}
    if getattr(error, "diagnosis", None) is not None:
        info["diagnosis"] = str(error.diagnosis)[-20000:]
    return info


def _reply(thunk) -> None:
    try:
        result = {"value": plain(thunk())}
    except BaseException as error:  # noqa: BLE001 (a student's error is a result too)
        result = {"error": _error(error)}
    _send(result)


def probe(names: list) -> None:
    """For each name: "callable", "value" or "missing" in the student's namespace."""
    ns = _user_ns()
    _send({n: ("missing" if n not in ns else "callable" if callable(ns[n]) else "value")
           for n in names})


def fetch(name: str) -> None:
    _reply(lambda: _user_ns()[name])


def call(name: str, args_b64: str) -> None:
    """name(*args, **kwargs) with the arguments the grader sent."""
    import torch

    def run():
        args, kwargs = torch.load(io.BytesIO(base64.b64decode(args_b64)), weights_only=True)
        return _user_ns()[name](*args, **kwargs)
    _reply(run)


def world_call(size: int, world_kwargs: dict, payload_b64: str, names: list,
               trace: bool) -> None:
    """world.run / world.call of a task function on this sandbox's ranks."""
    def run():
        import cloudpickle
        import labkit
        ns = _user_ns()
        _STUDENT.update({n: ns[n] for n in names if n in ns})
        method, fn, args, kwargs, options = cloudpickle.loads(base64.b64decode(payload_b64))
        world = labkit.world(size, **world_kwargs)
        if names:
            world.run(_install, cloudpickle.dumps({n: ns[n] for n in names if n in ns}))
        records = None
        if trace:
            with world.tracing() as recorded:
                value = _invoke(world, method, fn, args, kwargs, options)
            records = [{k: _record_value(v) for k, v in r.items()} for r in recorded.records]
        else:
            value = _invoke(world, method, fn, args, kwargs, options)
        return {"results": value, "records": records}
    _reply(run)


def _invoke(world, method, fn, args, kwargs, options):
    if method == "run":
        return world.run(fn, *args, ranks=options.get("ranks"), **kwargs)
    return world.call(fn, args=args, kwargs=kwargs, ranks=options.get("ranks"),
                      timeout=options.get("timeout"))


def _record_value(value):
    try:
        return plain(value)
    except TypeError:
        return str(value)
