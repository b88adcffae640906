"""Memory: where the bytes of a training rank go, and what ZeRO removes (chapter 3,
`course/03_memory_and_zero.ipynb`; lab 3).

    from labkit.memory import ledger, zero, bench, measure, activations, zero_pipeline, widget
    ledger.model_states(psi=7.5e9, dp=64, stage=1)      # the ZeRO paper's formulas, bytes per rank
    world.run(bench.run_bench, bench.bench_case(stage=3))  # ZeRO stage 3 on real ranks
    measure.profile(step, roles=trainer.roles())         # torch's memory profiler, by category

| module | what |
|---|---|
| `ledger` | formulas only: bytes per parameter (2 + 2 + 12), ZeRO stages, the paper's table, wire bytes, Korthikanti's activations, in-flight microbatches, the per-rank calculator |
| `zero` | ZeRO stages 0-3 for blocks of an MLP (one flat tensor each), fp32 AdamW masters |
| `bench` | the bench on ranks: cases, data, rank programs, torch-module twin, single-process reference |
| `measure` | torch's memory profiler as a timeline by category; bytes saved for backward |
| `activations` | a transformer layer laid out as in Korthikanti et al., tensor- and sequence-parallel |
| `zero_pipeline` | ZeRO inside the stages of a 2-stage pipeline: schedules, one training step |
| `widget` | the calculator widget and its chart |
| `selfcheck` | the chapter's check-yourself questions: answered first, judged here |
| `checks` | lab 3's checkers |

Not here: a ZeRO-1 wrapper for any torch.optim optimizer, a memory predictor for the bench,
the peak of a pipeline stage under ZeRO's policies (lab 3, tasks 1-3).
"""
from labkit.memory.ledger import (FP32_ADAMW, MIXED_ADAMW, Recipe, activation_bytes_per_layer,  # noqa: F401
                                  model_states, per_rank_ledger, rank_bytes, split_bytes,
                                  wire_bytes_per_rank)


def ask(name: str, answer, expected: float, explanation: str, rel_tol: float = 0.02):
    """A self-check: `answer` is what the reader typed (None: not yet). Says right or wrong, then
    explains. Never raises, so a notebook runs through with the question unanswered."""
    if answer is None:
        print(f"Type your answer into `{name}` in the cell above, then run this cell again.")
        return None
    try:
        value = float(answer)
    except (TypeError, ValueError):
        print(f"`{name}` should be a number, got {answer!r}.")
        return False
    right = abs(value - expected) <= rel_tol * abs(expected)
    print(("Right. " if right else f"Not quite: {value:g} against {expected:g}. ") + explanation)
    return right
