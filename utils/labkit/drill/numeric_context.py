"""Numeric drills of chapter 10 (long sequences): the causal work of a context-parallel rank under
the plain and the load-balanced split, the bytes ring attention sends per rank and layer, and
Ulysses' bytes next to the ring's. Each answer comes from `labkit.context`'s own function (named
in `uses`, imported by name when a problem is posed: see `numeric.formula`); each drill names the
slips its ratios give away (`slips`).

The causal, load-balanced ring backward is lab 10's task: no drill computes its values here."""
from __future__ import annotations

from labkit.drill.base import bytes_text, factor, sig
from labkit.drill.numeric import draws, register


# ---- chapter 10, section 3: causal work per rank -------------------------------------------------

def _draw_work(rng):
    P = rng.choice([2, 3, 4, 8, 16, 32])
    return {"P": P, "rank": rng.randrange(P), "balanced": rng.choice([False, True])}


@register("cp-causal-work", "context", "Causal score blocks one context-parallel rank computes",
          10, "section 3", ["labkit.context.blocks_computed"])
@draws(_draw_work)
def _work(p, formula):
    P, rank, balanced = p["P"], p["rank"], p["balanced"]
    blocks = float(formula("labkit.context.blocks_computed")(P, rank, balanced))
    if balanced:
        split = (f"the load-balanced split (2P = {2 * P} chunks, rank r holds chunks r and "
                 "2P-1-r)")
        solution = [f"Rank {rank} holds chunks {rank} and {2 * P - 1 - rank}, each T/(2P) tokens; "
                    "count in quarter blocks (T/2P)^2.",
                    "Its own block: two diagonals and one whole quarter (the late chunk sees the "
                    "early one): 3. Every other rank's block: 2 quarters (half is masked "
                    "whichever rank it is).",
                    f"3 + 2 (P - 1) = 2P + 1 = {2 * P + 1} quarters = (2P + 1)/4 = {sig(blocks)} "
                    "blocks, the same for every rank."]
        slips = ((4.0, "That counts quarters, not (T/P)^2 blocks: divide by 4."),
                 ((rank + 1) / blocks if rank + 1 != blocks else 0.0,
                  "That is the plain split's count, r + 1."))
    else:
        split = "the plain split (rank r holds chunk r of P)"
        solution = [f"Rank {rank}'s queries see the keys of ranks 0..{rank}: {rank} whole blocks "
                    "and one diagonal block (computed, then masked).",
                    f"r + 1 = {rank + 1} block{'s' if rank else ''} of (T/P)^2 scores; rank "
                    "P-1 computes P, rank 0 one."]
        slips = (((rank + 0.5) / blocks, "That counts the diagonal as half a block; the kernel "
                  "computes the whole block and masks it."),
                 (rank / blocks if rank else 0.0, "That leaves out the diagonal block."))
    return {"question": f"Causal attention over T tokens, context parallelism on P = {P} ranks "
                        f"with {split}. How many score blocks of (T/P) x (T/P) does rank {rank} "
                        "compute (a diagonal block counts as one)?",
            "answer": blocks, "unit": "", "rel_tol": 0.0, "abs_tol": 1e-9,
            "solution": solution, "slips": tuple(s for s in slips if s[0])}


# ---- chapter 10, section 2: ring attention bytes ---------------------------------------------

def _draw_ring(rng):
    return {"B": rng.choice([1, 2]), "H_kv": rng.choice([8, 16, 32, 64]),
            "T": rng.choice([32768, 65536, 131072, 262144]), "d": rng.choice([64, 128]),
            "P": rng.choice([2, 4, 8, 16]), "backward": rng.choice([False, True])}


@register("ring-attention-bytes", "context", "Bytes one rank sends in a ring-attention layer",
          10, "section 2", ["labkit.context.ring_bytes"])
@draws(_draw_ring)
def _ring(p, formula):
    B, H_kv, T, d, P, backward = (p[k] for k in ("B", "H_kv", "T", "d", "P", "backward"))
    total = formula("labkit.context.ring_bytes")(B, H_kv, T, d, P, 2, backward)
    block = B * H_kv * (T // P) * d * 2
    solution = [f"One K block: B H_kv (T/P) d e = {B} x {H_kv} x {T // P:,} x {d} x 2 B = "
                f"{bytes_text(block)}.",
                f"Forward: K and V make P - 1 = {P - 1} hops: 2 (P-1) n_blk = "
                f"{bytes_text(2 * (P - 1) * block)}."]
    if backward:
        solution.append(f"Backward: K and V again (2 (P-1) n_blk), and the sums of dK and dV, "
                        f"P - 1 hops from the rank after the owner round to it (2 (P-1) n_blk): "
                        f"6 (P-1) n_blk in all, {bytes_text(total)}.")
    unit = "GB" if total >= 1e9 else "MB"
    if backward:
        slips = ((1 / 3, "That is the forward only; backward sends K, V and the sums of their "
                  "gradients too."),
                 (P / (P - 1), "That is P hops for every tensor; the ring needs P - 1."))
    else:
        slips = ((0.5, "That counts K only: V travels with it."),
                 (P / (P - 1), "That is P hops; the ring needs P - 1 (the first block is home)."))
    return {"question": f"Ring attention, B = {B}, {H_kv} key/value heads, T = {T:,} tokens, "
                        f"head dim {d}, BF16, P = {P} ranks: how many bytes does one rank send "
                        f"for one layer{', forward and backward' if backward else ', forward'}?",
            "answer": total / factor(unit), "unit": unit, "solution": solution,
            "slips": slips}


# ---- chapter 10, section 4: Ulysses against the ring ------------------------------------------

def _draw_ulysses(rng):
    heads = rng.choice([32, 64, 128])
    return {"H": heads, "H_kv": rng.choice([h for h in (8, heads) if h <= heads]),
            "P": rng.choice([2, 4, 8]), "T": rng.choice([65536, 131072]), "d": 128}


@register("ulysses-bytes", "context", "Bytes of a Ulysses layer per rank, and the ring's ratio",
          10, "section 4", ["labkit.context.ulysses_bytes", "labkit.context.ring_bytes"],
          source="Jacobs et al. 2023 (DeepSpeed-Ulysses, arXiv:2309.14509)")
@draws(_draw_ulysses)
def _ulysses(p, formula):
    H, H_kv, P, T, d = p["H"], p["H_kv"], p["P"], p["T"], p["d"]
    ulysses = formula("labkit.context.ulysses_bytes")(1, H, H_kv, T, d, P, 2)
    ring = formula("labkit.context.ring_bytes")(1, H_kv, T, d, P, 2)
    solution = [f"Four all-to-alls (q, k, v in, the output back), each keeping 1/P: (P-1)/P x "
                f"B (T/P) d e x (2 H + 2 H_kv) = {P - 1}/{P} x {T // P:,} x {d} x 2 x "
                f"{2 * H + 2 * H_kv} = {bytes_text(ulysses)}.",
                f"The ring, for comparison: 2 (P-1) B H_kv (T/P) d e = {bytes_text(ring)}, "
                f"{sig(ring / ulysses)} times Ulysses' bytes."]
    return {"question": f"DeepSpeed-Ulysses attention, B = 1, {H} query heads, {H_kv} key/value "
                        f"heads, T = {T:,}, head dim {d}, BF16, P = {P} ranks: how many MB does one "
                        "rank send in one layer's forward?",
            "answer": ulysses / factor("MB"), "unit": "MB", "solution": solution,
            "slips": tuple(s for s in (
                (4 * H / (2 * H + 2 * H_kv), "That counts K and V with the query heads; with "
                 "grouped-query attention they have H_kv heads."),
                ((H + 2 * H_kv) / (2 * H + 2 * H_kv), "That leaves out the all-to-all that brings "
                 "the output back.")) if s[0] != 1.0)}
