"""The formulas of chapter 10 (`course/10_long_sequences.ipynb`): causal work per rank, bytes per
rank of ring attention and of Ulysses, activation memory against the sequence length, and one rank
of a 5D (dp x cp x tp x pp, ep inside dp) configuration. Plain arithmetic, no torch.

Notation: B batch, T tokens of one sequence, H query heads, H_kv key/value heads, d head dim,
P ranks of the context-parallel group, e bytes per element. One K block is what one rank holds of
K: n_blk = B H_kv (T/P) d e bytes.

    blocks_computed(P, rank, balanced)   causal score blocks a rank computes, in (T/P)^2 units
    ring_bytes(...)                      2 (P-1) n_blk forward; + 2 (P-1) n_blk + 2 P n_blk backward
    ulysses_bytes(...)                   (P-1)/P B (T/P) d e (2 H + 2 H_kv) forward
"""
from __future__ import annotations

from fractions import Fraction

from labkit.memory import ledger


def _positive_int(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def blocks_computed(P: int, rank: int, balanced: bool) -> Fraction:
    """Causal score blocks rank `rank` of P computes, in units of a (T/P) x (T/P) block.

    A block of queries against a block of keys is computed whole when every key is earlier, half
    (the diagonal: computed, then masked) when they are the same chunk, skipped when every key is
    later. A diagonal block is counted as one block computed (the kernel does the whole product
    and masks it). plain: rank r has r whole blocks and one diagonal, r + 1. balanced (chunks i
    and 2P-1-i of size T/(2P)): (i + 1) + (2P - i) = 2P + 1 quarter-size blocks, (2P + 1)/4 for
    every rank."""
    _positive_int(P=P)
    if not (isinstance(rank, int) and 0 <= rank < P):
        raise ValueError(f"blocks_computed: rank must satisfy 0 <= rank < P={P}, got {rank!r}")
    if not balanced:
        return Fraction(rank + 1)
    return Fraction(2 * P + 1, 4)


def ring_bytes(B: int, H_kv: int, T: int, d: int, P: int, element_size: int = 2,
               backward: bool = False) -> float:
    """Bytes one rank of a ring of P sends for one attention layer.

    forward: its K and V blocks travel P - 1 hops: 2 (P-1) n_blk, n_blk = B H_kv (T/P) d e.
    backward (added when `backward`): K and V travel the P - 1 hops again, and the gradients dK,
    dV travel with them and take one hop more, home to their owner: 2 (P-1) n_blk + 2 P n_blk."""
    _positive_int(B=B, H_kv=H_kv, T=T, d=d, P=P, element_size=element_size)
    block = B * H_kv * (T / P) * d * element_size
    forward = 2 * (P - 1) * block
    return forward + (2 * (P - 1) * block + 2 * P * block if backward else 0.0)


def ulysses_bytes(B: int, H: int, H_kv: int, T: int, d: int, P: int,
                  element_size: int = 2) -> float:
    """Bytes one rank sends in the forward of one Ulysses attention layer: four all-to-alls (q, k,
    v from [B, heads, T/P, d] to [B, heads/P, T, d], and the output back), each keeping 1/P of
    the rank's tensor: (P-1)/P B (T/P) d e (H + 2 H_kv + H)."""
    _positive_int(B=B, H=H, H_kv=H_kv, T=T, d=d, P=P, element_size=element_size)
    return (P - 1) / P * B * (T / P) * d * element_size * (2 * H + 2 * H_kv)


def activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, cp: int = 1,
                     fused_attention: bool = False) -> float:
    """Bytes one transformer layer keeps for backward on one rank (Korthikanti et al. 2022, with
    tensor and sequence parallelism over t when t > 1), with the sequence split over cp ranks.

    sbh (34/t + 5as/(ht)) per layer at t > 1 (sbh (34 + 5as/h) at t = 1); a fused attention
    kernel (FlashAttention) keeps no s x s matrix: the 5as/h term goes, and it keeps its output
    and the log-sum-exp instead (counted in the 34: the projection's input). With cp, each rank
    holds s/cp tokens, so s becomes s/cp in both terms: a ring kernel only ever holds one
    (s/cp) x (s/cp) block of scores at a time."""
    _positive_int(s=s, b=b, h=h, a=a, t=t, cp=cp)
    if s % cp:
        raise ValueError(f"activation_bytes: s={s} tokens do not split over cp={cp} ranks")
    recompute = "selective" if fused_attention else "none"
    return ledger.activation_bytes_per_layer(s // cp, b, h, a, t, sequence_parallel=t > 1,
                                             recompute=recompute)


def five_d(layers: int, hidden: int, heads: int, seq: int, micro_batch: int, *, dp: int = 1,
           cp: int = 1, tp: int = 1, pp: int = 1, microbatches: int = 1, kv_heads: int | None = None,
           vocab: int = 0, zero_stage: int = 1, fused_attention: bool = True) -> dict:
    """One rank of a dp x cp x tp x pp job (torchtitan's order, outermost first: pp, dp, cp, tp):
    its peak memory (chapter 3's ledger) and the bytes it sends per step on the cp axis.

    Memory: cp ranks hold the same weights and are data-parallel for them (torchtitan shards
    FSDP over dp_shard x cp: `torchtitan/distributed/parallel_dims.py`), so ZeRO divides over
    dp * cp; the activations are those of seq / cp tokens. cp bytes: the ring's forward and
    backward per layer (`ring_bytes`, BF16), for the L/pp layers of the stage and each of the m
    microbatches, with each tp rank carrying its H_kv/tp heads."""
    _positive_int(layers=layers, hidden=hidden, heads=heads, seq=seq, micro_batch=micro_batch,
                  dp=dp, cp=cp, tp=tp, pp=pp, microbatches=microbatches)
    kv_heads = heads if kv_heads is None else kv_heads
    if seq % cp or heads % tp or kv_heads % tp:
        raise ValueError(f"five_d: need seq % cp == 0, heads % tp == 0 and kv_heads % tp == 0, got "
                         f"seq={seq}, cp={cp}, heads={heads}, kv_heads={kv_heads}, tp={tp}")
    recompute = "selective" if fused_attention else "none"
    memory = ledger.per_rank_ledger(layers, hidden, heads, seq // cp, micro_batch, vocab=vocab,
                                    dp=dp * cp, tp=tp, pp=pp, zero_stage=zero_stage,
                                    recompute=recompute, sequence_parallel=tp > 1,
                                    microbatches=microbatches)
    head_dim = hidden // heads
    cp_bytes = 0.0
    if cp > 1:
        cp_bytes = (layers // pp) * microbatches * ring_bytes(
            micro_batch, kv_heads // tp, seq, head_dim, cp, 2, backward=True)
    return {"world": dp * cp * tp * pp, "memory": memory["peak"],
            "activations": memory["activations"], "cp_bytes": cp_bytes}
