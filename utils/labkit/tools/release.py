"""Generate the student copies in labs/ from the nbgrader source in solutions/, and check them.

    labkit release            # regenerate labs/<lab>/ for every solutions/<lab>/
    labkit release --check    # exit 1 if labs/ differs from a fresh release, a lab has
                                        # no source, or solution / hidden-test text leaked

Generation uses nbgrader's Python API with the settings of the repository's nbgrader_config.py
and a throwaway sqlite gradebook, so it never touches grading/. nbgrader's output is byte-identical
across runs, which is what makes the --check comparison possible.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import sys
import tempfile
from pathlib import Path

from labkit.common import (HIDDEN_BEGIN, HIDDEN_END, MARKERS, SOLUTION_BEGIN,  # noqa: F401
                           SOLUTION_END)

# A secret line shorter than this is too generic to call a leak (`return total`, `dist.barrier()`).
MIN_LEAK_CHARS = 24
# A secret line this long is a leak on its own; a shorter one only next to another secret line
# (one generic line such as `except labkit.RankError as error:` can be written independently).
LONE_LEAK_CHARS = 48
# Working files that can appear next to a notebook; never part of a release or of the comparison.
IGNORED = [".ipynb_checkpoints", "__pycache__", ".hypothesis", ".pytest_cache"]
SCANNED_SUFFIXES = {".py", ".ipynb", ".md", ".txt", ".json", ".toml", ".cfg", ".yml", ".yaml"}


def lab_sources(root: Path) -> list[str]:
    """Names of the labs: the folders of solutions/ that hold a notebook."""
    solutions = root / "solutions"
    return sorted(p.name for p in solutions.iterdir()
                  if p.is_dir() and any(p.glob("*.ipynb"))) if solutions.is_dir() else []


def _config(root: Path, release_dir: Path, db_path: Path):
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader
    config = Config()
    if (root / "nbgrader_config.py").exists():
        config.merge(PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config())
    config.CourseDirectory.root = str(root)
    config.CourseDirectory.source_directory = str(root / "solutions")
    config.CourseDirectory.release_directory = str(release_dir)
    config.CourseDirectory.db_url = f"sqlite:///{db_path}"
    config.Exchange.root = str(db_path.parent / "exchange")  # unused; keeps nbgrader off /usr/local
    return config


def _ensure_tools_on_path() -> None:
    """nbgrader's gradebook start-up runs `alembic` from PATH: use this interpreter's bin/."""
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def generate(root: Path, release_dir: Path | None = None, labs: list[str] | None = None) -> list[str]:
    """Regenerate release_dir/<lab>/ (labs/ by default) for each lab; returns the lab names."""
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    _ensure_tools_on_path()
    root = root.resolve()
    release_dir = (release_dir or root / "labs").resolve()
    labs = lab_sources(root) if labs is None else labs
    with tempfile.TemporaryDirectory(prefix="labkit-release-") as tmp:
        config = _config(root, release_dir, Path(tmp) / "release.db")
        api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)
        for lab in labs:
            result = api.generate_assignment(lab, force=True, create=True)
            if not result["success"]:
                raise RuntimeError(f"nbgrader generate_assignment failed for {lab}:\n"
                                   f"{result.get('error') or ''}\n{result.get('log') or ''}")
            write_expected(release_dir / lab, lab)
    return labs


def write_expected(folder: Path, lab: str) -> None:
    """labs/<lab>/expected.json: the visible cases' expected values, computed by the grader's
    references (labkit.grading.references), which the student copy does not have."""
    from labkit import released
    from labkit.grading.references import expected
    values = expected(lab)
    if values is not None:
        with open(folder / released.FILE, "w", encoding="utf-8") as f:
            json.dump(values, f, indent=1, sort_keys=True)
            f.write("\n")


def _differences(expected: Path, actual: Path, prefix: str) -> list[str]:
    """Files that differ between two trees, as 'prefix/relative path: what'."""
    problems = []
    compare = filecmp.dircmp(expected, actual, ignore=IGNORED)
    problems += [f"{prefix}/{name}: missing (a fresh release has it)" for name in compare.left_only]
    problems += [f"{prefix}/{name}: not in a fresh release" for name in compare.right_only]
    for name in compare.common_files:
        if not filecmp.cmp(expected / name, actual / name, shallow=False):
            problems.append(f"{prefix}/{name}: differs from a fresh release")
    for name in compare.common_dirs:
        problems += _differences(expected / name, actual / name, f"{prefix}/{name}")
    return problems


def sync_problems(root: Path) -> list[str]:
    """labs/ against a fresh release of solutions/, and labs without a source."""
    root = root.resolve()
    labs_dir = root / "labs"
    sources = lab_sources(root)
    problems = []
    if not sources:
        problems.append("solutions/ holds no lab (a folder with a notebook)")
    released = sorted(p.name for p in labs_dir.iterdir() if p.is_dir()) if labs_dir.is_dir() else []
    for name in released:
        if name not in sources:
            problems.append(f"labs/{name}: no source in solutions/{name}/ (delete it or add one)")
    with tempfile.TemporaryDirectory(prefix="labkit-check-") as tmp:
        fresh = Path(tmp) / "labs"
        generate(root, fresh, sources)
        for lab in sources:
            if not (labs_dir / lab).is_dir():
                problems.append(f"labs/{lab}: not released (run `make release`)")
            else:
                problems += _differences(fresh / lab, labs_dir / lab, f"labs/{lab}")
    return problems


def _normal(line: str) -> str:
    return " ".join(line.split())


def secret_lines(root: Path) -> dict[str, str]:
    """Distinctive lines of every solution region and hidden-test region in solutions/.

    Returns {normalised line: 'solutions/<lab>/<nb> (solution|hidden test)'}. Lines that also
    appear outside those regions of the source (a docstring, a visible test) are not secret, nor
    are comments and `raise` lines (an error message is not an answer).
    """
    import nbformat
    secret, public = {}, set()
    for path in sorted((root / "solutions").glob("*/*.ipynb")):
        notebook = nbformat.read(str(path), as_version=4)
        for cell in notebook.cells:
            inside = None
            for line in cell.source.splitlines():
                if SOLUTION_BEGIN in line or HIDDEN_BEGIN in line:
                    inside = "solution" if SOLUTION_BEGIN in line else "hidden test"
                    continue
                if SOLUTION_END in line or HIDDEN_END in line:
                    inside = None
                    continue
                text = _normal(line)
                if inside is None:
                    public.add(text)
                elif len(text) >= MIN_LEAK_CHARS and not text.startswith(("#", "raise ")):
                    secret.setdefault(text, f"{path.relative_to(root)} ({inside})")
    return {line: where for line, where in secret.items() if line not in public}


def _text_lines(path: Path) -> list[str]:
    if path.suffix == ".ipynb":
        import nbformat
        try:
            notebook = nbformat.read(str(path), as_version=4)
        except Exception:
            return path.read_text(encoding="utf-8", errors="replace").splitlines()
        return [line for cell in notebook.cells for line in cell.source.splitlines()]
    return path.read_text(encoding="utf-8", errors="replace").splitlines()


def leak_problems(root: Path, places: tuple[str, ...] = ("labs", "utils", "course")) -> list[str]:
    """Markers in labs/, and solution or hidden-test lines anywhere in `places`."""
    root = root.resolve()
    secrets = secret_lines(root)
    problems = []
    for place in places:
        for path in sorted((root / place).rglob("*")):
            if not path.is_file() or path.suffix not in SCANNED_SUFFIXES or "build" in path.parts:
                continue
            where = path.relative_to(root)
            lines = [_normal(line) for line in _text_lines(path)]
            lines = [(number, text) for number, text in enumerate(lines, 1) if text]
            hits = [text in secrets for _, text in lines]
            for i, (number, text) in enumerate(lines):
                if (place == "labs" or path.suffix == ".ipynb") and any(m in text for m in MARKERS):
                    problems.append(f"{where}: line {number} holds an nbgrader marker")
                beside = (i > 0 and hits[i - 1]) or (i + 1 < len(hits) and hits[i + 1])
                if hits[i] and (len(text) >= LONE_LEAK_CHARS or beside):
                    problems.append(f"{where}: line {number} is text from {secrets[text]}: {text!r}")
    return problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if labs/ is stale, a lab lacks a source or text leaked")
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root (.)")
    parser.add_argument("labs", nargs="*", metavar="LAB",
                        help="regenerate only these labs (default: every folder of solutions/)")


def run(args: argparse.Namespace) -> int:
    root = args.root.resolve()
    if args.check:
        stale, leaks = sync_problems(root), leak_problems(root)
        for problem in stale + leaks:
            print(f"labkit release --check: {problem}", file=sys.stderr)
        if stale:
            print("fix: edit solutions/ (never labs/), run `make release`, commit labs/", file=sys.stderr)
        if leaks:
            print("fix: the lines above give away a graded answer or a hidden test; rewrite them "
                  "where they leaked (labkit may check an answer, never contain it)", file=sys.stderr)
        if stale or leaks:
            return 1
        print(f"labkit release --check: labs/ matches solutions/ ({', '.join(lab_sources(root))}); no leaks")
        return 0
    unknown = sorted(set(args.labs) - set(lab_sources(root)))
    if unknown:
        print(f"labkit release: no source for {unknown} in solutions/", file=sys.stderr)
        return 2
    labs = generate(root, labs=args.labs or None)
    if not labs:
        print("labkit release: solutions/ holds no lab", file=sys.stderr)
        return 1
    for lab in labs:
        print(f"released solutions/{lab}/ -> labs/{lab}/")
    sources = set(lab_sources(root))
    stale = [p.name for p in (root / "labs").iterdir() if p.is_dir() and p.name not in sources]
    for name in stale:
        print(f"labkit release: labs/{name} has no source in solutions/; delete it", file=sys.stderr)
    return 1 if stale else 0


def main(argv: list[str] | None = None) -> int:
    from labkit.common import run_module
    return run_module(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
