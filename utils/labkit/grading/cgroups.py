"""Memory and process limits for a whole submission: cgroup v1 or v2, whichever this host has.

    found = detect()                 # Cgroups(version=1 or 2 or None, bases={...}, why="...")
    leaf = make_group(found, "labkit-grading/<run>/<name>", memory_bytes=4 << 30, processes=512)
    join(leaf)                       # this process (and what it starts) is now bounded by them
    empty_and_remove(leaf)           # sandbox.py: every process in it killed, then rmdir

What each version enforces on the group (the kernel does it for every process in the group
together, the ones started later included):
- v1 (a `memory` and a `pids` hierarchy under /sys/fs/cgroup, writable by root):
  `memory.limit_in_bytes`, `memory.swappiness` = 0, `pids.max`. One folder per controller.
- v2 (the unified hierarchy: `cgroup.controllers` lists `memory` and `pids`): `memory.max`,
  `memory.swap.max` = 0, `pids.max`, in one folder. Its parents must pass both controllers down
  (`cgroup.subtree_control`); `make_group` enables them on every folder it creates, and on the
  base only where they are not on already. The base is $LABKIT_CGROUP_ROOT (a delegated subtree:
  a systemd unit with `Delegate=yes`, or a container's own cgroup namespace) or else the cgroup2
  mount at /sys/fs/cgroup itself. v2's "no internal processes" rule: a cgroup that passes
  controllers down may hold no process of its own, so the base must be one without processes
  (the root of the hierarchy always qualifies); where it has processes and the controllers are
  not passed down yet, `detect()` says so and the limits fall back to per-process rlimits.
  `detect()` only reads; `make_group` writes.
- neither (no root, or a v2 base without both controllers, or a hybrid host whose cgroup2 mount
  at /sys/fs/cgroup/unified has no controllers and no v1 hierarchy is writable): `RLIMIT_AS` per
  process and `RLIMIT_NPROC` per slot user (sandbox.py).

v1 is chosen where both exist (a hybrid host keeps its controllers in v1). The paths are
parameters, so tests lay out a real folder tree the way each version does and run the same code.
"""
from __future__ import annotations

import dataclasses
import os

ROOT = "/sys/fs/cgroup"
CONTROLLERS = ("memory", "pids")
ENV_ROOT = "LABKIT_CGROUP_ROOT"      # a delegated cgroup2 subtree to work under (v2 only)


@dataclasses.dataclass
class Cgroups:
    version: int | None              # 1, 2, or None (no usable memory+pids controllers)
    bases: dict                      # controller -> folder our groups go under (v2: one folder)
    why: str                         # what was found, in a sentence (labkit doctor shows it)

    @property
    def enforced(self) -> str:
        """The files that bound a group here, in words."""
        if self.version == 1:
            return "memory.limit_in_bytes, memory.swappiness=0 and pids.max (cgroup v1)"
        if self.version == 2:
            return "memory.max, memory.swap.max=0 and pids.max (cgroup v2)"
        return "none: per-process RLIMIT_AS and per-user RLIMIT_NPROC only"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(path: str, value, missing_ok: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(str(value))
    except FileNotFoundError:
        if not missing_ok:
            raise


def detect(root: str | None = None, v2_base: str | None = None, can_write=None) -> Cgroups:
    """What this host offers. root: the cgroup mount point; v2_base: the cgroup2 folder to work
    under (default $LABKIT_CGROUP_ROOT, else root); can_write(path): root may write there
    (default: os.access W_OK, and euid 0)."""
    root = ROOT if root is None else root
    if can_write is None:
        def can_write(path):
            return os.geteuid() == 0 and os.access(path, os.W_OK)
    v1 = {c: os.path.join(root, c) for c in CONTROLLERS
          if os.path.isfile(os.path.join(root, c, "cgroup.procs"))}
    unified = os.path.join(root, "unified", "cgroup.controllers")
    hybrid = "" if not os.path.isfile(unified) else (
        f" (a hybrid host: the cgroup2 mount at {os.path.dirname(unified)} has controllers "
        f"[{_read(unified).strip()}], not memory and pids)")
    if len(v1) == len(CONTROLLERS):
        if all(can_write(p) for p in v1.values()):
            return Cgroups(1, v1, f"cgroup v1: memory and pids hierarchies at {root}{hybrid}")
        return Cgroups(None, {}, f"cgroup v1 at {root}, not writable by this user")
    base = v2_base or os.environ.get(ENV_ROOT) or root
    listed = os.path.join(base, "cgroup.controllers")
    if not os.path.isfile(listed):
        return Cgroups(None, {}, f"no cgroup v1 memory+pids hierarchy and no cgroup2 at "
                                 f"{base}{hybrid}")
    available = _read(listed).split()
    missing = [c for c in CONTROLLERS if c not in available]
    if missing:
        return Cgroups(None, {}, f"cgroup v2 at {base} lacks the {', '.join(missing)} "
                                 f"controller(s) (it has: {' '.join(available) or 'none'})")
    if not can_write(base):
        return Cgroups(None, {}, f"cgroup v2 at {base}, not writable by this user (set "
                                 f"{ENV_ROOT} to a subtree delegated to it)")
    passed = [c.lstrip("+") for c in _read(os.path.join(base, "cgroup.subtree_control")).split()]
    is_root = not os.path.exists(os.path.join(base, "cgroup.type"))   # the root has no type
    if (not is_root and any(c not in passed for c in CONTROLLERS)
            and _read(os.path.join(base, "cgroup.procs")).split()):
        return Cgroups(None, {}, f"cgroup v2 at {base} holds processes of its own, so it cannot "
                                 f"pass memory and pids down to groups below it (v2's no-internal-"
                                 f"processes rule): point {ENV_ROOT} at a delegated subtree "
                                 f"without processes")
    return Cgroups(2, {c: base for c in CONTROLLERS}, f"cgroup v2 at {base}")


def _pass_down(folder: str, only_if_missing: bool = False) -> None:
    """Enables memory and pids in folder's cgroup.subtree_control (v2)."""
    path = os.path.join(folder, "cgroup.subtree_control")
    on = [c.lstrip("+") for c in _read(path).split()]   # the kernel lists them without "+"
    todo = [c for c in CONTROLLERS if c not in on] if only_if_missing else list(CONTROLLERS)
    if todo:
        _write(path, " ".join("+" + c for c in todo))


def make_group(found: Cgroups, relative: str, memory_bytes: int | None = None,
               processes: int | None = None) -> list[str]:
    """Creates the group `relative` (e.g. "labkit-grading/<run>/<name>") under each base and
    writes its limits; returns the folders a process joins (v1: one per controller, v2: one).
    An existing group is reused with its limits rewritten."""
    if found.version is None:
        return []
    if found.version == 2:
        base = found.bases["memory"]
        parts = relative.strip("/").split("/")
        _pass_down(base, only_if_missing=True)
        for depth in range(1, len(parts)):          # the folders above the leaf pass both down
            folder = os.path.join(base, *parts[:depth])
            os.makedirs(folder, exist_ok=True)
            _pass_down(folder, only_if_missing=True)
        leaf = os.path.join(base, *parts)
        os.makedirs(leaf, exist_ok=True)
        if memory_bytes is not None:
            _write(os.path.join(leaf, "memory.max"), int(memory_bytes))
            _write(os.path.join(leaf, "memory.swap.max"), 0, missing_ok=True)   # no swap built
        if processes is not None:
            _write(os.path.join(leaf, "pids.max"), int(processes))
        return [leaf]
    leaves = []
    for controller, base in found.bases.items():
        if (controller == "memory" and memory_bytes is None) or (
                controller == "pids" and processes is None):
            continue
        leaf = os.path.join(base, relative.strip("/"))
        os.makedirs(leaf, exist_ok=True)
        if controller == "memory":
            _write(os.path.join(leaf, "memory.limit_in_bytes"), int(memory_bytes))
            _write(os.path.join(leaf, "memory.swappiness"), 0, missing_ok=True)
        else:
            _write(os.path.join(leaf, "pids.max"), int(processes))
        leaves.append(leaf)
    return leaves


def join(folders: list[str], pid: int | None = None) -> None:
    """Moves a process (default: this one) into each group."""
    for folder in folders:
        _write(os.path.join(folder, "cgroup.procs"), os.getpid() if pid is None else pid)


def limits_of(folder: str) -> dict:
    """The limits a group's files hold now, read back ({"memory": bytes or "max", "pids": ...})."""
    out = {}
    files = (("memory", ("memory.max", "memory.limit_in_bytes")), ("pids", ("pids.max",)))
    for key, names in files:
        for name in names:
            text = _read(os.path.join(folder, name)).strip()
            if text:
                out[key] = int(text) if text.isdigit() else text
                break
    return out
