"""The configuration explorer (chapter 6, section 4): a model, a cluster shape and a configuration
in, the predicted step (by part) and the memory of one rank out. And the chapter's self-checks.

    from labkit.mesh import widget
    widget.explorer()                          # in a notebook: controls and two live charts
    widget.plot_cost(cost.predict(...))        # the same charts, static
"""
from __future__ import annotations

import os

from labkit.memory import widget as memory_widget
from labkit.mesh import cost, figures

PARTS = {"compute": "C0", "bubble": "C7", "tp": "C3", "pp": "C2", "dp": "C1", "latency": "C4"}


def presets() -> dict:
    """Models to explore: Megatron-LM 2021's table and chapter 3's GPT-3 sizes (vocabulary, heads
    and layers as published)."""
    found = {f"Megatron {row['model'].name}": row["model"] for row in figures.megatron_rows()}
    for name, (layers, hidden, heads, vocab) in memory_widget.PRESETS.items():
        found[name] = figures.Model(name, layers, hidden, heads, vocab=vocab)
    return found


def plot_cost(predicted: dict, axes=None, title: str = ""):
    """Left: the step's time by part (one stacked bar). Right: chapter 3's ledger of one rank."""
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(9, 3.2))       # ~900 px: a laptop's notebook width
    left, right = axes
    bottom = 0.0
    for part, colour in PARTS.items():
        value = predicted["breakdown"][part] * 1e3
        left.bar(0, value, bottom=bottom, color=colour, width=0.5, label=f"{part} {value:.0f} ms")
        bottom += value
    left.set_xlim(-0.6, 2.2)
    left.set_xticks([])
    left.set_ylabel("ms per step")
    left.set_title(title or f"step {predicted['step_time'] * 1e3:.0f} ms, "
                   f"{predicted['tflops_per_gpu']:.0f} TFLOP/s per GPU", fontsize="small")
    left.legend(fontsize="x-small", loc="upper right")
    memory_widget.plot_ledger(predicted["ledger"], predicted["limit"] / 1e9, ax=right)
    return axes


def _headless() -> bool:
    """No one to move a slider: `labkit build` (papermill) or nbgrader is executing."""
    return os.environ.get("LABKIT_OUTPUT", "auto") == "text" or bool(
        os.environ.get("NBGRADER_EXECUTION"))


def explorer():
    """ipywidgets controls -> cost.predict -> plot_cost, redrawn on every change. Headless (a
    build, a grader), the default configuration is drawn once, without widgets: an Output widget
    redrawn by a callback has kept papermill waiting for the cell to end until its timeout."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    models = presets()
    # Laid out for a laptop (1280 x 800, JupyterLab's side bar open: ~950 px of notebook): two
    # columns of controls, each 300 px with its label sized to its text ('initial'), above the
    # charts; side by side with the charts, the controls were squeezed to three characters.
    style = {"description_width": "initial"}

    def wide(px=300):
        return w.Layout(width=f"{px}px")
    controls = {
        "model": w.Dropdown(options=list(models), value="Megatron 145.6B", description="model",
                            style=style, layout=wide()),
        "cluster": w.Dropdown(options=list(figures.CLUSTERS), value="DGX A100",
                              description="nodes of", style=style, layout=wide()),
        "nodes": w.IntSlider(192, 1, 512, description="nodes", style=style, layout=wide()),
        "tp": w.Dropdown(options=[1, 2, 4, 8, 16], value=8, description="tp", style=style,
                         layout=wide()),
        "pp": w.IntSlider(8, 1, 128, description="pp", style=style, layout=wide()),
        "zero_stage": w.Dropdown(options=[0, 1, 2, 3], value=1, description="ZeRO stage",
                                 style=style, layout=wide()),
        "reshard": w.Dropdown(options=list(cost.RESHARD), value="microbatch",
                              description="ZeRO-2/3 reshard every", style=style, layout=wide()),
        "global_batch": w.IntText(2304, description="global batch", style=style, layout=wide()),
        "microbatches": w.IntSlider(96, 1, 512, description="microbatches", style=style,
                                    layout=wide()),
        "recompute": w.Dropdown(options=["full", "selective", "none"], value="full",
                                description="recompute", style=style, layout=wide()),
        "sequence_parallel": w.Checkbox(False, description="sequence parallel", indent=False,
                                        style=style, layout=wide()),
    }
    out = w.Output()

    def redraw(_=None):
        v = {k: c.value for k, c in controls.items()}
        model = models[v["model"]]
        cluster = figures.CLUSTERS[v["cluster"]].with_nodes(v["nodes"])
        with out:
            out.clear_output(wait=True)
            if cluster.gpus % (v["tp"] * v["pp"]):
                print(f"GPUs ({cluster.gpus}) are not a multiple of tp x pp "
                      f"({v['tp']} x {v['pp']})")
                return
            config = {"dp": cluster.gpus // (v["tp"] * v["pp"]), "tp": v["tp"], "pp": v["pp"],
                      "zero_stage": v["zero_stage"], "microbatches": v["microbatches"]}
            try:
                predicted = cost.predict(model, cluster, config, v["global_batch"], v["recompute"],
                                         reshard=v["reshard"],
                                         sequence_parallel=v["sequence_parallel"])
            except ValueError as error:
                print(error)
                return
            print(f"{model.name}: {model.parameters / 1e9:.1f}B parameters on {cluster.gpus} GPUs, "
                  f"dp = {config['dp']}")
            print(cost.show(predicted))
            plot_cost(predicted)
            plt.show()
    if _headless():
        out = _Direct()
        redraw()
        return controls
    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    items = list(controls.values())
    display(w.VBox([w.GridBox(items, layout=w.Layout(grid_template_columns="repeat(2, 310px)",
                                                     grid_gap="4px 12px")), out]))
    return controls


class _Direct:
    """Stands in for an ipywidgets Output: what is drawn inside goes straight to the cell."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def clear_output(self, wait=False):
        pass


def ask(name: str, answer, expected, explanation: str, rel_tol: float = 0.02):
    """A self-check: `answer` is what the reader typed (None: not yet). Numbers compare within
    `rel_tol`, lists and tuples element by element, anything else by equality. Says right or
    wrong, then explains; never raises."""
    if answer is None:
        print(f"Type your answer into `{name}` in the cell above, then run this cell again.")
        return None

    def same(a, e):
        if isinstance(e, (list, tuple)):
            return isinstance(a, (list, tuple)) and len(a) == len(e) and all(map(same, a, e))
        if isinstance(e, (int, float)) and not isinstance(e, bool):
            try:
                return abs(float(a) - e) <= rel_tol * abs(e) + 1e-12
            except (TypeError, ValueError):
                return False
        return a == e
    right = same(answer, expected)
    print(("Right. " if right else f"Not quite: you said {answer!r}, the answer is {expected!r}. ")
          + explanation)
    return right
