"""The trusted side of grading one submission: test cells run here, never in the student's kernel.

    runner = TrustedRunner(session, task_names)  # session: the submission's sandbox (worker.py)
    verdict = runner.run_test(source, label)     # {"passed": bool, "outputs": [...]}

The test cell's source (restored from the gradebook, hidden part included) is executed in this
process, in a fresh namespace holding the lab's locked setup cells. The lab's task names (the
top-level names of its solution cells) are bound to `StudentProxy` objects. `labkit.world(P)` here
returns a `GradingWorld`:
- a call that involves a task name (`world.run_each(program, shares, ring_all_reduce)`, or a
  checker that makes one) runs on ranks THIS process starts inside the sandbox (grading/ranks.py):
  each rank a user of its own, its inputs written by this process, its traffic counted by the
  operating system outside the ranks, its results read back as plain data;
- any other call (a reference such as `real_all_reduce`) runs on ranks this process starts on the
  host, where no student code ever ran;
- a direct call of a task function (`crossover_bytes(1e-4, 1e-9, 4)`) runs on a sandbox rank of its
  own, with plain arguments and a plain result.
The student's kernel only hands over its task objects as bytes, which this process never loads.
Assertions, checkers, references and expected values run where no student code ever ran; a test
cell passes only when this process executed it to its last line.
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import io
import re
import traceback
import types

import cloudpickle

from labkit.grading import rankside
from labkit.grading.notebook import hidden_lines

MARKER = "labkit-student:"
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
    from labkit.runtime.plain import loads
    return loads(payload)


def rebuild(error):
    """A RankError of a direct call as the student's own exception type, when it is a builtin one
    a test may expect (`ValueError` for bad input); otherwise the RankError itself."""
    from labkit.errors import RankError
    if isinstance(error, RankError) and error.module == "builtins" and error.kind in _REBUILT:
        rebuilt = _REBUILT[error.kind](_student_message(error))
        rebuilt.student_traceback = error.traceback
        return rebuilt
    return error


def _student_message(error) -> str:
    """The exception's own message, out of RankError's 'rank 0 raised X: message' headline."""
    text = str(error).split("\n\n", 1)[0]
    prefix = f"rank {error.rank} raised {error.kind}: "
    return text[len(prefix):] if text.startswith(prefix) else text


class StudentProxy:
    """Stands for the student's object `name` in a test cell."""

    def __init__(self, session, name: str):
        self._session, self._name = session, name
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args, **kwargs):
        return self._session.call_student(self._name, list(args), dict(kwargs))

    def __reduce__(self):
        return (rankside.student, (MARKER + self._name,))

    def __repr__(self):
        return f"<the student's {self._name}>"


def write_back(original, after, depth: int = 0) -> None:
    """Make `original` (an argument of a direct call, in this process) hold what the student's
    function left in its copy (`after`, plain data the rank sent back), in place: dicts and lists
    are updated, tensors copied into. Immutable values and values of another type are left
    alone (a local call could not have changed them in place either); None means the rank could
    not send that argument back."""
    import torch
    if after is None or depth > 20:
        return
    if isinstance(original, dict) and isinstance(after, dict):
        for key in [k for k in original if k not in after]:
            del original[key]
        for key, value in after.items():
            if key in original and _same_kind(original[key], value):
                write_back(original[key], value, depth + 1)
            elif key not in original or not _equal(original[key], value):
                original[key] = value
    elif isinstance(original, list) and isinstance(after, (list, tuple)):
        if len(original) != len(after):
            original[:] = list(after)
            return
        for i, value in enumerate(after):
            if _same_kind(original[i], value):
                write_back(original[i], value, depth + 1)
            elif not _equal(original[i], value):
                original[i] = value
    elif isinstance(original, tuple) and isinstance(after, (list, tuple)) and \
            len(original) == len(after):
        for item, value in zip(original, after):
            write_back(item, value, depth + 1)
    elif isinstance(original, torch.Tensor) and isinstance(after, torch.Tensor):
        if _equal(original, after):
            return
        with torch.no_grad():
            if original.shape == after.shape and original.dtype == after.dtype:
                original.copy_(after)
            else:
                original.set_(after.clone())


def _same_kind(a, b) -> bool:
    import torch
    return (isinstance(a, dict) and isinstance(b, dict)) or \
        (isinstance(a, list) and isinstance(b, (list, tuple))) or \
        (isinstance(a, tuple) and isinstance(b, (list, tuple)) and len(a) == len(b)) or \
        (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))


def _equal(a, b) -> bool:
    """`a` (the caller's value, compared as the plain data it was sent as) equals `b`."""
    import torch
    from labkit.runtime.plain import plain
    try:
        a = plain(a)
    except TypeError:
        return False
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or \
                a.shape != b.shape or a.dtype != b.dtype:
            return False
        bits = [t.detach().cpu().reshape(-1).contiguous().view(torch.uint8) for t in (a, b)]
        return torch.equal(*bits)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True                                   # NaN is NaN: nothing to write back
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 (values that cannot be compared are different)
        return False


class GradingTrace:
    """What `world.tracing()` returns during grading: the records of the calls made inside
    (records written by the ranks: hints for messages, never evidence for a point)."""

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
    """`labkit.world(P)` inside a test cell (see the module docstring)."""

    def __init__(self, session, size, backend="auto", timeout=30.0, teaching=True):
        self._session, self.size, self.backend = session, int(size), "gloo"
        self._kwargs = {"backend": "gloo", "timeout": float(timeout), "teaching": bool(teaching)}
        self.teaching, self.timeout = bool(teaching), float(timeout)
        self._traces: list = []
        self._measuring = 0       # open world.traffic() blocks: their calls run in the sandbox
        self.alive = True

    def run(self, fn, *args, ranks=None, **kwargs):
        return self._dispatch("run", fn, args, kwargs, {"ranks": ranks})

    def call(self, fn, args=(), kwargs=None, ranks=None, timeout=None):
        return self._dispatch("call", fn, tuple(args), dict(kwargs or {}),
                              {"ranks": ranks, "timeout": timeout})

    def run_each(self, fn, shares, *args, timeout=None, **kwargs):
        return self._dispatch("run_each", fn, args, kwargs, {"timeout": timeout},
                              shares=list(shares))

    def tracing(self):
        return GradingTrace(self)

    def traffic(self):
        """Counted on the sandbox's ranks, where calls of student code run; every call made
        inside the block runs there (a checker's calibration as much as the graded call), so
        what is measured is what ran."""
        grading_world, measure = self, self._sandbox().traffic()

        class _Measured:
            def __enter__(self):
                grading_world._measuring += 1
                return measure.__enter__()

            def __exit__(self, *exc):
                grading_world._measuring -= 1
                return measure.__exit__(*exc)
        return _Measured()

    def close(self):
        pass

    def inject_fault(self, *args, **kwargs):
        raise GradingError("world.inject_fault is not available in graded test cells")

    def _sandbox(self):
        return self._session.sandbox_world(self.size, self._kwargs["teaching"],
                                           self._kwargs["timeout"])

    def _dispatch(self, method, fn, args, kwargs, options, shares=None):
        payload = cloudpickle.dumps((fn, args, kwargs, shares))
        names = sorted({m.decode() for m in _MARKER_RE.findall(payload)})
        sandboxed = bool(names) or self._measuring > 0
        if sandboxed:
            world = self._sandbox()
            if names:
                self._session.install(world, names)
        else:                                          # trusted code only: trusted ranks
            from labkit.runtime import launcher
            world = launcher.world(self.size, **self._kwargs)
        timeout = options.get("timeout")
        what = f"world.{method}({', '.join(names) or getattr(fn, '__name__', 'a function')})"
        with contextlib.ExitStack() as stack:
            inner = [stack.enter_context(world.tracing())
                     for _ in self._traces[:1]] if not sandboxed else []
            try:
                if method == "run_each":
                    value = world.run_each(fn, shares, *args, timeout=timeout, **kwargs)
                elif method == "run":
                    value = world.run(fn, *args, ranks=options.get("ranks"), **kwargs)
                else:
                    value = world.call(fn, args=args, kwargs=kwargs, ranks=options.get("ranks"),
                                       timeout=timeout)
            except BaseException as error:
                if sandboxed:
                    self._session.note_failure(error, what)
                raise
            finally:
                if sandboxed:
                    self._session.student_output(world)
        for trace in self._traces:
            if sandboxed:   # a sandbox world's replies carry their records (hints only)
                trace.records += [r for recs in world.last_records.values() for r in recs]
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
        exported = self.session.exported() if wanted else {}
        for name in wanted:
            entry = exported.get(name, {"kind": "missing"})
            if entry["kind"] in ("callable", "unsendable"):
                self.ns[name] = StudentProxy(self.session, name)   # unsendable: said when used
            elif entry["kind"] == "value":
                self.ns[name] = entry["value"]
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
        verdict = {"passed": finished and error is None, "outputs": outputs}
        if error is not None:
            outputs.append(render_error(error, source, filename, hidden, label))
            if failed_in_hidden(error, filename, hidden):   # instructors only (worker.py)
                verdict["hidden_failure"] = hidden_failure_record(error, source, filename,
                                                                  hidden, label)
        return verdict


_SEED = re.compile(r"case seed (\d+)")
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]*)", line \d+')
_LABKIT_FILE = re.compile(r"[/\\]labkit[/\\](?:[A-Za-z0-9_]+[/\\])*[A-Za-z0-9_]+\.py$")


def without_labkit_frames(text: str) -> str:
    """A traceback text without the frames of labkit's own files (checkers' rank programs, the
    grader's plumbing): the student sees their own lines and the message, not labkit's code."""
    out, skipping = [], False
    for line in text.splitlines():
        frame = _FRAME.match(line)
        if frame:
            skipping = bool(_LABKIT_FILE.search(frame["path"]))
            if not skipping:
                out.append(line)
            continue
        if skipping and line.startswith("    "):       # the frame's source line and carets
            continue
        skipping = False
        out.append(line)
    return "\n".join(out)


def _cell_frames(error: BaseException, filename: str) -> list:
    return [f for f in traceback.extract_tb(error.__traceback__) if f.filename == filename]


def _kind_message(error: BaseException) -> tuple[str, str, str]:
    """(exception class, message, the student's traceback) as the test cell met them."""
    if isinstance(error, StudentCodeError):
        return (str(error.info.get("type", "Error")), str(error.info.get("message")),
                str(error.info.get("traceback", "") or ""))
    return type(error).__name__, str(error), getattr(error, "student_traceback", "") or ""


def failed_in_hidden(error: BaseException, filename: str, hidden: set[int]) -> bool:
    """Whether the failure belongs to the hidden region: a frame of the test cell in it, or no
    frame of the cell at all in a cell that has one (its origin is unknown: kept secret)."""
    frames = _cell_frames(error, filename)
    return any(f.lineno in hidden for f in frames) or (not frames and bool(hidden))


def hidden_failure_record(error: BaseException, source: str, filename: str, hidden: set[int],
                          grade_id: str) -> dict:
    """What an instructor needs to see why a hidden test failed, and that never reaches the
    student: the exception, its message, the case seed it names, the hidden lines it went
    through (results JSON key "instructor_only", labkit_hidden_failures in the gradebook)."""
    lines = source.splitlines()
    kind, message, student = _kind_message(error)
    seed = _SEED.search(message) or _SEED.search(student)
    return {"grade_id": grade_id, "type": kind, "message": message[:4000],
            "seed": int(seed[1]) if seed else None,
            "traceback": [f"line {f.lineno}: {lines[f.lineno - 1].strip()}"
                          for f in _cell_frames(error, filename)
                          if 0 < f.lineno <= len(lines)][:20],
            "student_traceback": student[-4000:]}


def render_error(error: BaseException, source: str, filename: str, hidden: set[int],
                 grade_id: str | None = None) -> dict:
    """An nbformat error output that never shows a hidden line, nor a hidden failure's message.
    A visible failure shows the test cell's lines, the message and the student's own frames."""
    lines = source.splitlines()
    grade_id = grade_id or (filename[len("<test "):-1] if filename.startswith("<test ") else "")
    frames = _cell_frames(error, filename)
    kind, message, student = _kind_message(error)
    if failed_in_hidden(error, filename, hidden):
        what = ("your code raised " + kind) if isinstance(error, StudentCodeError) else (
            "it raised " + kind)
        return {"output_type": "error", "ename": "HiddenTestFailed",
                "evalue": f"a hidden test of this cell failed ({what})",
                "traceback": [f"HiddenTestFailed: a hidden test of this cell failed ({what}). "
                              "Check your function on other inputs than the visible ones."]}
    shown = [f"  line {f.lineno}: {lines[f.lineno - 1].strip()}" for f in frames
             if 0 < f.lineno <= len(lines) and f.lineno not in hidden]
    message = without_labkit_frames(message)
    text = [f"{kind}: {message}"[:20000]]
    if shown:
        text = [f"Test cell {grade_id}, where it failed:" if grade_id else
                "Test cell, where it failed:"] + shown + text
    student = without_labkit_frames(student)
    if student.strip() and student.strip() not in message:
        text.append("Your code's traceback:\n" + student[-8000:])
    return {"output_type": "error", "ename": kind, "evalue": message[:20000], "traceback": text}
