"""Lab 2's graded wrong answers (issue 26), two submissions of one or two mistakes per task (14
points: task 1 2 + 1 + 1 + 1, task 2 1 + 1 + 1 + 1, task 3 2 + 1 + 1 + 1). Each mistake alone
loses exactly the cells named here; tests/chapters/test_ch02_data_parallel.py runs every one alone
(with more that labkit grade does not grade: issue 32's a rank without a microbatch that runs no
backward, buckets rebuilt in the reverse of model.parameters() (fails only the hidden model that
uses its blocks in another order), buckets fixed before the first step, the recorded order
reversed, every rank cutting buckets from its own order).

"means_empty_replicas_no_overlap" (7 of 14):
- task 1: the mean of microbatch means (test_task1_gradients, 2) and no error for an empty global
  batch (test_task1_empty_batch, 1);
- task 2: replicas counted once per copy (test_task2_norm and test_task2_clipped_step, 1 + 1);
- task 3: everything all-reduced from finish(), nothing during backward (test_task3_overlap and
  test_task3_buckets, 1 + 1).
"every_sync_own_loss_dtype_no_skip_missing_frozen" (7 of 14):
- task 1: every microbatch synchronised (test_task1_one_synchronisation, 1) and this rank's own
  loss logged (test_task1_logged_loss, 1);
- task 2: the dtype argument ignored (test_task2_norm_dtype, 1) and a non-finite norm stepped
  with anyway (test_task2_skipped_step, 1);
- task 3: a missing gradient is an error and the step's state is kept
  (test_task3_missing_gradients_and_failures, 1) and the frozen parameters bucketed too
  (test_task3_values, 2: only its hidden case freezes a block)."""
from wrong_answers import swap

CELLS3 = ["test_task3_values", "test_task3_missing_gradients_and_failures", "test_task3_overlap",
          "test_task3_buckets"]

# name: (old, new) edits of the solution's answer cell, and the cells the mistake alone must fail
TASK1 = {
    "the mean of microbatch means (the habit from one GPU)": (
        ("            (total * (R / tokens)).backward()          # DDP divides the summed gradients by R\n",
         "            n = dp.count_tokens(microbatch)\n"
         "            (total / max(n, 1) / len(microbatches)).backward()\n"),
        {"test_task1_gradients"}),
    "every microbatch synchronised (no no_sync)": (
        ("        with contextlib.nullcontext() if last else ddp_model.no_sync():   # one sync, at the end\n",
         "        with contextlib.nullcontext():\n"),
        {"test_task1_one_synchronisation"}),
    "this rank's own loss logged": (
        ("    dist.all_reduce(logged)                            # sum of all token losses, for the log\n"
         "    return (logged / tokens).item()\n",
         "    mine = sum(dp.count_tokens(mb) for mb in microbatches)\n"
         "    return (logged / max(mine, 1)).item()\n"),
        {"test_task1_logged_loss"}),
    "no error for an empty global batch": (
        ("    if tokens == 0:\n", "    if tokens < 0:\n"),
        {"test_task1_empty_batch"}),
    "a rank without a microbatch runs no backward (the others wait in DDP's all-reduce)": (
        ("    pieces = microbatches or [[]]                      # no data: one empty backward, to join DDP\n",
         "    pieces = microbatches\n"),
        {"test_task1_gradients"}),
}

TASK2 = {
    "replicas counted once per copy": (
        ("square().sum() / copies", "square().sum()"), {"test_task2_norm", "test_task2_clipped_step"}),
    "the dtype argument ignored": (
        ("        squares += grad.detach().to(device=device, dtype=dtype).square().sum() / copies\n",
         "        squares += grad.detach().to(device=device, dtype=torch.float32).square().sum() / copies\n"),
        {"test_task2_norm_dtype"}),
    "clipping by rebinding list entries": (
        ("            g.mul_(scale)\n            p.sub_(lr * g)\n",
         "            pass\n"
         "        for i in range(len(grads)):\n"
         "            grads[i] = grads[i] * scale\n"
         "            params[i] = params[i] - lr * grads[i]\n"),
        {"test_task2_clipped_step"}),
    "each rank skips on its own NaN": (
        ("    norm = global_grad_norm(grads, replicas, device)\n",
         "    if any(not torch.isfinite(g).all() for g in grads):\n"
         "        return torch.tensor(float('nan'))        # skips the collective: the others wait\n"
         "    norm = global_grad_norm(grads, replicas, device)\n"),
        {"test_task2_skipped_step"}),
    "a non-finite norm stepped with anyway": (
        ("    if not torch.isfinite(norm):            # the same norm on every rank: all of them skip\n",
         "    if False:\n"),
        {"test_task2_skipped_step"}),
}

TASK3 = {
    "all-reduced after backward, in finish() (no overlap)": (
        ("        while self.next_to_send < len(self.buckets) and self.missing[self.next_to_send] == 0:\n"
         "            self._send(self.next_to_send)\n",
         "        pass                                   # everything is sent from finish()\n"),
        {"test_task3_overlap", "test_task3_buckets"}),
    "one bucket per parameter, whatever bucket_bytes says": (
        ("            if size >= self.bucket_bytes:          # this bucket is full: start the next one\n",
         "            if True:\n"),
        {"test_task3_buckets"}),
    "buckets rebuilt after the first step, but in the reverse of model.parameters()": (
        ("        mine = self.recorded + [p for p in reversed(self.params) if p not in seen]\n",
         "        mine = list(reversed(self.params))\n"),
        {"test_task3_overlap", "test_task3_buckets"}),
    "buckets fixed before the first step, reverse of model.parameters() (the second edition)": (
        ("        self.recorded = []                  # first step: parameters in arrival order\n",
         "        self.recorded = []\n"
         "        self._build_buckets()               # guessed before any gradient arrived\n"),
        {"test_task3_overlap", "test_task3_buckets"}),
    "the recorded order reversed": (
        ("        mine = self.recorded + [p for p in reversed(self.params) if p not in seen]\n",
         "        mine = self.recorded[::-1] + [p for p in reversed(self.params) if p not in seen]\n"),
        {"test_task3_overlap", "test_task3_buckets"}),
    "every rank cuts buckets from its own order (rank 0's not broadcast)": (
        ("        dist.broadcast(order, src=0)               # DDP: sync_bucket_indices, rank 0's order\n",
         ""),
        {"test_task3_missing_gradients_and_failures"}),
    "a missing gradient is an error, and the step's state is kept (the first edition)": (
        ("        try:\n            if self.buckets is None:\n",
         "        if self.buckets is not None and self.next_to_send < len(self.buckets):\n"
         "            raise RuntimeError('a parameter got no gradient')   # the step's state stays\n"
         "        try:\n            if self.buckets is None:\n"),
        {"test_task3_missing_gradients_and_failures"}),
    "averages never divided by the world size": (
        ("                flat = self.flats[i] / self.world_size\n",
         "                flat = self.flats[i].clone()\n"),
        set(CELLS3)),
    "every bucket all-reduced twice (right values, twice the bytes)": (
        ("        self.in_flight.append((i, dist.all_reduce(flat, async_op=True)))\n",
         "        dist.all_reduce(flat)\n"
         "        flat /= self.world_size\n"
         "        self.in_flight.append((i, dist.all_reduce(flat, async_op=True)))\n"),
        {"test_task3_buckets"}),
    "frozen parameters bucketed too (they never get a gradient)": (
        ("        self.params = [p for p in model.parameters() if p.requires_grad]   # creation order\n",
         "        self.params = list(model.parameters())\n"),
        {"test_task3_values"}),
    "no_sync ignored": (
        ("        previous, self.syncing = self.syncing, False\n",
         "        previous = self.syncing\n"),
        set(CELLS3)),
}

WRONG = {
    "means_empty_replicas_no_overlap": ({
        "task1_accumulation_step": swap(TASK1["the mean of microbatch means (the habit from one GPU)"][0],
                                        TASK1["no error for an empty global batch"][0]),
        "task2_norm_and_step": swap(TASK2["replicas counted once per copy"][0]),
        "task3_bucketed_grad_sync": swap(TASK3["all-reduced after backward, in finish() (no overlap)"][0]),
    }, None, 7),
    "every_sync_own_loss_dtype_no_skip_missing_frozen": ({
        "task1_accumulation_step": swap(TASK1["every microbatch synchronised (no no_sync)"][0],
                                        TASK1["this rank's own loss logged"][0]),
        "task2_norm_and_step": swap(TASK2["the dtype argument ignored"][0],
                                    TASK2["a non-finite norm stepped with anyway"][0]),
        "task3_bucketed_grad_sync": swap(TASK3["a missing gradient is an error, and the step's state is kept (the first edition)"][0],
                                         TASK3["frozen parameters bucketed too (they never get a gradient)"][0]),
    }, None, 7),
}
