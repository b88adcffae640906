"""Lab 4's graded wrong answers (issue 26). Every edit below is a plausible answer that the lab's
hidden tests let through before this round; the chapter test (tests/chapters/test_ch04_*.py)
runs each through the lab's own test cells and asserts exactly which cells it fails, and the two
submissions of WRONG carry one per task, graded with `labkit grade` at their exact score.

    twice_is_t      task 1: ColumnParallelLinear's shard written as out // 2 (the locked t):
                            fails test_task1_column (at t = 3)
                    task 2: tp_block's f all-reduces its input in forward too ("make sure
                            every rank has the same input": x / t summed, right values): twice
                            Megatron's bytes in forward, within the values cell's bound of three
                            times, so it fails test_task2_block_traffic only (the same t = 2
                            mistake in task 2, half_block, fails both task-2 cells and is run by
                            the chapter test alone)
                    task 3: the loss's backward recomputes the softmax from the saved logits
                            and max, and so reduces the sum again (four reductions of N in
                            all, within the old bound): fails test_task3_ce_traffic
    dense_shortcuts task 1: RowParallelLinear gathers its whole W when the input is whole and
                            takes the dense product (x.grad then needs no collective): fails
                            test_task1_row (the backward that should gather sends nothing)
                    task 2: tp_block gathers the weights and runs the whole block when the
                            activation is small (the traffic cell's shapes are larger): fails
                            test_task2_block_values (bytes judged on every value call)
                    task 3: the loss gathers the logits when the vocabulary is small (the
                            traffic cell's are larger): fails test_task3_ce_values

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
    "heads_only": ("task2_tp_block", [(
        "    if heads % tp or ffn % tp:",
        "    if heads % tp:                      # the MLP width forgotten")], ""),
    "half_block": ("task2_tp_block", [(
        "    head_dim = width // (heads // tp)",
        "    head_dim = width // (heads // 2)                       # t written as 2")], ""),
    "small_dense_block": ("task2_tp_block", [(
        '    width = local["o.weight"].shape[1]                                 # A/t\n',
        '    width = local["o.weight"].shape[1]                                 # A/t\n'
        "    if x.shape[0] * x.shape[1] < 32:      # small: cheaper to gather the weights once\n"
        "        full = dict(local)\n"
        '        qkv = _GatherAlong.apply(local["qkv.weight"].view(3, width, hidden), 1)\n'
        '        full["qkv.weight"] = qkv.reshape(-1, hidden)\n'
        '        qkv_bias = _GatherAlong.apply(local["qkv.bias"].view(3, width), 1)\n'
        '        full["qkv.bias"] = qkv_bias.reshape(-1)\n'
        '        full["o.weight"] = _GatherAlong.apply(local["o.weight"], 1)\n'
        '        full["fc1.weight"] = _GatherAlong.apply(local["fc1.weight"], 0)\n'
        '        full["fc1.bias"] = _GatherAlong.apply(local["fc1.bias"], 0)\n'
        '        full["fc2.weight"] = _GatherAlong.apply(local["fc2.weight"], 1)\n'
        "        return tpk.block_reference(full, x, heads)\n")], _GATHER),
    "block_twice": ("task2_tp_block", [(
        "        return x.view_as(x)\n\n    @staticmethod\n    def backward(ctx, grad):\n"
        "        grad = grad.contiguous()",
        "        x = x.contiguous() / dist.get_world_size()\n"
        "        dist.all_reduce(x)   # 'make sure every rank has the same input'\n"
        "        return x\n\n    @staticmethod\n"
        "    def backward(ctx, grad):\n        grad = grad.contiguous()")], ""),
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


# 18 points: 3 per test cell. twice_is_t loses the column cell (3), the block's traffic cell (3)
# and the loss's traffic cell (3); dense_shortcuts the row cell, the block's values and the loss's
# values.
WRONG = {
    "twice_is_t": (_answers("half_column", "block_twice", "recompute_in_backward"), None, 9),
    "dense_shortcuts": (_answers("dense_row", "small_dense_block", "narrow_gather"), None, 9),
}

# the test cells no graded wrong answer of this module fails yet (test_labs checks it exactly)
UNCOVERED = []
