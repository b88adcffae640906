"""ZeRO-1 on the chapter 8 bench: AdamW moments sharded over the ranks (chapter 8, section 5).

All parameters are laid end to end in one flat vector of N elements, padded with zeros to
P * chunk, chunk = ceil(N / P); rank r owns the range [r * chunk, (r + 1) * chunk) of the two
AdamW moments (chapter 3's ZeRO stage 1). The layout is what a snapshot must record so that
another world size can find its data again:

    layout = FlatLayout([("embed.weight", (29, 32)), ...], world_size=4)
    layout.offsets["mix.weight"]     # where a parameter starts in the flat vector
    layout.range(2)                  # (start, end) owned by rank 2, end may run into padding
    layout.to_dict()                 # plain data for a manifest: names, shapes, offsets, ...

Resharding (reading a layout saved at P ranks back at P') is the course's and the lab's to write.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


class FlatLayout:
    """Global shapes, flat offsets and per-rank ranges of a list of named tensors."""

    def __init__(self, named_shapes, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.names = [name for name, _ in named_shapes]
        self.shapes = {name: tuple(int(d) for d in shape) for name, shape in named_shapes}
        self.offsets, offset = {}, 0
        for name in self.names:
            self.offsets[name] = offset
            offset += math.prod(self.shapes[name])
        self.numel = offset                                     # N
        self.world_size = world_size                            # P
        self.chunk = -(-offset // world_size)                   # ceil(N / P)

    @property
    def padded(self) -> int:
        return self.chunk * self.world_size                     # P * ceil(N / P) >= N

    def range(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in [0, {self.world_size})")
        return rank * self.chunk, (rank + 1) * self.chunk

    def to_dict(self) -> dict:
        return {"names": list(self.names), "shapes": {n: list(s) for n, s in self.shapes.items()},
                "offsets": dict(self.offsets), "numel": self.numel,
                "world_size": self.world_size, "chunk": self.chunk}

    @classmethod
    def from_dict(cls, data: dict, world_size: int | None = None) -> "FlatLayout":
        """The same tensors, laid out for `world_size` ranks (default: as saved)."""
        layout = cls([(n, tuple(data["shapes"][n])) for n in data["names"]],
                     world_size or data["world_size"])
        if layout.offsets != {n: int(o) for n, o in data["offsets"].items()}:
            raise ValueError("the saved offsets do not follow from the saved shapes")
        return layout


class Zero1AdamW(torch.optim.Optimizer):
    """AdamW whose two moments are sharded: rank r updates only its range of the flat vector,
    then the ranks all-gather the updated ranges. Gradients arrive already averaged.

    State (what a checkpoint of it holds): `exp_avg`, `exp_avg_sq`: [chunk] (this rank's range),
    `step_count`, and `layout` (a FlatLayout).
    """

    def __init__(self, named_parameters, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01):
        named = list(named_parameters)
        super().__init__([p for _, p in named], dict(lr=lr, betas=betas, eps=eps,
                                                     weight_decay=weight_decay))
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.layout = FlatLayout([(n, p.shape) for n, p in named], world_size)
        self.exp_avg = torch.zeros(self.layout.chunk)            # [chunk] = [ceil(N / P)]
        self.exp_avg_sq = torch.zeros(self.layout.chunk)         # [chunk]
        self.step_count = 0

    def _flat(self, tensors) -> torch.Tensor:
        flat = torch.zeros(self.layout.padded)                   # [P * chunk]
        torch.cat([t.reshape(-1) for t in tensors], out=flat[:self.layout.numel])
        return flat

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        params = group["params"]
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], \
            group["weight_decay"]
        start, end = self.layout.range(self.rank)
        grad = self._flat([p.grad if p.grad is not None else torch.zeros_like(p)
                           for p in params])[start:end]         # [chunk]
        flat = self._flat([p.detach() for p in params])          # [P * chunk]
        mine = flat[start:end].clone()                           # [chunk]
        self.step_count += 1
        mine.mul_(1 - lr * decay)
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1, bias2 = 1 - beta1 ** self.step_count, 1 - beta2 ** self.step_count
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
        mine.addcdiv_(self.exp_avg, denom, value=-lr / bias1)
        if self.layout.world_size > 1:
            pieces = [torch.empty(self.layout.chunk) for _ in range(self.layout.world_size)]
            dist.all_gather(pieces, mine)                        # P x [chunk] -> [P * chunk]
            flat = torch.cat(pieces)
        else:
            flat = mine
        for name, p in zip(self.layout.names, params):
            offset = self.layout.offsets[name]
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
        return None
