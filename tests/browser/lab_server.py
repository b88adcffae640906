"""A throwaway JupyterLab server for the browser tests: free port, throwaway settings, sure to stop.

    server = LabServer(root_dir, state_dir)   # root_dir: what Lab shows; state_dir: its settings
    server.start()                      # bounded: raises LabStartError with Lab's log after 60 s
    server.url("lab/tree/x.ipynb")      # http://127.0.0.1:<port>/lab/tree/x.ipynb?reset&token=...
    server.stop()                       # REST shutdown, then SIGTERM/SIGKILL of anything left

Every process Lab starts (kernels, and the rank processes those start) is tracked with psutil, so
stop() also ends ranks that a kernel orphaned. The measured facts this follows are in
shared/notes/browser-testing.md.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0


class LabStartError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """In the Lab process before exec: SIGTERM it when the test process dies, even by SIGKILL
    (Linux prctl PR_SET_PDEATHSIG); Lab then shuts its kernels down itself."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except Exception:
        pass


def free_port() -> int:
    """A port nothing listens on now (the OS picks it). Lab starts with port_retries=0, so a race
    with another process shows as a start failure, which start() retries with a new port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


class LabServer:
    def __init__(self, root_dir: Path, state_dir: Path, configure=None):
        """configure: called with the server's environment after its settings are written and
        before Lab starts (a command that writes more user-level config, say)."""
        self.configure = configure
        self.root_dir = Path(root_dir)
        self.state_dir = Path(state_dir)  # config, runtime, settings, workspaces, log: throwaway
        self.token = secrets.token_hex(16)
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path = self.state_dir / "lab.log"
        self._seen: dict[int, psutil.Process] = {}  # every descendant ever seen, by pid

    # -- settings -------------------------------------------------------------------------------
    def _env(self) -> dict:
        s = self.state_dir
        env = dict(os.environ)
        env.update(
            JUPYTER_CONFIG_DIR=str(s / "config"),
            JUPYTER_RUNTIME_DIR=str(s / "runtime"),
            JUPYTERLAB_SETTINGS_DIR=str(s / "settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(s / "workspaces"),
            IPYTHONDIR=str(s / "ipython"),
            # the kernels import labkit from the working tree even where it is not pip-installed
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "utils"), env.get("PYTHONPATH")])),
            PYTHONUNBUFFERED="1",
        )
        env.pop("JUPYTER_PATH", None)
        return env

    def _write_settings(self) -> None:
        s = self.state_dir
        # The news pop-up appears unless this is set, even with news_url=None.
        _write_json(s / "settings/@jupyterlab/apputils-extension/notification.jupyterlab-settings",
                    {"fetchNews": "false", "checkForUpdates": False})
        # Lab renders only the cells near the viewport by default; far ones lose their prompt's
        # text, which the tests read to know a cell has run. Render them all.
        _write_json(s / "settings/@jupyterlab/notebook-extension/tracker.jupyterlab-settings",
                    {"windowingMode": "none"})
        # Extensions a student does not have (ipyparallel is a test extra) or need here (instructor
        # views). The ipyparallel lab extension shows an error dialog without its server part.
        _write_json(s / "config/labconfig/page_config.json",
                    {"disabledExtensions": {"ipyparallel-labextension": True}})
        _write_json(s / "config/jupyter_server_config.json", {"ServerApp": {"jpserver_extensions": {
            "ipyparallel": False,
            "jupyter_lsp": False,      # scans the machine for language servers at start
            "nbgrader.server_extensions.formgrader": False,
            "nbgrader.server_extensions.course_list": False,
            "nbgrader.server_extensions.assignment_list": False,
        }}})

    # -- start / stop -----------------------------------------------------------------------------
    def start(self, attempts: int = 3) -> None:
        self._write_settings()
        if self.configure is not None:
            self.configure(self._env())
        for attempt in range(attempts):
            self.port = free_port()
            try:
                self._start_once()
                return
            except LabStartError:
                self.stop()
                if attempt == attempts - 1:
                    raise

    def _start_once(self) -> None:
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
               "--ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--ServerApp.root_dir={self.root_dir}", f"--IdentityProvider.token={self.token}",
               "--LabApp.news_url=None",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=self.root_dir, env=self._env(), stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True,  # own process group: killpg at the end
                                     preexec_fn=_die_with_parent if sys.platform == "linux"
                                     else None)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LabStartError(f"JupyterLab exited with {self.proc.returncode}:\n"
                                    f"{self.log_tail()}")
            try:
                self.api("GET", "api/status", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.2)
        raise LabStartError(f"JupyterLab did not answer within {START_TIMEOUT_S:.0f} s:\n"
                            f"{self.log_tail()}")

    def stop(self) -> list[str]:
        """Stops Lab and everything it started. Returns a line for each process that outlived the
        REST shutdown and had to be killed (empty when everything stopped by itself)."""
        if self.proc is None:
            return []
        self.track()
        if self.proc.poll() is None:
            try:
                self.api("POST", "api/shutdown", timeout=5)
            except Exception:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        leftovers = self.kill_leftovers(grace_s=3.0)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        self.proc = None
        return leftovers

    # -- processes ------------------------------------------------------------------------------
    def track(self) -> list[psutil.Process]:
        """Remembers every process now below Lab (kernels, ranks); returns the living ones."""
        if self.proc is None:
            return []
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        for p in kids:
            self._seen.setdefault(p.pid, p)
        return kids

    def alive(self, procs) -> list[psutil.Process]:
        out = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    def kill_leftovers(self, grace_s: float = 0.0) -> list[str]:
        """Kills tracked processes still alive after grace_s (is_running() also checks that a pid
        was not reused). Returns one line per process that had to be killed."""
        self.track()
        deadline = time.monotonic() + grace_s
        left = self.alive(self._seen.values())
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self.alive(left)
        lines = []
        for p in left:
            try:
                lines.append(f"pid {p.pid}: {' '.join(p.cmdline())[:200]}")
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=5)
        for pid in [pid for pid, p in self._seen.items() if not self.alive([p])]:
            del self._seen[pid]
        return lines

    def kernel_process(self, kernel_id: str) -> psutil.Process:
        for p in self.track():
            try:
                if any(kernel_id in arg for arg in p.cmdline()):
                    return p
            except psutil.NoSuchProcess:
                pass
        raise LookupError(f"no kernel process for kernel {kernel_id}")

    # -- REST -----------------------------------------------------------------------------------
    def url(self, path: str, reset: bool = True) -> str:
        query = ("reset&" if reset else "") + f"token={self.token}"
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}?{query}"

    def api(self, method: str, path: str, timeout: float = 5):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"},
                                     data=b"" if method in ("POST", "PUT") else None)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def kernels(self) -> list[dict]:
        return self.api("GET", "api/kernels")

    def shutdown_kernels(self, wait: bool = True) -> None:
        """Asks Lab to shut down every kernel, each in its own thread (a kernel closes its world
        first, which takes a second or two). wait=False returns at once: the next test starts
        while they stop, and stop() kills whatever is still left at the end."""
        threads = [threading.Thread(target=self._delete_kernel, args=(k["id"],), daemon=True)
                   for k in self.kernels()]
        for t in threads:
            t.start()
        if wait:
            for t in threads:
                t.join(timeout=20)

    def _delete_kernel(self, kernel_id: str) -> None:
        try:
            self.api("DELETE", f"api/kernels/{kernel_id}", timeout=15)
        except Exception:
            pass

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"
