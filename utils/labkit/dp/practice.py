"""Chapter 2, section 7 (data parallelism in practice): the measurement machinery behind DDP's
`gradient_as_bucket_view` and its gradient-reduce dtype hooks. Rank programs; no graded answer.

Run on a world with teaching=False (DDP's constructor crashes under TORCH_DISTRIBUTED_DEBUG=DETAIL
in torch 2.13):

    world = labkit.world(3, teaching=False)
    world.run(practice.gradient_storage, True)    # bytes of gradients outside DDP's buckets
    world.run(practice.ddp_gradients, "bf16")     # DDP gradients reduced through bf16_compress_hook
"""
import torch
import torch.distributed as dist
from torch import nn

HOOKS = ("fp32", "fp16", "bf16")


def _mlp(width: int, layers: int, device) -> nn.Module:
    """The same FP32 MLP in every process (seeded), `layers` Linear(width, width) + GELU."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                            for _ in range(layers)]).to(device)
    torch.random.set_rng_state(generator_state)
    return model


def _rank_input(width: int, device) -> torch.Tensor:
    """A different [8, width] input on every rank (seeded by rank)."""
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    return torch.randn(8, width, generator=generator).to(device)       # x: [8, width]


def gradient_storage(gradient_as_bucket_view: bool, width: int = 64, layers: int = 3) -> dict:
    """On every rank: one DDP backward; where do the gradients live?

    A comm hook records the storage of every bucket DDP sends (`bucket.buffer()`); after backward
    every `p.grad` is classified by its storage. Returns the bytes of gradient storage that is not a
    bucket (the copy `gradient_as_bucket_view=True` removes), the parameter bytes, and counts.
    Source: torch/nn/parallel/distributed.py, the `gradient_as_bucket_view` docstring.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from labkit import device
    model = _mlp(width, layers, device())
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=gradient_as_bucket_view)
    buckets = {}                                                   # storage pointer -> bytes

    def record_then_reduce(state, bucket):
        buffer = bucket.buffer()
        buckets[buffer.untyped_storage().data_ptr()] = buffer.untyped_storage().nbytes()
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, record_then_reduce)
    ddp(_rank_input(width, device())).square().mean().backward()
    grad_storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                     for p in model.parameters()}
    outside = sum(nbytes for ptr, nbytes in grad_storages.items() if ptr not in buckets)
    return {"gradient_bytes_outside_buckets": outside,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "bucket_bytes": sum(buckets.values()), "buckets": len(buckets),
            "gradient_storages": len(grad_storages)}


def ddp_gradients(hook: str, width: int = 64, layers: int = 2) -> dict:
    """On every rank: one DDP backward with the gradients reduced in `hook` ("fp32": DDP's default
    all_reduce; "fp16"/"bf16": torch's fp16_compress_hook / bf16_compress_hook, which cast each
    bucket, all-reduce it in that dtype and cast back). Returns {name: averaged FP32 gradient}.
    Source: torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py; in torch 2.13
    DDP.register_comm_hook refuses the bf16 hook unless torch was built with CUDA/ROCm and NCCL
    2.10+, or XPU and XCCL (torch/nn/parallel/distributed.py): a CPU-only torch refuses it on gloo."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from labkit import device
    if hook not in HOOKS:
        raise ValueError(f"rank {dist.get_rank()}: hook {hook!r} is not one of {HOOKS}; "
                         "pick the dtype the buckets are all-reduced in")
    model = _mlp(width, layers, device())
    ddp = nn.parallel.DistributedDataParallel(model)
    if hook != "fp32":
        compress = {"fp16": default_hooks.fp16_compress_hook,
                    "bf16": default_hooks.bf16_compress_hook}[hook]
        ddp.register_comm_hook(dist.group.WORLD, compress)
    ddp(_rank_input(width, device())).square().mean().backward()
    return {name: p.grad.detach().float().cpu().clone() for name, p in model.named_parameters()}
