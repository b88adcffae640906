"""Lab 5's graded wrong answers (issue 26). Each function takes an answer cell's solution source and
returns the wrong one; tests/chapters/test_ch05_pipeline_parallel.py runs every one of them alone
(lab_notebooks.run_lab) and asserts the cells it loses, exactly:

    stop_after_last_i    task 1  loses test_task1_complete (1): the loop ends once every I has
                                 run, so the Ws still waiting are never scheduled (the memory and
                                 idle of what runs are right)
    no_budget            task 1  loses test_task1_memory (1): forwards never held back, m alive
                                 once m > 2p - 1 (the same idle time)
    one_f_one_b_budget   task 1  loses test_task1_bubble (1): 1F1B's budget min(m, p), within
                                 memory but too few forwards to fill the wait before the first I
    no_cycle_ever        task 2  loses test_task2_cycle (2): a finder that never finds anything
    fifo_links           task 2  loses test_task2_no_false_alarm (1): in-order delivery (NCCL's
                                 model) taken for a deadlock on a schedule that finishes
    untagged             task 3  loses test_task3_gradients (2): no tags; right wherever every link
                                 delivers in send order, wrong on the reordered schedule
    header_messages      task 3  loses test_task3_messages (2): a [microbatch, stage] header message
                                 before every activation and gradient (right gradients)
    start_and_duration   task 4  loses test_task4_timeline (2): (start, duration) pairs, the bubble
                                 computed right from them
    closed_forms         task 4  loses test_task4_bubble (1): the bubble picked by the schedule's
                                 shape wherever the stages are equal, the timeline elsewhere

Three submissions of 13 points, each with one wrong answer per task it touches."""
from wrong_answers import edit



def stop_after_last_i(source: str) -> str:
    return edit(source, "    while any(len(actions) < 3 * m for actions in schedule):\n",
                "    while any(done < m for done in next_i):      # until every I has run\n")


def no_budget(source: str) -> str:
    return edit(source, "budget = min(m, 2 * p - 1)", "budget = m")


def one_f_one_b_budget(source: str) -> str:
    return edit(source, "budget = min(m, 2 * p - 1)", "budget = min(m, p)")


def no_cycle_ever(source: str) -> str:
    return edit(source, '    ### BEGIN SOLUTION\n', '    ### BEGIN SOLUTION\n    return None\n')


def fifo_links(source: str) -> str:
    return edit(source, "    if not stopped:\n        return None\n",
                    "    if not stopped:\n"
                    "        if pipeline.check_schedule(schedule, m).link_order:   # NCCL: in order\n"
                    "            return [(0, schedule[0][0], 0, schedule[0][0])]\n"
                    "        return None\n")


def untagged(source: str) -> str:
    for call in ('tag=tag(s, "activation", i)', 'tag=tag(s + 1, "activation", i)',
                 'tag=tag(s, "gradient", i)', 'tag=tag(s - 1, "gradient", i)'):
        source = edit(source, ", " + call, "")
    return source


def header_messages(source: str) -> str:
    """Each message preceded by a 2-number header on the same tag (gloo keeps a tag's order)."""
    for old in ('dist.recv(x, (s - 1) % p, tag=tag(s, "activation", i))',
                'dist.recv(grad, (s + 1) % p, tag=tag(s, "gradient", i))'):
        header = old.replace("(x,", "(torch.empty(2, dtype=torch.int64),").replace(
            "(grad,", "(torch.empty(2, dtype=torch.int64),")
        source = edit(source, old, f"{header}; {old}")
    for old in ('sending.append(dist.isend(out.detach(), (s + 1) % p, tag=tag(s + 1, "activation", i)))',
                'sending.append(dist.isend(x.grad, (s - 1) % p, tag=tag(s - 1, "gradient", i)))'):
        header = old.replace("out.detach(),", "torch.tensor([i, s]),").replace(
            "x.grad,", "torch.tensor([i, s]),")
        source = edit(source, old, f"{header}; {old}")
    return source


def start_and_duration(source: str) -> str:
    source = edit(source, "out[k].append((start, free[k]))",
                      "out[k].append((start, free[k] - start))")
    source = edit(source, "makespan = max(end for stage in stages for _, end in stage)",
                      "makespan = max(start + length for stage in stages for start, length in stage)")
    return edit(source, "busy = sum(end - start for stage in stages for start, end in stage)",
                    "busy = sum(length for stage in stages for _, length in stage)")


def closed_forms(source: str) -> str:
    return edit(source, "    stages = timeline(schedule, m, costs, latency)\n",
                    "    p = len(schedule)\n"
                    "    v = 1 + max(pipeline.action(a).chunk for stage in schedule for a in stage)\n"
                    "    if latency == 0 and all(c == costs[0] for c in costs):   # equal stages\n"
                    "        if any(pipeline.action(a).kind == 'I' for stage in schedule for a in stage):\n"
                    "            return (p - 1) / (3 * m + p - 1)\n"
                    "        return (p - 1) / (v * m + p - 1)\n"
                    "    stages = timeline(schedule, m, costs, latency)\n")


WRONG = {
    "wrong_task1_ws_task2_cycle_task3_headers_task4_closed_forms": (
        {"task1_zb_h2": stop_after_last_i, "task2_find_deadlock": no_cycle_ever,
         "task3_run_pipeline": header_messages, "task4_timeline": closed_forms},
        None, 13 - 1 - 2 - 2 - 1),
    "wrong_task1_budget_task2_fifo_task3_untagged_task4_durations": (
        {"task1_zb_h2": no_budget, "task2_find_deadlock": fifo_links,
         "task3_run_pipeline": untagged, "task4_timeline": start_and_duration},
        None, 13 - 1 - 1 - 2 - 2),
    "wrong_task1_one_f_one_b_budget": ({"task1_zb_h2": one_f_one_b_budget}, None, 13 - 1),
}

# the test cells no graded wrong answer of this module fails yet (test_labs checks it exactly)
UNCOVERED = []
