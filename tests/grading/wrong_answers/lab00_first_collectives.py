"""Lab 0's graded wrong answers (issue 26), two submissions of one wrong answer per task (7 points:
task 1 2, task 2 1 + 1, task 3 2 + 1):

"extras_last_vague_float32" (2 of 7):
- task 1, test_task1_shard_bounds (2): the leftover items go to the last rank (even to within one,
  covering, but not what the task asks: the first `n % P` ranks take one more);
- task 2, test_task2_length_message (1): a ValueError that says the lengths differ, not what each
  rank passed;
- task 3, test_task3_global_mean (2): the sum and the count all-reduced in float32 (digits lost).
"no_op_check_no_error" (5 of 7):
- task 2, test_task2_all_reduce_result (1): an unknown op taken for a sum instead of refused;
- task 3, test_task3_no_values (1): 0.0 returned when no rank holds a value, instead of ValueError.
The answers that always refuse (task 2 and task 3), which the ordinary input beside each refusal
now fails, and the mean of per-rank means are run alone in tests/chapters/test_ch00_lab_environment.py."""
from wrong_answers import swap

EXTRAS_LAST = swap((
    "    start = rank * base + min(rank, extra)\n"
    "    return start, start + base + (1 if rank < extra else 0)\n",
    "    start = rank * base\n"
    "    return start, start + base + (extra if rank == world_size - 1 else 0)\n"))

VAGUE = swap(('raise ValueError(f"every rank must pass the same number of values; per rank: {lengths}")',
              'raise ValueError("the ranks passed different numbers of values")'))

FLOAT32 = swap(("local_values.double().sum().item()", "local_values.float().sum().item()"),
               ("dtype=torch.float64, device=labkit.device())   # totals: [2]",
                "dtype=torch.float32, device=labkit.device())   # totals: [2]"))

ANY_OP_IS_A_SUM = swap(("    if op not in reducers:\n"
                        "        raise ValueError(f\"op must be one of {sorted(reducers)}, got {op!r}\")\n",
                        "    reducers.setdefault(op, sum)\n"))

NO_ERROR = swap(('        raise ValueError("no rank holds a value: the global mean is undefined")',
                 "        return 0.0"))

WRONG = {
    "extras_last_vague_float32": ({"task1_shard_bounds": EXTRAS_LAST,
                                   "task2_all_reduce_result": VAGUE,
                                   "task3_global_mean": FLOAT32}, None, 2),
    "no_op_check_no_error": ({"task2_all_reduce_result": ANY_OP_IS_A_SUM,
                              "task3_global_mean": NO_ERROR}, None, 5),
}
