"""An interactive alpha-beta explorer for all-reduce algorithms (chapter 1, `course/01_collectives.ipynb`).

    from labkit.collectives.explorer import explorer, compare
    explorer()                                   # sliders: P, message size, alpha, beta
    compare(P=8, n_bytes=1e6, alpha=5e-6, beta=1e-10)   # the same numbers as plain data

The formulas are those of labkit.collectives (ring and recursive doubling).
"""
from __future__ import annotations

import math

from labkit.collectives import ALL_REDUCE_ALGORITHMS, algbw, bus_factor


def compare(P, n_bytes, alpha, beta):
    """{algorithm: {"seconds", "algbw", "busbw"}} for an all-reduce of n_bytes over P ranks."""
    rows = {}
    for name, formula in ALL_REDUCE_ALGORITHMS.items():
        seconds = formula(n_bytes, P, alpha, beta)
        rows[name] = {"seconds": seconds,
                      "algbw": algbw(n_bytes, seconds) if seconds > 0 else float("inf"),
                      "busbw": algbw(n_bytes, seconds) * bus_factor("all_reduce", P)
                      if seconds > 0 else float("inf")}
    return rows


def _report(P, n_bytes, alpha, beta):
    rows = compare(P, n_bytes, alpha, beta)
    lines = [f"all-reduce of {n_bytes:,.0f} bytes on {P} ranks, alpha {alpha * 1e6:g} us, "
             f"1/beta {1 / beta / 1e9:g} GB/s"]
    for name, row in rows.items():
        lines.append(f"  {name:<19} {row['seconds'] * 1e3:10.3f} ms   algbw {row['algbw'] / 1e9:8.3f} "
                     f"GB/s   busbw {row['busbw'] / 1e9:8.3f} GB/s")
    best = min(rows, key=lambda name: rows[name]["seconds"])
    lines.append(f"  faster: {best}")
    return "\n".join(lines)


def _plot(P, n_bytes, alpha, beta, ax):
    import numpy as np
    sizes = np.logspace(2, 10, 60)
    for name, formula in ALL_REDUCE_ALGORITHMS.items():
        ax.loglog(sizes, [formula(n, P, alpha, beta) for n in sizes], label=name)
    ax.axvline(n_bytes, color="grey", linestyle=":", label="your message")
    ax.set_xlabel("message size n (bytes)")
    ax.set_ylabel("predicted time (s)")
    ax.set_title(f"all-reduce on P = {P} ranks")
    ax.legend(fontsize="small")


def explorer(P=8, n_bytes=1e6, alpha=5e-6, beta=1e-10):
    """Sliders for P, log10 message size, alpha (us) and bandwidth 1/beta (GB/s).

    Returns the widget without displaying it: end a cell with `explorer(...)` to show it once."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    p_slider = widgets.IntSlider(value=P, min=2, max=1024, description="P (ranks)")
    size_slider = widgets.FloatSlider(value=math.log10(n_bytes), min=2, max=10,
                                      step=0.1, description="log10 bytes")
    alpha_slider = widgets.FloatLogSlider(value=alpha * 1e6, base=10, min=-1, max=4,
                                          description="alpha (us)")
    bandwidth_slider = widgets.FloatLogSlider(value=1 / beta / 1e9, base=10, min=-1, max=3,
                                              description="1/beta GB/s")
    out = widgets.Output()

    def update(_=None):
        # The figure goes into the Output widget as a PNG (append_display_data), not by capturing
        # plt.show() inside `with out:`: headless runners (papermill) follow captured output
        # message by message, and a capture once held a cell until its time limit.
        import io

        from IPython.display import Image
        P_, n_ = p_slider.value, 10 ** size_slider.value
        a_, b_ = alpha_slider.value * 1e-6, 1 / (bandwidth_slider.value * 1e9)
        out.outputs = ()
        out.append_stdout(_report(P_, n_, a_, b_) + "\n")
        fig, ax = plt.subplots(figsize=(6, 3.5))
        _plot(P_, n_, a_, b_, ax)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        out.append_display_data(Image(data=png.getvalue(), format="png"))

    for slider in (p_slider, size_slider, alpha_slider, bandwidth_slider):
        slider.observe(update, names="value")
    box = widgets.VBox([widgets.HBox([p_slider, size_slider]),
                        widgets.HBox([alpha_slider, bandwidth_slider]), out])
    update()
    return box
