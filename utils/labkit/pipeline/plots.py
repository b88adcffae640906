"""Timelines of a pipeline step: one row per stage, one bar per action (chapter 5, section 4).

    draw_timeline(report.timeline, p)                    # the unit-cost simulation of a schedule
    draw_timeline(events_timeline(results), p)           # what real ranks did, measured
"""
from __future__ import annotations

COLOURS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"}


def events_timeline(results, clock: str = "wall") -> dict:
    """{(rank, (kind, microbatch, n)): (start, end)} from the per-rank results of pipeline_step /
    run_actions: wall-clock seconds from the first start, or the virtual clock's units."""
    at = {"wall": 2, "virtual": 4}[clock]
    t0 = min(e[at] for r in results for e in r["events"])
    timeline = {}
    for rank, result in enumerate(results):
        for n, event in enumerate(result["events"]):
            timeline[(rank, (event[0], event[1], n))] = (event[at] - t0, event[at + 1] - t0)
    return timeline


def measured_bubble(results, clock: str = "wall") -> float:
    """1 - (time the stages spent in their actions) / (p * the step's span), from the events of
    every rank, on the wall clock or the virtual clock."""
    at = {"wall": 2, "virtual": 4}[clock]
    events = [e for r in results for e in r["events"]]
    span = max(e[at + 1] for e in events) - min(e[at] for e in events)
    busy = sum(e[at + 1] - e[at] for e in events)
    return 1 - busy / (len(results) * span)


def draw_timeline(timeline: dict, p: int, ax=None, title: str = "", unit: str = ""):
    """Bars from a timeline {(rank, action-like): (start, end)}; the action's first two fields
    are its kind and microbatch. Returns the axes."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.45 * p + 0.9))
    for (rank, a), (start, end) in timeline.items():
        kind, microbatch = a[0], a[1]
        start, end = float(start), float(end)
        ax.barh(rank, end - start, left=start, color=COLOURS.get(kind, "grey"),
                edgecolor="black", linewidth=0.4)
        ax.text((start + end) / 2, rank, f"{kind}{microbatch}", ha="center", va="center",
                fontsize=7, color="white")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlabel(unit or "time")
    if title:
        ax.set_title(title, fontsize=10)
    return ax
