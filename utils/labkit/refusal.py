"""Chapter helpers refused inside a graded call: a task that asks for what a chapter's module
already does must not be answered by calling that module.

    with refusal.refused(fn, ep, ("exchange_counts", "all_to_all"), "lab 1, task 3 asks ..."):
        return fn(rows, dest)                  # on a rank: the student's function, under refusal

For the length of the block, each named function of `module` is replaced by one that raises
RuntimeError(message), so a call reached as an attribute (`ep.all_to_all(...)`, `detect.x(...)`)
is refused; before the block, `fn` is searched (`holds`) for the real functions held by name
(`from labkit.moe.ep import all_to_all` puts the object itself in the student's globals), and the
call is refused at once when it holds one. After the block the functions are put back; a block
that put them back itself (`importlib.reload(module)`) is refused too.

Used by lab 1, task 3 (labkit.collectives.checks: chapter 7's dispatch helpers) and lab 9,
tasks 1 and 2 (labkit.faults.rates: chapter 9's detection rules, `labkit.faults.detect`).
The search is of what the student's objects name, three levels down (functions, the functions
and classes they name, theirs), not a sandbox: a rank that runs student code is one anyway.
"""
from __future__ import annotations

import contextlib
import functools
import types


def functions_of(module) -> tuple:
    """The public functions defined in `module` (not the ones it imports)."""
    return tuple(name for name, value in vars(module).items()
                 if not name.startswith("_") and isinstance(value, types.FunctionType)
                 and value.__module__ == module.__name__)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def _code_names(code) -> set:
    """Global names a code object and the functions defined inside it use."""
    names, todo = set(), [code]
    while todo:
        current = todo.pop()
        names.update(current.co_names)
        todo += [c for c in current.co_consts if isinstance(c, types.CodeType)]
    return names


def _named(obj) -> list:
    """What `obj` names one level down: for a function, the values of the globals its code uses,
    its closure and its defaults; for a class, its attributes (and its bases'); for a bound
    method or partial, the function; for a container, its items."""
    if isinstance(obj, (types.MethodType, classmethod, staticmethod)):
        return [obj.__func__]
    if isinstance(obj, property):
        return [f for f in (obj.fget, obj.fset, obj.fdel) if f is not None]
    if isinstance(obj, type):
        return [value for klass in obj.__mro__ if klass is not object
                for value in vars(klass).values()]
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    code = getattr(obj, "__code__", None)
    if not isinstance(code, types.CodeType):
        return []
    found = []
    names = _code_names(code)
    found += [value for name, value in getattr(obj, "__globals__", {}).items() if name in names]
    found += [cell.cell_contents for cell in (getattr(obj, "__closure__", None) or ())
              if _filled(cell)]
    found += list(getattr(obj, "__defaults__", None) or ())
    found += list((getattr(obj, "__kwdefaults__", None) or {}).values())
    return found


def holds(obj, targets, depth: int = 3) -> bool:
    """Whether `obj` (a function, a class, a method), or what it names `depth` levels down,
    is one of `targets` (compared by identity)."""
    wanted = {id(t) for t in targets}
    seen, todo = set(), [obj]
    for _ in range(depth + 1):
        following = []
        for item in todo:
            if id(item) in wanted:
                return True
            if id(item) in seen or isinstance(item, (types.ModuleType, str, bytes, int, float)):
                continue
            seen.add(id(item))
            following += _named(item)
        todo = following
    return False


@contextlib.contextmanager
def refused(fn, module, names, message: str):
    """Refuse `module`'s functions `names` (RuntimeError(message)) for the block; refuse at once
    when `fn` holds one of them by name (module docstring)."""
    real = {name: getattr(module, name) for name in names}

    def refuse(*_args, **_kwargs):
        raise RuntimeError(message)
    if holds(fn, list(real.values())):
        refuse()
    for name in real:
        setattr(module, name, refuse)
    try:
        yield
        put_back = sorted(name for name in real if getattr(module, name) is not refuse)
        if put_back:
            raise RuntimeError(f"{message} (and {', '.join(put_back)} were put back during the "
                               "call)")
    finally:
        for name, value in real.items():
            setattr(module, name, value)
