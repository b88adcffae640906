"""Node-limited dispatch: the bytes that cross between nodes (chapter 7, section 5).

    from labkit.moe import nodes
    nodes.cross_node_rows(owners, home_rank=r, ranks_per_node=G)      # {"per_copy", "per_node"}
    nodes.expected_remote_nodes(experts=256, top_k=8, nodes=8)        # uniform routing, per token

A token on rank r whose K experts live on ranks `owners[t]` (a row of [N, K]) crosses the
inter-node network

  - once per copy whose owner sits on another node, when every copy goes straight to its expert
    (a flat all-to-all over every rank): sum_t #{j : node(owners[t, j]) != node(r)};
  - once per *other node* that holds at least one of its experts, when it is sent over
    InfiniBand once per target node and forwarded inside that node over NVLink (DeepSeek-V3's
    node-limited routing, at most M = 4 nodes per token, with DeepEP's normal kernels;
    DeepSeek-V3 Technical Report, arXiv:2412.19437, sections 2.1.2 and 3.2):
    sum_t #{node(owners[t, j]) : j} \\ {node(r)}.

node(q) = q // G with G ranks per node. A row costs H * itemsize bytes on the wire, plus what
travels with it (which expert, which token).
"""
from __future__ import annotations

import math

import torch


def node_of(rank, ranks_per_node: int):
    """The node of `rank` (an int or a tensor) when nodes hold `ranks_per_node` consecutive ranks."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    return rank // ranks_per_node


def cross_node_rows(owners, home_rank: int, ranks_per_node: int) -> dict:
    """Rows rank `home_rank` sends to other nodes, for owners [N, K] (the rank of each copy's expert).

    Returns {"per_copy": copies whose expert is on another node (a flat all-to-all),
             "per_node": (token, other node) pairs (once per target node, then forwarded)}.
    """
    owners = torch.as_tensor(owners)
    if owners.dim() != 2:
        raise ValueError(f"owners must be [N, K] (the rank of each token's K experts), got shape "
                         f"{tuple(owners.shape)}")
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    node = owners // ranks_per_node                                   # [N, K]
    home = home_rank // ranks_per_node
    remote = node != home                                             # [N, K]
    if owners.numel() == 0:
        return {"per_copy": 0, "per_node": 0}
    n_nodes = int(node.max()) + 1
    hit = torch.zeros(owners.size(0), max(n_nodes, home + 1), dtype=torch.bool)
    hit.scatter_(1, node, True)                                       # [N, nodes]
    hit[:, home] = False
    return {"per_copy": int(remote.sum()), "per_node": int(hit.sum())}


def expected_remote_nodes(experts: int, top_k: int, nodes: int) -> dict:
    """Per token, uniform top-K routing over E experts spread evenly over `nodes` nodes:

        copies to other nodes   = K (nodes - 1) / nodes
        other nodes reached     = (nodes - 1) * (1 - C(E - E/nodes, K) / C(E, K))

    (a node is missed when all K distinct experts fall among the E - E/nodes elsewhere).
    Node-limited routing caps the second at M - 1 when the token's own node is among its M.
    """
    if experts < 1 or top_k < 1 or top_k > experts or nodes < 1 or experts % nodes:
        raise ValueError(f"need 1 <= top_k <= experts and experts a multiple of nodes; got "
                         f"experts={experts}, top_k={top_k}, nodes={nodes}")
    miss = math.comb(experts - experts // nodes, top_k) / math.comb(experts, top_k)
    return {"per_copy": top_k * (nodes - 1) / nodes, "per_node": (nodes - 1) * (1 - miss)}
