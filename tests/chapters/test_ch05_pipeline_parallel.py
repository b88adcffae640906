"""Chapter 5 / lab 5: schedules as data (labkit.pipeline), the reference executor on real ranks,
the lab's reference answers used as a library, and the lab's checkers rejecting the wrong answers
the issue names, each in the task it belongs to."""
import math
import random
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st

import lab_notebooks
import labkit
from labkit import checks, pipeline
from labkit.pipeline import Action, checks as lab_checks
from labkit.grading.references import pipeline as pipeline_reference

ROOT = Path(__file__).resolve().parents[2]
LAB = "lab05_pipeline_parallel"
SOLUTION = ROOT / "solutions" / LAB / f"{LAB}.ipynb"
FEW = settings(max_examples=25, derandomize=True, deadline=None, database=None,
               suppress_health_check=list(HealthCheck))


def _reference(grade_id, *names):
    """Functions from an answer cell of the lab's solution notebook (instructor side)."""
    cell = lab_notebooks.cells(LAB)[grade_id]      # json: this module is imported in every rank
    namespace = {"torch": torch, "dist": dist, "labkit": labkit, "pipeline": pipeline,
                 "Action": Action, "__name__": "__main__"}
    exec(compile(cell.source, f"{SOLUTION.name}:{grade_id}", "exec"), namespace)
    found = [namespace[name] for name in names]
    return found[0] if len(found) == 1 else found


zb_h2 = _reference("task1_zb_h2", "zb_h2")


def one_f_one_b(p, m):
    """1F1B for any p and m (torch refuses m < p): the tests' own, for the executor and timeline
    tests (no longer a lab task, so it lives here, not in the student's labkit)."""
    schedule = []
    for k in range(p):
        warmup = min(p - 1 - k, m)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action("F", warmup + i), Action("B", i)]
        schedule.append(actions + [Action("B", i) for i in range(m - warmup, m)])
    return schedule
find_deadlock = _reference("task2_find_deadlock", "find_deadlock")
run_pipeline = _reference("task3_run_pipeline", "run_pipeline")
timeline, bubble_fraction = _reference("task4_timeline", "timeline", "bubble_fraction")

CROSSED = pipeline.parse("F0 F1 F2 B0 B1 B2\nF0 F1 B0 F2 B1 B2\nF0 B0 F1 B1 F2 B2\nF1 B1 F0 B0 F2 B2")


# ---- schedules as data ------------------------------------------------------------------------

@FEW
@given(st.integers(1, 5), st.integers(1, 8))
def test_gpipe_and_torch_1f1b_bubble_is_the_formula_exactly(p, m):
    report = pipeline.check_schedule(pipeline.gpipe(p, m), m)
    assert report.ok and report.bubble == (pipeline.bubble_formula(p, m) if p > 1 else 0)
    assert report.peak_alive == [m] * p
    if m >= p:
        report = pipeline.check_schedule(pipeline.torch_schedule("1F1B", p, m), m)
        assert report.ok and report.bubble == (pipeline.bubble_formula(p, m) if p > 1 else 0)
        assert report.peak_alive == [p - k for k in range(p)]


@FEW
@given(st.integers(2, 5), st.integers(1, 3), st.integers(2, 3))
def test_interleaved_bubble_is_over_v_and_equals_torch_order(p, rounds, v):
    m = rounds * p
    ours = pipeline.interleaved_1f1b(p, m, v)
    report = pipeline.check_schedule(ours, m)
    assert report.ok and not report.link_order
    assert report.bubble == pipeline.bubble_formula(p, m, v)
    assert report.bubble / (1 - report.bubble) == pipeline.bubble_ratio_formula(p, m, v)
    if m > p:                     # Megatron's m = p case runs all forwards first; torch's does not
        assert ours == pipeline.torch_schedule("Interleaved1F1B", p, m, v)


@FEW
@given(st.integers(2, 5), st.integers(0, 6))
def test_zero_bubble_idles_p_minus_1_with_at_most_p_alive(p, extra):
    m = p + extra
    schedule = pipeline.zero_bubble(pipeline.torch_schedule("1F1B", p, m), m)
    report = pipeline.check_schedule(schedule, m)
    assert report.ok
    assert [report.makespan - busy for busy in report.busy] == [p - 1] * p
    assert max(report.peak_alive) <= p


def test_blocking_sends_deadlock_1f1b_not_gpipe():
    for p in (2, 3, 4):
        for m in (p, 2 * p):
            assert pipeline.check_schedule(pipeline.gpipe(p, m), m).blocking_deadlock is None
            stuck = pipeline.check_schedule(pipeline.torch_schedule("1F1B", p, m), m).blocking_deadlock
            assert stuck is not None and "send of the" in str(stuck)


def test_checker_names_what_is_wrong():
    assert pipeline.validate(pipeline.parse("F0 F0 B0\nF0 B0"), 1) == ["stage 0: F0 appears 2 times"]
    problems = pipeline.validate(pipeline.parse("F0 F1 B0\nF0 F1 B0 B1 I1"), 2)
    assert "stage 0: microbatch 1 has no backward (B, or I and W)" in problems
    assert any("both B and I/W" in p for p in problems)
    assert any("outside the step" in p for p in pipeline.validate(pipeline.parse("F0 F3 B0 B3"), 2))
    report = pipeline.check_schedule(CROSSED, 3)
    assert not report.problems and report.deadlock.stuck == {
        0: Action("B", 0), 1: Action("B", 0), 2: Action("B", 0), 3: Action("F", 1)}
    assert report.bubble is None and "deadlock" in str(report)
    with pytest.raises(ValueError, match="cannot finish"):
        report.raise_if_not_ok()


def test_actions_parse_print_and_refuse_nonsense():
    assert pipeline.action("F3.1") == Action("F", 3, 1) == pipeline.action(("F", 3, 1))
    assert pipeline.action(["B", 2]) == Action("B", 2, 0) and str(Action("W", 4, 2)) == "W4.2"
    for bad in ("X1", ("F", -1), ("F", 1.0), ("F", True), "F", 7):
        with pytest.raises(ValueError, match="not an action"):
            pipeline.action(bad)
    schedule = pipeline.interleaved_1f1b(2, 4, 2)
    text = pipeline.format_schedule(schedule, width=6).replace("stage 0: ", "").replace("stage 1: ", "")
    assert pipeline.parse(text) == schedule
    with pytest.raises(ValueError, match="multiple of p"):
        pipeline.interleaved_1f1b(3, 4, 2)
    with pytest.raises(ValueError, match="plain 1F1B"):
        pipeline.interleaved_1f1b(3, 6, 1)


def test_torch_published_1f1b_table_is_off_by_one_on_the_last_stage():
    """torch 2.13's Schedule1F1B.pipeline_order skips F0 and adds F(m) on the last stage (the
    course says so). If torch fixes it, update chapter 5's section 2."""
    problems = pipeline.check_schedule(pipeline.torch_pipeline_order("1F1B", 3, 4), 4).problems
    assert problems == ["stage 2: F4 is outside the step (microbatches 0..3, chunks 0..0)",
                        "stage 2: no forward of microbatch 0"]
    assert pipeline.check_schedule(pipeline.torch_pipeline_order("GPipe", 3, 4), 4).ok


@FEW
@given(st.integers(1, 5), st.integers(1, 7), st.lists(st.integers(1, 9), min_size=10, max_size=10),
       st.integers(0, 4))
def test_gpipe_bubble_closed_form_matches_the_reference_timeline(p, m, raw, lag):
    costs = [{"F": Fraction(raw[k]), "B": Fraction(raw[k + 5])} for k in range(p)]
    latency = Fraction(lag, 3)
    got = bubble_fraction(pipeline.gpipe(p, m), m, costs, latency)
    assert math.isclose(float(got), pipeline_reference.gpipe_bubble(costs, m, latency), abs_tol=1e-12)


# ---- the lab's reference answers, as a library -------------------------------------------------

def test_reference_1f1b_matches_torch_where_torch_agrees():
    for p in range(1, 5):
        for m in range(p, 9):
            assert pipeline.normalise(one_f_one_b(p, m)) == pipeline.torch_schedule("1F1B", p, m)


def test_lab_and_grader_zb_h2_meet_every_bound_and_beat_zb_h1():
    """The bounds the lab grades are reachable (by the lab's solution and the grader's reference,
    which agree), tight (no idle when m >= 2p - 1) and not met by chapter 5's ZB-H1."""
    for p in range(1, 7):
        for m in range(1, 11):
            report = lab_checks.check_zb_h2_bubble(zb_h2, p, m)
            lab_checks.check_zb_h2_memory(zb_h2, p, m)
            assert pipeline.normalise(zb_h2(p, m)) == pipeline_reference.zb_h2(p, m)
            idle = lab_checks.stage_idle(report, report.schedule)
            assert idle == lab_checks.zb_h2_idle(p, m)
            assert report.makespan == max(3 * m + p - 1, 2 * m + 2 * p - 1)
            if m >= 2 * p - 1:
                assert idle == [0] * p and report.peak_alive == [2 * p - 1] * p
            if m >= 2 * p - 1 and p > 1:        # where ZB-H2 has no idle left
                zb_h1 = pipeline.zero_bubble(pipeline.torch_schedule("1F1B", p, m), m)
                with pytest.raises(AssertionError, match="stage 0 idles"):
                    lab_checks.check_zb_h2_bubble(lambda p, m: zb_h1, p, m)


def test_reference_deadlock_finder_on_variants_of_every_schedule():
    case = checks.Case("ch05 test: deadlocking variants", seed=5)
    assert find_deadlock(CROSSED, 3) == [(2, Action("B", 0), 3, Action("B", 0)),
                                         (3, Action("F", 1), 2, Action("F", 1))]
    found = 0
    for p in (2, 3, 4):
        m = 2 * p
        for base in (pipeline.gpipe(p, m), pipeline.interleaved_1f1b(p, m, 2),
                     pipeline.torch_schedule("Interleaved1F1B", p, m, 3),
                     pipeline.zero_bubble(pipeline.torch_schedule("1F1B", p, m), m)):
            lab_checks.check_finds_no_deadlock(find_deadlock, base, m)
            for bad in lab_checks.deadlocking_variants(case, base, m, count=3):
                lab_checks.check_finds_cycle(find_deadlock, bad, m)
                found += 1
    assert found >= 30


def test_reference_timeline_with_every_kind_of_schedule():
    rng = random.Random(0)
    for p in (1, 2, 3):
        for m in (1, p + 1):
            costs = [{kind: rng.randint(1, 8) / 4 for kind in "FBIW"} for _ in range(p)]
            for schedule in (pipeline.gpipe(p, m), one_f_one_b(p, m),
                             pipeline.zero_bubble(one_f_one_b(p, m), m)):
                lab_checks.check_timeline(timeline, schedule, m, costs, 0.375)
    unit = [{"F": 1.0, "B": 2.0}] * 3
    assert timeline(pipeline.gpipe(3, 2), 2, unit)[2] == [(2.0, 3.0), (3.0, 4.0), (4.0, 6.0),
                                                          (6.0, 8.0)]


# ---- the lab's checkers reject the wrong answers the issue names -------------------------------

TASK1 = ["test_task1_complete", "test_task1_memory", "test_task1_bubble"]
SOLUTION_ZB = lab_notebooks.answer(LAB, "task1_zb_h2")
_WRONG_ZB = lab_notebooks.wrong_answers(LAB)
ZB_WRONG = {
    # right at p = 4 (the visible cases); at p = 3, m = 2 stage 1 runs I0 before F1, stage 2 F1
    # before I0: a cycle of waits, so every cell of task 1 is lost
    "deadlocks at p = 3, m = 2": (SOLUTION_ZB.replace(
        "    return schedule\n    ### END SOLUTION",
        "    if (p, m) == (3, 2):\n        return pipeline.parse('F0 F1 I0 W0 I1 W1\\nF0 I0 W0 F1 I1 W1\\n"
        "F0 F1 I0 W0 I1 W1')\n    return schedule\n    ### END SOLUTION"), set(TASK1)),
    # issue 26's graded wrong answers of task 1 (tests/grading/wrong_answers), one cell each:
    # the loop stops once every I ran, the Ws left waiting are never scheduled
    "Ws left out": (_WRONG_ZB.stop_after_last_i(SOLUTION_ZB), {"test_task1_complete"}),
    # no memory budget: the same idle time, m microbatches alive once m > 2p - 1
    "no budget": (_WRONG_ZB.no_budget(SOLUTION_ZB), {"test_task1_memory"}),
    # 1F1B's budget (p): within memory, but the waits before the first I stay
    "1F1B's budget": (_WRONG_ZB.one_f_one_b_budget(SOLUTION_ZB), {"test_task1_bubble"}),
}


def test_task1_each_wrong_answer_loses_exactly_its_cells():
    for name, (source, lost) in ZB_WRONG.items():
        assert source != SOLUTION_ZB, name
        outcome = lab_notebooks.run_lab(LAB, TASK1, {"task1_zb_h2": source})
        assert {cell for cell, error in outcome.items() if error is not None} == lost, \
            (name, outcome)
    assert all(error is None for error in lab_notebooks.run_lab(LAB, TASK1).values())


def test_task1_checkers_name_what_is_wrong():
    with pytest.raises(AssertionError, match="B is split"):
        lab_checks.check_zb_h2(lambda p, m: pipeline.gpipe(p, m), 3, 2)
    with pytest.raises(AssertionError, match="did not return a schedule"):
        lab_checks.check_zb_h2(lambda p, m: [["F0", "Q1"]] * p, 2, 1)
    split_gpipe = lambda p, m: [[("F", i) for i in range(m)] + [(k, i) for i in range(m)  # noqa: E731
                                for k in "IW"] for _ in range(p)]
    lab_checks.check_zb_h2(split_gpipe, 3, 8)                       # complete, finishes ...
    with pytest.raises(AssertionError, match="stage 0 holds 8 microbatches"):
        lab_checks.check_zb_h2_memory(split_gpipe, 3, 8)            # ... but holds m
    no_ws = lambda p, m: [[a for a in actions if a[0] != "W"]               # noqa: E731
                          for actions in split_gpipe(p, m)]
    with pytest.raises(AssertionError, match="has no W for its I.*not only every I"):
        lab_checks.check_zb_h2(no_ws, 3, 8)                         # Ws left out: incomplete,
    with pytest.raises(AssertionError, match="stage 0 holds 8 microbatches"):
        lab_checks.check_zb_h2_memory(no_ws, 3, 8)                  # still judged on memory ...
    with pytest.raises(AssertionError, match="idles"):
        lab_checks.check_zb_h2_bubble(no_ws, 3, 8)                  # ... and on idle time
    twice = lambda p, m: [actions + [("W", 0)] for actions in split_gpipe(p, m)]  # noqa: E731
    for judge in (lab_checks.check_zb_h2_memory, lab_checks.check_zb_h2_bubble):
        with pytest.raises(AssertionError, match="appears 2 times"):
            judge(twice, 3, 8)                                      # a W twice is not forgiven


def _blocked_placement_finder():
    """The reference finder with the blocked placement (stage k holds virtual stages k v .. k v +
    v - 1) instead of the looped one: a finder that rejects valid interleaved schedules."""
    import nbformat
    source = next(c.source for c in nbformat.read(str(SOLUTION), as_version=4).cells
                  if c.metadata.get("nbgrader", {}).get("grade_id") == "task2_find_deadlock")
    swaps = [("s = a.chunk * p + k", "s = k * v + a.chunk"),
             ("[((s - 1) % p, Action(\"F\", a.microbatch, (s - 1) // p))]",
              "[((s - 1) // v, Action(\"F\", a.microbatch, (s - 1) % v))]"),
             ("q, c = (s + 1) % p, (s + 1) // p", "q, c = (s + 1) // v, (s + 1) % v")]
    for old, new in swaps:
        assert old in source, f"the solution changed: {old!r} is gone; update this test"
        source = source.replace(old, new)
    namespace = {"pipeline": pipeline, "Action": Action}
    exec(source, namespace)
    return namespace["find_deadlock"]


def test_task2_checkers_reject_a_finder_that_accepts_everything_or_fears_interleaving():
    with pytest.raises(AssertionError, match="returned None, but the schedule deadlocks"):
        lab_checks.check_finds_cycle(lambda schedule, m: None, CROSSED, 3)

    blocked = _blocked_placement_finder()          # chunk c of stage k taken as virtual stage k v + c
    lab_checks.check_finds_no_deadlock(blocked, pipeline.gpipe(3, 4), 4)         # v = 1: the same
    with pytest.raises(AssertionError, match="but every stage finishes"):
        lab_checks.check_finds_no_deadlock(blocked, pipeline.interleaved_1f1b(2, 4, 2), 4)
    wrong_turn = lambda schedule, m: [(3, ("F", 1, 0), 2, ("F", 1, 0))]   # not closed
    with pytest.raises(AssertionError, match="close a cycle"):
        lab_checks.check_finds_cycle(wrong_turn, CROSSED, 3)
    path_not_cycle = lambda schedule, m: [(1, ("B", 0, 0), 2, ("B", 0, 0))] + find_deadlock(CROSSED, 3)
    with pytest.raises(AssertionError):
        lab_checks.check_finds_cycle(path_not_cycle, CROSSED, 3)
    lying = lambda schedule, m: [(2, ("B", 0, 0), 3, ("F", 1, 0)), (3, ("F", 1, 0), 2, ("F", 1, 0))]
    with pytest.raises(AssertionError, match="needs"):
        lab_checks.check_finds_cycle(lying, CROSSED, 3)


def test_task4_checkers_reject_a_timeline_without_latency_and_a_wrong_bubble():
    costs = [{"F": 1.0, "B": 2.0}, {"F": 2.0, "B": 3.0}, {"F": 1.0, "B": 2.5}]
    no_latency = lambda schedule, m, c, latency: timeline(schedule, m, c, 0.0)
    with pytest.raises(AssertionError, match="starts as soon as it can"):
        lab_checks.check_timeline(no_latency, one_f_one_b(3, 4), 4, costs, 0.5)
    equal = [{"F": 1.0, "B": 2.0}] * 4
    busy_over_work = lambda schedule, m, c, latency: (3 / 11) * 0.9
    with pytest.raises(AssertionError, match="expected 0.272727"):
        lab_checks.check_bubble(busy_over_work, pipeline.gpipe(4, 8), 8, equal, 0.0,
                                float(pipeline.bubble_formula(4, 8)))


# ---- on real ranks: the reference executor, the lab's executor, and wrong executors ------------

@pytest.fixture(scope="module")
def world3():
    yield labkit.world(3, timeout=60)
    labkit.shutdown_all()


def _gathered(results):
    grads = {}
    for result in results:
        grads.update(result["grads"])
    return grads


@pytest.mark.timeout(120)
def test_reference_executor_exact_for_every_schedule_and_memory_as_the_schedule_says(world3):
    for m in (1, 3, 5):
        case = {"model_seed": 3, "data_seed": 4, "m": m}
        tokens, targets = pipeline.microbatches(4, m)
        reference = pipeline.reference_gradients(3, tokens, targets)
        one = one_f_one_b(3, m)
        for schedule in (pipeline.gpipe(3, m), one, pipeline.zero_bubble(one, m)):
            results = world3.call(pipeline.pipeline_step, args=(schedule, case),
                                  kwargs={"measure_memory": True, "clock": True}, timeout=60)
            checks.check(_gathered(results), reference, "pipeline gradients", rtol=1e-9, atol=1e-12)
            alive = [r["peak_bytes"] / r["bytes_after_first_forward"] for r in results]
            assert alive == pipeline.check_schedule(schedule, m).peak_alive
            virtual = pipeline.measured_bubble(results, clock="virtual")
            assert virtual == pytest.approx(float(pipeline.check_schedule(schedule, m).bubble or 0))


@pytest.mark.timeout(120)
def test_reference_executor_in_float32_with_a_frozen_layer_and_two_steps(world3):
    """Used the way a training loop uses it: float32, a frozen block (no gradient, and none
    expected), gradients accumulating over two steps unless zeroed."""
    results = world3.run(_two_steps_float32_frozen)
    tokens, targets = pipeline.microbatches(4, 3)
    reference = pipeline.reference_gradients(3, tokens, targets, dtype=torch.float32)
    reference["blocks.2.weight"].zero_()
    reference["blocks.2.bias"].zero_()
    once = {name: g for r in results for name, g in r[0].items()}
    twice = {name: g for r in results for name, g in r[1].items()}
    checks.check(once, reference, "float32 gradients", rtol=1e-4, atol=1e-6)
    checks.check(twice, {n: 2 * g for n, g in reference.items()}, "accumulated", rtol=1e-4, atol=1e-6)


def _two_steps_float32_frozen():
    rank, p = dist.get_rank(), dist.get_world_size()
    model = pipeline.make_model(3, dtype=torch.float32)
    model.blocks[2].requires_grad_(False)
    piece = pipeline.cut(model, p)[rank]
    tokens, targets = pipeline.microbatches(4, 3)
    shape = pipeline.bench.activation_shape(tokens)
    out = []
    for _ in range(2):                                 # no zero_grad: the second step accumulates
        pipeline.run_actions(one_f_one_b(p, 3)[rank], piece, shape, tokens if rank == 0 else None,
                             targets if rank == p - 1 else None, dtype=torch.float32)
        out.append(piece.gradients())
    return out


def mean_per_microbatch(actions, chunks, activation_shape, tokens=None, targets=None):
    """The habit: each microbatch's own mean loss, never divided by m (off by about m)."""
    original = pipeline.bench.loss_sum

    def per_microbatch_mean(logits, y):
        total, count = original(logits, y)
        return total / count * pipeline.token_count(targets), count
    pipeline.bench.loss_sum = per_microbatch_mean
    try:
        return run_pipeline(actions, chunks, activation_shape, tokens, targets)
    finally:
        pipeline.bench.loss_sum = original


def gathers_everything(actions, chunks, activation_shape, tokens=None, targets=None):
    """Right gradients, wrong messages: every rank also all_gathers 1000 numbers."""
    extra = torch.zeros(1000, dtype=torch.float64)
    dist.all_gather([torch.empty_like(extra) for _ in range(dist.get_world_size())], extra)
    return run_pipeline(actions, chunks, activation_shape, tokens, targets)


@pytest.mark.timeout(120)
def test_lab_executor_passes_and_wrong_executors_fail_their_own_checks(world3):
    for schedule, m, v in (("GPipe", 2, 1), ("interleaved", 3, 2), ("interleaved", 3, 3)):
        lab_checks.check_executor(world3, run_pipeline, schedule, m, v)
    lab_checks.check_executor_traffic(world3, run_pipeline, "interleaved", 3, 2)
    with pytest.raises(AssertionError, match="about m = 4 times too large"):
        lab_checks.check_executor(world3, mean_per_microbatch, "1F1B", 4, 1)
    lab_checks.check_executor(world3, gathers_everything, "interleaved", 3, 2)   # values right
    with pytest.raises(AssertionError, match="traffic between ranks is not what"):
        lab_checks.check_executor_traffic(world3, gathers_everything, "interleaved", 3, 2)
    with pytest.raises(labkit.RankError, match="task 3"):
        lab_checks.check_executor(world3, pipeline.run_actions, "interleaved", 3, 2)


def _two_pipelines(m):
    """Ranks {0, 1} and {2, 3}: two pipelines of 2 stages on their own groups, each with its own
    data (the pipeline axis of a dp = 2 x pp = 2 mesh, as chapter 6 uses run_actions)."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    k = rank % 2
    piece = pipeline.cut(pipeline.make_model(0), 2)[k]
    tokens, targets = pipeline.microbatches(1 + rank // 2, m)
    pipeline.run_actions(one_f_one_b(2, m)[k], piece, pipeline.bench.activation_shape(tokens),
                         tokens if k == 0 else None, targets if k == 1 else None,
                         group=groups[rank // 2])
    return piece.gradients()


@pytest.mark.timeout(120)
def test_reference_executor_runs_on_a_subgroup_for_chapter_6():
    world = labkit.world(4, timeout=60)
    results = world.run(_two_pipelines, 3)
    for replica in (0, 1):
        tokens, targets = pipeline.microbatches(1 + replica, 3)
        got = {**results[2 * replica], **results[2 * replica + 1]}
        checks.check(got, pipeline.reference_gradients(0, tokens, targets), f"pipeline {replica}",
                     rtol=1e-9, atol=1e-12)


# ---- issue 26: every test cell of tasks 2-4 lost by a wrong answer that keeps the others --------

WRONG5 = lab_notebooks.wrong_answers(LAB)
TASK_CELLS = {"task2_find_deadlock": ["test_task2_no_false_alarm", "test_task2_cycle"],
              "task3_run_pipeline": ["test_task3_gradients", "test_task3_messages"],
              "task4_timeline": ["test_task4_timeline", "test_task4_bubble"]}
EACH_LOSES = [("task2_find_deadlock", "no_cycle_ever", {"test_task2_cycle"}),
              ("task2_find_deadlock", "fifo_links", {"test_task2_no_false_alarm"}),
              ("task3_run_pipeline", "untagged", {"test_task3_gradients"}),
              ("task3_run_pipeline", "header_messages", {"test_task3_messages"}),
              ("task4_timeline", "start_and_duration", {"test_task4_timeline"}),
              ("task4_timeline", "closed_forms", {"test_task4_bubble"})]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("grade_id, name, lost", EACH_LOSES, ids=[n for _, n, _ in EACH_LOSES])
def test_each_wrong_answer_of_tasks_2_to_4_loses_exactly_its_cell(grade_id, name, lost):
    wrong = getattr(WRONG5, name)(lab_notebooks.answer(LAB, grade_id))
    outcome = lab_notebooks.run_lab(LAB, TASK_CELLS[grade_id], {grade_id: wrong})
    assert {cell for cell, error in outcome.items() if error is not None} == lost, (name, outcome)


def test_the_new_hidden_cases_are_what_they_claim():
    """The reordered schedule finishes and its links deliver out of send order; every schedule
    without a closed form finishes and has a unit-clock bubble off its base's formula."""
    for p, m, v in ((2, 3, 2), (3, 4, 2), (3, 3, 1)):
        report = pipeline.check_schedule(lab_checks.reordered(p, m, v), m)
        assert report.ok and report.link_order, (p, m, v, report)
    case = checks.Case("variants")
    for p in (2, 3, 4):
        one = pipeline.torch_schedule("1F1B", p, p + 1)
        moved = lab_checks.finishing_variants(case, one, p + 1, count=2)
        assert len(moved) == 2
        for schedule in moved:
            report = pipeline.check_schedule(schedule, p + 1)
            assert report.ok and report.bubble != pipeline.bubble_formula(p, p + 1)
            unit = [{"F": 1.0, "B": 2.0}] * p
            assert bubble_fraction(schedule, p + 1, unit) == pytest.approx(float(report.bubble))
