"""A transformer layer laid out as in Korthikanti et al. 2022, to count its activations (chapter 3,
section 7).

    layer = activations.Layer(h=64, a=4, t=1, seed=0)              # one process
    x = torch.randn(s, b, h, dtype=torch.bfloat16)                   # [s, b, h]
    saved = activations.measure(layer, x)                            # bytes kept for backward
    world.run(activations.measure_on_rank, case)                     # t ranks: tensor parallel

The layer: x -> LN -> Q, K, V -> softmax(QK^T/sqrt(d)) -> dropout -> .V -> projection -> dropout
-> + x -> LN -> fc1 -> GeLU -> fc2 -> dropout -> + . 16-bit activations, 1-byte dropout masks.
What autograd keeps, per the paper's section 4.1 (sbh = s*b*h):

    LN 1 input 2sbh, Q and K 4sbh, softmax output 2as^2b, its dropout mask as^2b, the dropped
    probabilities 2as^2b and V 2sbh (for the product with V), projection input 2sbh, dropout mask
    sbh; LN 2 input 2sbh, fc1 input 2sbh, GeLU input 8sbh, fc2 input 8sbh, dropout mask sbh.
    Total sbh(34 + 5as/h). Q, K and V come from one LN output, kept once (2sbh).

With t tensor-parallel ranks (Megatron's column-parallel Q/K/V and fc1, row-parallel projection
and fc2) the attention and MLP insides are split, the LN and dropout parts stay whole:
sbh(10 + 24/t + 5as/(ht)). With sequence parallelism those parts are split along s too and the
linear layers keep only their slice of the input (gathered again in backward): sbh(34/t + 5as/(ht)).

What torch keeps beyond the paper (`extra_bytes`): each LayerNorm also saves its mean and 1/std
per token (s*b values each; s*b/t under sequence parallelism), in float32 on CUDA and in the
input's dtype on CPU; and on CPU dropout is torch's composite version, which keeps its mask in the
input's dtype (2 bytes) where CUDA's fused kernel keeps 1 byte (aten/src/ATen/native/Dropout.cpp,
`is_fused_kernel_acceptable`). On CPU that adds as^2b/t + 2sbh (/t with sequence parallelism).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

DROPOUT = 0.1


def _weights(h, seed, dtype):
    """Full weights of the layer (the same in every process): Wq, Wk, Wv, Wo [h, h], W1 [4h, h],
    W2 [h, 4h], LayerNorm gains and biases [h]."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype)
    return {"q": w(h, h), "k": w(h, h), "v": w(h, h), "o": w(h, h), "fc1": w(4 * h, h),
            "fc2": w(h, 4 * h), "ln1": torch.ones(h, dtype=dtype), "ln2": torch.ones(h, dtype=dtype)}


class _Group:
    """The tensor-parallel group's collectives along dim 0 (the sequence), differentiable."""

    def __init__(self, group):
        self.group = group
        self.t = 1 if group is None else dist.get_world_size(group)

    def all_reduce(self, x):
        return _AllReduce.apply(x, self) if self.t > 1 else x

    def gather_seq(self, x):
        """[s/t, b, h] -> [s, b, h]."""
        out = torch.empty((x.shape[0] * self.t,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, x.contiguous(), group=self.group)
        return out

    def scatter_seq(self, x):
        """Sum over ranks of [s, b, h], rank r keeping rows r*s/t ... -> [s/t, b, h]."""
        received = torch.empty_like(x)
        dist.all_to_all_single(received, x.contiguous(), group=self.group)
        return received.view((self.t, -1) + tuple(x.shape[1:])).sum(0)


class _AllReduce(torch.autograd.Function):
    """Megatron's g: all-reduce in forward, identity in backward (row-parallel output)."""

    @staticmethod
    def forward(ctx, x, tp):
        x = x.clone()
        dist.all_reduce(x, group=tp.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Copy(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        if ctx.tp.t > 1:
            dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None


class _GatherLinear(torch.autograd.Function):
    """Sequence parallel: gather x [s/t, b, h] along s, multiply by W [n, h]; keep only the slice
    x for backward and gather it again there (so the linear's input costs 2sbh/t, not 2sbh)."""

    @staticmethod
    def forward(ctx, x, weight, tp):
        ctx.tp = tp
        ctx.save_for_backward(x, weight)
        return tp.gather_seq(x) @ weight.T                   # [s, b, n]

    @staticmethod
    def backward(ctx, grad):                                 # grad: [s, b, n]
        x, weight = ctx.saved_tensors
        full = ctx.tp.gather_seq(x)                          # [s, b, h], again
        grad_weight = grad.reshape(-1, grad.shape[-1]).T @ full.reshape(-1, full.shape[-1])
        return ctx.tp.scatter_seq(grad @ weight), grad_weight, None


class _ScatterSeq(torch.autograd.Function):
    """Sequence parallel: sum the row-parallel partial outputs and keep this rank's slice of s."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return tp.scatter_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.gather_seq(grad), None


class Layer(torch.nn.Module):
    """One transformer layer, this rank's share of it under t-way tensor parallelism."""

    def __init__(self, h, a, t=1, rank=0, seed=0, sequence_parallel=False, group=None,
                 dtype=torch.bfloat16):
        super().__init__()
        if h % a or a % t:
            raise ValueError(f"need h divisible by a and a by t: h={h}, a={a}, t={t}")
        self.h, self.a, self.t, self.sp = h, a, t, sequence_parallel
        self.tp = _Group(group)
        full, n = _weights(h, seed, dtype), h // t
        rows = slice(rank * n, (rank + 1) * n)                            # this rank's columns
        self.wq, self.wk, self.wv = (torch.nn.Parameter(full[k][rows]) for k in "qkv")  # [h/t, h]
        self.wo = torch.nn.Parameter(full["o"][:, rows])                  # [h, h/t]
        self.w1 = torch.nn.Parameter(full["fc1"][4 * rank * n:4 * (rank + 1) * n])  # [4h/t, h]
        self.w2 = torch.nn.Parameter(full["fc2"][:, 4 * rank * n:4 * (rank + 1) * n])  # [h, 4h/t]
        self.ln1 = torch.nn.Parameter(full["ln1"])
        self.ln2 = torch.nn.Parameter(full["ln2"])

    def _column(self, x, weight):
        if self.sp:
            return _GatherLinear.apply(x, weight, self.tp)
        return _Copy.apply(x, self.tp) @ weight.T

    def _row(self, x, weight):
        partial = x @ weight.T                                            # [s, b, h], partial
        return _ScatterSeq.apply(partial, self.tp) if self.sp else self.tp.all_reduce(partial)

    def attention_core(self, q, k, v):
        """softmax(QK^T / sqrt(d)) -> dropout -> .V, per head. q, k, v: [s, b, h/t]."""
        s, b = q.shape[0], q.shape[1]
        heads, d = self.a // self.t, self.h // self.a

        def split(x):                                                     # -> [b*heads, s, d]
            return x.view(s, b * heads, d).transpose(0, 1)
        scores = torch.bmm(split(q) * (1 / math.sqrt(d)), split(k).transpose(1, 2))  # [bA, s, s]
        probs = F.dropout(torch.softmax(scores, dim=-1), DROPOUT, self.training)
        context = torch.bmm(probs, split(v))                              # [b*heads, s, d]
        return context.transpose(0, 1).reshape(s, b, heads * d)           # [s, b, h/t]

    def forward(self, x, selective=False):
        """x: [s, b, h] ([s/t, b, h] with sequence parallelism)."""
        y = F.layer_norm(x, (self.h,), self.ln1)
        q, k, v = (self._column(y, w).contiguous() for w in (self.wq, self.wk, self.wv))
        if selective:
            context = torch.utils.checkpoint.checkpoint(self.attention_core, q, k, v,
                                                        use_reentrant=True)
        else:
            context = self.attention_core(q, k, v)
        x = x + F.dropout(self._row(context, self.wo), DROPOUT, self.training)
        y = F.layer_norm(x, (self.h,), self.ln2)
        hidden = F.gelu(self._column(y, self.w1))                         # [s, b, 4h/t]
        return x + F.dropout(self._row(hidden, self.w2), DROPOUT, self.training)


def extra_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none", device="cpu",
                element_size=2) -> float:
    """What torch saves beyond the paper's count (see the module docstring): LayerNorm statistics,
    and on CPU the second byte of every dropout mask element. Full recomputation keeps only the
    layer's input: nothing extra."""
    if recompute == "full":
        return 0.0
    split = t if sequence_parallel else 1
    on_cuda = str(device).startswith("cuda")
    stat_bytes = 4 if on_cuda else element_size
    extra_mask_bytes = 0 if on_cuda else element_size - 1
    masks = (0 if recompute == "selective" else a * s * s * b / t) + 2 * s * b * h / split
    return 2 * 2 * stat_bytes * s * b / split + extra_mask_bytes * masks


def measure(layer, x, recompute="none") -> int:
    """Bytes autograd keeps after the layer's forward (parameters excluded), each storage once.
    Runs backward afterwards, so nothing is left behind."""
    from labkit.memory.measure import saved_bytes
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    x = x.detach().requires_grad_(True)
    with saved_bytes(exclude=list(layer.parameters())) as saved:
        if recompute == "full":
            out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
        else:
            out = layer(x, selective=recompute == "selective")
    out.float().square().mean().backward()
    return saved.total


def _my_part(case):
    """This rank's tensor-parallel group (the first t ranks of the world), or None outside it."""
    from labkit.memory.zero import subgroup
    t = case.get("t", dist.get_world_size())
    group = subgroup(t)
    return (group, t) if dist.get_rank() < t else (None, t)


def measure_on_rank(case: dict):
    """On every rank of the world: ranks 0 .. t-1 (t = case["t"], default the world size) build
    their share of the layer, feed it the same input (their slice under sequence parallelism) and
    return the bytes they saved; the other ranks return None."""
    group, t = _my_part(case)
    if group is None:
        return None
    rank = dist.get_rank()
    s, b, h, a = case["s"], case["b"], case["h"], case["a"]
    sp = case.get("sequence_parallel", False)
    import labkit
    device = labkit.device()
    layer = Layer(h, a, t=t, rank=rank, seed=case.get("seed", 0), sequence_parallel=sp,
                  group=group).to(device)
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    if sp:
        x = x[rank * s // t:(rank + 1) * s // t].clone()                  # [s/t, b, h], its own
    torch.manual_seed(2)
    return measure(layer, x, case.get("recompute", "none"))


def outputs_agree(case: dict):
    """On ranks 0 .. t-1: the largest difference between this rank's tensor-parallel output
    (dropout off, float64) and the one-process layer's. (The split computes the same function.)"""
    group, t = _my_part(case)
    if group is None:
        return None
    rank = dist.get_rank()
    s, b, h, a = case["s"], case["b"], case["h"], case["a"]
    sp = case.get("sequence_parallel", False)
    import labkit
    device = labkit.device()
    kwargs = dict(seed=case.get("seed", 0), dtype=torch.float64)
    whole = Layer(h, a, **kwargs).to(device).eval()
    mine = Layer(h, a, t=t, rank=rank, sequence_parallel=sp, group=group, **kwargs).to(device).eval()
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    expected = whole(x)
    if sp:
        got = mine(x[rank * s // t:(rank + 1) * s // t])
        expected = expected[rank * s // t:(rank + 1) * s // t]
    else:
        got = mine(x)
    return (got - expected).abs().max().item()


def recomputation_gradients(preserve_rng_state=True, checkpointed=True, seed=0, p=0.5,
                            hidden=16, tokens=8) -> dict:
    """One process: gradients of a block with dropout, x -> W2 gelu(dropout(W1 x)), float64, run
    plain or under `torch.utils.checkpoint.checkpoint` (non-reentrant, which recomputes the block
    in backward). The generator is seeded the same before every run, so the forward draws the same
    dropout mask; with preserve_rng_state=False the recomputation draws a fresh one, and backward
    differentiates a different function from the one forward ran. Returns the loss and the
    gradients of x, W1 and W2 (chapter 3, section 7)."""
    if not 0 <= p < 1:
        raise ValueError(f"dropout p must be in [0, 1), got {p!r}")
    g = torch.Generator().manual_seed(1234)
    w1 = torch.randn(4 * hidden, hidden, generator=g, dtype=torch.float64).requires_grad_(True)
    w2 = torch.randn(hidden, 4 * hidden, generator=g, dtype=torch.float64).requires_grad_(True)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).requires_grad_(True)

    def block(x_):                                            # x_: [N, H] -> [N, H]
        return F.gelu(F.dropout(x_ @ w1.T, p=p, training=True)) @ w2.T

    torch.manual_seed(seed)                                   # the mask forward draws
    if checkpointed:
        from torch.utils.checkpoint import checkpoint
        out = checkpoint(block, x, use_reentrant=False, preserve_rng_state=preserve_rng_state)
    else:
        out = block(x)
    torch.manual_seed(seed + 1)                               # what the generator is at backward
    loss = out.square().sum()
    loss.backward()
    return {"loss": loss.detach(), "x": x.grad, "w1": w1.grad, "w2": w2.grad}
