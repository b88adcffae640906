"""The formulas of chapter 10 (`course/10_long_sequences.ipynb`): causal work per rank, bytes per
rank of ring attention and of Ulysses, and activation memory against the sequence length. Plain
arithmetic, no torch. (One rank of a 5D configuration in chapter 6's model is lab 10's task 3:
labkit holds no answer to it.)

Notation: B batch, T tokens of one sequence, H query heads, H_kv key/value heads, d head dim,
P ranks of the context-parallel group, e bytes per element. One K block is what one rank holds of
K: n_blk = B H_kv (T/P) d e bytes.

    blocks_computed(P, rank, balanced)   causal score blocks a rank computes, in (T/P)^2 units
    ring_bytes(...)                      2 (P-1) n_blk forward; + 4 (P-1) n_blk backward
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
    backward (added when `backward`): K and V travel the P - 1 hops again, and the sums of the
    gradients dK, dV make P - 1 hops too (started by the rank after the owner, sent home by the
    last one): 4 (P-1) n_blk."""
    _positive_int(B=B, H_kv=H_kv, T=T, d=d, P=P, element_size=element_size)
    block = B * H_kv * (T / P) * d * element_size
    forward = 2 * (P - 1) * block
    return forward + (4 * (P - 1) * block if backward else 0.0)


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

