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


def run_build(root: Path, out: Path, only=None, world=2, jobs=1) -> int:
    args = argparse.Namespace(world=world, backend="gloo", scale="small", only=only, root=root,
                              out=out, cell_timeout=300, jobs=jobs)
    return build.run(args)


def test_finds_course_notebooks_then_lab_solutions():
    found = [str(p) for p in build.find_notebooks(ROOT)]
    assert found and found[0].startswith("course/00_"), found
    assert any(p.startswith("solutions/lab00_") for p in found), found
    assert all(not p.startswith("labs/") for p in found), "student copies are not executed"


@pytest.fixture(scope="module")
def course_build(tmp_path_factory):
    """The whole course built once, at 3 ranks per world (P = 2 hides ring directions and byte
    factors; the README offers 2, 3 and 4), two notebooks at once (`make course JOBS=2`: 264 s
    against 376 s one at a time on 2 cores). Returns (exit code, printed output, out folder)."""
    import contextlib
    import io
    out = tmp_path_factory.mktemp("build")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = run_build(ROOT, out, only="course/", world=3, jobs=2)
    return code, printed.getvalue(), out


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("notebook", COURSE, ids=str)
def test_course_notebook_executes_at_three_ranks(notebook, course_build):
    code, printed, out = course_build
    line = next((l for l in printed.splitlines() if str(notebook) in l and "..." in l), "")
    assert line.rstrip().split(" ... ")[-1].startswith("ok"), printed[-3000:]
    executed = nbformat.read(str(out / "executed" / notebook), as_version=4)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected and "WORLD_SIZE = 3" in injected[0].source
    assert (out / "html" / notebook.with_suffix(".html")).stat().st_size > 0


@pytest.mark.timeout(1500)
def test_every_chapter_checks_formulas_and_the_ledger_counts_them(course_build):
    import json
    code, printed, out = course_build
    records = json.loads((out / "formulas.json").read_text())
    by_notebook = {}
    for record in records:
        by_notebook.setdefault(record["notebook"], []).append(record)
    chapters = [str(n) for n in COURSE if n.name[:2].isdigit()]
    missing = [c for c in chapters if not by_notebook.get(c)]
    assert not missing, f"chapters without a formula checked against a measurement: {missing}"
    from labkit import formulas
    kindless = [(r["notebook"], r["name"]) for r in records if r.get("kind") not in formulas.KINDS]
    assert not kindless, f"formula checks without a kind ({formulas.KINDS}): {kindless}"
    unmeasured = [c for c in chapters if not any(r["kind"] == "measured" for r in by_notebook[c])]
    assert not unmeasured, f"chapters with no formula checked against a measurement: {unmeasured}"
    totals = {k: sum(r["kind"] == k for r in records) for k in formulas.KINDS}
    assert "formula checks by kind: " + ", ".join(f"{k} {n}" for k, n in totals.items()) in printed
    assert all(r["passed"] for r in records if not r.get("timing")), \
        [r["name"] for r in records if not r["passed"] and not r.get("timing")]
    assert f"{len(records)} formula checks in" in printed
    ledger = (out / "formulas.md").read_text()
    assert f"{len(records)} checks" in ledger and ledger.count("\n| course/") == len(records)
    index = (out / "html" / "index.html").read_text()
    assert index.count("<tr><td>course/") >= len(records)


@pytest.mark.timeout(1500)
def test_html_pages_show_their_math_offline(course_build):
    code, printed, out = course_build
    pages = sorted((out / "html" / "course").glob("*.html"))
    assert pages
    for page in pages:
        text = page.read_text()
        assert "mathjax" not in text.lower(), f"{page.name} loads MathJax from the network"
    assert any("<math" in page.read_text() for page in pages)


def test_mathml_leaves_code_and_prices_alone():
    from labkit.tools.mathml import markdown_to_mathml
    text = "cost $2(P-1)/P$ and `$HOME` and a price of $5 and $$\\sum_r n_r$$"
    out = markdown_to_mathml(text)
    assert out.count("<math") == 2 and "`$HOME`" in out and "a price of $5" in out


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


@pytest.mark.timeout(180)
def test_jobs_build_notebooks_at_once_and_report_them_in_order(tmp_path, capsys):
    """--jobs 2: each notebook in a process of its own, two at a time; a line per notebook as it
    finishes, numbered in notebook order; the summary in notebook order; a failure still fails."""
    root = tmp_path / "repo"
    (root / "course").mkdir(parents=True)
    for name, body in (("01_slow", "import time; time.sleep(3)"), ("02_fails", "1 / 0"),
                       ("03_quick", "x = 1")):
        nbformat.write(nbformat.v4.new_notebook(cells=[
            nbformat.v4.new_code_cell("WORLD_SIZE = 1", metadata={"tags": ["parameters"]}),
            nbformat.v4.new_code_cell(body)], metadata=KERNEL), str(root / "course" / f"{name}.ipynb"))
    assert run_build(root, tmp_path / "out", jobs=2) == 1
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if l.startswith("[")]
    assert sorted(l.split()[0] for l in lines) == ["[1/3]", "[2/3]", "[3/3]"], out
    assert lines[-1].startswith("[1/3] course/01_slow.ipynb ... ok"), out    # the slow one last
    assert "ZeroDivisionError" in out and "2 passed, 1 failed" in out
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [l.split()[0] for l in summary[2:]] == [f"course/{n}.ipynb" for n in
                                                   ("01_slow", "02_fails", "03_quick")]
    assert run_build(root, tmp_path / "out2", jobs=0) == 2


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
    assert "pip uninstall -y -q rfc3987-syntax" in dry, "jsonschema's slow IRI checker stays"


def test_ci_runs_exactly_make_test():
    script = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in script.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert "make test || status=$?" in commands, script
    assert not any("pytest" in c for c in commands), "CI must run the README's command, not its own"
    assert "make test" in (ROOT / "README.md").read_text()
