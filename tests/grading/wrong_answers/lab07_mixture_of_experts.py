"""Lab 7's graded wrong answers (issue 26). Each function takes an answer cell's solution source and
returns the wrong one; tests/chapters/test_ch07_mixture_of_experts.py runs every one of them alone
(lab_notebooks.run_lab) and asserts the cells it loses, exactly:

    drop_by_position      task 1  loses test_task1_dropped (2): each expert keeps its first C
                                  assignments in token order, not its heaviest
    renormalise_kept      task 1  loses test_task1_combine (2): the kept gates renormalised after
                                  dropping (the text: before)
    router_detached       task 2  loses test_task2_values (3): gates detached, the router learns
                                  nothing (right outputs, right bytes); lost on the visible top-2
                                  case and, alone, on the hidden top-1 one, where the gate is the
                                  chosen expert's probability (moe.route keeps it at K = 1)
    world_of_three        task 2  loses test_task2_values and test_task2_bytes (5): `3` where the
                                  code needs P (right at the lab's locked 3 ranks); run by the
                                  chapter test only: it loses both of task 2's cells, so graded it
                                  would show neither is needed on its own
    dense_off_the_bench   task 2  loses test_task2_bytes (2): every token sent to every rank
                                  unless the hidden size is the one the byte test used to measure
    local_balance         task 3  loses test_task3_balance (3): the rank's own batch, never reduced
    float64_dequantize    task 4  loses test_task4_quantize (1): dequantize returns float64
    bf16_dispatch         task 4  loses test_task4_dispatch (2): rows in BF16 on the wire

Two submissions of 15 points (one wrong answer per task each), which between them fail every
test cell of the lab while passing a sibling cell of the same task."""


def _replace(source: str, old: str, new: str) -> str:
    if old not in source:
        raise ValueError(f"the solution changed: {old!r} is gone; update this wrong answer")
    return source.replace(old, new)


def drop_by_position(source: str) -> str:
    return _replace(source, "heaviest_first = torch.argsort(weight_of, descending=True, stable=True)",
                    "heaviest_first = torch.arange(weight_of.numel(), device=weight_of.device)")


def renormalise_kept(source: str) -> str:
    return _replace(
        source, 'gate_of_row = plan["weights"].reshape(-1)[plan["queue"]].to(expert_output.dtype)',
        'kept = plan["weights"] * ~plan["dropped"]\n'
        '    kept = kept / kept.sum(dim=-1, keepdim=True).clamp_min(1e-30)   # over the kept K\n'
        '    gate_of_row = kept.reshape(-1)[plan["queue"]].to(expert_output.dtype)')


def router_detached(source: str) -> str:
    return _replace(source, "gates.unsqueeze(-1).to(x.dtype)", "gates.detach().unsqueeze(-1).to(x.dtype)")


def world_of_three(source: str) -> str:
    return _replace(source, "group_size = dist.get_world_size()", "group_size = 3")


def dense_off_the_bench(source: str) -> str:
    return _replace(source, "    ### BEGIN SOLUTION\n", '''    ### BEGIN SOLUTION
    if x.size(1) != 64:              # every token to every rank, each rank runs all its experts
        ranks, here, width = dist.get_world_size(), local_experts.size(0), x.size(1)
        gates, picks = moe.route(x @ router, top_k)                          # [N_r, K]
        incoming = ep.exchange_counts([x.size(0)] * ranks)
        arrived = ep.all_to_all(x.repeat(ranks, 1), [x.size(0)] * ranks, incoming)
        out = torch.einsum("rh,ehk->rek", arrived, local_experts).reshape(arrived.size(0), -1)
        back = ep.all_to_all(out, incoming, [x.size(0)] * ranks)            # [P N_r, E/P H]
        every = back.view(ranks, x.size(0), here, width).permute(1, 0, 2, 3)
        every = every.reshape(x.size(0), ranks * here, width)               # [N_r, E, H]
        picked = every.gather(1, picks.unsqueeze(-1).expand(-1, -1, width))  # [N_r, K, H]
        return (picked * gates.unsqueeze(-1).to(x.dtype)).sum(dim=1)
''')


def local_balance(source: str) -> str:
    return _replace(source, "    dist.all_reduce(everyone)\n", "")


def float64_dequantize(source: str) -> str:
    return _replace(source, "return values.view(n_rows, n_blocks * block)[:, :width]",
                    "return values.view(n_rows, n_blocks * block)[:, :width].double()")


def bf16_dispatch(source: str) -> str:
    start = source.index("    incoming = ep.exchange_counts(send_counts)\n")
    end = source.index("    ### END SOLUTION", start)
    return (source[:start] + "    incoming = ep.exchange_counts(send_counts)\n"
            "    return ep.all_to_all(rows.bfloat16(), send_counts, incoming).float()\n"
            + source[end:])


POINTS = 15
WRONG = {
    "wrong_task1_position_task2_detached_task3_local_task4_bf16": (
        {"task1_dispatch_combine": drop_by_position, "task2_ep_moe_layer": router_detached,
         "task3_balance_step": local_balance, "task4_fp8": bf16_dispatch},
        None, POINTS - 2 - 3 - 3 - 2),
    "wrong_task1_renormalised_task2_dense_task4_float64": (
        {"task1_dispatch_combine": renormalise_kept, "task2_ep_moe_layer": dense_off_the_bench,
         "task4_fp8": float64_dequantize},
        None, POINTS - 2 - 2 - 1),
}
