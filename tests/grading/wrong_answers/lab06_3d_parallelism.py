"""Lab 6's graded wrong answers (issue 26). Each is a function of an answer cell's solution source
that returns the wrong one; tests/chapters/test_ch06_3d_parallelism.py runs every one of them alone
(lab_notebooks.run_lab) and asserts the cells it loses, exactly:

    FLOAT_DEGREE         task 1  loses test_task1_errors (1): degrees checked by `size < 1` only,
                                 so {"tp": 2.0} with the right product is laid out, not refused
    GROUPS_BY_NAME       task 1  loses test_task1_layout (2): each axis's groups keyed by the other
                                 axes' coordinates in alphabetical order, not in the mesh's order
                                 (right groups, listed in the wrong order)
    NO_NODE_CHECK        task 1  loses test_task1_nodes (1): gpus_per_node checked for dividing the
                                 world, never against the tp groups
    OPTIMIZER_DROPPED    task 2  loses test_task2_step, test_task2_replicated, test_task2_tied and
                                 test_task2_clipped (5): `optimizer` never handed to mesh.Zero1,
                                 whose default is AdamW; wrong wherever the tests ask for SGD,
                                 right on the traffic cell (AdamW)
    TIED_ALWAYS          task 2  loses test_task2_step, test_task2_replicated and
                                 test_task2_traffic (5): the embedding and the head summed across
                                 pp whether or not they are tied (`tied` never read; the clipped
                                 cell's meshes with a pipeline are all tied, so it passes)
    TIED_NOT_SUMMED      task 2  loses test_task2_tied, test_task2_traffic and test_task2_clipped
                                 (4): the two copies of the tied embedding each stepped with their
                                 own gradient
    TIED_COUNTED_TWICE   task 2  loses test_task2_clipped (1): the clip's norm counts the tied
                                 embedding on the first and on the last stage (issue 29: torch's
                                 clip_grad_norm_ in one process counts the one parameter once)
    PLAIN_DATA_PARALLEL  task 2  loses test_task2_traffic and test_task2_clipped (3): gradients
                                 all-reduced over dp, one whole optimizer on every rank (ZeRO-1's
                                 values and bytes), and no clipping
    ZERO1_ONLY           task 3  loses test_task3_choice (2): the search restricted to ZeRO-1
    LIMIT_IGNORED        task 3  loses test_task3_memory (1): every configuration judged against
                                 the GPU's own memory, not `memory_limit`

Five submissions of 14 points, one wrong answer per task each."""
from wrong_answers import swap


FLOAT_DEGREE = swap(
    ("        if isinstance(size, bool) or not isinstance(size, int) or size < 1:",
     "        if size < 1:"))

GROUPS_BY_NAME = swap(
    ("            lines.setdefault(tuple(c[a] for a in axes if a != axis), []).append(rank)",
     "            lines.setdefault(tuple(c[a] for a in sorted(axes) if a != axis), []).append(rank)"),
    ("        groups[axis] = sorted(lines.values())",
     "        groups[axis] = [group for _, group in sorted(lines.items())]"))

NO_NODE_CHECK = swap(('    if gpus_per_node is not None and "tp" in degrees:', "    if False:"))

OPTIMIZER_DROPPED = swap(
    ("    zero1 = mesh.Zero1(stage.parameters(), dp_group, optimizer)\n",
     "    zero1 = mesh.Zero1(stage.parameters(), dp_group)\n"))

TIED_ALWAYS = swap(("    if tied and pp > 1:\n", "    if pp > 1:\n"))

TIED_COUNTED_TWICE = swap(
    ("\n                        and not (tied_group is not None and last and p is stage.head.weight)))",
     "))"))

TIED_NOT_SUMMED = swap(
    ("            dist.all_reduce(copy.grad, group=tied_group)\n",
     "            pass                               # each copy steps with its own gradient\n"))

PLAIN_DATA_PARALLEL = swap(
    ("    zero1 = mesh.Zero1(stage.parameters(), dp_group, optimizer)\n",
     "    params = [p for p in stage.parameters() if p.requires_grad]\n"
     "    master = torch.cat([mesh.local(p).detach().reshape(-1) for p in params]).clone()\n"
     "    master.requires_grad_(True)\n"
     "    whole = mesh.model.make_optimizer([master], optimizer)   # all of it, on every rank\n"),
    ("        grad = zero1.reduce_gradients(scale=1.0)   # reduce-scatter over dp (a sum): my 1/dp\n"
     "        if max_norm is not None:\n",
     "        if False:                              # no ZeRO-1 shard to clip: not clipped\n"),
    ("        zero1.apply()                          # step my slice, all-gather over dp\n"
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

LIMIT_IGNORED = swap(("memory_limit=memory_limit)", "memory_limit=None)"))

POINTS = 14
WRONG = {
    "shortcut-per-task": ({"task1_mesh_layout": FLOAT_DEGREE,
                           "task2_train_3d": PLAIN_DATA_PARALLEL,
                           "task3_choose_config": ZERO1_ONLY}, None, POINTS - 1 - 3 - 2),
    "wrong-groups-optimizer-limit": ({"task1_mesh_layout": GROUPS_BY_NAME,
                                      "task2_train_3d": OPTIMIZER_DROPPED,
                                      "task3_choose_config": LIMIT_IGNORED},
                                     None, POINTS - 2 - 5 - 1),
    "wrong-nodes-tied": ({"task1_mesh_layout": NO_NODE_CHECK,
                          "task2_train_3d": TIED_NOT_SUMMED}, None, POINTS - 1 - 4),
    "wrong-tied-always": ({"task2_train_3d": TIED_ALWAYS}, None, POINTS - 5),
    "wrong-clip-tied-twice": ({"task2_train_3d": TIED_COUNTED_TWICE}, None, POINTS - 1),
}

# the test cells no graded wrong answer of this module fails yet (test_labs checks it exactly)
UNCOVERED = []
