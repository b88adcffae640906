"""The cards: seed 004's whiteboard questions, its ten self-check questions and its three open
questions, each with a model answer in the course's own words and the chapter that teaches it.

    from labkit.drill.cards import CARDS
    card = CARDS["whiteboard-1"]
    card.prompt, card.answer_text(), card.key_points, card.links

A card is answered first (a few lines, typed), then its model answer and key points are shown and
the reader says whether they had it: that decides its Leitner box. The key points a typed answer
mentions are counted by their terms (`mentions`: one distinct term, or two plain words), as a hint
only. Figures in a model answer are computed from the chapters' functions when the card is shown
(`figures`), so cards and chapters cannot disagree;
figures the CPU course cannot measure (GPU, network, vendor) are marked as external with their
source.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from labkit.drill.base import MissingFormula, bytes_text, sig
from labkit.drill.cards_text import TEXTS
from labkit.drill.numeric import formula

KINDS = {"whiteboard": "whiteboard question", "self-check": "self-check question",
         "open": "open question"}


@dataclasses.dataclass(frozen=True)
class Card:
    id: str
    kind: str                         # "whiteboard", "self-check" or "open"
    number: int                       # its number in seed 004's list of that kind
    topic: str                        # a labkit topic package
    links: tuple                      # ((chapter, section), ...) that teach it
    prompt: str
    answer: str                       # the model answer; {name} fields come from `figures`
    key_points: tuple                 # ((point, (keyword, ...)), ...)
    figures: Callable | None = None   # () -> {name: text}, from the chapters' functions

    @property
    def title(self) -> str:
        return f"{KINDS[self.kind]} {self.number} of seed 004"

    @property
    def source(self) -> str:
        return f"seed 004, {KINDS[self.kind]} {self.number}"

    def answer_text(self) -> str:
        """The model answer with its figures filled in (or named, while a chapter is missing)."""
        if self.figures is None:
            return self.answer
        try:
            return self.answer.format(**self.figures())
        except MissingFormula as exc:
            names = re.findall(r"{(\w+)}", self.answer)
            return self.answer.format(**{n: "[?]" for n in names}) + \
                f"\n([?]: waits for {exc.name})"

    def points_mentioned(self, text: str) -> list:
        """[(point, mentioned?)]: see `mentions`."""
        return [(point, mentions(point, keywords, text)) for point, keywords in self.key_points]


# ---- ticking a key point -------------------------------------------------------------------------
# A single everyday word ("data", "gather", "memory") says little about an answer, so it never
# ticks a point alone. A point's terms are its keywords and the words of the point itself; the
# distinct ones (a phrase, or a term with a digit or a symbol: "once per step", "bf16",
# "(p - 1)/p") tick it alone; plain words tick it two at a time, one of them a keyword.

_STOP = set("the a an and or of to on in at for by with its it is are be per every each one two "
            "from as into than then not no all before after what which this that them they "
            "their only any how when where so but".split())


def _stem(word: str) -> str:
    """A word without its ordinary ending: norms, normed -> norm; clipping -> clip; passes ->
    pass; (normal stays normal)."""
    w = word.lower().removesuffix("'s").strip("'")
    if not w.endswith("ss"):
        for suffix in ("ing", "ed", "es", "s"):
            stem = w[:-len(suffix)]
            if w.endswith(suffix) and len(stem) >= 3 and (
                    suffix != "es" or stem.endswith(("s", "x", "z", "ch", "sh"))):
                w = stem
                break
    if len(w) >= 4 and w[-1] == w[-2] and w[-1] not in "aeioulsz":
        w = w[:-1]                                        # clipp -> clip, runn -> run
    return w


def _words(text: str) -> list:
    return re.findall(r"[a-z0-9']+", text.lower())


def point_terms(point: str, keywords) -> tuple:
    """(distinct terms, each enough alone; stems of the plain words, two of which are needed)."""
    distinct = [k for k in keywords if not re.fullmatch(r"[a-z]+", k)]
    plain = {_stem(k) for k in keywords if re.fullmatch(r"[a-z]+", k)}
    for word in (w.strip("'") for w in _words(point)):
        if len(word) < 3 or word in _STOP or word.isdigit():
            continue
        if re.search(r"\d", word):
            distinct.append(word)
        else:
            plain.add(_stem(word))
    return distinct, plain


def _said(keyword: str, text: str) -> bool:
    """`keyword` in `text` as a word or phrase of its own, with an ordinary ending."""
    pattern = (r"(?<![a-z0-9])" + re.escape(keyword.lower())
               + r"(?:s|es|ed|d|ing|ping|ped|ting|ted|ning|ned)?(?![a-z0-9])")
    return re.search(pattern, text) is not None


def mentions(point: str, keywords, text: str) -> bool:
    """Whether `text` mentions the key point: one of its distinct terms as a word or phrase of its
    own ("data" inside "metadata" is not "data"), or two of its plain words, one of them a
    keyword where the point has plain keywords ("rolling" and "batch" do not make "roll back to a
    checkpoint and quarantine the batch") unless the text has all of the point's own words; a
    point with a single plain word: that word."""
    low = (text or "").lower()
    distinct, plain = point_terms(point, keywords)
    if any(_said(k, low) for k in distinct):
        return True
    seen = {_stem(w) for w in _words(low)}
    chosen = {_stem(k) for k in keywords if re.fullmatch(r"[a-z]+", k)}
    own = point_terms(point, ())[1]                       # the point's own words
    found = plain & seen
    need = min(2, len(plain))
    return need > 0 and len(found) >= need and (
        not chosen or bool(found & chosen) or own <= seen)


# ---- figures computed from the chapters --------------------------------------------------------

def _moe_figures() -> dict:
    v3 = formula("labkit.moe.DEEPSEEK_V3")
    ep_bytes = formula("labkit.moe.ep_bytes_per_rank")
    H, K, N, P = v3["hidden"], v3["top_k"], 4096, 64
    both = ep_bytes(N, K, H, P, backward=True)
    return {"H": f"{H:,}", "K": K, "per_token": bytes_text(8 * K * H),
            "fwd": bytes_text(ep_bytes(N, K, H, P)), "both": bytes_text(both)}


def _zero3_figures() -> dict:
    wire = formula("labkit.memory.wire_bytes_per_rank")
    return {"ratio": sig(wire(1.0, 8, 3, microbatches=32) / wire(1.0, 8, 1, microbatches=32))}


def _overlap_figures() -> dict:
    v3 = formula("labkit.moe.DEEPSEEK_V3")
    H, K, F = v3["hidden"], v3["top_k"], v3["expert_hidden"]
    nodes = v3["max_nodes_per_token"]
    row = formula("labkit.moe.fp8.row_bytes")(H)
    ib = formula("labkit.tensor_parallel.INTERCONNECTS")["InfiniBand NDR (one 400 Gb/s port)"][0]
    peak = formula("labkit.mesh.figures.H100_PEAK_BF16")
    flop = 2 * 3 * H * F                                   # one expert, forward, one token
    shared_us, routed_us = flop / peak * 1e6, K * flop / peak * 1e6
    wire_us = nodes * row / ib * 1e6                       # at most 4 nodes, FP8 rows
    return {"flop": f"{flop / 1e6:.0f} MFLOP", "shared_us": sig(shared_us, 2),
            "routed_us": sig(routed_us, 2), "wire_us": sig(wire_us, 2), "nodes": nodes,
            "row": f"{row:,}", "share": f"{shared_us / wire_us:.0%}",
            "ib": f"{ib / 1e9:g} GB/s", "peak": f"{peak / 1e12:g} TFLOP/s"}


def _loss_figures() -> dict:
    ring_bytes = formula("labkit.collectives.ring_bytes_sent")
    n, P, mtu, p = 1e9, 1024, 4096, 1e-4
    packets = ring_bytes("all_reduce", n, P) / mtu          # through one link of the ring
    per_message = 1 - (1 - p) ** (n / P / mtu)              # one ring step's chunk
    return {"packets": f"{packets:,.0f}", "losses": sig(packets * p, 2),
            "chunk": bytes_text(n / P), "per_message": f"{per_message:.1%}"}


def _bf16_figures() -> dict:
    import torch
    one, small = torch.tensor(1.0, dtype=torch.bfloat16), 1e-5
    total32 = torch.tensor(1.0, dtype=torch.float32)
    total16 = one.clone()
    for _ in range(8):
        total16 = total16 + torch.tensor(small, dtype=torch.bfloat16)
        total32 = total32 + small
    return {"spacing": sig(torch.finfo(torch.bfloat16).eps), "bf16_sum": sig(float(total16), 6),
            "fp32_sum": sig(float(total32), 6),
            "fp32_spacing": f"{torch.finfo(torch.float32).eps:.2e}"}


_FIGURES = {"whiteboard-1": _moe_figures, "self-check-1": _zero3_figures,
            "self-check-3": _moe_figures, "open-1": _overlap_figures, "open-2": _loss_figures,
            "open-3": _bf16_figures}

CARDS: dict = {}
for _text in TEXTS:
    _card = Card(figures=_FIGURES.get(_text["id"]), **_text)
    CARDS[_card.id] = _card
