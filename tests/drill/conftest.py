"""Fixtures of the drill's tests: an isolated boxes file, and a pseudo-terminal to type into."""
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest


@pytest.fixture(autouse=True)
def drill_file(tmp_path, monkeypatch):
    """Every test keeps its boxes in its own file, never in ~/.labkit."""
    path = tmp_path / "drill.json"
    monkeypatch.setenv("LABKIT_DRILL_FILE", str(path))
    return path


class Terminal:
    """A process on a pseudo-terminal, driven as a person would: read the screen, type a line."""

    def __init__(self, args, columns=100):
        master, slave = pty.openpty()
        os.set_blocking(master, False)
        env = dict(os.environ, COLUMNS=str(columns), LINES="40", TERM="xterm")
        self.process = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env,
                                        start_new_session=True, close_fds=True)
        os.close(slave)
        self.master = master
        self.screen = ""          # everything shown so far (\r removed)
        self.seen = 0             # where the last expect() matched

    def _read(self, timeout):
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return False
        try:
            chunk = os.read(self.master, 65536)
        except OSError:           # the child closed the terminal
            return None
        if not chunk:
            return None
        self.screen += chunk.decode("utf-8", "replace").replace("\r", "")
        return True

    def expect(self, pattern, timeout=30.0):
        """Wait until `pattern` (a regex) appears after the last match; return the new text."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            found = regex.search(self.screen, self.seen)
            if found:
                new = self.screen[self.seen:found.end()]
                self.seen = found.end()
                return new
            left = deadline - time.monotonic()
            if left <= 0 or self._read(min(left, 0.5)) is None and not regex.search(
                    self.screen, self.seen):
                raise AssertionError(f"{pattern!r} never appeared; the screen after the last "
                                     f"match:\n{self.screen[self.seen:][-3000:]}")

    def type(self, line):
        os.write(self.master, line.encode() + b"\n")

    def end_of_input(self):
        os.write(self.master, b"\x04")            # Ctrl-D at the start of a line

    def wait(self, timeout=30):
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            self._read(0.2)
        while self._read(0.05):
            pass
        return self.process.wait(timeout=max(deadline - time.monotonic(), 1))

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        os.close(self.master)


@pytest.fixture
def terminal():
    """terminal(*args, columns=100): `python -m labkit.drill.terminal *args` on a
    pseudo-terminal that many columns wide."""
    started = []

    def start(*args, columns=100):
        started.append(Terminal([sys.executable, "-m", "labkit.drill.terminal", *args],
                                columns=columns))
        return started[-1]

    yield start
    for t in started:
        t.close()
