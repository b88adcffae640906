"""The self-checks of chapter 6: the reader answers first, then the cell says whether the answer
is right and why. The answers are computed here, from the chapter's layout and figures, when the
check runs, so the notebook's visible source never prints them.

    from labkit.mesh import selfcheck
    selfcheck.ask("answer_pp_group_of_9", answer_pp_group_of_9)   # keyed by the variable
"""
from __future__ import annotations

from labkit.mesh import cost, figures, layout


def questions() -> dict:
    """{the variable the reader types into: (right answer, how it is derived)}."""
    h100 = figures.DGX_H100
    P = h100.peak_flops * cost.EFFICIENCY
    L, s, V = 96, 2048, 51200
    h_star = 2 * 7 / 9 * P / h100.inter_bw - s / 6 - V / (12 * L)
    return {
        "answer_pp_group_of_9": (
            layout.my_groups(9, 2, 3, 2)["pp"],
            "9 = (d x 3 + p) x 2 + t gives t = 1 and d x 3 + p = 4, so d = 1, p = 1. Its pipeline "
            "keeps d = 1, t = 1 and runs p = 0, 1, 2: ranks 7, 9, 11 (stride tp = 2)."),
        "answer_bubble": (
            7 / 96,
            "(p-1)/m = 7/96, about 7%: the bubble is p - 1 microbatch-slots of idle time per "
            "stage, next to m slots of work. Halve m and it doubles, which is why Megatron-LM's "
            "runs use microbatches of one sequence."),
        "answer_tp_crossover_h100": (
            h_star,
            f"h* = 2(t-1)/9 x P/bw - s/6 - V/(12L) with P = {h100.peak_flops / 1e12:.0f} TFLOP/s x "
            f"{cost.EFFICIENCY} and bw = {h100.inter_bw / 1e9:.0f} GB/s: 14/9 x "
            f"{P / h100.inter_bw:,.0f} - {s / 6:.0f} - {V / (12 * L):.0f} = {h_star:,.0f}. The H100's "
            "FLOPs grew faster than its InfiniBand port, so a node boundary costs tp even more."),
    }


def ask(question: str, answer, rel_tol: float = 0.02):
    """Check the reader's `answer` to `question`, the name of the variable it was typed into
    (None: not answered yet, and nothing of the answer is shown)."""
    from labkit.mesh import widget
    found = questions()
    if question not in found:
        raise KeyError(f"no question named {question!r}; the questions are {sorted(found)}")
    expected, why = found[question]
    return widget.ask(question, answer, expected, why, rel_tol=rel_tol)
