"""Single-process references and validators that lab 7's checkers compare against
(`labkit.moe.checks`). None of them is a lab task: the dense MoE under a mask, the global-batch
balance quantities computed in one process, and the layout of rows after an all-to-all.
"""
from __future__ import annotations

import torch

from labkit.moe import imbalance, route

PLAN_KEYS = ("packed", "tokens_per_expert", "dropped")


def assert_plan_shape(plan, tokens, experts, top_k, hidden, dtype, case) -> None:
    """The plan dispatch returns: a dict with packed [M, H], tokens_per_expert [E] int64 summing
    to M, dropped [N, K] bool."""
    if not isinstance(plan, dict) or any(key not in plan for key in PLAN_KEYS):
        got = sorted(plan) if isinstance(plan, dict) else type(plan).__name__
        raise AssertionError(f"dispatch should return a dict with keys {list(PLAN_KEYS)} (and any "
                             f"others combine needs), got {got} [{case}]")
    packed, per_expert, dropped = (plan[key] for key in PLAN_KEYS)
    if not isinstance(per_expert, torch.Tensor) or per_expert.dtype != torch.int64 \
            or tuple(per_expert.shape) != (experts,):
        raise AssertionError(f"plan['tokens_per_expert'] should be an int64 tensor [E] = "
                             f"[{experts}] (torch.bincount gives one), got "
                             f"{_describe(per_expert)} [{case}]")
    if not isinstance(dropped, torch.Tensor) or dropped.dtype != torch.bool \
            or tuple(dropped.shape) != (tokens, top_k):
        raise AssertionError(f"plan['dropped'] should be a bool tensor [N, K] = [{tokens}, "
                             f"{top_k}], got {_describe(dropped)} [{case}]")
    rows = int(per_expert.sum())
    if not isinstance(packed, torch.Tensor) or tuple(packed.shape) != (rows, hidden) \
            or packed.dtype != dtype:
        raise AssertionError(f"plan['packed'] should be [{rows}, {hidden}] {dtype} (one row per "
                             f"kept assignment: tokens_per_expert sums to {rows}), got "
                             f"{_describe(packed)} [{case}]")
    if rows != int((~dropped).sum()):
        raise AssertionError(f"plan['packed'] has {rows} rows but plan['dropped'] keeps "
                             f"{int((~dropped).sum())} assignments [{case}]")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__


def verify_drops(dropped, weights, chosen, experts, cap, case):
    """Without computing the answer: every expert keeps min(load, C) assignments, and none it
    dropped weighs more than one it kept. Returns None or the first problem as a sentence."""
    for e in range(experts):
        mine = chosen == e                                                 # [N, K]
        load, kept = int(mine.sum()), int((mine & ~dropped).sum())
        want = load if cap is None else min(load, cap)
        if kept != want:
            return (f"expert {e} has {load} assignments and keeps {kept}; with "
                    f"{'no capacity' if cap is None else f'capacity C = {cap}'} it keeps {want}")
        kept_weights, dropped_weights = weights[mine & ~dropped], weights[mine & dropped]
        if len(kept_weights) and len(dropped_weights) \
                and dropped_weights.max() > kept_weights.min():
            t, j = ((weights == dropped_weights.max()) & mine & dropped).nonzero()[0].tolist()
            return (f"expert {e} dropped token {t}'s choice {j} (weight "
                    f"{weights[t, j].item():.4f}) but kept an assignment of weight "
                    f"{kept_weights.min().item():.4f}")
    return None


def dense_moe(x, weights, chosen, kept, expert_maps):
    """y_t = sum_j [kept_tj] w_tj (x_t @ W_{e_tj}): every expert sees every token, under a mask."""
    y = torch.zeros_like(x)                                                # [N, H]
    for e in range(expert_maps.size(0)):
        gate = (weights * ((chosen == e) & kept)).sum(dim=-1, keepdim=True)  # [N, 1]
        y = y + gate.to(x.dtype) * (x @ expert_maps[e])
    return y


def balance_reference(logits, top_k, bias, alpha, gamma) -> dict:
    """One process, the whole batch: load, the auxiliary loss and its gradient, the new bias,
    imbalance. logits [N, E] (float64)."""
    logits = logits.detach().clone().requires_grad_(True)
    n_tokens, experts = logits.shape
    _, chosen = route(logits.detach(), top_k, bias)
    load = torch.bincount(chosen.reshape(-1), minlength=experts)           # [E]
    f = load.double() / (top_k * n_tokens)
    P = logits.softmax(dim=-1).mean(dim=0)                                 # [E]
    aux = alpha * experts * (f * P).sum()
    aux.backward()
    new_bias = bias + gamma * torch.sign(load.double().mean() - load.double())
    return {"load": load, "aux_value": aux.item(), "grad": logits.grad, "bias": new_bias,
            "imbalance": imbalance(load)}


def received_rows(rows_by_rank, counts, rank):
    """What `rank` holds after an all-to-all in which rank r sends counts[r][q] consecutive rows
    of rows_by_rank[r] to rank q: every source's block for `rank`, in source order."""
    pieces = []
    for source, rows in enumerate(rows_by_rank):
        start = sum(counts[source][:rank])
        pieces.append(rows[start:start + counts[source][rank]])
    return torch.cat(pieces)
