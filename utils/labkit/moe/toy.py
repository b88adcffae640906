"""A tiny MoE regression task whose router can be trained in a second or two on a CPU, to watch
real routers balance or collapse (chapter 7, section 3).

    from labkit.moe import toy
    history = toy.train(steps=150)                                   # no balancing
    history = toy.train(steps=150, aux_loss=my_aux_loss)             # an auxiliary loss
    history = toy.train(steps=150, bias_update=my_bias_update)       # DeepSeek-V3's bias
    history["load"][-1]                                              # tokens per expert, last step

The task: tokens come from a few clusters; the target is one linear map shared by all of them,
so any expert can learn it. Nothing in the task asks for the work to be spread, which is what
makes an unbalanced router collapse: the expert that is a little ahead gets more tokens, learns
faster, and gets more tokens still.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from labkit.moe import route


def train(steps: int = 150, experts: int = 8, top_k: int = 2, hidden: int = 16,
          tokens: int = 256, seed: int = 0, aux_loss=None, bias_update=None,
          lr: float = 3e-2) -> dict:
    """Train router and experts with Adam; return per-step {"task_loss", "load", "bias"}.

    aux_loss(probs [N, E], chosen [N, K]) -> 0-dim tensor, added to the task loss.
    bias_update(bias [E], load [E]) -> new bias [E], applied after each step; the router then
    selects by probs + bias (weights still from the probabilities: `moe.route`).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)              # tiny ops: threads only cost time here
    try:
        return _train(steps, experts, top_k, hidden, tokens, seed, aux_loss, bias_update, lr)
    finally:
        torch.set_num_threads(threads)


def _train(steps, experts, top_k, hidden, tokens, seed, aux_loss, bias_update, lr):
    data = torch.Generator().manual_seed(seed)
    clusters = 8
    centers = torch.randn(clusters, hidden, generator=data)                      # [C, H]
    target_map = torch.randn(hidden, hidden, generator=data) / math.sqrt(hidden)  # [H, H]
    init = torch.Generator().manual_seed(seed + 1)
    router = torch.nn.Parameter(torch.randn(hidden, experts, generator=init) / math.sqrt(hidden))
    expert_maps = torch.nn.Parameter(torch.randn(experts, hidden, hidden, generator=init) * 0.02)
    optimizer = torch.optim.Adam([router, expert_maps], lr=lr)
    bias = torch.zeros(experts)
    history = {"task_loss": [], "load": [], "bias": []}
    for _ in range(steps):
        which = torch.randint(0, clusters, (tokens,), generator=data)
        x = centers[which] + 0.5 * torch.randn(tokens, hidden, generator=data)  # x: [N, H]
        logits = x @ router                                                      # [N, E]
        weights, chosen = route(logits, top_k, bias if bias_update else None)   # [N, K]
        every_expert = torch.einsum("nh,ehd->ned", x, expert_maps)               # [N, E, H]
        picked = every_expert.gather(1, chosen[..., None].expand(-1, -1, hidden))  # [N, K, H]
        y = (weights[..., None] * picked).sum(dim=1)                             # [N, H]
        task_loss = F.mse_loss(y, x @ target_map)
        loss = task_loss
        if aux_loss is not None:
            loss = loss + aux_loss(logits.softmax(dim=-1), chosen)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        load = torch.bincount(chosen.reshape(-1), minlength=experts)             # [E]
        if bias_update is not None:
            bias = bias_update(bias, load).detach()
        history["task_loss"].append(task_loss.item())
        history["load"].append(load.tolist())
        history["bias"].append(bias.tolist())
    return history
