"""Lab 6's graded wrong answers (issue 26), one submission with one shortcut per task, each of
which passed every cell before this round:

- task 1, `float_degree`: degrees checked by `size < 1` only, so {"tp": 2.0} with the right
  product is laid out instead of refused: fails test_task1_errors (1 point);
- task 2, plain data parallelism where ZeRO-1 is required (gradients all-reduced over dp, one
  whole optimizer on every rank): same values, same bytes; fails test_task2_traffic, which now
  judges the optimizer state each rank holds (2 points);
- task 3, the search restricted to ZeRO-1: fails test_task3_choice, whose hidden cases now have
  optima at ZeRO-3 (2 points).

13 - 1 - 2 - 2 = 8. The other cells' wrong answers are in tests/chapters/test_ch06_3d_parallelism.py
(run_lab, no nbgrader)."""
from wrong_answers import swap



FLOAT_DEGREE = swap(
    ("        if isinstance(size, bool) or not isinstance(size, int) or size < 1:",
     "        if size < 1:"))

PLAIN_DATA_PARALLEL = swap(
    ("    zero1 = mesh.Zero1(stage.parameters(), dp_group, optimizer)\n",
     "    params = [p for p in stage.parameters() if p.requires_grad]\n"
     "    master = torch.cat([mesh.local(p).detach().reshape(-1) for p in params]).clone()\n"
     "    master.requires_grad_(True)\n"
     "    whole = mesh.model.make_optimizer([master], optimizer)   # all of it, on every rank\n"),
    ("        zero1.step(scale=1.0)                  # reduce-scatter over dp (a sum), step, all-gather\n"
     "        zero1.zero_grad()\n",
     "        with torch.no_grad():\n"
     "            flat = torch.cat([(mesh.local(p.grad) if p.grad is not None\n"
     "                               else torch.zeros_like(mesh.local(p))).reshape(-1) for p in params])\n"
     "            dist.all_reduce(flat, group=dp_group)                # [N]: the whole gradient\n"
     "            master.grad = flat\n"
     "            whole.step()\n"
     "            master.grad = None\n"
     "            offset = 0\n"
     "            for p in params:\n"
     "                t = mesh.local(p)\n"
     "                t.copy_(master[offset:offset + t.numel()].view_as(t))\n"
     "                offset += t.numel()\n"
     "        for p in params:\n"
     "            p.grad = None\n"))

ZERO1_ONLY = swap(("                for stage in range(4):", "                for stage in (1,):"))

WRONG = {
    "shortcut-per-task": ({"task1_mesh_layout": FLOAT_DEGREE,
                           "task2_train_3d": PLAIN_DATA_PARALLEL,
                           "task3_choose_config": ZERO1_ONLY}, None, 8),
}

# the test cells no graded wrong answer of this module fails yet (test_labs checks it exactly)
UNCOVERED = [
    'test_task1_layout',
    'test_task1_nodes',
    'test_task2_step',
    'test_task2_replicated',
    'test_task2_tied',
    'test_task3_memory',
]
