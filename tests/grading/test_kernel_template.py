"""Kernels forked from the run's kernel template (grading/kernel_template.py) against kernels
started the old way (`unshare ... python _nsinit.py`): the same view of the machine from inside,
no descriptor of the template in the kernel, the old way when the template cannot answer, another
uid refused, and the sandbox's life cycle (alive, namespace_pid, kill, close, a worker killed).
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from grading_helpers import needs_root_sandbox
from labkit.grading.kernel_template import KernelTemplate
from labkit.grading.sandbox import Limits, Sandbox, hidden_paths, user_processes

pytestmark = [needs_root_sandbox(), pytest.mark.timeout(240)]
HERE = os.path.dirname(os.path.abspath(__file__))

# What the kernel sees of its process and of the machine, printed as JSON (the grader reads it
# from stdout). The sandbox's own folder and tag are replaced by placeholders before comparing.
PROBE = r"""
import json as _j, os as _o, sys as _s, resource as _r, signal as _g, site as _si, socket as _so
import tempfile as _t, threading as _th, locale as _l, ctypes as _c
def _probe():
    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines()
                  if ":\t" in line)
    mask = _o.umask(0o077); _o.umask(mask)
    mounts = []
    for line in open("/proc/self/mountinfo"):
        left, right = line.split(" - ")
        fields, kinds = left.split(), right.split()
        mounts.append([fields[4], fields[5], kinds[0]])
    def kind(fd):
        try:
            target = _o.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        return target.split(":[")[0] if ":[" in target else target
    fds = sorted(k for k in (kind(fd) for fd in _o.listdir("/proc/self/fd")) if k)
    def handler(number):
        h = _g.getsignal(number)
        return h if isinstance(h, int) or h is None else getattr(h, "__qualname__", repr(h))
    limits = {name: _r.getrlimit(getattr(_r, name)) for name in dir(_r)
              if name.startswith("RLIMIT_")}
    return {
        "environ": dict(_o.environ), "path": list(_s.path), "flags": repr(_s.flags),
        "argv": list(_s.argv), "orig_argv": list(_s.orig_argv), "executable": _s.executable,
        "prefix": [_s.prefix, _s.base_prefix, _s.exec_prefix], "cwd": _o.getcwd(),
        "ids": [_o.getresuid(), _o.getresgid(), _o.getgroups()], "umask": mask,
        "pid": [_o.getpid(), _o.getppid(), _o.getpgid(0), _o.getsid(0)],
        "status": {k: status[k] for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
                                          "NoNewPrivs", "Seccomp", "Threads")},
        "dumpable": _c.CDLL(None).prctl(3, 0, 0, 0, 0),
        "limits": limits, "nice": _o.nice(0), "affinity": sorted(_o.sched_getaffinity(0)),
        "hostname": _so.gethostname(), "net": sorted(l.split(":")[0].strip() for l in
                                                   open("/proc/net/dev").readlines()[2:]),
        "root": sorted(_o.listdir("/")), "tmp": sorted(_o.listdir("/tmp")),
        "workdir": sorted(_o.listdir(".")), "mounts": mounts, "fds": fds,
        "cgroup": open("/proc/self/cgroup").read(),
        "processes": sorted(int(p) for p in _o.listdir("/proc") if p.isdigit()),
        "signals": {n.name: handler(n) for n in _g.valid_signals() if isinstance(n, _g.Signals)},
        "site": [_si.ENABLE_USER_SITE, _si.getuserbase(), _si.getusersitepackages()],
        "tempdir": _t.gettempdir(), "encoding": [_l.getpreferredencoding(False),
                                                 _s.getfilesystemencoding()],
        "threads": sorted(t.name for t in _th.enumerate()),
        "main": sorted(k for k in _s.modules["__main__"].__dict__ if not k.startswith("_")),
    }
print(_j.dumps(_probe()))
"""
AFTER_SETUP = ("import labkit.grading._kernel_side as __labkit_grading__\n"   # worker.HELPER
               "import torch, labkit\nimport json as _j\n"
               "print(_j.dumps([torch.get_num_threads(), torch.initial_seed(), "
               "sorted(m for m in __import__('sys').modules if m.startswith('labkit.grading'))]))")


@pytest.fixture(scope="module")
def template():
    with KernelTemplate() as started:
        yield started


def _box(folder, template_path=None):
    box = Sandbox(str(folder), limits=Limits(kernel_template=template_path))
    box.start()
    return box


def _printed(box, code):
    result = box.execute(code, timeout=120)
    assert result.status == "ok", (result.outputs, result.error)
    return json.loads("".join(o["text"] for o in result.outputs if o.get("name") == "stdout"))


def _normalized(box, value):
    """The probe's answer with this sandbox's own names (folder, tag, uid) as placeholders."""
    tag = os.path.basename(box.workdir)[2:]
    text = json.dumps(value).replace(box.workdir, "<workdir>").replace(box.run_dir, "<run>")
    value = json.loads(text.replace(tag, "<tag>"))
    assert value["ids"] == [[box.uid] * 3, [box.gid] * 3, []], value["ids"]   # the slot's user
    value["ids"] = "the slot's user"
    return value


def test_a_forked_kernel_sees_what_a_started_kernel_sees(tmp_path, template):
    started = _box(tmp_path / "started")
    forked = _box(tmp_path / "forked", template.path)
    try:
        assert not started.forked and forked.forked, forked._log_tail()
        answers = [_normalized(box, _printed(box, PROBE)) for box in (started, forked)]
        setup = [_printed(box, AFTER_SETUP) for box in (started, forked)]
    finally:
        forked.close()
        started.close()
    old, new = answers
    # the only differences: what the kernel process had imported before the first cell (torch,
    # labkit: the point) shows nowhere above; /proc/self/cmdline and /proc/self/environ (the
    # process's first arguments and variables, not os.environ) are the template's, not probed
    different = sorted(key for key in old if old[key] != new[key])
    assert not different, {key: (old[key], new[key]) for key in different}
    assert old["status"]["CapEff"] == "0000000000000000", old
    assert old["pid"][:2] == [2, 1] and old["dumpable"] == 1, old
    assert setup[0][0] == setup[1][0] and setup[0][2] == setup[1][2], setup
    assert setup[0][1] != setup[1][1], "the kernels' torch generators share a seed"
    assert not [m for m in setup[1][2] if m.startswith("labkit.grading.references")], setup


def test_no_descriptor_of_the_template_is_open_in_the_kernel(tmp_path, template):
    box = _box(tmp_path / "run", template.path)
    try:
        assert box.forked, box._log_tail()
        targets = _printed(box, "import os, json\nprint(json.dumps([os.readlink(f'/proc/self/fd/"
                                "{fd}') for fd in os.listdir('/proc/self/fd') if "
                                "os.path.exists(f'/proc/self/fd/{fd}')]))")
        listener = f"socket:[{template.listener_inode}]"
        assert listener not in targets, targets
        assert not [t for t in targets if template.folder in t or "template" in t], targets
        kernel_pid = int(open(f"/proc/{box.namespace_pid()}/task/{box.namespace_pid()}"
                              "/children").read().split()[0])
        seen = {os.readlink(f"/proc/{kernel_pid}/fd/{fd}")
                for fd in os.listdir(f"/proc/{kernel_pid}/fd")}
        assert listener not in seen and template.log_path not in seen, seen
        assert box.log_path in seen, seen     # its output (ipykernel keeps a copy of fd 1, 2)
        assert os.readlink(f"/proc/{kernel_pid}/fd/0") == "/dev/null"
    finally:
        box.close()


def test_the_old_way_when_the_template_cannot_answer(tmp_path):
    box = _box(tmp_path / "run", str(tmp_path / "no-template"))
    try:
        assert not box.forked
        assert "kernel template did not answer" in box._log_tail(), box._log_tail()
        assert _printed(box, "print(6 * 7)") == 42
    finally:
        box.close()


def test_another_uid_is_refused(template):
    """The folder is 0700 (another uid cannot even reach the socket); opened up for this test,
    the template itself refuses the connection by SO_PEERCRED and forks nothing."""
    assert os.stat(template.folder).st_mode & 0o777 == 0o700
    code = ("import os, socket, sys\nos.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(sys.argv[1])\n"
            "except PermissionError:\n    print('unreachable'); sys.exit()\n"
            "s.settimeout(30)\ntry:\n    s.sendall(b'{}\\n')\n    data = s.recv(100)\n"
            "except (BrokenPipeError, ConnectionResetError):\n    data = b''\n"
            "print('answered' if data else 'closed')\n")
    run = lambda: subprocess.run([sys.executable, "-c", code, template.path],  # noqa: E731
                                 capture_output=True, text=True, timeout=60)
    out = run()
    assert out.stdout.strip() == "unreachable", out
    os.chmod(template.folder, 0o711)
    os.chmod(template.path, 0o777)
    try:
        out = run()
        assert out.stdout.strip() == "closed", out
    finally:
        os.chmod(template.path, 0o755)
        os.chmod(template.folder, 0o700)
    deadline = time.monotonic() + 10
    while "refused a kernel request from uid 65534" not in template.log_tail():
        assert time.monotonic() < deadline, template.log_tail()
        time.sleep(0.1)


def test_the_graders_references_are_not_in_a_forked_kernel(tmp_path, template):
    [references] = hidden_paths()
    box = _box(tmp_path / "run", template.path)
    try:
        answer = _printed(box, "import os, sys, json, importlib\ntry:\n"
                               "    importlib.import_module('labkit.grading.references.mesh')\n"
                               "    imported = True\nexcept ImportError:\n    imported = False\n"
                               f"print(json.dumps([os.listdir({references!r}), imported, "
                               "[m for m in sys.modules if "
                               "m.startswith('labkit.grading.references.')]]))")
        assert answer == [[], False, []], answer
    finally:
        box.close()


def test_no_sandbox_spec_is_left_in_a_forked_kernels_memory(tmp_path, template):
    """The fork read its sandbox's spec (host paths of the root, the references, the cgroups);
    execve would have dropped it, so the kernel empties it: no object the kernel can reach holds
    the references' host path or the spec's keys."""
    [references] = hidden_paths()
    box = _box(tmp_path / "run", template.path)
    try:
        code = ("import gc, json\n"
                "spec = [o for o in gc.get_objects() if type(o) is dict and 'cgroups' in o "
                "and 'hidden' in o]\n"
                f"named = [o for o in gc.get_objects() if type(o) is list and {references!r} in o]\n"
                "print(json.dumps([len(spec), len(named)]))")
        answer = _printed(box, code)
        assert answer == [0, 0], f"spec dicts reachable in the kernel: {answer}"
    finally:
        box.close()


def test_a_template_that_cannot_start_leaves_nothing(monkeypatch):
    import glob
    import subprocess
    def folders():
        return {f for d in {tempfile.gettempdir(), "/tmp"}
                for f in glob.glob(os.path.join(d, "labkit-kernels-*"))}
    before = folders()
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(OSError):
        KernelTemplate()
    assert folders() == before


def _alive(pid) -> bool:
    """Whether `pid` runs (a zombie does not: only its parent's wait is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _gone(pids, uid, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [p for p in pids if _alive(p)] and not user_processes(uid):
            return True
        time.sleep(0.1)
    return False


def test_life_cycle_alive_kill_close(tmp_path, template):
    box = _box(tmp_path / "run", template.path)
    first = box.namespace_pid()
    starter = box.proc.pid
    assert box.alive and box.forked
    nspid = open(f"/proc/{first}/status").read().split("NSpid:")[1].split("\n")[0].split()
    assert nspid[-1] == "1", nspid                       # process 1 of its PID namespace
    cgroups = list(box.cgroups)
    assert cgroups and all(os.path.isdir(c) for c in cgroups)
    # a daemon of the kernel: it must go with the namespace
    assert _printed(box, "import os, subprocess\np = subprocess.Popen(['sleep', '600'], "
                         "start_new_session=True)\nprint(p.pid)") > 2
    box.proc.kill()
    deadline = time.monotonic() + 10
    while box.alive:
        assert time.monotonic() < deadline, "the killed kernel still looks alive"
        time.sleep(0.05)
    assert box.execute("1", timeout=5).status == "died"
    assert box.proc.returncode == -signal.SIGKILL
    uid = box.uid
    box.close()
    assert _gone([first, starter], uid), user_processes(uid)
    assert not [c for c in cgroups if os.path.exists(c)], cgroups


def test_a_kernel_that_exits_ends_its_sandbox(tmp_path, template):
    box = _box(tmp_path / "run", template.path)
    first, uid = box.namespace_pid(), box.uid
    assert box.execute("import os\nos._exit(3)", timeout=30).status == "died"
    box.proc.wait(timeout=10)
    assert box.proc.returncode == 3
    box.close()
    assert _gone([first], uid)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_worker_takes_its_forked_kernel_along(tmp_path, template, how):
    """The worker holding the sandbox dies without closing it: the starter sees its socket close
    and ends the namespace; the run's cleanup then removes the cgroups
    (pipeline._remove_cgroups)."""
    from labkit.grading.pipeline import _remove_cgroups
    run_dir = tmp_path / "run-id" / "student"
    holder = subprocess.Popen([sys.executable, os.path.join(HERE, "kernel_template_holder.py"),
                               template.path, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(holder.stdout.readline())
        assert info["forked"] and info["ok"] == "ok", info
        holder.send_signal(how)
        holder.wait(timeout=30)
        assert _gone([info["namespace_pid"], info["starter_pid"]], info["uid"]), \
            user_processes(info["uid"])
        _remove_cgroups("run-id")
        assert not [c for c in info["cgroups"] if os.path.exists(c)], info["cgroups"]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_the_template_refuses_to_serve_with_the_references_or_a_thread(monkeypatch):
    """What every kernel inherits is checked before the first fork: the grader's references
    imported, or a thread started (a fork keeps only the calling one), and it does not serve."""
    import threading
    from labkit.grading import _kernel_template
    monkeypatch.setattr(_kernel_template, "KERNEL_IMPORTS", ("labkit.grading.references",))
    with pytest.raises(RuntimeError, match="imported the grader's references"):
        _kernel_template.import_kernel_code()
    monkeypatch.setattr(_kernel_template, "KERNEL_IMPORTS", ("json",))
    monkeypatch.setattr(sys, "modules", {k: v for k, v in sys.modules.items()
                                         if not k.startswith("labkit.grading.references")})
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match=r"has \d+ threads after its imports"):
            _kernel_template.import_kernel_code()
    finally:
        stop.set()
        thread.join()


def test_a_template_that_died_is_reported_and_kernels_start_the_old_way(tmp_path, capfd):
    with KernelTemplate() as dead:
        dead.popen.kill()
        dead.popen.wait()
        since = time.monotonic()
        box = _box(tmp_path / "run", dead.path)
        try:
            assert time.monotonic() - since < 30, "the sandbox waited for a dead template"
            assert not box.forked and "kernel template did not answer" in box._log_tail()
            assert _printed(box, "print(1)") == 1
        finally:
            box.close()
    assert "the run's kernel template exited" in capfd.readouterr().err


def test_templates_that_die_mid_run_leave_the_sandboxes_in_flight_alone(tmp_path):
    """The host's OOM killer or an operator kills the run's two templates while a submission
    runs. Its kernel and its rank starter go on: they live as long as their worker's sockets,
    not as long as the templates (before, they died a moment after them by PR_SET_PDEATHSIG, and
    the submission was graded as if its code had crashed). Closing the sandbox leaves nothing."""
    import torch.distributed as dist
    from labkit.grading.ranks import RankStarterTemplate, SandboxWorld, Zygote
    with KernelTemplate() as kernels, RankStarterTemplate() as starters:
        box = _box(tmp_path / "run", kernels.path)
        zygote = Zygote(box, box.private_dir(), template=starters.path)
        try:
            assert box.forked and zygote.forked, (box._log_tail(), zygote.log_tail())
            first, uid = box.namespace_pid(), box.uid
            for template in (kernels, starters):
                template.popen.kill()
                template.popen.wait()
            time.sleep(1.0)             # a PR_SET_PDEATHSIG would have killed them by now
            assert box.alive, box._log_tail()
            assert _printed(box, "print(6 * 7)") == 42
            world = SandboxWorld(2, box, timeout=30, zygote=zygote)
            try:
                assert world.run(lambda: dist.get_rank() + 10) == [10, 11]
            finally:
                world.close()
        finally:
            zygote.close()
            box.close()
        assert _gone([first, box.proc.pid], uid), user_processes(uid)
