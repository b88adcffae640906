"""Run inside a student copy (`labkit dist`): call every function of its labkit on each graded
task's visible case; print, as JSON, the functions whose results equal the task's answer.

    python no_answer_walk.py SOLUTIONS_DIR      # with PYTHONPATH=<copy>/utils, cwd=<copy>

The answers are computed here from the solution cells of solutions/ (which the copy lacks).
"""
import importlib
import inspect
import json
import math
import os
import pkgutil
import signal
import sys
import time

import torch

CALL_SECONDS = 2
SKIPPED_PACKAGES = ("labkit.runtime", "labkit.tools", "labkit.__main__", "labkit.drill.terminal",
                    "labkit.drill.notebook")
SKIPPED_FUNCTIONS = {"labkit.world"}                    # starts ranks

# task -> visible cases as (args, kwargs) source, evaluated in the lab's namespace
TASKS = {
    "lab00_first_collectives": {
        "shard_bounds": ["(10, 0, 3), {}", "(10, 1, 3), {}", "(10, 2, 3), {}", "(8, 1, 2), {}"],
        "all_reduce_result": ["([[1, 2], [3, 4]], 'sum'), {}", "([[1, 5], [3, 4], [2, 0]], 'max'), {}"],
    },
    "lab01_collectives": {"crossover_bytes": ["(1e-4, 1e-9, 2), {}", "(1e-4, 1e-9, 4), {}"],
                          "all_to_all_seconds": ["([[4, 2], [2, 4]], 1000, 1e-4, 1e-9), {}",
                                                 "([[2, 0, 30], [5, 1, 40], [3, 8, 4]], 1024, 1e-5, 1e-9), {}"]},
    "lab03_memory_and_zero": {
        "predict_memory": ["(), dict(stage=1, P=2, layers=2, hidden=48, batch=4, seq=32)",
                           "(), dict(stage=3, P=2, layers=2, hidden=48, batch=2, seq=8)"],
        "predict_pipeline_peaks": ["(zero_pipeline.case(zero_stage=3, reshard='step', schedule='1f1b', "
                                   "layers=2, microbatches=4, pp=2), 2), {}",
                                   "(zero_pipeline.case(zero_stage=3, reshard='step', schedule='gpipe', "
                                   "layers=2, microbatches=3, pp=2), 2), {}"],
    },
    "lab04_tensor_parallel": {"gqa_placement": ["(12, 4, 3), {}", "(32, 8, 16), {}", "(12, 2, 4), {}"]},
    "lab05_pipeline_parallel": {
        "zb_h2": ["(4, 8), {}", "(4, 3), {}"],
        "find_deadlock": ["(pipeline.gpipe(4, 3), 3), {}", "(pipeline.interleaved_1f1b(2, 4, 2), 4), {}",
                          "(pipeline.parse('F0 F1 F2 B0 B1 B2\\nF0 F1 B0 F2 B1 B2\\nF0 B0 F1 B1 F2 B2\\n"
                          "F1 B1 F0 B0 F2 B2'), 3), {}"],
        "timeline": ["(pipeline.gpipe(3, 4), 4, [{'F': 1.0, 'B': 2.0}] * 3, 0.0), {}",
                     "(pipeline.torch_schedule('1F1B', 3, 4), 4, [{'F': 1.0, 'B': 2.0}, "
                     "{'F': 2.0, 'B': 3.0}, {'F': 1.0, 'B': 2.5}], 0.5), {}"],
        "bubble_fraction": ["(pipeline.gpipe(4, 8), 8, [{'F': 1.0, 'B': 2.0}] * 4, 0.0), {}"],
    },
    "lab06_3d_parallelism": {
        "mesh_layout": ["(8, {'dp': 2, 'pp': 2, 'tp': 2}, ['dp', 'pp', 'tp']), {}",
                        "(12, {'dp': 3, 'tp': 2, 'pp': 2}, ['pp', 'dp', 'tp']), {}"],
        "choose_config": ["(MODEL_36, A100_8, 512, None), {}", "(MODEL_36, A100_8, 512, 12e9), {}"],
    },
    "lab07_mixture_of_experts": {
        "dispatch": ["(X, LOGITS, 2, 1.0), {}"],
        "quantize_e4m3": ["(X12, 64), {}"],
    },
    "lab08_checkpoints": {
        "simulate_async": ["(350.0, 100.0, 5.0, 20.0, 30.0, []), {}",
                           "(350.0, 100.0, 5.0, 20.0, 30.0, [250.0]), {}",
                           "(350.0, 100.0, 5.0, 20.0, 30.0, [225.0]), {}"],
        "async_interval": ["(2.0, 0.0, 3600.0), {}", "(3.0, 10.0, 5000.0), {}"],
    },
    "lab09_failures_at_scale": {"validate_resume": ["(SNAP, RUN), {}"]},
    "lab10_long_sequences": {
        "predict_cp_step": ["(Model('m', layers=32, hidden=4096, heads=32, seq=32768, vocab=51200), "
                            "{'dp': 2, 'cp': 4, 'tp': 2, 'pp': 2, 'zero_stage': 1, 'microbatches': 4}, 16), {}",
                            "(Model('m', layers=16, hidden=2048, heads=16, seq=49152, vocab=32000), "
                            "{'dp': 1, 'cp': 3, 'tp': 4, 'pp': 2, 'zero_stage': 3, 'microbatches': 2}, 8, 'none'), {}"],
    },
}
PRELUDE = """
import dataclasses
g = torch.Generator().manual_seed(0)
X, LOGITS = torch.randn(48, 16, generator=g), torch.randn(48, 6, generator=g)
X12 = torch.randn(12, 200, generator=g)
SNAP = {"step": 3, "world_size": 2, "global_batch": 4,
        "tokenizer": {"name": "char", "vocab_size": 29, "sha256": "ab12"},
        "data": {"mixture": {"web": 1.0}, "seed": 0, "samples_seen": 12, "cursor": {"web": 12},
                 "rank_cursors": [6, 6]}}
RUN = {"world_size": 4, "global_batch": 4, "tokenizer": dict(SNAP["tokenizer"]),
       "data": {"mixture": {"web": 1.0}, "seed": 0}}
try:
    MODEL_36 = dataclasses.asdict(mesh.figures.megatron_rows()[1]["model"])
    A100_8 = dataclasses.asdict(mesh.DGX_A100.with_nodes(8))
except NameError:
    pass
"""


class CallTimeout(BaseException):
    pass


def _alarm(signum, frame):
    raise CallTimeout()


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b)))
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and set(a) == set(b) \
            and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) \
            and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (math.isfinite(a) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12))
    if a is None or b is None:
        return a is b
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def lab_namespace(solutions, lab):
    with open(os.path.join(solutions, lab, f"{lab}.ipynb"), encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    ns = {"WORLD_SIZE": 2, "BACKEND": "gloo", "__name__": f"answers_{lab}"}
    for cell in cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or meta.get("grade"):
            continue
        if meta.get("grade_id") == "setup":          # imports only: no world, no prints
            source = "\n".join(line for line in source.splitlines()
                               if "labkit.world(" not in line and not line.startswith("print("))
        elif not meta.get("solution"):
            continue
        exec(compile(source, f"{lab}:{meta.get('grade_id')}", "exec"), ns)
    exec(PRELUDE, ns)
    return ns


def candidates():
    import labkit
    names = ["labkit"] + [m.name for m in pkgutil.walk_packages(labkit.__path__, "labkit.")]
    found, broken = [], []
    for name in sorted(set(names)):
        if name.startswith(SKIPPED_PACKAGES) or any(part.startswith("_") for part in name.split(".")):
            continue                                  # private modules: servers, rank entry points
        try:
            module = importlib.import_module(name)
        except Exception as error:  # noqa: BLE001
            broken.append(f"{name}: {type(error).__name__}: {error}")
            continue
        for attr, fn in sorted(vars(module).items()):
            if not inspect.isfunction(fn) or fn.__module__ != name or attr.startswith("__"):
                continue
            if f"{name}.{attr}" in SKIPPED_FUNCTIONS or fn.__module__.startswith(SKIPPED_PACKAGES):
                continue
            try:
                found.append((f"{name}.{attr}", fn, inspect.signature(fn)))
            except (TypeError, ValueError):
                pass
    return found, broken


def main(solutions):
    import labkit
    out = {"labkit": labkit.__file__, "leaks": [], "calls": 0, "functions": 0, "broken": []}
    try:
        import labkit.grading  # noqa: F401
        out["grading_present"] = True
    except ImportError:
        out["grading_present"] = False
    functions, out["broken"] = candidates()
    out["functions"] = len(functions)
    import torch._dynamo  # noqa: F401 (a lazy import cut by the alarm leaves it half made)
    answers = []                     # every answer first, before any candidate runs
    for lab, tasks in TASKS.items():
        ns = lab_namespace(solutions, lab)
        for task, sources in tasks.items():
            cases = [eval(f"({s})", ns) for s in sources]
            answers.append((lab, task, cases, [ns[task](*a, **k) for a, k in cases]))
    signal.signal(signal.SIGALRM, _alarm)
    for lab, task, cases, expected in answers:
        if True:
            for qualname, fn, signature in functions:
                answered = True
                for (args, kwargs), want in zip(cases, expected):
                    try:
                        signature.bind(*args, **kwargs)
                    except TypeError:
                        answered = False
                        break
                    out["calls"] += 1
                    started = time.monotonic()
                    signal.alarm(CALL_SECONDS)
                    try:
                        got = fn(*args, **kwargs)
                    except BaseException:  # noqa: BLE001 (a refusal or a timeout: no answer)
                        answered = False
                    finally:
                        signal.alarm(0)
                        spent = time.monotonic() - started
                        if spent > 0.5:
                            print(f"slow: {qualname} {spent:.1f} s", file=sys.stderr, flush=True)
                    if not answered or not same(got, want):
                        answered = False
                        break
                if answered:
                    out["leaks"].append(f"{qualname} answers {lab}'s {task} on its visible case")
    print("NO_ANSWER_WALK " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
