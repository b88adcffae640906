import os

import psutil
import pytest

import labkit


@pytest.fixture
def world2():
    """A world of 2; reused across tests while its settings stay the current ones."""
    return labkit.world(2, timeout=20)


@pytest.fixture(scope="module", autouse=True)
def _close_worlds():
    yield
    labkit.shutdown_all()


def rank_processes():
    """Live rank processes below this test process (the forkserver's children)."""
    me = psutil.Process(os.getpid())
    return [p for p in me.children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and "forkserver" not in " ".join(p.cmdline())]
