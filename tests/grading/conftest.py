"""The throwaway course holding the fixture lab, for every grading test (helpers live in
grading_helpers.py)."""
import os
import shutil

import pytest

from grading_helpers import FIXTURES


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    shutil.copytree(os.path.join(FIXTURES, "solutions"), root / "solutions")
    return root
