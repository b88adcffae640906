"""Lab 8 asks students to write publication and resume themselves: while its checkers run a
student's code, the course's reference versions (store.py, resume.py) refuse to run.

    with switched_off("Lab 8, task 1"):      # in a checker's rank program, around student code
        student_commit(...)                  # a call of store.commit inside raises CheckpointError
"""
from __future__ import annotations

import contextlib

_OFF: str | None = None


def guard(name: str) -> None:
    """Called first by every reference function that a lab task asks students to write."""
    if _OFF is not None:
        from labkit.checkpoint.layout import CheckpointError
        raise CheckpointError(f"{_OFF} asks you to write this yourself: labkit.checkpoint's "
                              f"{name} is the course's version and is switched off in this "
                              "task's tests (layout helpers such as snapshot_id, check_name and "
                              "sha256_bytes stay available)")


@contextlib.contextmanager
def switched_off(task: str):
    global _OFF
    previous, _OFF = _OFF, task
    try:
        yield
    finally:
        _OFF = previous
