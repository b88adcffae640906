"""The per-rank memory calculator (chapter 3, section 9): ipywidgets controls, a stacked bar.

    from labkit.memory import widget
    widget.calculator()                       # last line of a cell: sliders and a live chart
    widget.plot_ledger(ledger.per_rank_ledger(...), limit_gb=80)   # the same chart, static

"One rank" is the pipeline stage that peaks highest (`ledger.peak_rank_ledger`): the first stage
holds the most microbatches of activations (pp under 1F1B, times Megatron-LM's interleaving
penalty 1 + (p-1)/(pv) with v chunks, all m under GPipe; Megatron-LM's
theoretical_memory_usage.py models the same), the last stage the fp32 logits, both the embedding.
"""
from __future__ import annotations

from labkit.memory import ledger

COLOURS = {"parameters": "C0", "gradients": "C1", "optimizer_states": "C2", "activations": "C3",
           "transients": "C7"}
PRESETS = {   # layers, hidden, heads, vocab (GPT-3 paper, table 2.1; Llama 2 70B's, for the last)
    "GPT-3 1.3B": (24, 2048, 16, 50257), "GPT-3 6.7B": (32, 4096, 32, 50257),
    "GPT-3 13B": (40, 5140, 40, 50257), "GPT-3 175B": (96, 12288, 96, 50257),
    "70B (80 x 8192)": (80, 8192, 64, 32000),
}


def plot_ledger(result: dict, limit_gb: float = 80.0, ax=None, title: str = ""):
    """One stacked bar: steady categories, then transients; the device limit as a red line."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    bottom = 0.0
    for name, colour in COLOURS.items():
        value = result[name] / 1e9
        ax.bar(0, value, bottom=bottom, color=colour, width=0.5, label=f"{name} {value:.1f} GB",
               hatch="//" if name == "transients" else None)
        bottom += value
    ax.axhline(limit_gb, color="red", linewidth=1.5, label=f"device {limit_gb:.0f} GB")
    ax.set_xlim(-0.6, 2.2)
    ax.set_xticks([])
    ax.set_ylabel("GB per rank")
    fits = "fits" if result["peak"] / 1e9 <= limit_gb else "does NOT fit"
    ax.set_title(title or f"peak {result['peak'] / 1e9:.1f} GB: {fits}", fontsize="small")
    ax.legend(fontsize="x-small", loc="upper right")
    return ax


def calculator(limit_gb: float = 80.0):
    """ipywidgets controls -> per_rank_ledger -> plot_ledger, redrawn on every change.

    Returns the widget without displaying it: end a cell with `calculator()` to show it once."""
    import ipywidgets as w
    import matplotlib.pyplot as plt

    style = {"description_width": "120px"}
    controls = {
        "preset": w.Dropdown(options=list(PRESETS), value="GPT-3 6.7B", description="model", style=style),
        "dp": w.IntSlider(8, 1, 256, description="DP degree", style=style),
        "tp": w.Dropdown(options=[1, 2, 4, 8], value=1, description="TP degree", style=style),
        "pp": w.Dropdown(options=[1, 2, 4, 8, 16], value=1, description="PP degree", style=style),
        "zero_stage": w.Dropdown(options=[0, 1, 2, 3], value=1, description="ZeRO stage", style=style),
        "recipe": w.Dropdown(options=[("bf16 AdamW, bf16 grads: 2+2+12", "mixed"),
                                      ("bf16 AdamW, fp32 grads (Megatron): 2+4+12", "mixed_fp32_grads"),
                                      ("fp32 AdamW: 4+4+8", "fp32")],
                             value="mixed", description="bytes/param", style=style),
        "micro_batch": w.IntSlider(1, 1, 16, description="micro-batch", style=style),
        "seq": w.Dropdown(options=[1024, 2048, 4096, 8192], value=2048, description="sequence", style=style),
        "recompute": w.Dropdown(options=list(ledger.RECOMPUTE), value="none", description="recompute", style=style),
        "sequence_parallel": w.Checkbox(False, description="sequence parallel"),
        "schedule": w.Dropdown(options=["1f1b", "gpipe"], value="1f1b", description="schedule", style=style),
        "microbatches": w.IntSlider(8, 1, 64, description="microbatches", style=style),
        "chunks": w.Dropdown(options=[1, 2, 4], value=1, description="chunks v (interleaved)", style=style),
        "limit": w.FloatSlider(limit_gb, min=16, max=192, step=8, description="device GB", style=style),
    }
    out = w.Output()

    def redraw(_=None):
        # The chart goes into the Output widget as a PNG (append_display_data), not by capturing
        # plt.show() inside `with out:`, which headless runners track message by message.
        import io

        from IPython.display import Image
        values = {k: c.value for k, c in controls.items()}
        layers, hidden, heads, vocab = PRESETS[values.pop("preset")]
        limit = values.pop("limit")
        out.outputs = ()
        try:
            result = ledger.peak_rank_ledger(layers, hidden, heads, vocab=vocab, **values)
        except ValueError as error:
            out.append_stdout(f"{error}\n")
            return
        fig, ax = plt.subplots(figsize=(6, 3.2))
        plot_ledger(result, limit, ax, f"stage {result['stage']} peaks: {result['peak'] / 1e9:.1f} GB "
                    f"({'fits' if result['peak'] / 1e9 <= limit else 'does NOT fit'})")
        items = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in result["transient_items"].items() if v)
        ax.text(0.98, 0.02, f"transients (GB): {items}", transform=ax.transAxes, ha="right",
                fontsize=6, wrap=True)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        out.append_display_data(Image(data=png.getvalue(), format="png"))
    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return w.HBox([w.VBox(list(controls.values())), out])
