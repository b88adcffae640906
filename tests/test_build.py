"""`make course`'s runner: every course notebook executes headless; failures are reported."""
import argparse
import os
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

from labkit.tools import build

ROOT = Path(__file__).resolve().parents[1]
COURSE = build.find_notebooks(ROOT, "course/")
KERNEL = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
          "language_info": {"name": "python"}}


def run_build(root: Path, out: Path, only=None, world=2) -> int:
    args = argparse.Namespace(world=world, backend="gloo", scale="small", only=only, root=root,
                              out=out, cell_timeout=300)
    return build.run(args)


def test_finds_course_notebooks_then_lab_solutions():
    found = [str(p) for p in build.find_notebooks(ROOT)]
    assert found and found[0].startswith("course/00_"), found
    assert any(p.startswith("solutions/lab00_") for p in found), found
    assert all(not p.startswith("labs/") for p in found), "student copies are not executed"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("notebook", COURSE, ids=str)
def test_course_notebook_executes(notebook, tmp_path, capsys):
    assert run_build(ROOT, tmp_path, only=str(notebook)) == 0, capsys.readouterr().out
    executed = nbformat.read(str(tmp_path / "executed" / notebook), as_version=4)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected and "WORLD_SIZE = 2" in injected[0].source
    assert (tmp_path / "html" / notebook.with_suffix(".html")).stat().st_size > 0
    assert "1 passed, 0 failed" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_a_failing_notebook_fails_the_build_and_says_where(tmp_path, capsys):
    root = tmp_path / "repo"
    (root / "course").mkdir(parents=True)
    good = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("WORLD_SIZE = 1", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("1 / 0")], metadata=KERNEL)
    nbformat.write(good, str(root / "course" / "01_fails.ipynb"))
    untagged = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")], metadata=KERNEL)
    nbformat.write(untagged, str(root / "course" / "02_untagged.ipynb"))
    assert run_build(root, tmp_path / "out") == 1
    out = capsys.readouterr().out
    assert "ZeroDivisionError" in out and "no cell tagged 'parameters'" in out
    assert "0 passed, 2 failed" in out
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "course/01_fails.ipynb" in summary and "FAILED" in summary
    # the source notebook is never written to
    assert not nbformat.read(str(root / "course" / "01_fails.ipynb"), as_version=4).cells[1].outputs


def test_cli_lists_subcommands_and_rejects_unknown_ones(capsys):
    from labkit.tools import cli
    assert cli.main([]) == 2
    assert "release" in capsys.readouterr().out
    assert cli.main(["no-such-command"]) == 2
    assert cli.main(["build", "--world", "0"]) == 2


def test_make_reuses_an_up_to_date_environment(tmp_path):
    """The environment is rebuilt only when pyproject.toml is newer than the stamp."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shutil.copy(ROOT / "Makefile", tmp_path)
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    venv = tmp_path / "env"
    (venv / "bin").mkdir(parents=True)
    stamp = venv / ".installed-from-pyproject"
    stamp.touch()
    question = ["make", "-q", "-C", str(tmp_path), f"VENV={venv}", "setup"]
    assert subprocess.run(question).returncode == 0, "an up-to-date environment would be rebuilt"
    old = stamp.stat().st_mtime - 100
    os.utime(stamp, (old, old))
    assert subprocess.run(question).returncode == 1, "a changed pyproject.toml would not rebuild"
    dry = subprocess.run(["make", "-n", "-C", str(tmp_path), f"VENV={venv}", "setup"],
                         capture_output=True, text=True).stdout
    assert "pip install" in dry and "ipykernel install" in dry, dry


def test_ci_runs_exactly_make_test():
    script = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in script.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert "make test || status=$?" in commands, script
    assert not any("pytest" in c for c in commands), "CI must run the README's command, not its own"
    assert "make test" in (ROOT / "README.md").read_text()
