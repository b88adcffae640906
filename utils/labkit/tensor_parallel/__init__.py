"""Tensor parallelism: the test bench of chapter 4 (`course/04_tensor_parallel.ipynb`) and lab 4.

    from labkit import tensor_parallel as tp_kit
    block = tp_kit.make_block(seed=0)                # the single-process reference block
    params = tp_kit.fused_params(block)              # the same weights, q/k/v fused: lab 4's layout
    y = tp_kit.block_reference(params, x, heads=12)  # = block(x), written with plain functions

What is here: one transformer block (pre-LayerNorm, causal attention, GELU MLP) as a module and as
a function of a parameter dict, with weights that depend only on a seed; the chapter's formulas
(bytes per layer per step, activation memory, the bytes of a vocabulary-parallel cross-entropy);
interconnect figures quoted from vendor documentation. `placement` describes where a tensor's
pieces live, `measure` counts activation bytes, peak memory and bytes written, `gqa` is lab 4
task 2's grouped-query bench (one-process attention, bytes per pair). What is not here: the
parallel layers, the GQA head placement and parallel attention, and the parallel cross-entropy
(lab 4, tasks 1-3).

Notation (chapter 4): tp ranks in the tensor-parallel group (the course writes t); B batch,
T sequence, H hidden, A = heads * head_dim the attention width, F the MLP width, V vocabulary,
N = B * T tokens. A linear layer computes Y = X W^T + b with W: [out, in]. Weights here are never
square (A != H, F != H), so a split on the wrong dimension fails instead of passing by accident.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# The course's sizes: every size that tensor parallelism divides is a multiple of 2, 3 and 4.
BATCH, SEQ, HIDDEN, HEADS, HEAD_DIM, FFN, VOCAB = 4, 24, 48, 12, 5, 120, 96


def _divide(size: int, tp: int, what: str) -> int:
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if size % tp:
        raise ValueError(f"{what} ({size}) is not divisible by tp ({tp}): pick a tp that divides "
                         f"it, or pad {what} to a multiple of tp")
    return size // tp


def causal_bias(T: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """[T, T]: 0 where query i may see key j (j <= i), -inf above the diagonal."""
    return torch.full((T, T), float("-inf"), dtype=dtype, device=device).triu(1)


def attention_core(q, k, v):
    """Causal attention over heads: q, k, v: [B, n, T, d] -> [B, n, T, d].

    Written out (not F.scaled_dot_product_attention) so that what autograd keeps is the textbook's:
    q and k for the scores, the softmax output [B, n, T, T] and v."""
    d, T = q.shape[-1], q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)                  # [B, n, T, T]
    weights = torch.softmax(scores + causal_bias(T, q.dtype, q.device), dim=-1)
    return weights @ v                                                # [B, n, T, d]


def split_heads(x, head_dim: int):
    """[B, T, n * d] -> [B, n, T, d]: n is whatever x holds (all heads, or one rank's)."""
    B, T, _ = x.shape
    return x.view(B, T, -1, head_dim).transpose(1, 2)


def merge_heads(x):
    """[B, n, T, d] -> [B, T, n * d]."""
    B, n, T, d = x.shape
    return x.transpose(1, 2).reshape(B, T, n * d)


class Attention(nn.Module):
    """Causal multi-head attention, separate projections: q, k, v: [A, H], o: [H, A]."""

    def __init__(self, hidden=HIDDEN, heads=HEADS, head_dim=HEAD_DIM):
        super().__init__()
        self.head_dim = head_dim
        width = heads * head_dim                                       # A
        self.q, self.k, self.v = (nn.Linear(hidden, width) for _ in range(3))
        self.o = nn.Linear(width, hidden)

    def forward(self, x):                                              # x: [B, T, H]
        # The number of heads comes from the tensor, not from a constant: under torch's
        # parallelize_module the same code sees only its rank's heads ([B, T, A/tp]).
        q, k, v = (split_heads(proj(x), self.head_dim) for proj in (self.q, self.k, self.v))
        return self.o(merge_heads(attention_core(q, k, v)))           # [B, T, H]


class MLP(nn.Module):
    """fc1: [F, H], GELU, fc2: [H, F]."""

    def __init__(self, hidden=HIDDEN, ffn=FFN):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):                                              # x: [B, T, H]
        return self.fc2(F.gelu(self.fc1(x)))                           # [B, T, F] -> [B, T, H]


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then h + mlp(ln2(h))."""

    def __init__(self, hidden=HIDDEN, heads=HEADS, head_dim=HEAD_DIM, ffn=FFN):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(hidden), Attention(hidden, heads, head_dim)
        self.ln2, self.mlp = nn.LayerNorm(hidden), MLP(hidden, ffn)

    def forward(self, x):                                              # x: [B, T, H]
        h = x + self.attn(self.ln1(x))
        return h + self.mlp(self.ln2(h))                               # [B, T, H]


def make_block(seed=0, hidden=HIDDEN, heads=HEADS, head_dim=HEAD_DIM, ffn=FFN,
               dtype=torch.float64, device="cpu") -> Block:
    """A Block whose weights depend only on `seed` (LayerNorm weights too: not all ones)."""
    generator = torch.Generator().manual_seed(seed)
    block = Block(hidden, heads, head_dim, ffn)
    with torch.no_grad():
        for name, p in block.named_parameters():
            fan_in = p.shape[-1] if p.dim() == 2 else hidden
            scale = 1 / math.sqrt(fan_in)
            values = torch.randn(p.shape, generator=generator, dtype=torch.float64) * scale
            if name.startswith(("ln1.weight", "ln2.weight")):
                values = 1 + 0.1 * values
            p.copy_(values)
    return block.to(dtype=dtype, device=device)


FUSED_NAMES = ("ln1.weight", "ln1.bias", "qkv.weight", "qkv.bias", "o.weight", "o.bias",
               "ln2.weight", "ln2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def fused_params(block: Block) -> dict:
    """The block's weights under lab 4's names, q, k and v fused row-wise as one [3A, H] matrix.

    qkv.weight = cat(q.weight, k.weight, v.weight): rows [0, A) are q, [A, 2A) k, [2A, 3A) v,
    and inside each, rows [h*d, (h+1)*d) belong to head h. Detached copies."""
    a = block.attn
    out = {"ln1.weight": block.ln1.weight, "ln1.bias": block.ln1.bias,
           "qkv.weight": torch.cat([a.q.weight, a.k.weight, a.v.weight]),    # [3A, H]
           "qkv.bias": torch.cat([a.q.bias, a.k.bias, a.v.bias]),            # [3A]
           "o.weight": a.o.weight, "o.bias": a.o.bias,                       # [H, A], [H]
           "ln2.weight": block.ln2.weight, "ln2.bias": block.ln2.bias,
           "fc1.weight": block.mlp.fc1.weight, "fc1.bias": block.mlp.fc1.bias,   # [F, H], [F]
           "fc2.weight": block.mlp.fc2.weight, "fc2.bias": block.mlp.fc2.bias}   # [H, F], [H]
    return {name: tensor.detach().clone() for name, tensor in out.items()}


def random_params(generator: torch.Generator, hidden: int, heads: int, head_dim: int, ffn: int,
                  dtype=torch.float64) -> dict:
    """Fresh weights under lab 4's names (what a checker draws for each case)."""
    width = heads * head_dim
    shapes = {"ln1.weight": (hidden,), "ln1.bias": (hidden,), "qkv.weight": (3 * width, hidden),
              "qkv.bias": (3 * width,), "o.weight": (hidden, width), "o.bias": (hidden,),
              "ln2.weight": (hidden,), "ln2.bias": (hidden,), "fc1.weight": (ffn, hidden),
              "fc1.bias": (ffn,), "fc2.weight": (hidden, ffn), "fc2.bias": (hidden,)}
    params = {}
    for name, shape in shapes.items():
        values = torch.randn(shape, generator=generator, dtype=torch.float64)
        fan_in = shape[-1] if len(shape) == 2 else hidden
        params[name] = (1 + 0.1 * values if name.endswith("ln1.weight") or name == "ln2.weight"
                        else values / math.sqrt(fan_in)).to(dtype)
    return params


def block_reference(params: dict, x, heads: int):
    """The block as a function of lab 4's parameter dict: x: [B, T, H] -> [B, T, H]."""
    H = x.shape[-1]
    width = params["o.weight"].shape[1]                                # A
    head_dim = width // heads
    h1 = F.layer_norm(x, (H,), params["ln1.weight"], params["ln1.bias"])
    qkv = F.linear(h1, params["qkv.weight"], params["qkv.bias"])       # [B, T, 3A]
    q, k, v = (split_heads(part, head_dim) for part in qkv.split(width, dim=-1))
    h = x + F.linear(merge_heads(attention_core(q, k, v)), params["o.weight"], params["o.bias"])
    h2 = F.layer_norm(h, (H,), params["ln2.weight"], params["ln2.bias"])
    return h + F.linear(F.gelu(F.linear(h2, params["fc1.weight"], params["fc1.bias"])),
                        params["fc2.weight"], params["fc2.bias"])


# ---- formulas: bytes per layer per step --------------------------------------------------------

def all_reduce_bytes(n_bytes, tp):
    """Ring all-reduce: each rank sends 2(t-1)/t * n (chapter 1)."""
    return 2 * (tp - 1) / tp * n_bytes


def all_gather_bytes(n_bytes, tp):
    """Ring all-gather of an n-byte result (or a reduce-scatter of an n-byte input): (t-1)/t * n."""
    return (tp - 1) / tp * n_bytes


def tp_layer_bytes(B, T, H, tp, itemsize=4, sequence_parallel=False, reduce_scatter_factor=1.0,
                   regather_in_backward=False):
    """Bytes one rank sends for one transformer layer, forward and backward (Megatron layout).

    Tensor parallel: f and g each cost one all-reduce of an activation [B, T, H] (n = B T H b
    bytes), one in forward and one in backward per sub-block, two sub-blocks:
        4 * 2(t-1)/t * n.
    Sequence parallel: each all-reduce becomes a reduce-scatter plus an all-gather, (t-1)/t * n
    each: the same 4 * 2(t-1)/t * n on a ring. gloo's reduce-scatter is an all-reduce that keeps
    one block (chapter 1, section 5): pass reduce_scatter_factor=2 for what gloo sends. The
    all-reduce of the gradients that sequence parallelism turns into partial sums is not counted
    here (6H values per layer: see `sequence_parallel_grad_bytes`).
    regather_in_backward (Megatron-LM's choice, sequence parallel only): the column-parallel
    layers keep only their input's shard and all-gather it again in backward, one more
    all-gather per sub-block: + 2 * (t-1)/t * n."""
    n = B * T * H * itemsize
    if not sequence_parallel:
        if regather_in_backward:
            raise ValueError("regather_in_backward=True needs sequence_parallel=True: without "
                             "sequence parallelism the column layers' input is already whole")
        return 4 * all_reduce_bytes(n, tp)
    regathers = 2 if regather_in_backward else 0
    return ((4 + regathers) * all_gather_bytes(n, tp)
            + 4 * reduce_scatter_factor * all_gather_bytes(n, tp))


def sequence_parallel_grad_bytes(H, tp, itemsize=4):
    """Sequence parallelism: the parameters that see only a rank's tokens (two LayerNorms' weights
    and biases, the biases of o and fc2: 6H values) get partial-sum gradients, all-reduced once
    per step."""
    return all_reduce_bytes(6 * H * itemsize, tp)


def vocab_parallel_ce_bytes(N, tp, itemsize=4, reductions=3):
    """Vocabulary-parallel cross-entropy, forward: all-reduces of [N] values per token (the max,
    the sum of exponentials, the target's logit): reductions * 2(t-1)/t * N b. Backward: none.
    The vocabulary V does not appear."""
    return reductions * all_reduce_bytes(N * itemsize, tp)


def gathered_logits_bytes(N, V, tp, itemsize=4):
    """What gathering the logits [N, V] from vocabulary shards sends per rank: (t-1)/t * N V b."""
    return all_gather_bytes(N * V * itemsize, tp)


# ---- formulas: activation memory ----------------------------------------------------------------

def activation_elements(B, T, H, A, F, heads, tp=1, sequence_parallel=False,
                        regather_in_backward=False):
    """Elements autograd keeps for backward in one `Block` (no dropout), per rank.

    Counted from what each op saves (course section 4 derives it):
      replicated under tensor parallelism (LayerNorm inputs and their mean and 1/std, the inputs
      of the two column-parallel layers):      4 B T H + 4 B T
      split by tensor parallelism (q, k, v, the softmax output, the input of o, the GELU input and
      the input of fc2):                      (4 B T A + heads B T^2 + 2 B T F) / t
    With sequence parallelism the LayerNorm part is split too; the inputs of the column-parallel
    layers are all-gathered and kept whole (2 B T H) unless backward gathers them again, as
    Megatron-LM does. The paper's own per-layer formula (16-bit, dropout, F = 4H) is chapter 3's
    `labkit.memory.ledger.activation_bytes_per_layer`. regather_in_backward=True is Megatron's
    way: the column layers keep their input's shard, and everything is exactly 1/t of tp=1."""
    split = 4 * B * T * A + heads * B * T * T + 2 * B * T * F
    layernorm, column_inputs = 2 * B * T * H + 4 * B * T, 2 * B * T * H
    if not sequence_parallel:
        if regather_in_backward:
            raise ValueError("regather_in_backward=True needs sequence_parallel=True")
        return layernorm + column_inputs + split / tp
    if regather_in_backward:
        return (column_inputs + layernorm + split) / tp
    return column_inputs + (layernorm + split) / tp


# ---- interconnects: vendor documentation, quoted (nothing here was measured) -------------------

INTERCONNECTS = {
    # name: (bytes per second per GPU, one direction, as the vendor states it; source)
    "NVLink 4 (H100 SXM, 18 links)": (450e9, "NVIDIA H100 Tensor Core GPU datasheet: NVLink "
                                       "900 GB/s total (both directions)"),
    "NVLink 3 (A100 SXM, 12 links)": (300e9, "NVIDIA A100 Tensor Core GPU datasheet: NVLink "
                                       "600 GB/s total (both directions)"),
    "PCIe Gen5 x16": (64e9, "NVIDIA H100 datasheet, PCIe Gen5 128 GB/s (both directions); "
                            "PCI-SIG: 32 GT/s per lane"),
    "InfiniBand NDR (one 400 Gb/s port)": (50e9, "NVIDIA ConnectX-7 / Quantum-2 product brief: "
                                                  "400 Gb/s per port"),
}


from labkit.tensor_parallel.selfcheck import self_check  # noqa: E402  (uses the formulas above)
