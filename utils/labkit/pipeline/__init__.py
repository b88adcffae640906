"""Pipeline parallelism: schedules as data, the schedule checker, the bubble, a reference executor
(chapter 5, `course/05_pipeline_parallel.ipynb`; lab 5; chapter 6 reuses them).

    from labkit import pipeline
    schedule = pipeline.gpipe(p=4, m=8)                    # one list of actions per stage
    report = pipeline.check_schedule(schedule, m=8)        # complete? deadlock? bubble? memory?
    results = world.call(pipeline.pipeline_step, args=(schedule, case))   # on real ranks

Notation: p stages (one rank each), m microbatches, v model chunks per rank (interleaving),
S = v p virtual stages, chunk c of rank r = virtual stage c p + r. Actions: F (forward), B
(backward), I and W (the input-gradient and weight-gradient halves of a backward).

Modules: `schedules.py` (Action, parsing and printing, GPipe, interleaved 1F1B for v >= 2, the
zero-bubble variant of a given 1F1B, torch's own orders and tables, the V layout of ZB-V and
DualPipeV), `analysis.py` (check_schedule:
structure, deadlocks with buffered and blocking sends, unit-cost timeline and bubble, activations
alive, link order; the bubble formulas), `bench.py` (the model cut into pieces, ragged
microbatches, the single-process reference), `executor.py` (run_actions: one piece per rank runs
F/B/I/W with point-to-point messages, a virtual clock, activation bytes; pipeline_step(s) for the
bench), `torch_runs.py` (torch.distributed.pipelining's schedules on the same bench; the saved-activation
peak of torch's 1F1B and interleaved 1F1B), `plots.py`
(timelines; the measured bubble), `checks.py` (lab 5's checkers), `selfcheck.py` (the
chapter's check-yourself questions: answered first, judged here).

Not here (lab 5): ZB-H2 (zero bubble with about twice 1F1B's activations), the deadlock cycle
finder, an executor for v chunks per rank,
the timeline with per-stage costs and message time.
"""
from labkit.pipeline.analysis import (Deadlock, Report, bubble_formula, bubble_ratio_formula,
                                      check_schedule, link_order, peak_alive, simulate,
                                      simulate_blocking_sends, validate)
from labkit.pipeline.bench import (cut, make_model, microbatches, reference_gradients,
                                   token_count)
from labkit.pipeline.executor import ActivationMeter, pipeline_step, pipeline_steps, run_actions
from labkit.pipeline.plots import draw_timeline, events_timeline, measured_bubble
from labkit.pipeline.schedules import (KINDS, Action, action, chunks_of, format_schedule, gpipe,
                                       interleaved_1f1b, normalise, parse, placement,
                                       torch_pipeline_order, torch_schedule, torch_table_kinds,
                                       torch_v_schedule,
                                       unit_cost,
                                       virtual_stage, zero_bubble)
from labkit.pipeline.torch_runs import torch_step

__all__ = [
    "Action", "action", "normalise", "parse", "format_schedule", "chunks_of", "KINDS",
    "virtual_stage", "placement", "unit_cost", "gpipe", "interleaved_1f1b", "zero_bubble",
    "torch_schedule", "torch_pipeline_order", "torch_table_kinds", "torch_v_schedule", "check_schedule", "Report",
    "Deadlock", "validate",
    "simulate", "simulate_blocking_sends", "peak_alive", "link_order", "bubble_formula",
    "bubble_ratio_formula", "make_model", "cut", "microbatches", "reference_gradients",
    "token_count", "run_actions", "pipeline_step", "pipeline_steps", "ActivationMeter",
    "torch_step",
    "draw_timeline", "events_timeline", "measured_bubble",
]
