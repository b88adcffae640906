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


