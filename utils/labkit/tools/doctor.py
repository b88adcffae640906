"""`labkit doctor`: can this machine run the course, and grade it? One line per check.

    labkit doctor                         # the course's checks and the grader's
    labkit doctor --world 4               # for 4 ranks: memory per rank, a 4-rank gloo world
    labkit doctor --db postgresql://grader@db.example/course   # and the shared gradebook answers

Each line: the verdict (ok, warn, FAIL, skip), what was checked, what was found and, for anything
not ok, the fix. The first step of a GPU runner's course run (.github/workflows/gpu-course.yml).

Exit code: 0 the course runs here and `labkit grade` can isolate submissions; 1 the course cannot
run here (a FAIL marked "course"); 2 the course runs, but grading cannot isolate (a FAIL marked
"grade": no root, no unshare, useradd or nsenter, an unreachable --db). warn and skip never
change it (no usable cgroup v1 or v2 memory+pids is a warn: limits then hold per process, not
per submission; the cgroups line says which version holds and with which files).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time

CHROMIUM = os.environ.get("LABKIT_CHROMIUM", "/usr/lib/chromium/chromium")
MIN_PYTHON = (3, 10)
GIB = 1 << 30
RANK_GIB_WARN, RANK_GIB_FAIL = 1.5, 0.5      # free memory per rank: a small-scale course rank
#                                              uses about 0.3-0.8 GiB (torch + its tensors)


@dataclasses.dataclass
class Check:
    verdict: str        # "ok" | "warn" | "FAIL" | "skip"
    name: str
    found: str
    fix: str = ""
    needed_for: str = ""   # "course" | "grade": what a FAIL stops

    def line(self) -> str:
        text = f"{self.verdict:<4}  {self.name:<9} {self.found}"
        return text + (f"\n      fix: {self.fix}" if self.fix and self.verdict != "ok" else "")


# --- the checks (each returns one Check; the inputs are parameters so tests can vary them) --
def check_python(version=None) -> Check:
    version = tuple(version or sys.version_info[:3])
    found = "Python " + ".".join(map(str, version))
    if version[:2] < MIN_PYTHON:
        return Check("FAIL", "python", found, "install Python 3.11 (the course needs >= "
                     f"{'.'.join(map(str, MIN_PYTHON))}) and recreate the environment", "course")
    return Check("ok", "python", found + f" ({sys.executable})")


def torch_pin() -> str | None:
    """The torch version this installed labkit asks for (pyproject's `torch==X`), if any."""
    try:
        from importlib.metadata import PackageNotFoundError, requires
        for requirement in requires("labkit") or []:
            name, _, pin = requirement.partition("==")
            if name.strip() == "torch" and pin:
                return pin.split(";")[0].strip()
    except (ImportError, PackageNotFoundError):
        return None
    return None


def check_torch(version: str | None = None, pin: str | None = None) -> Check:
    if version is None:
        try:
            import torch
            version = torch.__version__
        except ImportError as error:
            return Check("FAIL", "torch", f"not importable ({error})",
                         "pip install -e . (in the course repository)", "course")
    pin = pin if pin is not None else torch_pin()
    if pin and version.split("+")[0] != pin:
        return Check("warn", "torch", f"torch {version}; the course is measured on {pin}",
                     f"pip install 'torch=={pin}' (figures and tolerances were set on it)")
    return Check("ok", "torch", f"torch {version}")


def _rank_report():
    """Run on each rank of a doctor's world: who it is, its device, its free GPU memory."""
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    t = torch.ones(1) * (rank + 1)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    report = {"rank": rank, "sum": float(t.item()), "device": "cpu"}
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        index = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        report.update(device=f"cuda:{index} {torch.cuda.get_device_name(index)}",
                      free_gib=free / GIB, total_gib=total / GIB)
    return report


def _start_world(world_size: int, backend: str) -> tuple[list | None, str, float]:
    started = time.monotonic()
    try:
        import labkit
        world = labkit.world(world_size, backend=backend, timeout=120.0)
        try:
            reports = world.run(_rank_report)
        finally:
            world.close()
    except Exception as error:  # noqa: BLE001 (the doctor reports whatever went wrong)
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}", 0.0
    return reports, "", time.monotonic() - started


def check_gloo(world_size: int = 2) -> Check:
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        return Check("FAIL", "gloo", "this torch has no gloo backend",
                     "install the pinned torch from PyPI (pip install -e .)", "course")
    reports, error, seconds = _start_world(world_size, "gloo")
    expected = world_size * (world_size + 1) / 2
    if reports is None or any(r["sum"] != expected for r in reports):
        return Check("FAIL", "gloo", f"a {world_size}-rank gloo world did not work: "
                     f"{error or reports}", "check that 127.0.0.1 is up (loopback) and that "
                     "nothing blocks local TCP ports; rerun with --world 1 to isolate", "course")
    return Check("ok", "gloo", f"{world_size} ranks started, all_reduce correct "
                 f"({seconds:.1f} s)")


def check_nccl(world_size: int = 2) -> Check:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return Check("skip", "nccl", "no torch")
    if not torch.cuda.is_available():
        return Check("skip", "nccl", "no GPU here: the course runs on CPU with gloo "
                     "(BACKEND=auto picks it)")
    gpus = torch.cuda.device_count()
    if not dist.is_nccl_available():
        return Check("FAIL", "nccl", f"{gpus} GPUs but this torch has no NCCL",
                     "install a CUDA build of the pinned torch", "course")
    ranks = min(world_size, gpus)
    reports, error, seconds = _start_world(ranks, "nccl")
    if reports is None:
        return Check("FAIL", "nccl", f"{gpus} GPUs; a {ranks}-rank NCCL world failed: {error}",
                     "nvidia-smi must list the GPUs; NCCL_DEBUG=INFO labkit doctor shows why",
                     "course")
    per_rank = "; ".join(f"rank {r['rank']}: {r['device']}, {r.get('free_gib', 0):.0f}/"
                         f"{r.get('total_gib', 0):.0f} GiB free" for r in reports)
    note = "" if world_size <= gpus else f" (only {gpus} GPUs for {world_size} ranks: " \
                                         f"BACKEND=nccl needs WORLD <= {gpus})"
    return Check("ok" if not note else "warn", "nccl", f"{gpus} GPUs, {ranks} ranks in "
                 f"{seconds:.1f} s, one GPU per rank: {per_rank}{note}",
                 f"make course BACKEND=nccl WORLD={gpus}")


def check_memory(world_size: int = 2, available: int | None = None,
                 cores: int | None = None) -> Check:
    if available is None:
        import psutil
        available = psutil.virtual_memory().available
    cores = cores or os.cpu_count() or 1
    per_rank = available / world_size / GIB
    found = (f"{available / GIB:.1f} GiB free: {per_rank:.1f} GiB per rank at {world_size} "
             f"ranks; {cores} cores")
    if per_rank < RANK_GIB_FAIL:
        return Check("FAIL", "memory", found, f"free memory, or use fewer ranks "
                     f"(WORLD={max(1, int(available / GIB / RANK_GIB_WARN))})", "course")
    if per_rank < RANK_GIB_WARN or world_size > cores:
        return Check("warn", "memory", found, "fewer ranks run faster here (WORLD=2), or "
                     "SCALE=small" + ("; more ranks than cores: timings oversubscribed"
                                      if world_size > cores else ""))
    return Check("ok", "memory", found)


def check_ss() -> Check:
    if shutil.which("ss") is None:
        return Check("FAIL", "ss", "`ss` missing: world.traffic() (bytes counted by the OS) "
                     "cannot read socket counters", "apt-get install -y iproute2", "course")
    return Check("ok", "ss", f"{shutil.which('ss')} (iproute2: world.traffic)")


def student_copy() -> bool:
    """A copy made by `labkit dist`: no labkit.grading, notebooks on ipykernel's python3."""
    import importlib.util
    return importlib.util.find_spec("labkit.grading") is None


def check_kernel() -> Check:
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        specs = KernelSpecManager().find_kernel_specs()
    except Exception as error:  # noqa: BLE001
        return Check("FAIL", "kernel", f"jupyter_client unusable: {error}", "pip install -e .",
                     "course")
    if student_copy():
        if "python3" in specs:
            return Check("ok", "kernel", f"python3 kernel at {specs['python3']} (the student "
                         "copy's notebooks name it)")
        return Check("FAIL", "kernel", "no python3 Jupyter kernel", "pip install -e . "
                     "(it installs ipykernel)", "course")
    if "labkit" not in specs:
        return Check("warn", "kernel", "no `labkit` Jupyter kernel: JupyterLab asks for one, "
                     "nbclient raises NoSuchKernel (`labkit build` falls back to the "
                     "notebook's own)", f"{sys.executable} -m ipykernel install --sys-prefix "
                     "--name labkit --display-name 'Python (labkit)' (make setup does it)")
    return Check("ok", "kernel", f"labkit kernel at {specs['labkit']}")


def check_sandbox(euid: int | None = None, which=shutil.which, cgroups: dict | None = None,
                  found=None) -> list[Check]:
    """What `labkit grade` needs to isolate a submission (docs/INSTRUCTORS.md). Tests pass
    `found` (a labkit.grading.cgroups.Cgroups) or `cgroups` ({controller: folder}, v1's shape)."""
    if cgroups is None and found is None and student_copy():
        return [Check("skip", "sandbox", "no labkit.grading here (a student copy): grading "
                      "checks skipped")]
    euid = os.geteuid() if euid is None else euid
    checks = []
    fix_root = "run `labkit grade` as root (sudo -E .venv/bin/labkit grade ...)"
    checks.append(Check("ok", "root", "running as root") if euid == 0 else
                  Check("FAIL", "root", f"running as uid {euid}: the sandbox cannot switch "
                        "users or build namespaces (grading would run with rlimits only)",
                        fix_root, "grade"))
    for tool, package, why in (("unshare", "util-linux", "PID, mount and network namespaces"),
                               ("useradd", "passwd", "one unprivileged user per grading slot"),
                               ("nsenter", "util-linux", "bytes counted inside the sandbox")):
        path = which(tool)
        checks.append(Check("ok", tool, f"{path} ({why})") if path else
                      Check("FAIL", tool, f"`{tool}` missing ({why})",
                            f"apt-get install -y {package}", "grade"))
    checks.append(check_cgroups(euid, cgroups, found))
    return checks


def check_cgroups(euid: int, cgroups: dict | None = None, found=None) -> Check:
    """Which cgroup version bounds a whole submission here, and with which files (cgroups.py)."""
    from labkit.grading.cgroups import Cgroups, detect
    if found is None:
        if cgroups is not None:      # given by a test: v1-style {"memory": path, "pids": path}
            both = {"memory", "pids"} <= set(cgroups)
            found = Cgroups(1 if both else None, dict(cgroups) if both else {},
                            "controllers given" if both else "no memory+pids controllers given")
        elif euid != 0:
            found = Cgroups(None, {}, f"not root (uid {euid}): no cgroup can be made")
        else:
            found = detect()
    if found.version is None:
        return Check("warn", "cgroups", f"{found.why}: no per-submission limit; memory and "
                     "processes are capped per process (RLIMIT_AS) and per slot user "
                     "(RLIMIT_NPROC), not for the submission's kernel and ranks together",
                     "run as root on a host with cgroup v1 memory and pids hierarchies, or on a "
                     "cgroup v2 host whose /sys/fs/cgroup (or $LABKIT_CGROUP_ROOT, a delegated "
                     "subtree without processes of its own) offers the memory and pids "
                     "controllers")
    return Check("ok", "cgroups", f"{found.why}: a submission's kernel and its ranks are bounded "
                 f"together by {found.enforced}")


def check_chromium(path: str = CHROMIUM) -> Check:
    if os.access(path, os.X_OK):
        return Check("ok", "chromium", f"{path} (browser tests)")
    return Check("warn", "chromium", f"no chromium at {path}: the browser tests "
                 "(tests/browser) skip; the course itself does not need it",
                 ".ci/install-browser (Debian's chromium), or LABKIT_CHROMIUM=/path/to/chromium")


def check_db(db_url: str) -> Check:
    try:
        from sqlalchemy import create_engine, text
        engine = create_engine(db_url, future=True)
        try:
            with engine.connect() as conn:
                version = conn.execute(text("SELECT version()" if db_url.startswith(
                    "postgresql") else "SELECT sqlite_version()")).scalar()
        finally:
            engine.dispose()
    except ModuleNotFoundError as error:
        return Check("FAIL", "gradebook", f"no database driver for {db_url.split(':')[0]} "
                     f"({error.name})", "pip install 'psycopg[binary]' (SQLAlchemy's driver "
                     "for postgresql:// URLs)", "grade")
    except Exception as error:  # noqa: BLE001
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        return Check("FAIL", "gradebook", f"cannot connect: {type(error).__name__}: {first}",
                     "check host, port, user and database in the URL (postgresql://USER@HOST:"
                     "PORT/DB) and that this machine may connect (pg_hba.conf)", "grade")
    return Check("ok", "gradebook", f"answers: {str(version).split(',')[0]}")


def run_checks(world_size: int = 2, db_url: str | None = None, gpu: bool = True) -> list:
    checks = [check_python(), check_torch()]
    if checks[-1].verdict == "FAIL":
        return checks
    checks += [check_gloo(world_size)]
    if gpu:
        checks.append(check_nccl(world_size))
    checks += [check_memory(world_size), check_ss(), check_kernel()]
    checks += check_sandbox()
    checks.append(check_chromium())
    if db_url:
        checks.append(check_db(db_url))
    return checks


def exit_code(checks: list) -> int:
    failed = {c.needed_for for c in checks if c.verdict == "FAIL"}
    return 1 if "course" in failed else 2 if "grade" in failed else 0


def verdict_line(code: int, checks: list = ()) -> str:
    if code == 0 and any(c.name == "sandbox" and c.verdict == "skip" for c in checks):
        return "verdict: this machine can run the course (a student copy: grading not checked)"
    return {0: "verdict: this machine can run the course and grade it",
            1: "verdict: the course cannot run here (see FAIL lines)",
            2: "verdict: the course runs here; `labkit grade` cannot isolate submissions "
               "(see FAIL lines)"}[code]


def add_arguments(parser) -> None:
    parser.add_argument("--world", type=int, default=2,
                        help="ranks the course will start (default 2, as `make course`)")
    parser.add_argument("--db", default=None, help="also check this gradebook URL answers")
    parser.add_argument("--no-gpu", action="store_true", help="skip the NCCL/GPU check")


def run(args) -> int:
    checks = run_checks(args.world, args.db, gpu=not args.no_gpu)
    for check in checks:
        print(check.line(), flush=True)
    code = exit_code(checks)
    print(verdict_line(code, checks))
    return code


if __name__ == "__main__":
    from labkit.common import run_module
    sys.exit(run_module(sys.modules[__name__]))
