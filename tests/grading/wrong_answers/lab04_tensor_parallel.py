"""Lab 4's graded wrong answers (issue 26). Every edit below is a plausible answer that the lab's
hidden tests let through before this round; the chapter test (tests/chapters/test_ch04_*.py)
runs each through the lab's own test cells and asserts exactly which cells it fails, and the
submissions of WRONG carry at most one per task, graded with `labkit grade` at their exact score.

    twice_is_t      task 1: ColumnParallelLinear's shard written as out // 2 (the locked t):
                            fails test_task1_column (at t = 3)
                    task 2: every kv gradient all-reduced over the whole world, zero-padded
                            where a rank does not hold the head (right values, no replica
                            groups): fails test_task2_gqa_traffic only
                    task 3: the loss's backward recomputes the softmax from the saved logits
                            and max, and so reduces the sum again (four reductions of N in
                            all, within the old bound): fails test_task3_ce_traffic
    dense_shortcuts task 1: RowParallelLinear gathers its whole W when the input is whole and
                            takes the dense product (x.grad then needs no collective): fails
                            test_task1_row (the backward that should gather sends nothing)
                    task 2: gqa_placement refuses what Megatron-Core's config check refuses
                            (a t that neither divides nor is divided by the kv heads): fails
                            test_task2_placement only (the attention tests hand the ranks the
                            right placement)
                    task 3: the loss gathers the logits when the vocabulary is small (the
                            traffic cell's are larger): fails test_task3_ce_values
    unsummed        task 2: the replicas of a shared kv head keep their own share of its
                            gradient (no sum over the holders): fails test_task2_gqa_values and
                            test_task2_gqa_traffic (values judged on both), passes the placement

EDITS maps a name to (answer cell's grade_id, [(old, new), ...], extra source appended)."""

# all-gather along `dim` forward, this rank's block of the gradient backward: what a dense
# shortcut needs so that its weight gradients still come out sliced
_GATHER = '''

class _GatherAlong(torch.autograd.Function):
    """all-gather along `dim` forward; this rank's block of the gradient backward."""

    @staticmethod
    def forward(ctx, piece, dim):
        ctx.dim = dim
        pieces = [torch.empty_like(piece) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, piece.contiguous())
        return torch.cat(pieces, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        mine = grad.chunk(dist.get_world_size(), dim=ctx.dim)[dist.get_rank()]
        return mine.contiguous(), None
'''

_CE_CALL = ("    return _VocabParallelCrossEntropy.apply(local_logits, targets, vocab_start, "
            "ignore_index)")

EDITS = {
    # ---- task 1
    "half_column": ("task1_parallel_linear", [(
        'local = _divide(out_features, tp, "out_features")',
        'local = _divide(out_features, 2, "out_features")   # t written as 2')], ""),
    "half_row": ("task1_parallel_linear", [(
        'local = _divide(in_features, tp, "in_features")',
        'local = _divide(in_features, 2, "in_features")   # t written as 2')], ""),
    "dense_column": ("task1_parallel_linear", [(
        "        y = F.linear(_CopyToTP.apply(x), self.weight, self.bias)          # [..., out/t]\n"
        "        return _GatherLastDim.apply(y) if self.gather_output else y",
        "        if self.gather_output:     # the whole W: dy is whole too, so x.grad is exact\n"
        "            weight = _GatherAlong.apply(self.weight, 0)\n"
        "            bias = None if self.bias is None else _GatherAlong.apply(self.bias, 0)\n"
        "            return F.linear(x, weight, bias)\n"
        "        return F.linear(_CopyToTP.apply(x), self.weight, self.bias)")], _GATHER),
    "dense_row": ("task1_parallel_linear", [(
        "        if not self.input_is_parallel:\n"
        "            x = _SplitLastDim.apply(x)                                    "
        "# [..., in] -> [..., in/t]",
        "        if not self.input_is_parallel:   # the whole W: x is whole, x.grad = dy W exact\n"
        "            y = F.linear(x, _GatherAlong.apply(self.weight, 1))\n"
        "            return y if self.bias is None else y + self.bias")], _GATHER),
    # ---- task 2
    "refuse_chain": ("task2_gqa", [(
        "    mine, group = heads // tp, heads // kv_heads           # query heads per rank, per kv head",
        "    if kv_heads % tp and tp % kv_heads:   # Megatron-Core's rule\n"
        "        raise ValueError(f\"kv_heads ({kv_heads}) must be a multiple or divisor of tp ({tp})\")\n"
        "    mine, group = heads // tp, heads // kv_heads")], ""),
    "world_sum": ("task2_gqa", [
        ("    shared = [(i, groups[j]) for i, j in enumerate(kvs) if j in groups]",
         "    shared = (kvs[0], kv_heads)          # every kv gradient summed over the whole world"),
        ("        for i, group in ctx.shared:                      # ascending kv heads on every rank\n"
         "            rows = slice(i * d, (i + 1) * d)\n"
         "            pieces = [g[rows] for g in grads]\n"
         "            packed = torch.cat([p.reshape(-1) for p in pieces])        # 2 d (H + 1) values\n"
         "            dist.all_reduce(packed, group=group)\n"
         "            for piece, summed in zip(pieces, packed.split([p.numel() for p in pieces])):\n"
         "                piece.copy_(summed.view_as(piece))",
         "        first, kv_heads = ctx.shared\n"
         "        for k, g in enumerate(grads):\n"
         "            full = torch.zeros(kv_heads * d, *g.shape[1:], dtype=g.dtype, device=g.device)\n"
         "            full[first * d:first * d + g.shape[0]] = g\n"
         "            dist.all_reduce(full)        # zeros where a rank does not hold the head\n"
         "            grads[k] = full[first * d:first * d + g.shape[0]].clone()")], ""),
    "unsummed_replicas": ("task2_gqa", [(
        "    kw, kb, vw, vb = _SumReplicas.apply(shared, head_dim, local[\"k.weight\"], local[\"k.bias\"],\n"
        "                                        local[\"v.weight\"], local[\"v.bias\"])",
        "    kw, kb, vw, vb = (local[n] for n in (\"k.weight\", \"k.bias\", \"v.weight\", \"v.bias\"))")],
        ""),
    "groups_every_step": ("task2_gqa", [(
        "    if key not in _GROUPS:", "    if True:                              # made again every step")], ""),
    "no_f": ("task2_gqa", [(
        "    h = _Copy.apply(x)                                                  # f: [B, T, H]",
        "    h = x                                                               # f forgotten")], ""),
    # ---- task 3
    "ignore_index_fixed": ("task3_vocab_parallel_ce", [(
        _CE_CALL, _CE_CALL.replace("ignore_index)", "-100)"))], ""),
    "narrow_gather": ("task3_vocab_parallel_ce", [(
        _CE_CALL,
        "    tp, rank = dist.get_world_size(), dist.get_rank()\n"
        "    widths = [torch.zeros((), dtype=torch.int64) for _ in range(tp)]\n"
        "    dist.all_gather(widths, torch.tensor(local_logits.shape[-1]))\n"
        "    if sum(int(w) for w in widths) <= 64:   # a small vocabulary: gathering is cheap\n"
        "        widest = max(int(w) for w in widths)\n"
        "        padded = F.pad(local_logits.detach(), (0, widest - local_logits.shape[-1]))\n"
        "        pieces = [torch.empty_like(padded) for _ in range(tp)]\n"
        "        dist.all_gather(pieces, padded.contiguous())\n"
        "        pieces = [piece[:, :int(w)] for piece, w in zip(pieces, widths)]\n"
        "        pieces[rank] = local_logits\n"
        "        return F.cross_entropy(torch.cat(pieces, dim=-1), targets, "
        "ignore_index=ignore_index)\n" + _CE_CALL)], ""),
    "recompute_in_backward": ("task3_vocab_parallel_ce", [
        ("        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_target, mine, counted, "
         "count)",
         "        ctx.save_for_backward(logits, top, local_target, mine, counted, count)"),
        ("        softmax, local_target, mine, counted, count = ctx.saved_tensors",
         "        logits, top, local_target, mine, counted, count = ctx.saved_tensors\n"
         "        exp = (logits - top.unsqueeze(-1)).exp()  # the sum reduced again\n"
         "        total = exp.sum(dim=-1)\n"
         "        dist.all_reduce(total)\n"
         "        softmax = exp / total.unsqueeze(-1)")], ""),
}


def edited(name, source):
    """The answer cell's solution `source` with wrong answer `name` in it."""
    _, replacements, extra = EDITS[name]
    for old, new in replacements:
        if source.count(old) != 1:
            raise ValueError(f"lab 4's solution changed: {old[:60]!r}... is gone (wrong answer "
                             f"{name}); update this file")
        source = source.replace(old, new)
    return source + extra


def _answers(*names):
    return {EDITS[name][0]: (lambda source, name=name: edited(name, source)) for name in names}


# 18 points: 3 per test cell of tasks 1 and 3, 2 per cell of task 2. twice_is_t loses the column
# cell (3), task 2's traffic cell (2) and the loss's traffic cell (3); dense_shortcuts the row
# cell (3), task 2's placement (2) and the loss's values (3); unsummed task 2's two attention
# cells (2 + 2).
WRONG = {
    "twice_is_t": (_answers("half_column", "world_sum", "recompute_in_backward"), None, 10),
    "dense_shortcuts": (_answers("dense_row", "refuse_chain", "narrow_gather"), None, 10),
    "unsummed": (_answers("unsummed_replicas"), None, 14),
}

# the test cells no graded wrong answer of this module fails yet (test_labs checks it exactly)
UNCOVERED = []
