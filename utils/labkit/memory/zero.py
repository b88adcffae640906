"""ZeRO stages 0-3 on real ranks, for a stack of MLP blocks (chapter 3, section 3).

    blocks = zero.make_blocks(layers=4, hidden=64, seed=0, world_size=P, stage=3)
    trainer = zero.ZeroTrainer(blocks, stage=3, lr=1e-3, weight_decay=0.1)
    loss = trainer.forward(x).float().square().mean()     # x: [B, T, H]
    loss.backward()
    trainer.step()

Each block is one unit of sharding (FSDP's "one fully_shard per layer"): its parameters live in
one flat tensor of N_l = 8H^2 + 5H elements, padded to a multiple of P so that rank r owns the
slice [r*S, (r+1)*S), S = N_l/P. What a rank keeps, by stage (b: bytes of the compute dtype):

    stage  parameters (b)   gradients (b)      fp32 master + AdamW m, v
    0      full  [N_l]      full  [N_l]         full   [N_l] x 3
    1      full  [N_l]      full  [N_l]         shard  [S]   x 3
    2      full  [N_l]      shard [S]           shard  [S]   x 3
    3      shard [S]        shard [S]           shard  [S]   x 3

Communication per step: stage 0 all-reduces the gradients; stages 1-2 reduce-scatter them and
all-gather the updated parameters once per block; stage 3 all-gathers each block's parameters
before its forward and again before its backward, frees them after use, and reduce-scatters
each block's gradient as soon as backward produced it. The reduce-scatter here is an all-to-all
plus a local sum: gloo's own reduce_scatter is an all-reduce underneath and sends twice the bytes
(measured in the chapter), where NCCL's is a ring that sends (P-1)/P of the data.

FP32 main gradients (`ZeroTrainer(..., main_grads=True)`, off by default): Megatron-LM's recipe with
bf16 weights, 2 + 4 + 12 = 18 bytes per parameter. Backward still computes each block's gradient
in the compute dtype, into a fresh tensor, and adds it at once into an FP32 accumulator kept per
block (`Block.main_grad`), as Megatron's backward hook does (`param.main_grad.add_(param.grad)` in
megatron/core/distributed/distributed_data_parallel.py, `_make_backward_post_hook`; the buffer is
`_ParamAndGradBuffer.grad_data`, allocated in `grad_dtype` = float32 when `grad_reduce_in_fp32`,
megatron/core/distributed/param_and_grad_buffer.py). The reduction runs in FP32 too, so it sends
twice the bf16 bytes. What stays, by stage:

    stage  FP32 main gradient kept        reduced by
    0      full  [N_l]                    all-reduce of main_grad, once per step
    1      full  [N_l]                    reduce-scatter of main_grad, once per step (Megatron's
                                          distributed optimizer keeps the whole grad_data buffer
                                          and reads its own slice: 6 + 12/d bytes per parameter)
    2, 3   shard [S]                      each backward's gradient copied to an FP32 buffer
                                          [N_l], reduce-scattered, its [S] added to main_grad

Block math, done by hand in `_BlockFunction` so that what is gathered, saved and freed is visible:
    pre = x W1^T + b1    [B, T, 4H]
    act = gelu(pre)      [B, T, 4H]
    out = x + act W2^T + b2
Saved for backward: x, pre, act: 9 * B*T*H elements per block.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STAGES = (0, 1, 2, 3)


_SUBGROUPS = {}


def subgroup(size: int):
    """The process group of ranks 0 .. size-1 (collective: every rank of the world calls it; made
    once per world). Ranks outside it get a group they are not part of.

    Made without teaching mode's DETAIL check: the check sends a fingerprint tensor with every
    collective, and gloo's thread frees it where torch's memory profiler does not look, which
    breaks the profiler's bookkeeping. The bench's own collectives need no check."""
    key = (dist.get_world_size(), size, id(dist.group.WORLD))
    if key not in _SUBGROUPS:
        if not 1 <= size <= dist.get_world_size():
            raise ValueError(f"a subgroup of {size} ranks needs 1 <= size <= world size "
                             f"({dist.get_world_size()})")
        level = dist.get_debug_level()
        dist.set_debug_level(dist.DebugLevel.OFF)
        try:
            _SUBGROUPS[key] = dist.new_group(list(range(size)))
        finally:
            dist.set_debug_level(level)
    return _SUBGROUPS[key]


def block_numel(hidden: int) -> int:
    """Parameters of one block: W1 [4H, H], b1 [4H], W2 [H, 4H], b2 [H]."""
    return 8 * hidden * hidden + 5 * hidden


def padded_numel(hidden: int, world_size: int) -> int:
    """N_l rounded up to a multiple of P, so every rank owns an equal slice."""
    return math.ceil(block_numel(hidden) / world_size) * world_size


def initial_flat(hidden: int, seed: int, layer: int, dtype=torch.float64) -> torch.Tensor:
    """Block `layer`'s parameters as one flat tensor [N_l]; the same in every process."""
    g = torch.Generator().manual_seed(1000 * seed + layer)
    scale_in, scale_out = hidden ** -0.5, (4 * hidden) ** -0.5
    w1 = torch.randn(4 * hidden, hidden, generator=g, dtype=torch.float64) * scale_in
    b1 = torch.randn(4 * hidden, generator=g, dtype=torch.float64) * 0.02
    w2 = torch.randn(hidden, 4 * hidden, generator=g, dtype=torch.float64) * scale_out
    b2 = torch.randn(hidden, generator=g, dtype=torch.float64) * 0.02
    return torch.cat([w1.flatten(), b1, w2.flatten(), b2]).to(dtype)


def unflatten(flat: torch.Tensor, hidden: int):
    """Views W1 [4H, H], b1 [4H], W2 [H, 4H], b2 [H] of a flat [>= N_l] tensor."""
    H, sizes = hidden, (4 * hidden * hidden, 4 * hidden, 4 * hidden * hidden, hidden)
    w1, b1, w2, b2 = flat[:sum(sizes)].split(sizes)
    return w1.view(4 * H, H), b1, w2.view(H, 4 * H), b2


def reduce_scatter(flat: torch.Tensor, received: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ranks of flat [P*S], rank r keeping slice r -> [S]: all-to-all, then a local sum.
    `received` [P*S] is a buffer for the slices the other ranks send."""
    world_size = dist.get_world_size(group)
    dist.all_to_all_single(received, flat, group=group)  # received[q*S:(q+1)*S]: rank q's slice r
    return received.view(world_size, -1).sum(dim=0)     # [P, S] -> [S]


class Buffers:
    """The communication buffers of one rank, sized for one block and reused by every block.

    Collectives write into these and they are never freed during a step: a constant-size buffer
    (ZeRO-R's "CB") instead of a fresh tensor per call. (It also keeps torch's CPU memory profiler
    exact: a tensor handed to gloo can otherwise be freed on gloo's own thread, which the profiler
    does not watch.) Stage 3 gathers into `gathered`; stages 1-3 receive slices in `received`;
    stages 2-3 build a block's full gradient in `gradient`; stages 1-2 stage the new bf16 slice
    in `outgoing`. `grad_dtype` (FP32 main gradients; default: `dtype`) is the dtype of the two
    that carry gradients on the wire, `gradient` and `received`."""

    def __init__(self, numel, shard_numel, stage, dtype, device, grad_dtype=None):
        def buffer(n, needed, kind=dtype):
            return torch.zeros(n if needed else 0, dtype=kind, device=device)
        grad_dtype = dtype if grad_dtype is None else grad_dtype
        self.gathered = buffer(numel, stage == 3)           # [N_l]
        self.gradient = buffer(numel, stage >= 2, grad_dtype)   # [N_l]
        self.received = buffer(numel, stage >= 1, grad_dtype)   # [N_l] = [P * S]
        self.outgoing = buffer(shard_numel, stage in (1, 2))  # [S]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())


class _BlockFunction(torch.autograd.Function):
    """One block's forward and backward, gathering and freeing the parameters explicitly."""

    @staticmethod
    def forward(ctx, x, leaf, block):
        w1, b1, w2, b2 = unflatten(block.full_parameters("forward"), block.hidden)
        pre = x @ w1.T + b1                                  # [B, T, 4H]
        act = F.gelu(pre)                                    # [B, T, 4H]
        out = x + act @ w2.T + b2                            # [B, T, H]
        block.after_use("forward")                           # stage 3: the gathered copy goes
        ctx.block = block
        ctx.save_for_backward(x, pre, act)
        return out

    @staticmethod
    def backward(ctx, grad_out):                             # grad_out: [B, T, H]
        x, pre, act = ctx.saved_tensors
        block, H = ctx.block, ctx.block.hidden
        full = block.full_parameters("backward")             # stage 3: gathered a second time
        w1, _, w2, _ = unflatten(full, H)
        grad_flat = block.gradient_buffer(full)              # [N_l padded], zeroed
        g_w1, g_b1, g_w2, g_b2 = unflatten(grad_flat, H)
        rows_out, rows_act = grad_out.reshape(-1, H), act.reshape(-1, 4 * H)   # [BT, H], [BT, 4H]
        torch.mm(rows_out.T, rows_act, out=g_w2)
        g_b2.copy_(rows_out.sum(0))
        grad_pre = torch.ops.aten.gelu_backward(grad_out @ w2, pre)            # [B, T, 4H]
        rows_pre = grad_pre.reshape(-1, 4 * H)
        torch.mm(rows_pre.T, x.reshape(-1, H), out=g_w1)
        g_b1.copy_(rows_pre.sum(0))
        grad_x = grad_out + grad_pre @ w1                    # [B, T, H]
        block.after_use("backward")
        return grad_x, block.reduce_gradient(grad_flat), None


class Block(nn.Module):
    """x + W2 gelu(W1 x + b1) + b2, sharded for ZeRO `stage` over the ranks of `group`.

    Parameters the optimizer and the profiler see: `flat` [N_l] (stages 0-2), `shard` [S] (stages
    2-3; in stage 2 a view of this rank's slice of `flat`), and in stage 3 `gathered` [N_l], the
    buffer the full weights are gathered into (no gradient: registered so that torch's memory
    profiler files the gathered weights as parameters)."""

    def __init__(self, hidden, stage, world_size, rank, initial, group=None):
        super().__init__()
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
        self.hidden, self.stage, self.world_size, self.rank = hidden, stage, world_size, rank
        self.group = group
        self.reshard_after_forward = True
        self.numel = padded_numel(hidden, world_size)        # N_l padded to a multiple of P
        self.shard_numel = self.numel // world_size          # S
        flat = torch.zeros(self.numel, dtype=initial.dtype, device=initial.device)
        flat[:initial.numel()] = initial
        mine = slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)
        self.held = False                                    # stage 3: is the gathered copy ours?
        self.reshard = "microbatch"                          # or "step": see keep_for_step
        self.last_backward = True                            # "step": is this the step's last?
        self.unsharded_gradient = None                       # "step": [N_l], summed over microbatches
        self.main_grad = None                                # FP32 main gradient: see use_main_grad
        self.gathered = None
        if stage <= 1:
            self.flat, self.shard = nn.Parameter(flat), None
        elif stage == 2:
            self.flat = nn.Parameter(flat, requires_grad=False)
            self.shard = nn.Parameter(self.flat.data[mine])  # a view: no extra memory
        else:
            self.flat, self.shard = None, nn.Parameter(flat[mine].clone())
        self.buffers = None                                  # set by ZeroTrainer

    def attach(self, buffers):
        self.buffers = buffers
        if self.stage == 3 and self.reshard_after_forward:
            self.gathered = nn.Parameter(buffers.gathered, requires_grad=False)   # shared

    def keep_after_forward(self):
        """Stage 3 without resharding after forward (FSDP's reshard_after_forward=False): the
        gathered copy stays from forward to backward, so this block needs a buffer of its own."""
        self.reshard_after_forward = False
        if self.stage == 3:
            self.gathered = nn.Parameter(torch.zeros(self.numel, dtype=self.shard.dtype,
                                                     device=self.shard.device), requires_grad=False)

    def keep_for_step(self):
        """Stages 2-3 inside a pipeline, resharded once per step (torch's pipelining stage with an
        FSDP2 module: reshard_after_backward and requires_gradient_sync off until the last
        backward). The gathered weights stay from the first forward of the step to its last
        backward, the full gradient [N_l] is summed over the microbatches, and one reduce-scatter
        after the last backward (`last_backward`, set by the schedule) hands this rank its slice.
        Both full tensors are freed between steps. Call before ZeroTrainer attaches buffers."""
        if self.stage < 2:
            raise ValueError(f"keep_for_step is for ZeRO stages 2-3 (stage 1 already reduces once "
                             f"per step), got stage {self.stage}")
        self.reshard, self.reshard_after_forward = "step", False
        self.unsharded_gradient = torch.zeros(0, dtype=self.flat_dtype(), device=self.device())
        if self.stage == 3:
            self.gathered = nn.Parameter(torch.zeros(0, dtype=self.shard.dtype,
                                                     device=self.shard.device), requires_grad=False)

    def use_main_grad(self, dtype=torch.float32):
        """Accumulate this block's gradient in `dtype` (Megatron's main_grad; see the module
        docstring): [N_l] kept for stages 0-1, this rank's [S] for stages 2-3. Autograd's own
        .grad stays None. Called by ZeroTrainer(main_grads=True)."""
        if self.reshard == "step":
            raise ValueError("FP32 main gradients are not built for reshard='step' (keep_for_step); "
                             "use the default policy")
        self.main_grad = torch.zeros(self.numel if self.stage <= 1 else self.shard_numel,
                                     dtype=dtype, device=self.device())

    def flat_dtype(self):
        return (self.flat if self.flat is not None else self.shard).dtype

    def device(self):
        return (self.flat if self.flat is not None else self.shard).device

    def forward(self, x):                                    # x: [B, T, H]
        return _BlockFunction.apply(x, self.flat if self.stage <= 1 else self.shard, self)

    def full_parameters(self, phase):
        """The whole flat parameter tensor [N_l]: held (stages 0-2), or all-gathered (stage 3)."""
        if self.stage < 3:
            return self.flat.detach()
        if not self.held:
            if self.gathered.numel() == 0:                   # "step": freed between steps
                self.gathered.data = torch.zeros(self.numel, dtype=self.shard.dtype,
                                                 device=self.shard.device)
            dist.all_gather_single(self.gathered.data, self.shard.detach(), group=self.group)
            self.held = True
        return self.gathered.detach()

    def after_use(self, phase):
        """Stage 3 lets go of the gathered copy after backward, and after forward when resharding."""
        if self.reshard == "step":
            if self.stage == 3 and phase == "backward" and self.last_backward:
                self.held = False
                self.gathered.data = self.gathered.data.new_zeros(0)     # freed until next step
            return
        if self.stage == 3 and (phase == "backward" or self.reshard_after_forward):
            self.held = False

    def gradient_buffer(self, like):
        """Where backward writes this block's full gradient: a fresh tensor (stages 0-1, handed to
        autograd, which adds it to flat.grad) or the shared buffer (stages 2-3, reduce-scattered
        at once). With a main gradient: a fresh tensor (Megatron's param.grad), added to it."""
        if self.stage <= 1 or self.reshard == "step" or self.main_grad is not None:
            return torch.zeros_like(like)
        self.buffers.gradient.zero_()
        return self.buffers.gradient

    def reduce_gradient(self, grad_flat):
        """Stages 0-1 keep the full gradient [N_l]; stages 2-3 keep only their slice [S], summed.
        With a main gradient the sum is kept there (FP32) and autograd gets None."""
        if self.main_grad is not None:
            if self.stage <= 1:                              # reduced once per step, in step()
                self.main_grad.add_(grad_flat)               # bf16 -> FP32 accumulator [N_l]
            else:
                wire = self.buffers.gradient                 # FP32 [N_l]: reduced in FP32
                wire.copy_(grad_flat)
                self.main_grad.add_(reduce_scatter(wire, self.buffers.received, self.group))  # [S]
            return None
        if self.stage <= 1:
            return grad_flat
        if self.reshard == "step":                           # sum now, reduce-scatter at the end
            if self.unsharded_gradient.numel() == 0:
                self.unsharded_gradient = torch.zeros_like(grad_flat)
            self.unsharded_gradient += grad_flat
            if not self.last_backward:
                return None                                  # nothing for the shard yet
            full, self.unsharded_gradient = self.unsharded_gradient, grad_flat.new_zeros(0)
            return reduce_scatter(full, self.buffers.received, self.group)
        return reduce_scatter(grad_flat, self.buffers.received, self.group)


def make_blocks(layers, hidden, seed, world_size, rank, stage, dtype=torch.bfloat16, device="cpu",
                group=None, first_layer=0):
    """Blocks first_layer .. first_layer + layers - 1 of the bench model, sharded for `stage`."""
    return nn.ModuleList(
        Block(hidden, stage, world_size, rank, initial_flat(hidden, seed, first_layer + i, dtype).to(device),
              group=group) for i in range(layers))


class ZeroTrainer:
    """AdamW with fp32 master weights over ZeRO-sharded blocks (see the module docstring).

    step(): averages the gradients over the ranks (stage 0 all-reduce, stage 1 reduce-scatter, stages
    2-3 already reduce-scattered in backward), steps this rank's fp32 master block by block (one
    block's fp32 gradient alive at a time), and writes the new weights back (stage 0 copies,
    stages 1-2 all-gather, stage 3 keeps its shard).

    main_grads=True: gradients accumulated and reduced in `master_dtype` (FP32 main gradients,
    Megatron-LM's 18 bytes per parameter; see the module docstring). Off by default."""

    def __init__(self, blocks, stage, group=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, master_dtype=torch.float32, main_grads=False):
        self.blocks, self.stage, self.group = blocks, stage, group
        self.world_size = dist.get_world_size(group)
        self.main_grads = bool(main_grads)
        weights = [b.flat if b.flat is not None else b.shard for b in blocks]
        self.buffers = Buffers(max(b.numel for b in blocks), max(b.shard_numel for b in blocks),
                               stage, weights[0].dtype, weights[0].device,
                               grad_dtype=master_dtype if self.main_grads else None)
        for block in blocks:
            block.attach(self.buffers)
            if self.main_grads:
                block.use_main_grad(master_dtype)
        self.masters, self.optimizers = [], []               # fp32 [N_l] (stage 0) or [S]
        for block in blocks:
            source = block.flat if stage == 0 else (
                block.shard if stage >= 2 else block.flat[block.rank * block.shard_numel:]
                [:block.shard_numel])
            master = source.detach().to(master_dtype).clone().requires_grad_(True)
            self.masters.append(master)
            self.optimizers.append(torch.optim.AdamW([master], lr=lr, betas=betas, eps=eps,
                                                     weight_decay=weight_decay, foreach=False))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def _summed_gradient(self, block):
        if block.main_grad is not None:                                 # FP32 on the wire
            if self.stage == 0:
                dist.all_reduce(block.main_grad, group=self.group)      # [N_l], summed
            elif self.stage == 1:                                       # main_grad [N_l] kept whole
                received = self.buffers.received[:block.numel]
                return reduce_scatter(block.main_grad, received, self.group)   # [N_l] -> [S]
            return block.main_grad                                      # [N_l] or [S], summed
        if self.stage == 0:
            dist.all_reduce(block.flat.grad, group=self.group)          # [N_l], summed
            return block.flat.grad
        if self.stage == 1:
            received = self.buffers.received[:block.numel]
            return reduce_scatter(block.flat.grad, received, self.group)    # [N_l] -> [S]
        return block.shard.grad                                         # [S], summed in backward

    @torch.no_grad()
    def step(self):
        for block, master, optimizer in zip(self.blocks, self.masters, self.optimizers):
            master.grad = self._summed_gradient(block).to(master.dtype, copy=True)
            master.grad.div_(self.world_size)                           # the mean over ranks
            optimizer.step()
            master.grad = None
            if self.stage == 0:
                block.flat.copy_(master)
            elif self.stage <= 2:                                       # everyone gets every slice
                outgoing = self.buffers.outgoing[:block.shard_numel]
                outgoing.copy_(master)
                dist.all_gather_single(block.flat.data, outgoing, group=self.group)
            else:
                block.shard.copy_(master)
            for p in (block.flat, block.shard):
                if p is not None and p.grad is not None:
                    p.grad.zero_()                                      # kept: a steady buffer
            if block.main_grad is not None:
                block.main_grad.zero_()                                 # kept, as Megatron's grad_data

    def roles(self) -> dict:
        """The tensors this rank keeps, by ledger category (after a first step, so that the
        optimizer states exist): parameters, gradients (FP32 main gradients with main_grads),
        optimizer_states (fp32 master, m, v, step), buffers."""
        parameters, gradients = [], []
        for block in self.blocks:
            for p in (block.flat, block.shard):
                if p is not None:
                    parameters.append(p)
                    if p.grad is not None:
                        gradients.append(p.grad)
            if block.main_grad is not None:
                gradients.append(block.main_grad)
        states = list(self.masters) + [t for opt in self.optimizers for state in opt.state.values()
                                        for t in state.values() if torch.is_tensor(t)]
        buffers = [t for t in vars(self.buffers).values() if t.numel()]
        buffers += [b.gathered for b in self.blocks if b.gathered is not None]
        return {"parameters": parameters, "gradients": gradients, "optimizer_states": states,
                "buffers": buffers}

    def full_weights(self):
        """Every block's parameters [N_l] in float64, gathered (for comparing with a reference)."""
        out = []
        for block in self.blocks:
            if self.stage < 3:
                out.append(block.flat.detach().double().clone())
            else:
                out.append(block.full_parameters("check").double().clone())
                block.held = False
        return out
