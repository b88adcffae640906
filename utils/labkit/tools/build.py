"""Execute every course notebook and every lab solution headless, as CI and `make course` do.

    labkit build                      # small, CPU/gloo unless every rank can have a GPU
    labkit build --world 4 --backend nccl --scale large
    labkit build --only 00            # notebooks whose path contains "00"

Each notebook runs under papermill with its `parameters` cell overridden (WORLD_SIZE, BACKEND,
SCALE), in a fresh kernel, in a copy of its folder under build/work/. The executed copy goes to
build/executed/<same path>.ipynb and an HTML rendering to build/html/<same path>.html; the sources
are never written to. One progress line per notebook, a summary table at the end, exit code 1 if
any notebook failed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from labkit import formulas

KERNEL = "labkit"  # installed into the virtual environment by `make setup`


@dataclass
class Result:
    notebook: Path            # relative to the root
    status: str               # "ok" or "FAILED"
    seconds: float
    executed: Path
    html: Path | None
    error: str = field(default="")
    formulas: list = field(default_factory=list)   # labkit.formulas records of the run


def find_notebooks(root: Path, only: str | None = None) -> list[Path]:
    """course/*.ipynb in chapter order, then solutions/<lab>/*.ipynb in lab order."""
    found = sorted((root / "course").glob("*.ipynb")) + sorted((root / "solutions").glob("*/*.ipynb"))
    found = [p.relative_to(root) for p in found if ".ipynb_checkpoints" not in p.parts]
    return [p for p in found if only is None or only in str(p)]


def pick_kernel() -> str | None:
    """The course kernel if installed; else None (papermill then uses the notebook's own)."""
    from jupyter_client.kernelspec import KernelSpecManager
    return KERNEL if KERNEL in KernelSpecManager().find_kernel_specs() else None


def has_parameters_cell(path: Path) -> bool:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return any("parameters" in c.get("metadata", {}).get("tags", []) for c in cells)


TEMPLATES = Path(__file__).parent / "templates"


def render_html(executed: Path, html: Path) -> None:
    """The executed notebook as a page that reads offline (math as MathML, no MathJax)."""
    import nbformat
    from nbconvert import HTMLExporter
    from labkit.tools.mathml import notebook_to_mathml
    exporter = HTMLExporter(template_name="offline", extra_template_basedirs=[str(TEMPLATES)])
    body, _ = exporter.from_notebook_node(
        notebook_to_mathml(nbformat.read(str(executed), as_version=4)))
    html.parent.mkdir(parents=True, exist_ok=True)
    html.write_text(body, encoding="utf-8")


@contextlib.contextmanager
def _stderr_to(path: Path):
    """Send this process's stderr (file descriptor 2, inherited by the kernel) to a log file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w", encoding="utf-8") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def execute_one(root: Path, notebook: Path, out: Path, parameters: dict, kernel: str | None,
                cell_timeout: int) -> Result:
    import papermill
    executed = out / "executed" / notebook
    html = out / "html" / notebook.with_suffix(".html")
    log = out / "logs" / notebook.with_suffix(".log")
    for stale in (executed, html):
        stale.unlink(missing_ok=True)
    executed.parent.mkdir(parents=True, exist_ok=True)
    # Run in a copy of the notebook's folder, so files a notebook writes (checkpoints, caches)
    # land under build/ and never in course/ or solutions/ (whence a release would ship them).
    workdir = out / "work" / notebook.parent
    shutil.copytree(root / notebook.parent, workdir, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.ipynb", ".ipynb_checkpoints", "__pycache__",
                                                  ".hypothesis", ".pytest_cache"))
    start = time.perf_counter()
    status, error = "ok", ""
    if not has_parameters_cell(root / notebook):
        status, error = "FAILED", "no cell tagged 'parameters' (papermill would inject blindly)"
    else:
        try:
            # headless: rank output as plain `[rank k] ...` lines (see labkit.runtime.display.live_view)
            os.environ.setdefault("LABKIT_OUTPUT", "text")
            with _stderr_to(log):  # kernel and papermill chatter: kept, off the progress line
                papermill.execute_notebook(
                    str(root / notebook), str(executed), parameters=parameters,
                    kernel_name=kernel, cwd=str(workdir),
                    execution_timeout=cell_timeout, progress_bar=False, log_output=False)
        except Exception as exc:  # PapermillExecutionError, CellTimeoutError, DeadKernelError...
            status = "FAILED"
            error = f"{_short_error(exc)} (kernel log: {log})"
    seconds = time.perf_counter() - start
    records = []
    try:
        if executed.exists():
            records = formula_records(executed)
            render_html(executed, html)
    except Exception as exc:  # a rendering problem must not hide the execution result
        error = error or f"HTML rendering failed: {exc}"
    return Result(notebook, status, seconds, executed, html if html.exists() else None, error,
                  records)


def formula_records(executed: Path) -> list:
    """The labkit.formulas checks an executed notebook recorded (see labkit/formulas.py)."""
    from labkit.formulas import records_in_notebook
    return records_in_notebook(json.loads(executed.read_text(encoding="utf-8")))


def _execute_in_parallel(root: Path, notebooks: list, out: Path, parameters: dict,
                         kernel: str | None, cell_timeout: int, jobs: int) -> list:
    """execute_one for each notebook, `jobs` at a time, each in a fresh process (spawned: the
    kernel's stderr is redirected per process, and no torch state is forked). A notebook's line
    is printed whole when it finishes, numbered in notebook order; results in notebook order."""
    import concurrent.futures
    import multiprocessing
    context = multiprocessing.get_context("spawn")
    results = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context,
                                                max_tasks_per_child=1) as pool:
        futures = {pool.submit(execute_one, root, notebook, out, parameters, kernel,
                               cell_timeout): i
                   for i, notebook in enumerate(notebooks, 1)}
        for future in concurrent.futures.as_completed(futures):
            i = futures[future]
            notebook = notebooks[i - 1]
            try:
                result = future.result()
            except Exception as exc:          # the worker process itself died
                result = Result(notebook, "FAILED", 0.0, out / "executed" / notebook, None,
                                f"the build's worker process failed: {_short_error(exc)}")
            results[i] = result
            print(f"[{i}/{len(notebooks)}] {notebook} ... {result.status} "
                  f"({result.seconds:.1f}s)", flush=True)
            if result.error:
                print(f"      {result.error}", flush=True)
    return [results[i] for i in sorted(results)]


def _number(values: list, unit: str) -> str:
    text = (f"{values[0]:.4g}" if len(values) == 1 else
            f"{len(values)} values, {min(values):.3g} to {max(values):.3g}")
    return f"{text} {unit}".strip()


def _abs_tol_text(abs_tol) -> str:
    """'0.5 abs', or for one tolerance per value 'per value 288 to 864 abs'; '' for none."""
    if isinstance(abs_tol, list):
        if not any(abs_tol):
            return ""
        low, high = min(abs_tol), max(abs_tol)
        return f"{low:.3g} abs" if low == high else f"per value {low:.3g} to {high:.3g} abs"
    return f"{abs_tol:.3g} abs" if abs_tol else ""


def formula_table(results: list) -> list[tuple]:
    """Rows (notebook, formula, kind, predicted, measured, error, tolerance, why this tolerance,
    status)."""
    rows = []
    for result in results:
        for r in result.formulas:
            tolerance = " or ".join(t for t in (
                f"{r['rel_tol']:.3g} rel" if r.get("rel_tol") else "",
                _abs_tol_text(r.get("abs_tol"))) if t) or "exact"
            if r.get("bound"):
                tolerance += f" ({r['bound']} bound)"
            error = r.get("worst_error")
            kind = kind_of(r)
            if r.get("basis"):
                kind += f": {r['basis']}"
            rows.append((str(result.notebook), r["name"], kind,
                         _number(r["predicted"], r.get("unit", "")),
                         _number(r["measured"], r.get("unit", "")),
                         formulas.error_text(r["predicted"], r["measured"], error,
                                             r.get("unit", "")), tolerance, r.get("why") or "-",
                         "ok" if r.get("passed") else
                         ("off (timing)" if r.get("timing") else "FAILED")))
    return rows


NO_KIND = "(no kind)"


def kind_of(record: dict) -> str:
    """A record's kind; records from before kinds existed with timing=True are timings."""
    kind = record.get("kind") or ("timing" if record.get("timing") else None)
    return kind if kind in formulas.KINDS else NO_KIND


def kind_counts(results: list) -> dict:
    """{notebook: {kind: checks}} in notebook order, every kind present (0 where none)."""
    counts = {}
    for result in results:
        row = dict.fromkeys(formulas.KINDS + (NO_KIND,), 0)
        for r in result.formulas:
            row[kind_of(r)] += 1
        counts[str(result.notebook)] = row
    return counts


def kind_totals(results: list) -> dict:
    totals = dict.fromkeys(formulas.KINDS + (NO_KIND,), 0)
    for row in kind_counts(results).values():
        for kind, n in row.items():
            totals[kind] += n
    return totals


def _kinds_shown(results: list) -> tuple:
    return formulas.KINDS + ((NO_KIND,) if kind_totals(results)[NO_KIND] else ())


def kind_summary(results: list) -> str:
    """One line: checks per kind ("measured 70, reproduction 3, simulation 12, timing 6")."""
    totals = kind_totals(results)
    return ", ".join(f"{kind} {totals[kind]}" for kind in _kinds_shown(results))


def write_formula_ledger(results: list, out: Path) -> int:
    """build/formulas.md and build/formulas.json; returns the number of checks."""
    rows = formula_table(results)
    head = ("notebook", "formula", "kind", "predicted", "measured", "error", "tolerance",
            "why this tolerance", "status")
    kinds = _kinds_shown(results)
    lines = ["# Formulas checked, and the evidence for each", "",
             f"{len(rows)} checks, written by `labkit build` from the executed notebooks "
             f"(labkit.formulas.check): {kind_summary(results)}.", "",
             "Kinds: **measured** (a quantity from real ranks, the OS or torch's profiler against a "
             "formula computed independently), **reproduction** (against a paper's printed figures), "
             "**simulation** (against a simulation of the same assumptions: it checks the arithmetic, "
             "not the world), **timing** (wall clock on a shared machine: recorded with its band, "
             "never raised). See docs/AUTHORS.md.", "",
             "## Checks per chapter and kind", "",
             "| chapter | " + " | ".join(kinds) + " | all |", "|" + "---|" * (len(kinds) + 2)]
    for notebook, row in kind_counts(results).items():
        name = Path(notebook).stem
        lines.append(f"| {name} | " + " | ".join(str(row[k]) for k in kinds)
                     + f" | {sum(row.values())} |")
    totals = kind_totals(results)
    lines += ["| **all** | " + " | ".join(str(totals[k]) for k in kinds) + f" | {len(rows)} |", "",
              "## Every check", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    (out / "formulas.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "formulas.json").write_text(json.dumps(
        [dict(r, notebook=str(res.notebook)) for res in results for r in res.formulas],
        indent=1), encoding="utf-8")
    return len(rows)


def write_index(results: list, out: Path, root: Path) -> Path:
    """build/html/index.html: every notebook (status, time, links) and the formula ledger."""
    import html as html_module
    esc = html_module.escape
    rows = []
    for r in results:
        link = (f'<a href="{esc(str(r.html.relative_to(out / "html")))}">{esc(str(r.notebook))}</a>'
                if r.html else esc(str(r.notebook)))
        rows.append(f"<tr><td>{link}</td><td>{esc(r.status)}</td><td>{r.seconds:.1f} s</td>"
                    f"<td>{len(r.formulas)}</td><td>{esc(r.error)}</td></tr>")
    formulas = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>"
                       for row in formula_table(results))
    kinds = _kinds_shown(results)
    totals = kind_totals(results)
    per_kind = "".join(f"<tr><td>{esc(Path(notebook).stem)}</td>"
                       + "".join(f"<td>{row[k]}</td>" for k in kinds)
                       + f"<td>{sum(row.values())}</td></tr>"
                       for notebook, row in kind_counts(results).items())
    per_kind += ("<tr><th>all</th>" + "".join(f"<th>{totals[k]}</th>" for k in kinds)
                 + f"<th>{sum(totals.values())}</th></tr>")
    kind_head = "".join(f"<th>{esc(k)}</th>" for k in kinds)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>The course, executed</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}</style></head><body>
<h1>The course, executed</h1>
<table><tr><th>notebook</th><th>status</th><th>time</th><th>formula checks</th><th>error</th></tr>
{"".join(rows)}</table>
<h2>Formulas checked ({len(formula_table(results))}): {esc(kind_summary(results))}</h2>
<p>measured: real ranks, the OS or torch's profiler against an independent formula; reproduction:
a paper's printed figures; simulation: a simulation of the same assumptions; timing: wall clock,
recorded with its band, never raised.</p>
<table><tr><th>chapter</th>{kind_head}<th>all</th></tr>{per_kind}</table>
<h2>Every check</h2>
<table><tr><th>notebook</th><th>formula</th><th>kind</th><th>predicted</th><th>measured</th>
<th>error</th><th>tolerance</th><th>why this tolerance</th><th>status</th></tr>{formulas}</table>
</body></html>"""
    index = out / "html" / "index.html"
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_text(page, encoding="utf-8")
    return index


def _short_error(exc: Exception) -> str:
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    cell = getattr(exc, "exec_count", None)
    where = f" in cell [{cell}]" if cell is not None else ""
    return f"{ename}{where}: {str(evalue).strip().splitlines()[0] if str(evalue).strip() else ''}"


def summary_table(results: list[Result], root: Path) -> str:
    def rel(p: Path | None) -> str:
        if p is None:
            return "-"
        try:
            return str(p.resolve().relative_to(root.resolve()))
        except ValueError:
            return str(p)
    rows = [("notebook", "status", "time", "executed copy", "html")]
    rows += [(str(r.notebook), r.status, f"{r.seconds:6.1f}s", rel(r.executed) if r.executed.exists()
              else "-", rel(r.html)) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=2, help="WORLD_SIZE: ranks per world (2)")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                        help="BACKEND: auto picks nccl when every rank can have a GPU, else gloo")
    parser.add_argument("--scale", default="small", choices=["small", "large"],
                        help="SCALE: problem sizes (small for CPUs and CI)")
    parser.add_argument("--only", default=None, help="run only notebooks whose path contains this")
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root (.)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (ROOT/build)")
    parser.add_argument("--cell-timeout", type=int, default=600, help="seconds per cell (600)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="notebooks executed at once, each in a process of its own (1)")


def run(args: argparse.Namespace) -> int:
    if args.world < 1:
        print(f"labkit build: --world must be >= 1, got {args.world}", file=sys.stderr)
        return 2
    root = args.root.resolve()
    out = (args.out or root / "build").resolve()
    notebooks = find_notebooks(root, args.only)
    if not notebooks:
        print(f"labkit build: no notebooks under {root}/course or {root}/solutions"
              + (f" matching {args.only!r}" if args.only else ""), file=sys.stderr)
        return 1
    parameters = {"WORLD_SIZE": args.world, "BACKEND": args.backend, "SCALE": args.scale}
    kernel = pick_kernel()
    print(f"labkit build: {len(notebooks)} notebooks, WORLD_SIZE={args.world} "
          f"BACKEND={args.backend} SCALE={args.scale}, kernel {kernel or '(from notebook)'}",
          flush=True)
    jobs = getattr(args, "jobs", 1)
    if not isinstance(jobs, int) or jobs < 1:
        print(f"labkit build: --jobs must be >= 1, got {jobs!r}", file=sys.stderr)
        return 2
    total_start = time.perf_counter()
    if jobs == 1:
        results = []
        for i, notebook in enumerate(notebooks, 1):
            print(f"[{i}/{len(notebooks)}] {notebook} ...", end="", flush=True)
            result = execute_one(root, notebook, out, parameters, kernel, args.cell_timeout)
            results.append(result)
            print(f" {result.status} ({result.seconds:.1f}s)", flush=True)
            if result.error:
                print(f"      {result.error}", flush=True)
    else:
        results = _execute_in_parallel(root, notebooks, out, parameters, kernel,
                                       args.cell_timeout, jobs)
    table = summary_table(results, root)
    failed = [r for r in results if r.status != "ok"]
    total = time.perf_counter() - total_start
    print("\n" + table)
    checks = write_formula_ledger(results, out)
    index = write_index(results, out, root)
    with_checks = sum(1 for r in results if r.formulas)
    print(f"\n{checks} formula checks in {with_checks} notebooks: {out / 'formulas.md'}; "
          f"index: {index}")
    print(f"formula checks by kind: {kind_summary(results)}")
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed in {total:.1f}s")
    (out / "summary.txt").write_text(table + "\n", encoding="utf-8")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    from labkit.common import run_module
    return run_module(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
