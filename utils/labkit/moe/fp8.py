"""FP8 (float8 e4m3) on the wire: the format's facts, the error bound of per-block scaling, the
bytes it saves, and which CPU ops accept it (chapter 7, section 7; lab 7, task 4).

    from labkit.moe import fp8
    fp8.row_bytes(7168)                      # 7392: 7168 one-byte values + 56 float32 scales
    fp8.error_bound(x, block=128)            # the most |dequantised - x| may be, element-wise
    fp8.op_support()                         # {op name: True/False} on this torch build

e4m3 (torch.float8_e4m3fn): 1 sign, 4 exponent, 3 mantissa bits; largest finite 448, smallest
normal 2^-6, smallest subnormal 2^-9, no infinity. Three mantissa bits put neighbouring normal
values 2^-3 apart relative to their size, so rounding to nearest is off by at most 2^-4 = 6.25%
of the value.
"""
from __future__ import annotations

import math

import torch

E4M3 = torch.float8_e4m3fn
MAX = 448.0                      # torch.finfo(torch.float8_e4m3fn).max
SMALLEST_NORMAL = 2.0 ** -6
SMALLEST_SUBNORMAL = 2.0 ** -9
RELATIVE_STEP = 2.0 ** -4        # half the spacing of normal values, relative
SCALE_BYTES = 4                  # one float32 scale per block
BLOCK = 128                      # DeepSeek-V3 scales activations per 1 x 128 tile


def blocks(hidden: int, block: int = BLOCK) -> int:
    """Scales per row: ceil(H / block) (the last block may be shorter)."""
    if hidden < 0 or block < 1:
        raise ValueError(f"need hidden >= 0 and block >= 1, got hidden={hidden}, block={block}")
    return -(-hidden // block)


def row_bytes(hidden: int, block: int = BLOCK, scale_bytes: int = SCALE_BYTES) -> int:
    """Bytes one token's row takes on the wire in FP8: H values of one byte plus its scales."""
    return hidden + scale_bytes * blocks(hidden, block)


def block_amax(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """[N, H] -> [N, ceil(H / block)]: the largest |value| of each row's blocks (float32)."""
    if x.dim() != 2:
        raise ValueError(f"expected rows [N, H], got shape {tuple(x.shape)}")
    n, h = x.shape
    nb = blocks(h, block)
    padded = torch.zeros(n, nb * block, dtype=torch.float32)         # [N, nb * block]
    padded[:, :h] = x.detach().float().abs()
    return padded.view(n, nb, block).amax(dim=-1)                    # [N, nb]


def error_bound(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Element-wise bound on |dequantise(quantise(x)) - x| for per-block scaling.

    With scale = amax / 448 a block's values land in [-448, 448]. A value that lands among the
    normal numbers is off by at most 2^-4 of itself; one that lands below 2^-6 (a value much
    smaller than its block's largest) among the subnormals, spaced 2^-9 apart, by at most half
    that spacing times the scale. Both terms, plus a float32 rounding allowance:

        |x_hat - x| <= 2^-4 |x| + 2^-10 * amax / 448 + 1e-6 |x|
    """
    amax = block_amax(x, block)                                      # [N, nb]
    per_element = amax.repeat_interleave(block, dim=1)[:, :x.shape[1]]   # [N, H]
    magnitude = x.detach().float().abs()
    return (RELATIVE_STEP + 1e-6) * magnitude + SMALLEST_SUBNORMAL / 2 * per_element / MAX


def op_support() -> dict:
    """{op: works} for float8_e4m3fn tensors on this torch build's CPU (measured, not assumed)."""
    q = torch.linspace(-2, 2, 256).reshape(2, 128).to(E4M3)
    trials = {
        "cast from float32 / bfloat16": lambda: torch.ones(2).bfloat16().to(E4M3),
        "cast to float32": lambda: q.float(),
        "view as uint8 (bytes for the wire)": lambda: q.view(torch.uint8).view(E4M3),
        "cat / index / clone": lambda: torch.cat([q[[0]], q.clone()]),
        "abs": lambda: q.abs(),
        "multiply by a scale": lambda: q * 2,
        "amax (find the scale)": lambda: q.amax(),
        "sum": lambda: q.sum(),
        "matmul": lambda: q @ q.t(),
    }
    support = {}
    for name, trial in trials.items():
        try:
            trial()
            support[name] = True
        except (RuntimeError, NotImplementedError, TypeError):
            support[name] = False
    return support


def cast_without_scale(values) -> list:
    """What a plain cast to e4m3 makes of some values (to show saturation and underflow)."""
    return torch.tensor(values, dtype=torch.float32).to(E4M3).float().tolist()


def ratio_to_bf16(hidden: int, block: int = BLOCK) -> float:
    """FP8 row bytes over BF16 row bytes: (H + 4 ceil(H / block)) / 2H (0.52 for block 128)."""
    return row_bytes(hidden, block) / (2 * hidden) if hidden else math.nan
