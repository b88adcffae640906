"""The trusted side of grading one submission: test cells run here, never in the student's kernel.

    runner = TrustedRunner(session)          # session: the submission's sandbox (see worker.py)
    verdict = runner.run_test(cell)          # {"passed": bool, "outputs": [...]}

The test cell's source (restored from the gradebook, hidden part included) is executed in this
process, in a fresh namespace holding the lab's locked setup cells. The lab's task names (the
top-level names of its solution cells) are bound to `StudentProxy` objects: calling one sends
plain-data arguments to the sandbox and brings back plain values (`torch.load(weights_only=True)`:
tensors, numbers, strings, containers; never an arbitrary object). `labkit.world(P)` here returns
a `GradingWorld`: a call that involves a task function runs on the sandbox's ranks; any other
call (a reference such as `real_all_reduce`) runs on ranks that this trusted process starts.
Assertions, checkers and references therefore run where no student code ever ran; a test cell
passes only when this process executed it to its last line.
"""
from __future__ import annotations

import ast
import base64
import builtins
import contextlib
import io
import re
import traceback
import types

import cloudpickle

from labkit.grading import _kernel_side
from labkit.grading.notebook import hidden_lines

_MARKER_RE = re.compile(rb"labkit-student:([A-Za-z_][A-Za-z0-9_]*)")
_REBUILT = {e.__name__: e for e in (ValueError, TypeError, KeyError, IndexError,
                                    ZeroDivisionError, NotImplementedError, RuntimeError,
                                    AssertionError, ArithmeticError, AttributeError,
                                    LookupError, OverflowError, NameError)}


class GradingError(Exception):
    """The lab's test cell does something the grader cannot do safely (the author's to fix)."""


class StudentCodeError(Exception):
    """The student's code raised an exception the grader does not rebuild by type."""

    def __init__(self, info: dict):
        super().__init__(f"{info.get('type')}: {info.get('message')}")
        self.info = info


class StudentTimeout(Exception):
    """The student's code ran past its time limit (and its kernel was restarted)."""


class StudentCrashed(Exception):
    """The student's kernel died (exit, crash, memory) while running the call."""


def loads_plain(payload: bytes):
    import torch
    return torch.load(io.BytesIO(payload), weights_only=True)


def dumps_plain(obj) -> str:
    import torch
    _kernel_side.plain(obj)               # raises TypeError on anything that is not plain
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def rebuild_error(info: dict) -> BaseException:
    """The student's exception, as an instance of a class of THIS process."""
    from labkit import errors
    kind, message = str(info.get("type")), str(info.get("message"))
    if kind == "RankError" and info.get("module", "").startswith("labkit"):
        return errors.RankError(message, info.get("rank"), info.get("rank_traceback", ""),
                                dict(info.get("errors") or {}))
    if kind == "RankDied" and info.get("module", "").startswith("labkit"):
        return errors.RankDied(message, info.get("rank"), info.get("exitcode"))
    if kind == "CallTimeout" and info.get("module", "").startswith("labkit"):
        return errors.CallTimeout(message, info.get("diagnosis", ""))
    if kind in ("WorldError", "PicklingError") and info.get("module", "").startswith("labkit"):
        return getattr(errors, kind)(message)
    if kind in _REBUILT and info.get("module") == "builtins":
        return _REBUILT[kind](message)
    return StudentCodeError(info)


class StudentProxy:
    """Stands for the student's object `name` in a test cell."""

    def __init__(self, session, name: str):
        self._session, self._name = session, name
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args, **kwargs):
        try:
            encoded = dumps_plain((list(args), kwargs))
        except TypeError as error:
            raise GradingError(f"the test calls {self._name}() with a value that is not plain "
                               f"data: {error}") from None
        return self._session.remote(f"__labkit_grading__.call({self._name!r}, {encoded!r})",
                                    what=f"{self._name}()")

    def __reduce__(self):
        return (_kernel_side.student_function, (_kernel_side.MARKER + self._name,))

    def __repr__(self):
        return f"<the student's {self._name}>"


class GradingTrace:
    """What `world.tracing()` returns during grading: the records of the calls made inside."""

    def __new__(cls, *args, **kwargs):
        from labkit.runtime.trace import Trace

        class _Trace(Trace):
            def __init__(self, world):
                self.world, self.records, self.complete = world, [], True

            def __enter__(self):
                self.world._traces.append(self)
                return self

            def __exit__(self, *exc):
                self.world._traces.remove(self)
                self.records.sort(key=lambda r: (r.get("t_start") or 0.0, r.get("rank", 0)))
                return False
        return _Trace(*args, **kwargs)


class GradingWorld:
    """`labkit.world(P)` inside a test cell."""

    def __init__(self, session, size, backend="auto", timeout=30.0, teaching=True):
        self._session, self.size, self.backend = session, int(size), "gloo"
        self._kwargs = {"backend": "gloo", "timeout": timeout, "teaching": teaching}
        self._traces: list = []
        self.alive = True

    def run(self, fn, *args, ranks=None, **kwargs):
        return self._dispatch("run", fn, args, kwargs, {"ranks": ranks})

    def call(self, fn, args=(), kwargs=None, ranks=None, timeout=None):
        return self._dispatch("call", fn, tuple(args), dict(kwargs or {}),
                              {"ranks": ranks, "timeout": timeout})

    def tracing(self):
        return GradingTrace(self)

    def close(self):
        pass

    def inject_fault(self, *args, **kwargs):
        raise GradingError("world.inject_fault is not available in graded test cells")

    def _dispatch(self, method, fn, args, kwargs, options):
        payload = cloudpickle.dumps((method, fn, args, kwargs, options))
        names = sorted({m.decode() for m in _MARKER_RE.findall(payload)})
        if not names:                                 # trusted code only: trusted ranks
            return self._trusted(method, fn, args, kwargs, options)
        timeout = options.get("timeout") or self._kwargs["timeout"]
        code = (f"__labkit_grading__.world_call({self.size}, {self._kwargs!r}, "
                f"{base64.b64encode(payload).decode()!r}, {names!r}, {bool(self._traces)!r})")
        value = self._session.remote(code, what=f"world.{method}({', '.join(names)})",
                                     timeout=float(timeout) + 30.0)
        for trace in self._traces:
            trace.records += list(value.get("records") or [])
        return value["results"]

    def _trusted(self, method, fn, args, kwargs, options):
        from labkit.runtime import launcher
        world = launcher.world(self.size, **self._kwargs)
        with contextlib.ExitStack() as stack:
            inner = [stack.enter_context(world.tracing()) for _ in self._traces[:1]]
            if method == "run":
                value = world.run(fn, *args, ranks=options.get("ranks"), **kwargs)
            else:
                value = world.call(fn, args=args, kwargs=kwargs, ranks=options.get("ranks"),
                                   timeout=options.get("timeout"))
        for trace in self._traces:
            for recorded in inner:
                trace.records += list(recorded.records)
        return value


def labkit_shim(session):
    """The `labkit` module as test cells see it: the real one, except `world`."""
    import labkit
    shim = types.ModuleType("labkit")
    shim.__doc__ = labkit.__doc__

    def world(n, backend="auto", timeout=30.0, teaching=True):
        return GradingWorld(session, n, backend, timeout, teaching)
    shim.world = world
    shim.shutdown_all = lambda: None
    shim.__getattr__ = lambda name: getattr(labkit, name)
    return shim


class _NoMagics:
    """`get_ipython()` in trusted setup cells: line and cell magics do nothing here."""

    def run_line_magic(self, *args, **kwargs):
        return None

    def run_cell_magic(self, *args, **kwargs):
        return None


def transform(source: str) -> str:
    if not any(line.lstrip().startswith(("%", "!")) for line in source.splitlines()):
        return source
    from IPython.core.inputtransformer2 import TransformerManager
    return TransformerManager().transform_cell(source)


class TrustedRunner:
    def __init__(self, session, task_names):
        self.session = session
        self.task_names = list(task_names)
        shim = labkit_shim(session)
        real_import = builtins.__import__

        def grading_import(name, globals=None, locals=None, fromlist=(), level=0):
            if name == "labkit" and level == 0:
                return shim
            if name.startswith("labkit.") and level == 0 and not fromlist:
                real_import(name, globals, locals, fromlist, level)
                return shim
            return real_import(name, globals, locals, fromlist, level)
        namespace_builtins = dict(builtins.__dict__, __import__=grading_import)
        self.ns = {"__name__": "__main__", "__builtins__": namespace_builtins,
                   "get_ipython": lambda: _NoMagics()}

    def run_setup(self, source: str, label: str) -> str | None:
        """A locked setup cell, here. Returns an error line, or None."""
        try:
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                exec(compile(transform(source), f"<setup {label}>", "exec"), self.ns)
        except BaseException as error:  # noqa: BLE001
            return f"{type(error).__name__}: {error}"
        return None

    def _bind_task_names(self, source: str):
        used = {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}
        wanted = [n for n in self.task_names if n in used]
        kinds = self.session.probe(wanted) if wanted else {}
        for name in wanted:
            kind = kinds.get(name, "missing")
            if kind == "callable":
                self.ns[name] = StudentProxy(self.session, name)
            elif kind == "value":
                self.ns[name] = self.session.remote(f"__labkit_grading__.fetch({name!r})",
                                                    what=name)
            else:
                self.ns.pop(name, None)      # NameError in the test, as in a fresh kernel

    def run_test(self, source: str, label: str) -> dict:
        """Run one test cell. {"passed": True} only if its last line ran in this process."""
        filename = f"<test {label}>"
        hidden = hidden_lines(source)
        self.session.begin_cell(hidden, filename)
        stdout = io.StringIO()
        finished = False
        try:
            code = compile(source, filename, "exec")
            self._bind_task_names(source)
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stdout):
                exec(code, self.ns)
            finished = True
            error = None
        except BaseException as exc:  # noqa: BLE001 (a failing test is a result)
            error = exc
        student_out = self.session.end_cell()
        outputs = []
        shown = ("" if hidden else stdout.getvalue()) + student_out
        if shown:
            outputs.append({"output_type": "stream", "name": "stdout", "text": shown[-20000:]})
        if error is not None:
            outputs.append(render_error(error, source, filename, hidden))
        return {"passed": finished and error is None, "outputs": outputs}


def render_error(error: BaseException, source: str, filename: str, hidden: set[int]) -> dict:
    """An nbformat error output that never shows a hidden line, nor a hidden failure's message."""
    lines = source.splitlines()
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == filename]
    in_hidden = any(f.lineno in hidden for f in frames)
    student = ""
    if isinstance(error, StudentCodeError):
        kind = error.info.get("type", "Error")
        student = error.info.get("traceback", "")
    else:
        kind = type(error).__name__
    if in_hidden or (not frames and hidden):
        what = ("your code raised " + kind) if isinstance(error, StudentCodeError) else (
            "it raised " + kind)
        return {"output_type": "error", "ename": "HiddenTestFailed",
                "evalue": f"a hidden test of this cell failed ({what})",
                "traceback": [f"HiddenTestFailed: a hidden test of this cell failed ({what}). "
                              "Check your function on other inputs than the visible ones."]}
    shown = [f"  line {f.lineno}: {lines[f.lineno - 1].strip()}" for f in frames
             if 0 < f.lineno <= len(lines) and f.lineno not in hidden]
    message = str(error) if not isinstance(error, StudentCodeError) else \
        str(error.info.get("message"))
    text = [f"{kind}: {message}"[:20000]]
    if shown:
        text = ["Test cell, where it failed:"] + shown + text
    if student:
        text.append("Your code's traceback:\n" + student[-8000:])
    return {"output_type": "error", "ename": kind, "evalue": message[:20000], "traceback": text}
