"""The student's task objects on a graded rank (untrusted side: runs next to student code).

The grader never unpickles anything a student's process made. It asks the student's kernel for
each task object as cloudpickle bytes (`_kernel_side.export`), hands those bytes to its own ranks
unopened, and the ranks (which run student code anyway) load them here. A test cell's reference to
a task name travels as a marker that `student(name)` resolves on the rank.
"""
from __future__ import annotations

_STUDENT: dict = {}


def install(blobs: dict) -> list:
    """Load the student's objects (cloudpickle bytes) by name; returns the names loaded."""
    import cloudpickle
    for name, blob in blobs.items():
        _STUDENT[name] = cloudpickle.loads(blob)
    return sorted(_STUDENT)


def student(name: str):
    """What a pickled task-name proxy becomes on a rank: the student's object of that name
    (`name` may carry the proxy's marker prefix)."""
    name = name.split(":", 1)[-1]
    try:
        return _STUDENT[name]
    except KeyError:
        raise NameError(f"name {name!r} is not defined (the task asks you to define it)") from None


def call_named(name: str, args: list, kwargs: dict):
    """A direct call of a task function from a test cell, run on a rank of its own. Returns
    {"value": what it returned, "args": [...], "kwargs": {...}}: the arguments as the function
    left them (None where one is not plain data), so that the trusted side sees a change the
    function made to them, as the caller of a local call would (grading.trusted.write_back)."""
    value = student(name)(*args, **kwargs)
    return {"value": value, "args": [_plain_or_none(a) for a in args],
            "kwargs": {str(k): _plain_or_none(v) for k, v in kwargs.items()}}


def _plain_or_none(value):
    from labkit.runtime.plain import plain
    try:
        return plain(value)
    except TypeError:
        return None
