"""The grader's helper inside the student's sandboxed kernel (untrusted side).

It does one thing: hand over the task objects the student defined, as bytes. Everything here runs
next to student code, so nothing here decides a grade: the bytes are loaded only by ranks the
grader starts (grading/rankside.py), and only plain data comes back from those. A student who
replaces this helper can hand over other objects, which is no more than defining other functions.
"""
from __future__ import annotations

import base64
import io

RESULT_MIME = "application/x-labkit-grading"


def _user_ns() -> dict:
    from IPython import get_ipython
    shell = get_ipython()
    if shell is None:
        raise RuntimeError("no kernel here")
    return shell.user_ns


def _send(obj) -> None:
    import torch
    from IPython.display import publish_display_data
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    publish_display_data({RESULT_MIME: base64.b64encode(buffer.getvalue()).decode()})


def export(names: list) -> None:
    """For each name: {"kind": "callable", "blob": cloudpickle bytes}, {"kind": "value",
    "value": plain data}, {"kind": "missing"} or {"kind": "unsendable", "why": text}."""
    import cloudpickle
    from labkit.runtime.plain import plain
    ns = _user_ns()
    found = {}
    for name in names:
        if name not in ns:
            found[name] = {"kind": "missing"}
            continue
        obj = ns[name]
        try:
            if callable(obj):
                found[name] = {"kind": "callable", "blob": cloudpickle.dumps(obj)}
            else:
                found[name] = {"kind": "value", "value": plain(obj)}
        except Exception as error:  # noqa: BLE001 (said to the student when the test uses it)
            found[name] = {"kind": "unsendable", "why": f"{type(error).__name__}: {error}"[:2000]}
    _send(found)
