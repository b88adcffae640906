"""Lab 7, task 2: checkers of the expert-parallel layer (re-exported by `labkit.moe.checks`).

    check_ep_layer(world, ep_moe_layer, experts_per_rank=2, top_k=2)   # outputs and gradients
    check_ep_traffic(world, ep_moe_layer)                              # bytes between every pair

Each rank gets its tokens, the upstream gradient, the replicated router and its own experts only;
the single-process reference (every expert in one process) is computed here.
"""
from __future__ import annotations

import torch

from labkit import checks
from labkit.moe import route
from labkit.moe.ep import owner, reference_layer

ROW_METADATA_BYTES = 16      # per dispatched row: an expert id and a weight travelling along, say
FRAMING_MESSAGES = 12        # all-to-alls a step may use per pair (counts, ids, data, backward)


def _ep_program(share, layer):
    """On a rank: forward and backward of layer(x, router, local_experts, top_k)."""
    from labkit import device
    dev = device()
    x = share["x"].to(dev).requires_grad_(True)
    router = share["router"].to(dev).requires_grad_(True)
    local = share["local_experts"].to(dev).requires_grad_(True)
    y = layer(x, router, local, share["top_k"])
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        raise TypeError(f"rank {share['rank']}: the layer returned "
                        f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}, "
                        f"expected a tensor of x's shape {tuple(x.shape)}")
    (y * share["grad_y"].to(dev)).sum().backward()
    grad = lambda t: (t.grad if t.grad is not None else torch.zeros_like(t)).detach()
    return {"y": y.detach(), "x": grad(x), "router": grad(router), "experts": grad(local)}


def ep_case(case, world_size, experts_per_rank=2, top_k=2, hidden=16, dtype="float64",
            tokens=None, empty_experts=0, idle_rank=False, no_tokens_rank=False):
    """Shares for the EP checks: rank r's tokens, upstream gradient and own experts; the router
    is replicated. Tokens per rank are random (or `tokens`). `empty_experts`: that many experts
    (or these expert ids) that no token selects; `idle_rank`: every expert of the last rank is
    such an expert (it receives nothing); `no_tokens_rank`: rank 0 holds no token."""
    P, E = world_size, world_size * experts_per_rank
    counts = list(tokens) if tokens is not None else [case.integer(4, 24) for _ in range(P)]
    if no_tokens_rank:
        counts[0] = 0
    hidden_dtype = getattr(torch, dtype)
    router = case.normal((hidden, E), "float64", scale=hidden ** -0.5)
    unused = (set(case.permutation(E)[:empty_experts]) if isinstance(empty_experts, int)
              else set(empty_experts))
    if idle_rank and P > 1:
        unused |= set(range((P - 1) * experts_per_rank, E))
    if len(unused) > E - top_k:
        raise ValueError(f"{len(unused)} unused experts leave fewer than top_k = {top_k}")
    router[:, sorted(unused)] = 0.0
    if unused:
        router[-1, sorted(unused)] = -50.0
    experts = case.normal((E, hidden, hidden), dtype, scale=hidden ** -0.5)
    shares = []
    for rank in range(P):
        x = case.normal((counts[rank], hidden), "float64")
        if unused:   # a constant feature whose weight for the unused experts is very negative
            x[:, -1] = 1.0
        shares.append({"rank": rank, "x": x.to(hidden_dtype), "top_k": top_k,
                       "grad_y": case.normal((counts[rank], hidden), dtype),
                       "local_experts": experts[rank * experts_per_rank:
                                                (rank + 1) * experts_per_rank].clone()})
    router = router.to(hidden_dtype)
    for share in shares:
        share["router"] = router.clone()
    return shares, router, experts


def _ep_expected(shares, router, experts, top_k):
    x = torch.cat([s["x"] for s in shares]).requires_grad_(True)
    r = router.clone().requires_grad_(True)
    w = experts.clone().requires_grad_(True)
    y = reference_layer(x, r, w, top_k)
    (y * torch.cat([s["grad_y"] for s in shares])).sum().backward()
    sizes = [s["x"].size(0) for s in shares]
    router_grads = []
    for share in shares:           # the router is replicated: rank r's gradient is its tokens'
        rr = router.clone().requires_grad_(True)
        yy = reference_layer(share["x"], rr, experts, top_k)
        (yy * share["grad_y"]).sum().backward()
        router_grads.append(rr.grad)
    per_rank = experts.size(0) // len(shares)
    pieces = zip(y.split(sizes), x.grad.split(sizes), router_grads)
    return [{"y": ys.detach(), "x": xs, "router": rg,
             "experts": w.grad[i * per_rank:(i + 1) * per_rank]}
            for i, (ys, xs, rg) in enumerate(pieces)]


def _routing_counts(shares, router, experts_total, top_k):
    """counts[r][q]: rows (token, expert) rank r dispatches to rank q; unique[r][q]: tokens."""
    P = len(shares)
    counts, unique = [[0] * P for _ in range(P)], [[0] * P for _ in range(P)]
    for r, share in enumerate(shares):
        if share["x"].size(0) == 0:
            continue
        _, chosen = route(share["x"] @ router, top_k)
        dest = owner(chosen, experts_total, P)                       # [N, K]
        for q in range(P):
            counts[r][q] = int((dest == q).sum())
            unique[r][q] = int((dest == q).any(dim=1).sum())
    return counts, unique


def check_ep_layer(world, layer, experts_per_rank=2, top_k=2, hidden=16, dtype="float64",
                   tokens=None, empty_experts=0, idle_rank=False, no_tokens_rank=False,
                   timeout=60, seed=None):
    """The layer on every rank equals the single-process layer: outputs, gradients of the tokens,
    of the (replicated) router from this rank's tokens, and of this rank's experts."""
    P = world.size
    case = checks.Case(f"lab 7 task 2: EP layer on {P} ranks, {experts_per_rank} experts per "
                       f"rank, top-{top_k}, {dtype}" + (", an expert nobody picks" if empty_experts
                                                         else "") +
                       (", a rank that receives nothing" if idle_rank else "") +
                       (", a rank without tokens" if no_tokens_rank else ""), seed)
    shares, router, experts = ep_case(case, P, experts_per_rank, top_k, hidden, dtype, tokens,
                                      empty_experts, idle_rank, no_tokens_rank)
    results = world.run_each(_ep_program, shares, layer, timeout=timeout)
    checks.one_result_per_rank(results, P, case, "the EP layer")
    expected = _ep_expected(shares, router, experts, top_k)
    rtol, atol = {"float64": (1e-9, 1e-11), "float32": (1e-4, 1e-5)}[dtype]
    hints = {"y": "route with moe.route(x @ router, top_k), send each (token, expert) row to the "
                  "expert's owner (rank expert // (E/P)), apply local expert i of that rank, "
                  "send the result back and weigh it by its gate",
             "x": "are both all-to-alls differentiable (moe.ep.all_to_all), so that gradients "
                  "travel back along the rows' paths?",
             "router": "the router's gradient reaches it through the gate weights: weigh the "
                       "returned outputs by them on the token's own rank",
             "experts": "each local expert must see exactly the rows routed to it, from every "
                        "rank (and none when nobody picked it)"}
    if empty_experts or idle_rank:
        silent = sorted(e for e in range(P * experts_per_rank)
                        if not any((route(s["x"] @ router, top_k)[1] == e).any() for s in shares))
        hints["y"] += (f" (here experts {silent} get no row at all: when you group the received "
                       "rows by local expert, an expert with no row must still have its (empty) "
                       "group, or the experts after it take the wrong rows)")
    for rank, (got, want) in enumerate(zip(results, expected)):
        for key in ("y", "router", "x", "experts"):   # router before x: x's gradient also flows
            # through the gates, and a detached gate is named by the router's hint, not x's
            what = f"rank {rank}'s " + ("output" if key == "y" else f"{key} gradient")
            hint = hints[key]
            if key == "router" and not got[key].any() and want[key].any():
                hint = ("the router got no gradient at all: are the gate weights detached (or "
                        "taken out of the graph by .item(), .tolist() or torch.no_grad)? " + hint)
            checks.check(got[key].cpu(), want[key], what, rtol=rtol, atol=atol, case=case,
                         hint=hint)
    return results


def check_ep_traffic(world, layer, experts_per_rank=2, top_k=2, hidden=None, dtype="float64",
                     empty_experts=0, idle_rank=False, no_tokens_rank=False, timeout=60,
                     seed=None):
    """Bytes rank r sends rank q, forward and backward, are those of the rows routed between them
    (uneven splits), not of splits padded to the largest count: between the 2 (c[r][q] + c[q][r])
    rows of a per-assignment exchange and the 2 (u[r][q] + u[q][r]) of one that sends each token
    once per rank, plus a little metadata and gloo's framing. `hidden` is drawn (48 .. 128) unless
    given, and the shapes check_ep_layer judges values on (an expert nobody picks, a rank that
    receives nothing, a rank without tokens) are measured too: a layer that takes another path
    on the shapes whose bytes are not measured is caught (issue 26, class 2)."""
    P = world.size
    case = checks.Case(f"lab 7 task 2: bytes of the EP layer on {P} ranks, {experts_per_rank} "
                       f"experts per rank, top-{top_k}, {dtype}" + (", an expert nobody picks"
                                                                  if empty_experts else "")
                       + (", a rank that receives nothing" if idle_rank else "")
                       + (", a rank without tokens" if no_tokens_rank else ""), seed)
    if hidden is None:
        hidden = 8 * case.integer(6, 16)
    tokens = [case.integer(6, 14) for _ in range(P)]
    tokens[case.integer(0, P - 1)] = 48                     # one rank with many tokens
    shares, router, experts = ep_case(case, P, experts_per_rank, top_k, hidden, dtype, tokens,
                                      empty_experts, idle_rank, no_tokens_rank)
    counts, unique = _routing_counts(shares, router, P * experts_per_rank, top_k)
    row = hidden * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    with world.traffic() as traffic:
        results = world.run_each(_ep_program, shares, layer, timeout=timeout)
    checks.one_result_per_rank(results, P, case, "the EP layer")
    if world.backend != "gloo":
        print(f"check_ep_traffic: bytes are counted on gloo's sockets only; not on {world.backend}")
        return traffic
    problems = []
    for r in range(P):
        for q in range(P):
            if r == q:
                continue
            low = 2 * (unique[r][q] + unique[q][r]) * row
            rows = 2 * (counts[r][q] + counts[q][r])
            high = (rows * (row + ROW_METADATA_BYTES) + 64 * P * experts_per_rank
                    + 2 * FRAMING_MESSAGES * checks.GLOO_BYTES_PER_MESSAGE)
            got = traffic.matrix[r][q]
            if not low <= got <= high:
                problems.append(f"rank {r} sent rank {q} {got} bytes; the rows routed between "
                                f"them ({counts[r][q]} one way, {counts[q][r]} the other, "
                                f"forward and backward) need {rows * row} (at most {high} with "
                                f"metadata and framing, at least {low})")
    if problems:
        raise AssertionError(
            f"the EP layer's traffic is not that of its routed rows [{case}]: "
            + "; ".join(problems[:3]) + ". Rows per destination differ (uneven splits): size "
            "each all_to_all_single by the real counts (exchange them first), never pad every "
            "split to the largest one")
    return traffic
