"""Per-submission limits through cgroup v1 or v2 (labkit/grading/cgroups.py), and what `labkit
doctor` says about them.

This machine is cgroup v1 (hybrid: /sys/fs/cgroup/unified is a cgroup2 mount without the memory
and pids controllers), so v2 cannot be exercised here end to end. What these tests do instead:
- detection and the v2 path's writes run against real folder trees laid out the way each version
  lays out its files (tmp_path); every file the code writes is read back;
- the v1 path runs on this machine's real hierarchies (root only): a real process is moved into
  the group and the kernel's own files are read back.
What no test here shows: that a v2 kernel accepts these writes and enforces them (an OOM kill at
memory.max, a fork refused at pids.max). docs/INSTRUCTORS.md says so too.
"""
import os
import subprocess
import sys
import uuid

import pytest

from labkit.grading import cgroups, sandbox
from labkit.tools import doctor

ANYONE = lambda path: True            # noqa: E731 (tests write where root would)
GIB = 1 << 30


def v2_tree(root, controllers="cpu io memory pids", subtree="", processes="", is_root=True):
    """A folder laid out like a cgroup2 folder: what the code reads before it writes."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text(subtree + "\n")
    (root / "cgroup.procs").write_text(processes)
    if not is_root:                   # only non-root cgroup2 folders have a type
        (root / "cgroup.type").write_text("domain\n")
    return root


def v1_tree(root, controllers=("memory", "pids")):
    for controller in controllers:
        (root / controller).mkdir(parents=True)
        (root / controller / "cgroup.procs").write_text("")
    return root


def test_v2_root_is_found_and_a_group_gets_both_limits(tmp_path):
    root = v2_tree(tmp_path / "cg")
    found = cgroups.detect(root=str(root), can_write=ANYONE)
    assert (found.version, found.bases) == (2, {"memory": str(root), "pids": str(root)})
    assert "memory.max" in found.enforced and "pids.max" in found.enforced

    leaves = cgroups.make_group(found, "labkit-grading/run1/s-ab", memory_bytes=3 * GIB,
                                processes=77)
    leaf = root / "labkit-grading" / "run1" / "s-ab"
    assert leaves == [str(leaf)], "v2 keeps both limits in one folder"
    assert (leaf / "memory.max").read_text() == str(3 * GIB)
    assert (leaf / "memory.swap.max").read_text() == "0"
    assert (leaf / "pids.max").read_text() == "77"
    assert not (leaf / "memory.limit_in_bytes").exists(), "a v1 file written on v2"
    assert cgroups.limits_of(str(leaf)) == {"memory": 3 * GIB, "pids": 77}
    # every folder above the leaf passes memory and pids down, the base included
    for folder in (root, root / "labkit-grading", root / "labkit-grading" / "run1"):
        assert (folder / "cgroup.subtree_control").read_text().split() == ["+memory", "+pids"], (
            folder)
    assert not (leaf / "cgroup.subtree_control").exists(), "the leaf holds processes: no pass-down"

    cgroups.join(leaves, pid=4242)
    assert (leaf / "cgroup.procs").read_text() == "4242"


def test_v2_base_that_already_passes_both_down_is_not_rewritten(tmp_path):
    root = v2_tree(tmp_path / "cg", subtree="cpu memory pids")
    found = cgroups.detect(root=str(root), can_write=ANYONE)
    cgroups.make_group(found, "labkit-grading/r/x", memory_bytes=GIB, processes=8)
    assert (root / "cgroup.subtree_control").read_text().split() == ["cpu", "memory", "pids"]


@pytest.mark.parametrize("controllers, missing", [("cpu io memory", "pids"),
                                                  ("cpu pids", "memory"), ("", "memory, pids")])
def test_v2_without_both_controllers_is_not_used(tmp_path, controllers, missing):
    root = v2_tree(tmp_path / "cg", controllers=controllers)
    found = cgroups.detect(root=str(root), can_write=ANYONE)
    assert (found.version, found.bases) == (None, {})
    assert f"lacks the {missing} controller" in found.why
    assert cgroups.make_group(found, "labkit-grading/r/x", GIB, 8) == []


def test_delegated_v2_subtree_from_the_environment(tmp_path, monkeypatch):
    """$LABKIT_CGROUP_ROOT: a subtree delegated to the grader (systemd Delegate=yes). One that
    holds processes of its own cannot pass controllers down (v2's no-internal-processes rule),
    unless it already does."""
    root = v2_tree(tmp_path / "cg")
    busy = v2_tree(root / "grader.service", processes="101\n102\n", is_root=False)
    monkeypatch.setenv(cgroups.ENV_ROOT, str(busy))
    found = cgroups.detect(root=str(root), can_write=ANYONE)
    assert found.version is None and "holds processes of its own" in found.why, found.why

    (busy / "cgroup.subtree_control").write_text("memory pids\n")
    assert cgroups.detect(root=str(root), can_write=ANYONE).version == 2

    idle = v2_tree(root / "labkit.slice", is_root=False)
    monkeypatch.setenv(cgroups.ENV_ROOT, str(idle))
    found = cgroups.detect(root=str(root), can_write=ANYONE)
    assert found.bases == {"memory": str(idle), "pids": str(idle)}
    leaf, = cgroups.make_group(found, "labkit-grading/r/k", memory_bytes=GIB, processes=9)
    assert leaf.startswith(str(idle) + os.sep)


def test_not_writable_is_not_used(tmp_path):
    root = v2_tree(tmp_path / "cg")
    found = cgroups.detect(root=str(root), can_write=lambda path: False)
    assert found.version is None and "not writable" in found.why
    v1 = v1_tree(tmp_path / "v1")
    assert cgroups.detect(root=str(v1), can_write=lambda path: False).version is None


def test_v1_is_preferred_on_a_hybrid_host(tmp_path):
    """This machine's layout: v1 memory and pids, and a cgroup2 mount at unified/ without them."""
    root = v1_tree(tmp_path / "cg")
    v2_tree(root / "unified", controllers="hugetlb")
    found = cgroups.detect(root=str(root), can_write=ANYONE)
    assert found.version == 1
    assert found.bases == {"memory": str(root / "memory"), "pids": str(root / "pids")}
    assert "hybrid" in found.why and "[hugetlb]" in found.why
    leaves = cgroups.make_group(found, "labkit-grading/r/s", memory_bytes=2 * GIB, processes=5)
    assert leaves == [str(root / c / "labkit-grading/r/s") for c in ("memory", "pids")]
    assert (root / "memory/labkit-grading/r/s/memory.limit_in_bytes").read_text() == str(2 * GIB)
    assert (root / "pids/labkit-grading/r/s/pids.max").read_text() == "5"
    assert not (root / "memory/labkit-grading/r/s/memory.max").exists()


def test_hybrid_host_without_v1_says_what_its_cgroup2_lacks(tmp_path):
    root = tmp_path / "cg"
    v2_tree(root / "unified", controllers="hugetlb")
    found = cgroups.detect(root=str(root), can_write=ANYONE)
    assert found.version is None
    assert "unified" in found.why and "[hugetlb]" in found.why, found.why


def test_doctor_names_the_version_and_the_files(tmp_path):
    on_v2 = cgroups.detect(root=str(v2_tree(tmp_path / "v2")), can_write=ANYONE)
    line = doctor.check_sandbox(euid=0, which=lambda tool: f"/usr/bin/{tool}", found=on_v2)[-1]
    assert (line.name, line.verdict) == ("cgroups", "ok")
    assert "cgroup v2" in line.found and "memory.max" in line.found and "pids.max" in line.found

    hybrid_root = tmp_path / "hy"
    v2_tree(hybrid_root / "unified", controllers="hugetlb")
    none = cgroups.detect(root=str(hybrid_root), can_write=ANYONE)
    line = doctor.check_sandbox(euid=0, which=lambda tool: f"/usr/bin/{tool}", found=none)[-1]
    assert line.verdict == "warn" and "per process" in line.found and "[hugetlb]" in line.found
    assert "LABKIT_CGROUP_ROOT" in line.fix


@pytest.mark.skipif(os.geteuid() != 0, reason="a grading worker's cgroup is made by root")
def test_the_worker_cgroup_uses_the_v2_files_on_a_v2_layout(tmp_path, monkeypatch):
    """sandbox.join_worker_cgroup, unchanged, on a v2 tree: memory.max in one folder, and this
    process's pid written to its cgroup.procs (a plain file here: nothing really moves)."""
    root = v2_tree(tmp_path / "cg")
    monkeypatch.setattr(cgroups, "ROOT", str(root))
    monkeypatch.delenv(cgroups.ENV_ROOT, raising=False)
    path = sandbox.join_worker_cgroup("run-x", 2, 5 * GIB)
    assert path == str(root / "labkit-grading" / "run-x" / "worker-2")
    assert cgroups.limits_of(path) == {"memory": 5 * GIB}
    assert (root / "labkit-grading/run-x/worker-2/cgroup.procs").read_text() == str(os.getpid())
    assert sandbox.cgroup_dirs() == {"memory": str(root), "pids": str(root)}


def real_v1():
    found = cgroups.detect()
    if os.geteuid() != 0 or found.version != 1:
        pytest.skip(f"needs root on a cgroup v1 host: {found.why}")
    return found


def test_this_host_is_detected_as_what_its_files_say():
    found = cgroups.detect()
    has_v1 = all(os.path.isfile(f"/sys/fs/cgroup/{c}/cgroup.procs") for c in ("memory", "pids"))
    if os.geteuid() == 0 and has_v1:
        assert found.version == 1, found.why
    elif not has_v1 and not os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
        assert found.version is None, found.why


def test_v1_group_on_this_host_holds_a_real_process_within_its_limits():
    """End to end on the real v1 hierarchies: the kernel's files hold the limits (read back from
    the kernel, which rounds memory to pages), and a process moved in is listed there."""
    found = real_v1()
    run = f"test-{uuid.uuid4().hex[:8]}"
    leaves = cgroups.make_group(found, f"labkit-grading/{run}/s", memory_bytes=GIB + 100,
                                processes=64)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert len(leaves) == 2
        memory, pids = leaves
        held, page = cgroups.limits_of(memory)["memory"], os.sysconf("SC_PAGE_SIZE")
        assert held % page == 0 and abs(held - (GIB + 100)) < page, held   # the kernel's value
        assert cgroups.limits_of(pids) == {"pids": 64}
        cgroups.join(leaves, pid=child.pid)
        with open(f"/proc/{child.pid}/cgroup") as f:
            lines = f.read()
        assert f"memory:/labkit-grading/{run}/s" in lines, lines
        assert f"pids:/labkit-grading/{run}/s" in lines, lines
    finally:
        child.kill()
        child.wait()
        for leaf in leaves:
            sandbox._empty_and_remove(leaf)
        for base in found.bases.values():
            for folder in (f"{base}/labkit-grading/{run}",):
                if os.path.isdir(folder):
                    os.rmdir(folder)
    assert not any(os.path.exists(leaf) for leaf in leaves)


def test_a_sandbox_kernel_runs_inside_its_groups_on_this_host(tmp_path):
    """Sandbox.start through cgroups.make_group on the real v1 hierarchies: the kernel's process
    is in the groups, which hold the limits given; close() removes them."""
    real_v1()
    if not sandbox.can_isolate()[0]:
        pytest.skip(f"no sandbox here: {sandbox.can_isolate()[1]}")
    box = sandbox.Sandbox(str(tmp_path / "run"), limits=sandbox.Limits(memory_bytes=3 * GIB,
                                                                     processes=300))
    try:
        box.start()
        assert len(box.cgroups) == len(box.rank_cgroups) == 2, (box.cgroups, box.rank_cgroups)
        for folder in box.cgroups + box.rank_cgroups:
            assert cgroups.limits_of(folder) == (
                {"memory": 3 * GIB} if "/memory/" in folder else {"pids": 300}), folder
        result = box.execute("import os\nprint(open('/proc/self/cgroup').read())", timeout=30)
        assert result.status == "ok", result
        shown = "".join(o.get("text", "") for o in result.outputs)
        for folder in box.cgroups:
            relative = folder.split("/sys/fs/cgroup/", 1)[1].split("/", 1)[1]
            assert f":/{relative}\n" in shown, (relative, shown)
    finally:
        folders = box.cgroups + box.rank_cgroups
        box.close()
    assert folders and not any(os.path.exists(f) for f in folders)
