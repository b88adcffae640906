"""Checkers of lab 5 (`labs/lab05_pipeline_parallel/`); tests/chapters/test_ch05 calls the same.

    check_zb_h2(zb_h2, p, m)                        # task 1: complete, split, deadlock-free
    check_zb_h2_memory(zb_h2, p, m)                 # task 1: at most min(m, 2p - 1) alive
    check_zb_h2_bubble(zb_h2, p, m)                 # task 1: idle per stage, unit costs
    check_finds_no_deadlock(find_deadlock, schedule, m)
    check_finds_cycle(find_deadlock, schedule, m)   # task 2: the cycle is verified, wait by wait
    check_executor(world, run_pipeline, "interleaved", m=4, v=2)           # task 3: gradients
    check_executor_traffic(world, run_pipeline, "interleaved", m=4, v=2)   # task 3: messages
    check_timeline(timeline, schedule, m, costs, latency)                  # task 4
    check_bubble(bubble_fraction, schedule, m, costs, latency, expected)   # task 4

None of these computes an answer of the lab. Task 2's cycle and task 4's timeline are verified
claim by claim (each wait is a real wait of a stopped stage; each start time is the moment the
action's stage and inputs were ready), from the dependency rules of labkit.pipeline.analysis.
Task 3 compares with one process on the whole batch and counts the messages from outside the
ranks. Schedules handed to student code are plain lists of (kind, microbatch, chunk) tuples.
"""
from __future__ import annotations

import math

from labkit import checks
from labkit.pipeline import analysis, bench, schedules
from labkit.pipeline.schedules import Action, normalise

TOLERANCE = 1e-9           # task 4: times are sums of the given costs; floats add them to ~1e-15


def plain_schedule(schedule) -> list:
    """A schedule as plain lists of (kind, microbatch, chunk) tuples: what student code gets."""
    return [[tuple(a) for a in actions] for actions in normalise(schedule)]


def _returned_schedule(value, what: str, p: int) -> list:
    try:
        schedule = normalise(value)
    except ValueError as error:
        raise AssertionError(f"{what} did not return a schedule: {error}") from None
    if len(schedule) != p:
        raise AssertionError(f"{what} returned {len(schedule)} stages, expected p = {p}: one list "
                             "of actions per stage")
    return schedule


# ---- task 1: a ZB-H2 generator -----------------------------------------------------------------

def zb_h2_memory_bound(p: int, m: int) -> list:
    """Per stage: the most microbatches ZB-H2 may hold at once, min(m, 2p - 1) (stage 0 must run
    2p - 1 forwards before its first I can arrive; Qi et al. 2024 budget 2p)."""
    return [min(m, 2 * p - 1)] * p


def zb_h2_idle(p: int, m: int) -> list:
    """Per stage k: the least idle time between its first and its last action, unit costs
    F = I = W = 1: max(0, 2p - 1 - 2k - m). Stage k starts at k (its F0 arrives), its first I
    cannot start before 2p - 1 - k (F0 down to stage p-1 and I0 back), and only forwards (at most
    m) can fill the wait; after that, pending Ws fill every gap. Zero on every stage once
    m >= 2p - 1: the parallelogram, whose steps tile back to back."""
    return [max(0, 2 * p - 1 - 2 * k - m) for k in range(p)]


def stage_idle(report: analysis.Report, schedule) -> list:
    """Per stage: (its last end - its first start) - its busy time, on the report's timeline."""
    idle = []
    for k, actions in enumerate(normalise(schedule)):
        times = [report.timeline[(k, a)] for a in actions if (k, a) in report.timeline]
        span = max(e for _, e in times) - min(s for s, _ in times) if times else 0
        idle.append(span - report.busy[k])
    return idle


def check_zb_h2(generator, p: int, m: int) -> analysis.Report:
    """generator(p, m) is complete with split backwards (each stage: F i, I i and W i once for
    every i, no B, one chunk) and finishes (buffered sends). The report keeps the schedule
    (report.schedule)."""
    report = _zb_h2_runs(generator, p, m)
    if report.problems:                            # only Ws can be missing here
        raise AssertionError(f"zb_h2({p}, {m}) is incomplete: {'; '.join(report.problems[:3])}. "
                             f"Every stage runs F i, I i and W i exactly once for each microbatch "
                             f"i in 0..{m - 1}: keep going until every W has run, not only every I")
    return report


def _zb_h2_runs(generator, p: int, m: int) -> analysis.Report:
    """What the memory and bubble cells judge: the schedule generator(p, m) returned, split (F,
    I and W on one chunk), every F and I exactly once, each W at most once and after its own I,
    and finishing (buffered sends). A W left out is the completeness cell's loss only (one
    mistake costs the cells of its own requirement): memory and idle are read from the actions
    the schedule runs, where a missing W leaves its microbatch alive and its time unworked."""
    what = f"zb_h2({p}, {m})"
    schedule = _returned_schedule(generator(p, m), what, p)
    odd = [f"stage {k}: {a}" for k, actions in enumerate(schedule) for a in actions
           if a.kind not in "FIW" or a.chunk]
    if odd:
        raise AssertionError(f"{what}: ZB-H2 uses F, I and W on one chunk per stage (B is split "
                             f"into I and W), got {odd[:3]}")
    padded = [actions + [Action("W", a.microbatch) for a in actions if a.kind == "I"
                         and Action("W", a.microbatch) not in actions] for actions in schedule]
    problems = analysis.validate(padded, m, 1)     # what is wrong besides a W left out
    if problems:
        raise AssertionError(f"{what} is incomplete: {'; '.join(problems[:3])}. Every stage runs "
                             f"F i, I i and W i exactly once for each microbatch i in 0..{m - 1}")
    report = analysis.check_schedule(schedule, m, 1)
    if report.deadlock is not None:
        raise AssertionError(f"{what} cannot finish: {report.deadlock}. Stage k can only run I i "
                             "once stage k + 1 ran its I i, and every stage must take the "
                             "microbatches' forwards in the same order")
    report.schedule = schedule
    return report


def check_zb_h2_memory(generator, p: int, m: int) -> analysis.Report:
    """...and no stage holds more than min(m, 2p - 1) microbatches' activations at once (a
    forward stores them, the W frees them: report.peak_alive)."""
    report = _zb_h2_runs(generator, p, m)
    bound = zb_h2_memory_bound(p, m)
    over = [k for k in range(p) if report.peak_alive[k] > bound[k]]
    if over:
        k = over[0]
        raise AssertionError(
            f"zb_h2({p}, {m}): stage {k} holds {report.peak_alive[k]} microbatches' activations at "
            f"once, ZB-H2's budget is min(m, 2p - 1) = {bound[k]} (peaks {report.peak_alive}): "
            "a microbatch stays alive from its F to its W, so run a waiting W before a forward "
            "that would go over the budget")
    return report


def check_zb_h2_bubble(generator, p: int, m: int) -> analysis.Report:
    """...and, on the unit-cost clock (F = I = W = 1), stage k idles no more than
    max(0, 2p - 1 - 2k - m) between its first and its last action (zb_h2_idle): no gap at all
    once m >= 2p - 1. ZB-H1 (pipeline.zero_bubble of a 1F1B) idles p - 1 on stage 0."""
    report = _zb_h2_runs(generator, p, m)
    idle, bound = stage_idle(report, report.schedule), zb_h2_idle(p, m)
    over = [k for k in range(p) if idle[k] > bound[k]]
    if over:
        k = over[0]
        raise AssertionError(
            f"zb_h2({p}, {m}): stage {k} idles {idle[k]} time units between its first and its last "
            f"action (F = I = W = 1), at most {bound[k]} = max(0, 2p - 1 - 2k - m) is possible "
            f"(idle per stage {[int(x) if x == int(x) else float(x) for x in idle]}, bounds "
            f"{bound}). Stage k's first I can start at 2p - 1 - k: fill that wait with forwards, "
            "and later keep a W in hand for every moment the stage would otherwise wait")
    return report


# ---- task 2: the cycle behind a deadlock -------------------------------------------------------

def check_finds_no_deadlock(finder, schedule, m: int, what: str = "the schedule") -> None:
    """finder(schedule, m) returns None for a schedule whose stages all finish."""
    schedule = normalise(schedule)
    _, deadlock = analysis.simulate(schedule, m)
    if deadlock is not None or analysis.validate(schedule, m):
        raise ValueError(f"check_finds_no_deadlock needs a complete schedule that finishes; "
                         f"{what} does not: {deadlock}")
    got = finder(plain_schedule(schedule), m)
    if got is not None:
        raise AssertionError(
            f"find_deadlock says {what} (p = {len(schedule)}, m = {m}, v = "
            f"{schedules.chunks_of(schedule)}) deadlocks ({_show(got)}), but every stage finishes. "
            "Check the dependencies: chunk c of stage k is virtual stage c * p + k; F needs the "
            "activation of virtual stage s - 1, B the gradient of s + 1 (the last virtual stage "
            "starts from its own loss)")


def check_finds_cycle(finder, schedule, m: int, what: str = "the schedule") -> list:
    """finder(schedule, m) returns a cycle of waits [(stage, action, other stage, other action)]
    that really holds the schedule up: each stage in it is stopped before that action (running
    every action as soon as its inputs exist, sends buffered), the other action is one of that
    action's inputs that never ran, on the other stage, and the other stage is the next in the
    cycle (the last one's is the first's). Returns the cycle as Actions."""
    schedule = normalise(schedule)
    v = schedules.chunks_of(schedule)
    ran, deadlock = analysis.simulate(schedule, m, v)
    if deadlock is None or analysis.validate(schedule, m, v):
        raise ValueError(f"check_finds_cycle needs a complete schedule that deadlocks; {what} "
                         "finishes or is incomplete")
    name = f"find_deadlock on {what} (p = {len(schedule)}, m = {m}, v = {v})"
    got = finder(plain_schedule(schedule), m)
    if got is None:
        raise AssertionError(f"{name} returned None, but the schedule deadlocks: {deadlock}")
    if not isinstance(got, (list, tuple)) or not got:
        raise AssertionError(f"{name} returned {got!r}: expected None or a non-empty list of "
                             "(stage, action, stage, action) waits")
    graph = analysis._Graph(schedule, m, v)
    cycle = []
    for n, wait in enumerate(got):
        try:
            stage, a, other, b = wait
            stage, other = int(stage), int(other)
            a, b = schedules.action(a), schedules.action(b)
        except (TypeError, ValueError):
            raise AssertionError(f"{name}: wait {n} is {wait!r}, expected (stage, action, stage, "
                                 "action), e.g. (2, ('B', 0, 0), 3, ('B', 0, 0))") from None
        if stage not in deadlock.stuck:
            raise AssertionError(f"{name}: wait {n} says stage {stage} waits, but stage {stage} "
                                 f"finishes; the stopped stages are {sorted(deadlock.stuck)}")
        if a != deadlock.stuck[stage]:
            raise AssertionError(f"{name}: wait {n} says stage {stage} is stopped before {a}, but "
                                 f"it runs every action before {deadlock.stuck[stage]} (run each "
                                 "action as soon as its inputs exist, until nothing can move)")
        inputs = [(q, x) for q, x, _ in graph.inputs(stage, a)]
        if (other, b) not in inputs:
            raise AssertionError(f"{name}: wait {n} says {a} on stage {stage} needs {b} from "
                                 f"stage {other}; it needs {_show_inputs(inputs)}")
        if (other, b) in ran:
            raise AssertionError(f"{name}: wait {n}: {b} on stage {other} did run, so {a} on "
                                 f"stage {stage} is not waiting for it")
        cycle.append((stage, a, other, b))
    stages = [w[0] for w in cycle]
    if len(set(stages)) != len(stages):
        raise AssertionError(f"{name}: stage {_first_repeat(stages)} appears twice; a cycle "
                             "visits each stage once (stop at the first repeated stage)")
    for n, wait in enumerate(cycle):
        following = cycle[(n + 1) % len(cycle)][0]
        if wait[2] != following:
            raise AssertionError(f"{name}: wait {n} is on stage {wait[2]}, but the next wait in "
                                 f"the list is stage {following}'s: the waits must close a cycle "
                                 "(each one's stage is the stage the previous waits on)")
    return cycle


def _show(cycle) -> str:
    try:
        return "; ".join(f"stage {s} at {schedules.action(a)} waits for {schedules.action(b)} on "
                         f"stage {o}" for s, a, o, b in cycle)
    except (TypeError, ValueError):
        return repr(cycle)


def _show_inputs(inputs) -> str:
    return ", ".join(f"{x} from stage {q}" for q, x in inputs) or "nothing"


def _first_repeat(items):
    seen = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    return None


def deadlocking_variants(case: checks.Case, schedule, m: int, count: int = 3) -> list:
    """Up to `count` complete schedules that deadlock, each made from `schedule` by moving one
    action of one stage earlier (drawn with the case's generator)."""
    schedule = normalise(schedule)
    found, tries = [], 0
    while len(found) < count and tries < 200:
        tries += 1
        k = case.integer(0, len(schedule) - 1)
        if len(schedule[k]) < 2:
            continue
        j = case.integer(1, len(schedule[k]) - 1)
        to = case.integer(0, j - 1)
        moved = [list(actions) for actions in schedule]
        moved[k].insert(to, moved[k].pop(j))
        if analysis.simulate(moved, m)[1] is not None and moved not in found:
            found.append(moved)
    return found


def finishing_variants(case: checks.Case, schedule, m: int, count: int = 3) -> list:
    """Up to `count` complete schedules that finish (buffered sends) and whose unit-cost bubble
    (analysis.check_schedule) differs from `schedule`'s, each made by moving one action of one
    stage later: schedules with no closed form for their bubble (drawn with the case's
    generator)."""
    schedule = normalise(schedule)
    base = analysis.check_schedule(schedule, m).bubble
    found, tries = [], 0
    while len(found) < count and tries < 400:
        tries += 1
        k = case.integer(0, len(schedule) - 1)
        if len(schedule[k]) < 2:
            continue
        j = case.integer(0, len(schedule[k]) - 2)
        to = case.integer(j + 1, len(schedule[k]) - 1)
        moved = [list(actions) for actions in schedule]
        moved[k].insert(to, moved[k].pop(j))
        report = analysis.check_schedule(moved, m)
        if report.ok and report.bubble != base and moved not in found:
            found.append(moved)
    return found


# ---- task 3: an executor for any schedule, v chunks per rank -----------------------------------

def _executor_program(share, fn, activation_shape):
    """On rank r: build its chunks from the weights it was sent, run the student's executor, read
    the gradients back from the modules it was handed."""
    from labkit import device
    chunks = [bench.Piece.from_weights(weights).to(device()) for weights in share["weights"]]
    fn(share["actions"], chunks, activation_shape, share["tokens"], share["targets"])
    grads = {}
    for chunk in chunks:
        grads.update(chunk.gradients())
    return grads


SCHEDULES = ("GPipe", "1F1B", "interleaved", "reordered")


def reordered(p: int, m: int, v: int = 1) -> list:
    """A complete schedule that finishes whose messages arrive on every link in another order
    than they were sent (for m >= 2): all forwards chunk by chunk, then all backwards, virtual
    stage s taking its microbatches in order when s is even and in reverse when s is odd. An
    executor that does not tag its messages (or posts one receive per link in send order) pairs
    activation i with microbatch m - 1 - i here; gloo matches by tag, so a tagged one is exact."""
    order = lambda s: list(range(m)) if s % 2 == 0 else list(range(m - 1, -1, -1))  # noqa: E731
    return [[Action("F", i, c) for c in range(v) for i in order(c * p + k)]
            + [Action("B", i, c) for c in reversed(range(v)) for i in order(c * p + k)]
            for k in range(p)]


def executor_case(case: checks.Case, p: int, m: int, v: int = 1, schedule: str = "interleaved"):
    """(shares, common args, expected gradients, the schedule, activation bytes) of one step.

    Rank r is sent the weights of its own chunks only, its own actions, the tokens if it holds
    virtual stage 0, the targets if it holds the last one. The expected gradients are one
    process's, on the whole batch, computed here."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule not in ("interleaved", "reordered") and v != 1:
        raise ValueError(f"{schedule} runs one chunk per rank: v must be 1, got {v}")
    S = v * p
    layers = max(bench.LAYERS, S)
    model_seed, data_seed = case.integer(0, 2 ** 31), case.integer(0, 2 ** 31)
    pieces = bench.cut(bench.make_model(model_seed, layers), S)
    tokens, targets = bench.microbatches(data_seed, m)
    if schedule == "GPipe":
        order = schedules.gpipe(p, m)
    elif schedule == "1F1B":
        order = schedules.torch_schedule("1F1B", p, m)
    elif schedule == "reordered":
        order = reordered(p, m, v)
    else:
        order = schedules.torch_schedule("Interleaved1F1B", p, m, v)
    plain = plain_schedule(order)
    shares = [{"weights": [pieces[schedules.virtual_stage(r, c, p)].weights() for c in range(v)],
               "actions": plain[r], "tokens": tokens if r == 0 else None,
               "targets": targets if r == (S - 1) % p else None} for r in range(p)]
    expected = bench.reference_gradients(model_seed, tokens, targets, layers)
    shape = bench.activation_shape(tokens)
    return shares, shape, expected, order, 8 * math.prod(shape)


def _gradient_hint(got: dict, expected: dict, m: int) -> str:
    import torch
    both = [name for name in expected if name in got]
    num = sum(float(got[n].double().norm() ** 2) for n in both) ** 0.5
    den = sum(float(expected[n].double().norm() ** 2) for n in both) ** 0.5
    ratio = num / den if den else math.inf
    silent = [n for n in both if not torch.any(got[n]) and torch.any(expected[n])]
    if silent:
        return (f"{silent[:3]} got no gradient: did every chunk run its backward, and did the "
                "gradient reach it from the next virtual stage?")
    if m > 1 and 0.5 * m <= ratio <= 2 * m:
        return (f"the gradients are about m = {m} times too large: the loss of microbatch i is "
                "S_i / N, N the valid tokens of every microbatch together "
                "(pipeline.token_count(targets)), not S_i / n_i of microbatch i alone")
    if m > 1 and 0.5 / m <= ratio <= 2 / m:
        return f"the gradients are about m = {m} times too small: is the loss divided by m too?"
    return ("compare one microbatch first: forward on each virtual stage in order (chunk c of "
            "rank r is virtual stage c * p + r), the activation and the gradient of the right "
            "microbatch and chunk (tag the messages)")


def check_executor(world, fn, schedule: str = "interleaved", m: int = 4, v: int = 2,
                   timeout: float = 30, case: checks.Case | None = None) -> dict:
    """One step of `schedule` run by fn(actions, chunks, activation_shape, tokens, targets) on
    every rank: the gradients left in the chunks equal one process's on the whole batch."""
    case = case or checks.Case(f"lab 5 executor, {schedule}, p = {world.size}, m = {m}, v = {v}")
    shares, shape, expected, _, _ = executor_case(case, world.size, m, v, schedule)
    results = world.run_each(_executor_program, shares, fn, shape, timeout=timeout)
    checks.one_result_per_rank(results, world.size, case, "run_pipeline")
    return _check_gradients(results, expected, m, case)


def _check_gradients(results, expected, m, case) -> dict:
    got = {}
    for result in results:
        got.update(result)
    checks.check(got, expected, "the gradients of the pipeline's chunks", rtol=bench.RTOL,
                 atol=bench.ATOL, case=case, hint=_gradient_hint(got, expected, m)
                 if set(got) == set(expected) else "")
    return got


def check_executor_traffic(world, fn, schedule: str = "interleaved", m: int = 4, v: int = 2,
                           timeout: float = 30, case: checks.Case | None = None):
    """The same step, counted from outside the ranks: rank r sends to rank q exactly the
    activations and gradients the schedule moves between them (one message each, [b, T, H] in
    float64), nothing else, and the gradients are right."""
    case = case or checks.Case(f"lab 5 executor messages, {schedule}, p = {world.size}, m = {m}, "
                               f"v = {v}")
    shares, shape, expected, order, message = executor_case(case, world.size, m, v, schedule)
    with world.traffic() as traffic:
        results = world.run_each(_executor_program, shares, fn, shape, timeout=timeout)
    checks.one_result_per_rank(results, world.size, case, "run_pipeline")
    _check_gradients(results, expected, m, case)
    p = world.size
    graph = analysis._Graph(order, m, v)
    messages = [[0] * p for _ in range(p)]
    for r, actions in enumerate(order):
        for a in actions:
            for q, _ in graph.sends(r, a):
                messages[r][q] += 1
    data = [[n * message for n in row] for row in messages]
    hint = ("each F sends one activation to the rank of the next virtual stage, each B one "
            "gradient to the rank of the previous one; with v chunks the last rank's chunk c "
            "feeds rank 0's chunk c + 1. Only point-to-point messages of the activation's shape, "
            "one per activation and per gradient, nothing else (a header message, a split or "
            "a merged message changes the count)")
    checks.expect_traffic(traffic, data, messages, case=case, what="run_pipeline", hint=hint)
    _expect_messages(traffic, data, messages, case, hint)
    return traffic


MESSAGE_SLACK = 40         # bytes; one more gloo message costs GLOO_HEADER_BYTES (96) + its payload


def _expect_messages(traffic, data, messages, case, hint) -> None:
    """One message per activation and per gradient, counted from the bytes: gloo frames each
    point-to-point message with GLOO_HEADER_BYTES on the sender's socket and GLOO_NOTICE_BYTES on
    the receiver's (measured exactly, chapter 1), so rank r sends q exactly payload + 96 n(r, q) +
    48 n(q, r). expect_traffic's framing allowance (160 B per message either way + 256) has room
    for extra small messages; this does not: one header message more, or two activations in one
    message, is off by at least 96 bytes."""
    from labkit.collectives import GLOO_HEADER_BYTES, GLOO_NOTICE_BYTES
    size, problems = traffic.size, []
    for r in range(size):
        for q in range(size):
            if r == q:
                continue
            exact = data[r][q] + GLOO_HEADER_BYTES * messages[r][q] + GLOO_NOTICE_BYTES * messages[q][r]
            got = traffic.matrix[r][q]
            if abs(got - exact) > MESSAGE_SLACK:
                problems.append(f"rank {r} sent {got} bytes to rank {q}, expected {exact} "
                                f"({messages[r][q]} messages of {data[r][q] // max(1, messages[r][q])} "
                                f"B sent, {messages[q][r]} received; each message costs "
                                f"{GLOO_HEADER_BYTES} B of framing on its sender's socket and "
                                f"{GLOO_NOTICE_BYTES} on its receiver's): {got - exact:+d} bytes")
    if problems:
        raise AssertionError(f"run_pipeline: not one message per activation and per gradient"
                             f"{checks._where(case)}: {'; '.join(problems[:4])}. {hint}")


# ---- task 4: the timeline of any schedule, per-stage costs and message time --------------------

def check_timeline(fn, schedule, m: int, costs: list, latency: float = 0.0,
                   what: str = "the schedule") -> list:
    """fn(schedule, m, costs, latency) returns, per stage, the (start, end) of each of its actions
    in its order; each is verified: it lasts its stage's cost, and starts exactly when its stage
    finished the action before (0 for the first) and its inputs ended (+ latency when an input
    comes from another stage), whichever is later."""
    schedule = normalise(schedule)
    p, v = len(schedule), schedules.chunks_of(schedule)
    name = f"timeline of {what} (p = {p}, m = {m}, latency {latency})"
    got = fn(plain_schedule(schedule), m, [dict(c) for c in costs], latency)
    if not isinstance(got, (list, tuple)) or len(got) != p:
        size = len(got) if hasattr(got, "__len__") else "?"
        raise AssertionError(f"{name}: expected one list of (start, end) per stage ({p}), got "
                             f"{type(got).__name__} of length {size}")
    end = {}
    for k, actions in enumerate(schedule):
        if len(got[k]) != len(actions):
            raise AssertionError(f"{name}: stage {k} has {len(actions)} actions, {len(got[k])} "
                                 "(start, end) pairs came back")
        for a, pair in zip(actions, got[k]):
            try:
                start, stop = (float(x) for x in pair)
            except (TypeError, ValueError):
                raise AssertionError(f"{name}: stage {k}, {a}: expected (start, end) numbers, got "
                                     f"{pair!r}") from None
            end[(k, a)] = stop
    graph = analysis._Graph(schedule, m, v)
    for k, actions in enumerate(schedule):
        previous = 0.0
        for a, pair in zip(actions, got[k]):
            start, stop = (float(x) for x in pair)
            cost = costs[k][a.kind]
            if not math.isclose(stop - start, cost, rel_tol=TOLERANCE, abs_tol=TOLERANCE):
                raise AssertionError(f"{name}: stage {k}'s {a} lasts {stop - start:g}, its cost on "
                                     f"stage {k} is {cost:g} (costs[{k}][{a.kind!r}])")
            ready, why = previous, f"stage {k} is free at {previous:g}"
            for q, x, _ in graph.inputs(k, a):
                arrives = end[(q, x)] + (latency if q != k else 0.0)
                if arrives > ready:
                    ready = arrives
                    why = (f"{x} on stage {q} ends at {end[(q, x)]:g}"
                           + (f" and its message takes {latency:g}" if q != k else ""))
            if not math.isclose(start, ready, rel_tol=TOLERANCE, abs_tol=TOLERANCE):
                raise AssertionError(f"{name}: stage {k}'s {a} starts at {start:g}; it can start "
                                     f"at {ready:g} ({why}), and starts as soon as it can")
            previous = stop
    return got


def check_bubble(fn, schedule, m: int, costs: list, latency: float, expected: float,
                 what: str = "the schedule") -> float:
    """fn(schedule, m, costs, latency) returns the bubble `expected` (a formula's value)."""
    schedule = normalise(schedule)
    got = fn(plain_schedule(schedule), m, [dict(c) for c in costs], latency)
    try:
        value = float(got)
    except (TypeError, ValueError):
        raise AssertionError(f"bubble_fraction of {what} returned {got!r}, expected a number") \
            from None
    if not math.isclose(value, expected, rel_tol=TOLERANCE, abs_tol=TOLERANCE):
        raise AssertionError(f"bubble_fraction of {what} (p = {len(schedule)}, m = {m}, latency "
                             f"{latency}) is {value:.6f}, expected {expected:.6f}: the idle "
                             "time of every stage over p x the step (from 0 to the last end)")
    return value
