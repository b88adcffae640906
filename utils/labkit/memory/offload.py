"""Offload on real ranks: the optimizer states, and then the parameters, kept in host memory, with
every copy between host and device counted as torch runs it (chapter 3, section 6, "Beyond the
three stages").

    row = offload.ledger_row(psi, dp, "optimizer")       # bytes per rank on the device and the host
    offload.pcie_bytes(psi, dp, "optimizer", b=2)         # {"down": ..., "up": ...} per step
    results = world.run(offload.run_offload, case)        # case = offload.case(...)

Two policies, both built on the chapter's blocks (labkit.memory.zero) over P data-parallel ranks:

    "optimizer"   ZeRO-Offload (Ren et al. 2021), on ZeRO stage 2. The device keeps the bf16
                  weights [N_l] and its bf16 gradient slice [S]; the fp32 master, m and v of the
                  slice live on the host, where AdamW steps them. Per block and step the gradient
                  slice goes down (host <- device, S b bytes) and the new bf16 slice comes up
                  (S b bytes) before the all-gather: PCIe carries 2 b Psi / P per rank and step.
    "parameters"  ZeRO-Infinity's parameter offload (Rajbhandari et al. 2021), on ZeRO stage 3:
                  the bf16 slice of the weights lives on the host too. Each use (forward, and
                  again backward) brings it up into a device staging slice before the
                  all-gather: 2 S b up per block and step, plus the gradient's S b down; the host's
                  own cast from the fp32 master to bf16 crosses nothing. 3 b Psi / P per step.

Host and device are both the CPU here, so "host memory" is a set of tensors the trainer keeps
apart (pinned buffers on a GPU machine); `CopyMeter`, a TorchDispatchMode, sees every
`aten.copy_` and `aten._to_copy` torch runs on the rank and counts the bytes of those that cross
between that set and the rest (or between devices, on a GPU). The prediction comes from the
formula above, not from the meter or the trainer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.memory import bench, ledger, zero

POLICIES = ("optimizer", "parameters")


def _check_policy(policy) -> None:
    if policy not in POLICIES:
        raise ValueError(f"offload policy must be one of {POLICIES}, got {policy!r}")


# ---- the ledger row and the wire -----------------------------------------------------------------

def ledger_row(psi: float, dp: int, policy: str, recipe=ledger.MIXED_ADAMW) -> dict:
    """Bytes per rank of the model states, where they live, for `policy` over dp ranks:
    {"device": {...}, "host": {...}}. Staging slices (the host's bf16 gradient and weights, the
    device's bf16 weight slice under parameter offload) are listed as "staging"; the gathered
    block in use and the collectives' buffers are transients, as in sections 3-5."""
    _check_policy(policy)
    recipe = ledger.recipe_named(recipe)
    shard = psi / dp
    if policy == "optimizer":              # on ZeRO-2: weights whole on the device
        device = {"parameters": recipe.param * psi, "gradients": recipe.grad * shard}
        host = {"optimizer_states": recipe.optimizer * shard,
                "staging": (recipe.grad + recipe.param) * shard}
    else:                                  # on ZeRO-3: the weights' slice on the host too
        device = {"gradients": recipe.grad * shard, "staging": recipe.param * shard}
        host = {"parameters": recipe.param * shard, "optimizer_states": recipe.optimizer * shard,
                "staging": recipe.grad * shard}
    return {"device": device, "host": host}


def pcie_bytes(psi: float, dp: int, policy: str, b: float = 2, microbatches: int = 1) -> dict:
    """Bytes one rank moves over PCIe per step: {"down": device -> host, "up": host -> device}.
    optimizer: b Psi / dp each way. parameters: b Psi / dp down (the gradient slice), and the
    weight slice up for every use: 2 m b Psi / dp with m microbatches (forward and backward of
    each, resharded every microbatch as sections 3-5 do)."""
    _check_policy(policy)
    shard = b * psi / dp
    return {"down": shard, "up": shard if policy == "optimizer" else 2 * microbatches * shard}


# ---- counting the copies -------------------------------------------------------------------------

def _storage(t) -> int:
    return t.untyped_storage().data_ptr()


class CopyMeter(TorchDispatchMode):
    """Bytes copied into (`down`) and out of (`up`) a set of host tensors, seen at torch's
    dispatcher: every aten.copy_ whose destination and source are on different sides of the set
    (or on different devices), and every aten._to_copy that changes device. Copies inside the host
    set (the fp32 master cast to bf16) or inside the device are not PCIe traffic."""

    def __init__(self, host_tensors=()):
        super().__init__()
        self.host = {_storage(t) for t in host_tensors}
        self.down = self.up = self.copies = 0

    def add_host(self, *tensors):
        self.host.update(_storage(t) for t in tensors)

    def _count(self, to_host: bool, nbytes: int):
        self.copies += 1
        if to_host:
            self.down += nbytes
        else:
            self.up += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            dst_host, src_host = _storage(dst) in self.host, _storage(src) in self.host
            if dst_host != src_host:                                   # across the host set
                self._count(dst_host, src.numel() * src.element_size())
            elif dst.device != src.device:                             # across devices (GPU)
                self._count(dst.device.type == "cpu", src.numel() * src.element_size())
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and out.device != args[0].device:
            self._count(out.device.type == "cpu", args[0].numel() * args[0].element_size())
        return out


# ---- the trainers --------------------------------------------------------------------------------

class _OffloadedBlock(zero.Block):
    """A stage-3 block whose bf16 weight slice lives on the host: before each gather it is copied
    up into the device slice `shard` (a staging buffer), then all-gathered as in zero.Block."""

    def offload(self):
        self.host_shard = self.shard.detach().to("cpu", copy=True)     # [S] bf16, host
        return self.host_shard

    def full_parameters(self, phase):
        if not self.held and phase != "check":
            self.shard.data.copy_(self.host_shard)                      # host -> device: S b bytes
        return super().full_parameters(phase)


class OffloadTrainer:
    """AdamW whose fp32 master, m and v live on the host, for `policy` (module docstring)."""

    def __init__(self, blocks, policy, group=None, lr=1e-3, weight_decay=0.0,
                 master_dtype=torch.float32):
        _check_policy(policy)
        self.blocks, self.policy, self.group = blocks, policy, group
        self.world_size = dist.get_world_size(group)
        stage = 2 if policy == "optimizer" else 3
        self.buffers = zero.Buffers(blocks[0].numel, blocks[0].shard_numel, stage,
                                    blocks[0].flat_dtype(), blocks[0].device())
        for block in blocks:
            block.attach(self.buffers)
        self.host = []                                                 # every host tensor
        self.masters, self.optimizers, self.grad_host, self.param_host = [], [], [], []
        for block in blocks:
            host_shard = block.offload() if policy == "parameters" else None
            source = host_shard if host_shard is not None else block.shard.detach().cpu()
            master = source.to(master_dtype).clone().requires_grad_(True)          # [S] host
            self.masters.append(master)
            self.optimizers.append(torch.optim.AdamW([master], lr=lr, weight_decay=weight_decay,
                                                     foreach=False))
            self.grad_host.append(torch.zeros(block.shard_numel, dtype=block.flat_dtype()))
            self.param_host.append(host_shard if host_shard is not None else
                                   torch.zeros(block.shard_numel, dtype=block.flat_dtype()))
            self.host += [master, self.grad_host[-1], self.param_host[-1]]

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    @torch.no_grad()
    def step(self, meter: CopyMeter | None = None):
        for i, (block, master, optimizer) in enumerate(zip(self.blocks, self.masters,
                                                           self.optimizers)):
            self.grad_host[i].copy_(block.shard.grad)                 # device -> host: S b
            master.grad = self.grad_host[i].to(master.dtype).div_(self.world_size)
            optimizer.step()                                           # on the host
            master.grad = None
            if meter is not None:                                      # AdamW's m and v: host
                meter.add_host(*[t for t in optimizer.state[master].values() if t.numel() > 1])
            self.param_host[i].copy_(master)                           # fp32 -> bf16, on the host
            if self.policy == "optimizer":
                outgoing = self.buffers.outgoing[:block.shard_numel]
                outgoing.copy_(self.param_host[i])                     # host -> device: S b
                dist.all_gather_single(block.flat.data, outgoing, group=self.group)
            block.shard.grad.zero_()

    def full_weights(self):
        out = []
        for block in self.blocks:
            if self.policy == "optimizer":
                out.append(block.flat.detach().double().clone())
            else:
                block.shard.data.copy_(block.host_shard)
                out.append(block.full_parameters("check").double().clone())
                block.held = False
        return out


def case(policy, P=None, layers=2, hidden=16, batch=2, seq=4, steps=2, dtype="bfloat16",
         lr=1e-2, weight_decay=0.1, seed=0) -> dict:
    """Plain data for `run_offload`: as labkit.memory.bench.bench_case, plus the policy."""
    _check_policy(policy)
    return dict(bench.bench_case(2 if policy == "optimizer" else 3, P=P, layers=layers,
                                 hidden=hidden, batch=batch, seq=seq, steps=steps, dtype=dtype,
                                 lr=lr, weight_decay=weight_decay, seed=seed, history=True),
                policy=policy)


def run_offload(case):
    """On every rank: ranks 0 .. P-1 train with offload; the others return None. Returns the
    weights after each step (float64 copies, for the reference) and, per step, the bytes the
    CopyMeter saw cross between host and device: {"history", "down", "up", "copies"}."""
    import labkit
    P = case["P"] or dist.get_world_size()
    group = zero.subgroup(P)
    rank = dist.get_rank()
    if rank >= P:
        return None
    dtype, device = getattr(torch, case["dtype"]), labkit.device()
    stage = 2 if case["policy"] == "optimizer" else 3
    blocks = torch.nn.ModuleList(
        (_OffloadedBlock if stage == 3 else zero.Block)(
            case["hidden"], stage, P, rank,
            zero.initial_flat(case["hidden"], case["seed"], i, dtype).to(device), group=group)
        for i in range(case["layers"]))
    trainer = OffloadTrainer(blocks, case["policy"], group=group, lr=case["lr"],
                             weight_decay=case["weight_decay"],
                             master_dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = {"history": [], "down": [], "up": [], "copies": []}
    for x in bench.batches(case, rank, P):
        x = x.to(device=device, dtype=dtype)
        with CopyMeter(trainer.host) as meter:
            trainer.forward(x).to(loss_dtype).square().mean().backward()
            trainer.step(meter)
        for key in ("down", "up", "copies"):
            out[key].append(getattr(meter, key))
        out["history"].append([w.cpu() for w in trainer.full_weights()])
    return out
