"""When tensor parallelism pays, and what it forces on a model's shapes (chapter 4, section 7).

    scaling.gqa_layout(heads=32, kv_heads=8, tp=16)    # q heads, kv heads per rank, kv replicas
    scaling.block_flops(B, T, H, A, F, tp=4)           # matmul FLOPs per rank, forward + backward
    scaling.crossover_tp(H, flops_per_second, bytes_per_second, itemsize=2)
    scaling.padded_vocab(50257, tp=8)                  # Megatron-LM's --make-vocab-size-divisible-by

Formulas only: no layer, no sharding of a checkpoint, no loss (those are lab 4's).
"""
from __future__ import annotations


def gqa_layout(heads: int, kv_heads: int, tp: int, replicate: bool = True) -> dict:
    """Grouped-query attention split by heads over tp ranks: each rank's attention reads heads/tp
    query heads and the key/value heads those query heads read.

    kv_heads >= tp: the kv heads are split too, kv_heads/tp per rank (needs tp | kv_heads).
    kv_heads < tp: one kv head per rank, each read by tp/kv_heads ranks (needs kv_heads | tp).
    Two stacks get it there differently; the layout of the attention is the same:
    vLLM's QKVParallelLinear replicates the kv head's weights on those ranks
    (`num_kv_head_replicas = divide(tp_size, total_num_kv_heads)`); Megatron-Core (since PR
    #2565, December 2025) keeps the fused q/k/v weight split evenly and all-gathers its output
    (`Attention.__init__` sets num_query_groups_per_partition = 1, and
    `SelfAttention.get_query_key_value_tensors` gathers along the last dim and slices out group
    rank // (tp / kv_heads), then query heads rank % (tp / kv_heads);
    megatron/core/transformer/attention.py).
    Neither divides the other: refused, as Megatron-Core's `TransformerConfig.__post_init__` does
    ("num_query_groups must be a multiple or divisor of tensor_model_parallel_size",
    megatron/core/transformer/transformer_config.py); lab 4, task 2 places that case.
    replicate=False: a plain head split that never lets two ranks read one kv head (Megatron-LM's
    rule before PR #2565: `divide(num_query_groups, world_size)`), refusing kv_heads < tp.
    Chapter 4, section 3. Returns {"q_heads": per rank, "kv_heads": per rank, "kv_replicas":
    ranks that read each kv head}."""
    for name, value in (("heads", heads), ("kv_heads", kv_heads), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) is not a multiple of kv_heads ({kv_heads}): every query "
                         f"group needs the same number of query heads")
    if heads % tp:
        raise ValueError(f"heads ({heads}) is not divisible by tp ({tp}): pick a tp that divides it")
    if kv_heads % tp == 0:
        return {"q_heads": heads // tp, "kv_heads": kv_heads // tp, "kv_replicas": 1}
    if not replicate:
        raise ValueError(f"kv_heads ({kv_heads}) is not divisible by tp ({tp}): a plain head split "
                         f"needs tp | kv_heads (Megatron-LM before PR #2565); use tp <= {kv_heads} "
                         f"that divides it, or let ranks share kv heads (replicate=True)")
    if tp % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) and tp ({tp}): neither divides the other, so the "
                         f"kv heads can be neither split nor replicated evenly")
    return {"q_heads": heads // tp, "kv_heads": 1, "kv_replicas": tp // kv_heads}


def block_flops(B, T, H, A, F, tp=1) -> float:
    """Matmul FLOPs one rank does for one `Block` (chapter 4's), forward and backward.

    Forward: q, k, v, o (4 * 2 B T H A), fc1 and fc2 (2 * 2 B T H F), scores and the weighted sum
    (2 * 2 B T^2 A, no saving from the causal mask); backward twice the forward (input and weight
    gradients): 3x in all, every term split by tp. LayerNorm, softmax and GELU are not matmuls."""
    forward = 2 * B * T * (4 * H * A + 2 * H * F) + 4 * B * T * T * A
    return 3 * forward / tp


def crossover_tp(H, flops_per_second, bytes_per_second, itemsize=2, F=None) -> float:
    """The t at which one layer's tensor-parallel bytes take as long as its matmuls.

    Compute per rank: 6 N (4H^2 + 2HF) / t FLOPs (A = H, attention scores left out), falling as
    1/t; bytes per rank: 4 * 2(t-1)/t * N H b, rising to 8 N H b. Equal when
    t - 1 = 6 (4H + 2F) bytes_per_second / (8 b flops_per_second); F = 4H gives 9 H bw / (R b)."""
    F = 4 * H if F is None else F
    return 1 + 6 * (4 * H + 2 * F) * bytes_per_second / (8 * itemsize * flops_per_second)


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padded vocabulary: the next multiple of divisible_by * tp
    (`_vocab_size_with_padding`, flag `--make-vocab-size-divisible-by`, default 128), so that
    every rank's embedding shard has the same number of rows, a multiple of 128."""
    if vocab < 1 or tp < 1 or divisible_by < 1:
        raise ValueError(f"vocab ({vocab}), tp ({tp}) and divisible_by ({divisible_by}) must be >= 1")
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple
