"""Lab 10's graded wrong answers (issue 26). Each function takes an answer cell's solution source and
returns the wrong one; tests/chapters/test_lab10_long_sequences.py runs every one of them alone
(lab_notebooks.run_lab) and asserts the cells it loses, exactly:

    own_part_dropped    task 1  loses test_task1_grads (3): a block's dK, dV summed over the other
                                ranks' queries only (the owner's own part, kept at step 0, is
                                forgotten); dq right, the ring's bytes right
    direct_exchange     task 1  loses test_task1_ring (2): every rank sends its K, V straight to
                                every rank and each dK, dV part straight to the block's owner:
                                right values and the ring's total bytes at any P, wrong pairs
    expanded_kv         task 2  loses test_task2_refuses and test_task2_bytes (3): K and V
                                expanded to the query heads before the all-to-all (GQA treated as
                                plain multi-head attention), so only the query heads are checked
                                against P and 4 Hq / P heads cross each pair; right values
    positions_in_order  task 2  loses test_task2_values (2): the causal mask built for positions
                                0..T-1 of the gathered sequence, not the balanced split's
    dp_only_gradients   task 3  loses test_task3_bytes (2): the gradient reduced over dp alone,
                                not over the dp x cp ranks that hold the same weights
    zero_over_dp_only   task 3  loses test_task3_memory (2): optimizer states sharded over dp alone

Two submissions of 14 points (one wrong answer per task each), which between them fail every
test cell of the lab while passing a sibling cell of the same task."""
from wrong_answers import swap

own_part_dropped = swap(("return dq, dk_own + dk_rest, dv_own + dv_rest",
                         "return dq, dk_rest, dv_rest"))


def direct_exchange(source: str) -> str:
    start = source.index("    ### BEGIN SOLUTION\n") + len("    ### BEGIN SOLUTION\n")
    end = source.index("    ### END SOLUTION")
    return source[:start] + '''    P, rank = dist.get_world_size(), dist.get_rank()
    T, scale = q.size(2) * P, q.size(-1) ** -0.5
    q_pos = context.positions(T, P, rank, balanced=True)
    rowsum = (dout * out).sum(dim=-1, keepdim=True)
    blocks = {rank: (k, v)}
    incoming = {}
    works = []
    for peer in range(P):                          # K, V straight to every rank
        if peer != rank:
            works += [dist.isend(k.contiguous(), peer), dist.isend(v.contiguous(), peer)]
            incoming[peer] = (torch.empty_like(k), torch.empty_like(v))
            works += [dist.irecv(incoming[peer][0], peer), dist.irecv(incoming[peer][1], peer)]
    for work in works:
        work.wait()
    blocks.update(incoming)
    dq, parts = torch.zeros_like(q), {}
    for owner, (k_block, v_block) in blocks.items():
        k_pos = context.positions(T, P, owner, balanced=True)
        scores = q @ k_block.transpose(-1, -2) * scale
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        weights = torch.exp(scores - lse.unsqueeze(-1))
        d_scores = weights * (dout @ v_block.transpose(-1, -2) - rowsum)
        dq += d_scores @ k_block * scale
        parts[owner] = (d_scores.transpose(-1, -2) @ q * scale, weights.transpose(-1, -2) @ dout)
    dk, dv = parts[rank]
    works, back = [], {}
    for peer in range(P):                          # each part straight to the block's owner
        if peer != rank:
            works += [dist.isend(parts[peer][0].contiguous(), peer),
                      dist.isend(parts[peer][1].contiguous(), peer)]
            back[peer] = (torch.empty_like(k), torch.empty_like(v))
            works += [dist.irecv(back[peer][0], peer), dist.irecv(back[peer][1], peer)]
    for work in works:
        work.wait()
    for dk_part, dv_part in back.values():
        dk, dv = dk + dk_part, dv + dv_part
    return dq, dk, dv
''' + source[end:]


expanded_kv = swap(("    kv_heads = k.size(1)                                                  # k, v: [B, Hkv, T/P, d]\n",
                    "    group = q_heads // k.size(1)                  # GQA as plain attention:\n"
                    "    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)\n"
                    "    kv_heads = q_heads\n"))

positions_in_order = swap((
    "where = torch.cat([context.positions(P * local, P, r, balanced=True) for r in range(P)])",
    "where = torch.arange(P * local)"))

dp_only_gradients = swap((
    "dp_bytes = cost.dp_wire_bytes(psi_rank, replicas, stage, m) if replicas > 1 else 0.0",
    "dp_bytes = cost.dp_wire_bytes(psi_rank, dp, stage, m) if dp > 1 else 0.0"))

zero_over_dp_only = swap(("vocab=model.vocab, dp=replicas,", "vocab=model.vocab, dp=dp,"))

POINTS = 14
WRONG = {
    "wrong_task1_own_dropped_task2_expanded_task3_dp_only": (
        {"task1_ring_backward": own_part_dropped, "task2_ulysses": expanded_kv,
         "task3_predict": dp_only_gradients},
        None, POINTS - 3 - 1 - 2 - 2),
    "wrong_task1_direct_task2_positions_task3_zero_dp": (
        {"task1_ring_backward": direct_exchange, "task2_ulysses": positions_in_order,
         "task3_predict": zero_over_dp_only},
        None, POINTS - 2 - 2 - 2),
}
UNCOVERED = []
