"""The self-checks of chapter 3: the reader answers first, then the cell says whether the answer
is right and why. The answers are computed here, from the chapter's ledger, when the check runs,
so the notebook's visible source never prints them.

    from labkit.memory import selfcheck
    selfcheck.ask("q2", q2)          # keyed by the variable the reader typed into
"""
from __future__ import annotations

from labkit.memory import ledger


def questions() -> dict:
    """{the variable the reader types into: (right answer, how it is derived, relative tolerance)}."""
    return {
        "q1": (16 * 1.5e9 / 1e9,
               "16 bytes per parameter (2 + 2 + 12) x 1.5e9 = 24 GB, already most of a 32 GB V100 "
               "before any activation (the ZeRO paper's own example).", 0.02),
        "q2": (sum(ledger.model_states(13e9, 16, 2).values()) / 1e9,
               "stage 2 keeps the bf16 parameters whole (2 x 13e9 = 26 GB) and splits gradients "
               "and optimizer states: 14 x 13e9 / 16 = 11.4 GB; 37.4 GB in all.", 0.02),
        "q3": (2 * 16 * 10,
               "each layer is gathered for every microbatch's forward and again for its backward: "
               "2 x 16 x 10 = 320 (stage 1, or stage 3 resharded once per step: 10).", 0),
        "q4": (ledger.activation_bytes_per_layer(2048, 1, 4096, 32) / 1e6,
               "sbh = 8.4e6; 34 + 5as/h = 34 + 80 = 114; 8.4e6 x 114 = 956 MB. The attention "
               "term (80) is most of it at this length.", 0.02),
    }


def ask(question: str, answer):
    """Check the reader's `answer` to `question` (None: not answered yet; nothing of the answer
    is shown)."""
    from labkit.memory import ask as judge
    found = questions()
    if question not in found:
        raise KeyError(f"no question named {question!r}; the questions are {sorted(found)}")
    expected, why, rel_tol = found[question]
    return judge(question, answer, expected, why, rel_tol=rel_tol)
