"""Lab 1's graded wrong answers (issue 26), two submissions of one wrong answer per task (10 points:
task 1 2 + 1 + 2, task 2 1 + 1 + 1, task 3 1 + 1):

"direct_all_reduce_one_latency" (6 of 10):
- task 1, test_task1_ring_traffic (2): a direct exchange (every chunk straight to its owner, then
  the reduced chunk to everyone): right values, the ring's byte total at P = 3, not a ring;
- task 2, test_task2_recursive_doubling_partners (1): dist.all_reduce inside (right values, no
  exchange with the partner r XOR 2^k);
- task 3, test_task3_all_to_all_seconds (1): one latency for the whole uneven all_to_all instead
  of one per message (P - 1 of them, empty blocks included).
"alone_any_op_max_ring_steps_own_block" (4 of 10):
- task 1, test_task1_ring_any_world (1) and test_task1_ring_values (2): a world of one rank
  zeroes the tensor, and an unknown op is reduced as a max instead of refused (only the values
  cell asks for "mean"; the traffic cell, which judges the values of its own calls, keeps its
  points);
- task 2, test_task2_recursive_doubling_values (1): max reduced as a sum (the same exchanges);
- task 2, test_task2_crossover (1): the ring counted as P - 1 steps instead of 2 (P - 1);
- task 3, test_task3_all_to_all_rows (1): the rows a rank routes to itself left out of what it
  returns (its own block treated as if it never took part).
test_labs.py's ATTACKS hold lab 1's forged and dodged rings; tests/chapters/test_ch01_collectives.py
runs the direct exchange alone."""
from wrong_answers import swap

DIRECT_EXCHANGE = '''
def ring_all_reduce(tensor, op="sum"):
    """Each rank sends chunk j straight to rank j, reduces its own chunk, sends it to everyone:
    the ring's byte total at P = 3, but not a ring."""
    if op not in ("sum", "max"):
        raise ValueError(op)
    P, rank = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1)
    base, extra = divmod(flat.numel(), P)
    starts = [i * base + min(i, extra) for i in range(P + 1)]
    chunk = lambda i: flat[starts[i]:starts[i + 1]]
    mine = chunk(rank)
    sends = [dist.isend(chunk(q).clone(), q) for q in range(P) if q != rank and chunk(q).numel()]
    for q in range(P):
        if q != rank and mine.numel():
            other = torch.empty_like(mine)
            dist.recv(other, q)
            mine.add_(other) if op == "sum" else torch.maximum(mine, other, out=mine)
    for s in sends:
        s.wait()
    sends = [dist.isend(mine, q) for q in range(P) if q != rank and mine.numel()]
    for q in range(P):
        if q != rank and chunk(q).numel():
            dist.recv(chunk(q), q)
    for s in sends:
        s.wait()
    return tensor
'''

ALL_REDUCE_INSIDE = swap(("    P, rank = dist.get_world_size(), dist.get_rank()\n"
                          "    flat = tensor.view(-1)                                   # flat: [N]\n",
                          "    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == \"sum\" else dist.ReduceOp.MAX)\n"
                          "    return tensor\n"
                          "    P, rank = dist.get_world_size(), dist.get_rank()\n"
                          "    flat = tensor.view(-1)                                   # flat: [N]\n"))

ONE_LATENCY = swap(("    return messages * alpha + busiest * beta",
                    "    return (alpha if messages else 0) + busiest * beta"))

ZEROED_ALONE_ANY_OP = swap(
    ("    if P == 1 or N == 0:\n        return tensor\n",
     "    if P == 1:\n        return tensor.zero_()\n    if N == 0:\n        return tensor\n"),
    ("    if op not in (\"sum\", \"max\"):\n        raise ValueError(f\"op must be 'sum' or 'max', got {op!r}\")\n",
     ""))

MAX_AS_SUM = swap(("            torch.maximum(flat, other, out=flat)", "            flat.add_(other)"))

RING_STEPS_HALF = swap(("    ring_steps = 2 * (world_size - 1)", "    ring_steps = world_size - 1"))

OWN_BLOCK = swap(("    P = dist.get_world_size()\n    order = torch.argsort(dest, stable=True)",
                  "    P = dist.get_world_size()\n    away = dest != dist.get_rank()\n"
                  "    rows, dest = rows[away], dest[away]                     # own rows dropped\n"
                  "    order = torch.argsort(dest, stable=True)"))

WRONG = {
    "direct_all_reduce_one_latency": ({"task1_ring_all_reduce": lambda _: DIRECT_EXCHANGE,
                                       "task2_recursive_doubling": ALL_REDUCE_INSIDE,
                                       "task3_all_to_all": ONE_LATENCY}, None, 6),
    "alone_any_op_max_ring_steps_own_block": ({"task1_ring_all_reduce": ZEROED_ALONE_ANY_OP,
                                        "task2_recursive_doubling": MAX_AS_SUM,
                                        "task2_crossover": RING_STEPS_HALF,
                                        "task3_all_to_all": OWN_BLOCK}, None, 4),
}
