"""The per-rank memory ledger: formulas only, no torch (chapter 3, `course/03_memory_and_zero.ipynb`).

Notation (the course's, after the ZeRO paper, Rajbhandari et al. 2020, section 3.1):
    Psi   parameters of the model           P (= N_d)  data-parallel ranks sharing the states
    b_param, b_grad, K   bytes per parameter for the parameters, the gradients and the optimizer
          states; mixed-precision AdamW: 2 + 2 + 12 (K = fp32 master copy 4 + momentum 4 + variance 4)

    M_rank = Psi * (b_rep + b_shard / P) + M_act + M_transient        (steady: without M_transient)

where b_rep are the bytes per parameter every rank keeps whole and b_shard those split over the P
ranks. ZeRO stage 1 moves K into b_shard, stage 2 also b_grad, stage 3 also b_param.

Activations per transformer layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4), 16-bit activations, s sequence, b micro-batch, h hidden,
a heads, t tensor-parallel ranks:
    no parallelism         s*b*h * (34 + 5*a*s/h)
    tensor parallel        s*b*h * (10 + 24/t + 5*a*s/(h*t))
    + sequence parallel    s*b*h * (34/t + 5*a*s/(h*t))
    full recomputation     2*s*b*h   (only the layer's input is kept; /t with sequence parallel)
"""
from __future__ import annotations

import dataclasses
import math
from decimal import ROUND_HALF_UP, Decimal

GB = 10**9          # the ZeRO paper's GB (its 7.5B-parameter example: 16 * 7.5e9 B = 120 GB)
STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of each model state."""
    param: float
    grad: float
    optimizer: float          # the ZeRO paper's K

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optimizer


MIXED_ADAMW = Recipe(param=2, grad=2, optimizer=12)    # bf16/fp16 weights and grads, fp32 master + m + v
FP32_ADAMW = Recipe(param=4, grad=4, optimizer=8)      # everything fp32: m + v only
# bf16 weights, fp32 gradient accumulators ("main grads"), fp32 master + m + v: 18 bytes. This is
# Megatron-LM's default with bf16 (its distributed-optimizer docs: 18 bytes per parameter, 6 + 12/d
# with the distributed optimizer, which is ZeRO-1 over the d data-parallel ranks). Chapter 2's
# numerics section measures why: a bf16 accumulator loses small microbatch contributions.
MIXED_ADAMW_FP32_GRADS = Recipe(param=2, grad=4, optimizer=12)
RECIPES = {"mixed": MIXED_ADAMW, "mixed_fp32_grads": MIXED_ADAMW_FP32_GRADS, "fp32": FP32_ADAMW}


def recipe_named(recipe) -> Recipe:
    """A Recipe, or one of RECIPES' names ("mixed" 2+2+12, "mixed_fp32_grads" 2+4+12, "fp32")."""
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be a Recipe or one of {sorted(RECIPES)}, got {recipe!r}")
    return RECIPES[recipe]


def _check_stage(stage) -> None:
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES} (0 = plain data parallel), got {stage!r}")


def _check_positive(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def split_bytes(stage: int, recipe: Recipe = MIXED_ADAMW) -> tuple[float, float]:
    """(b_rep, b_shard): bytes per parameter kept whole on every rank, and split over P ranks."""
    _check_stage(stage)
    recipe = recipe_named(recipe)
    sharded = {0: 0.0, 1: recipe.optimizer, 2: recipe.optimizer + recipe.grad,
               3: recipe.total}[stage]
    return recipe.total - sharded, sharded


def model_states(psi: float, dp: int, stage: int, recipe: Recipe = MIXED_ADAMW) -> dict:
    """Bytes per rank of parameters, gradients and optimizer states under ZeRO `stage` on `dp` ranks.

    Stage 0 (plain DP): (b_param + b_grad + K) * Psi. Stage 1: K * Psi / dp. Stage 2: gradients too.
    Stage 3: parameters too. (ZeRO paper, figure 1 and table 1.)"""
    _check_stage(stage)
    _check_positive(psi=psi, dp=dp)
    recipe = recipe_named(recipe)
    return {"parameters": recipe.param * psi / (dp if stage >= 3 else 1),
            "gradients": recipe.grad * psi / (dp if stage >= 2 else 1),
            "optimizer_states": recipe.optimizer * psi / (dp if stage >= 1 else 1)}


def rank_bytes(psi: float, b_rep: float, b_shard: float, p: int, activations: float = 0.0,
               transients: float = 0.0) -> dict:
    """The ledger in the source material's form: steady and peak bytes of one rank.

    M_rank = Psi * (b_rep + b_shard / p) + M_act (steady), + M_transient (peak)."""
    _check_positive(psi=psi, p=p)
    steady = psi * (b_rep + b_shard / p) + activations
    return {"steady": steady, "peak": steady + transients}


# ---- the ZeRO paper's own numbers ---------------------------------------------------------------

# Figure 1: 7.5B parameters, N_d = 64, K = 12, model states per device (GB, one decimal).
ZERO_FIGURE_1 = {"psi": 7.5e9, "dp": 64, "stages": {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}}

# Table 1 rows: (N_d, model size in parameters) -> (P_os, P_os+g, P_os+g+p) in GB, as printed.
ZERO_TABLE_1 = {
    (1, 7.5e9): (120, 120, 120), (4, 7.5e9): (52.5, 41.3, 30), (16, 7.5e9): (35.6, 21.6, 7.5),
    (64, 7.5e9): (31.4, 16.6, 1.88),
    (1, 128e9): (2048, 2048, 2048), (4, 128e9): (896, 704, 512), (16, 128e9): (608, 368, 128),
    (64, 128e9): (536, 284, 32),
    (1, 1e12): (16000, 16000, 16000), (4, 1e12): (7000, 5500, 4000), (16, 1e12): (4750, 2875, 1000),
}


def paper_round(value: float, significant: int = 3) -> float:
    """The paper's table style: whole numbers from 100 up, else `significant` digits, half up."""
    if value >= 100:
        return float(Decimal(repr(value)).quantize(Decimal(1), rounding=ROUND_HALF_UP))
    exponent = math.floor(math.log10(abs(value))) if value else 0
    step = Decimal(1).scaleb(exponent - significant + 1)
    return float(Decimal(repr(value)).quantize(step, rounding=ROUND_HALF_UP))


def one_decimal(value: float) -> float:
    """Figure 1's style: one decimal, half up."""
    return float(Decimal(repr(value)).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))


def zero_table(psi: float, dp: int, recipe: Recipe = MIXED_ADAMW) -> tuple:
    """(P_os, P_os+g, P_os+g+p) model-state GB per device, unrounded."""
    return tuple(sum(model_states(psi, dp, stage, recipe).values()) / GB for stage in (1, 2, 3))


# ---- communication ------------------------------------------------------------------------------

def communication_volume(stage: int) -> int:
    """Elements each rank moves per step, in units of Psi (ZeRO paper, section 7): a reduce-scatter
    and an all-gather (2 Psi) for DP and stages 1-2; stage 3 gathers the parameters twice (3 Psi)."""
    _check_stage(stage)
    return 3 if stage == 3 else 2


def wire_bytes_per_rank(psi: float, dp: int, stage: int, bytes_per_element: float = 2,
                        microbatches: int = 1, reshard: str = "microbatch",
                        reduction_bytes_per_element: float | None = None) -> float:
    """Bytes each rank sends per step on a ring or direct exchange: (P-1)/P of every collective.

    Stage 3 with m microbatches (gradient accumulation or a pipeline) resharded every microbatch
    (reshard="microbatch") gathers the parameters in every forward and every backward and
    reduce-scatters every backward: 3 m Psi. Stages 1-2 keep one gather per step; stage 2
    reduce-scatters per microbatch: (1 + m) Psi; DP and stage 1: 2 Psi. reshard="step" (weights
    and a full gradient kept for the step, as torch's pipelining stage does to FSDP2; chapter 6's
    `mesh.cost` has the same switch): stages 2-3 send 2 Psi, like stage 1.

    `reduction_bytes_per_element` (default: `bytes_per_element`): the dtype the gradients are
    reduced in, 4 with FP32 main gradients (Megatron's grad_reduce_in_fp32, FSDP2's
    reduce_dtype=float32). The reductions are DP's all-reduce (2 Psi), one reduce-scatter per step
    (stage 1, and stages 2-3 resharded once per step) or per microbatch (stages 2-3); the gathers
    carry the weights in `bytes_per_element`."""
    _check_stage(stage)
    _check_positive(psi=psi, dp=dp, microbatches=microbatches)
    if reshard not in ("microbatch", "step"):
        raise ValueError(f"reshard must be 'microbatch' or 'step', got {reshard!r}")
    reduced = bytes_per_element if reduction_bytes_per_element is None else reduction_bytes_per_element
    if reduction_bytes_per_element is not None:
        _check_positive(reduction_bytes_per_element=reduction_bytes_per_element)
    m = microbatches
    # (reduction, gather) units of Psi per step
    units = {0: (2, 0), 1: (1, 1), 2: (m, 1), 3: (m, 2 * m)}[
        1 if reshard == "step" and stage >= 2 else stage]
    if reduced == bytes_per_element:
        return sum(units) * (dp - 1) / dp * psi * bytes_per_element
    return (units[0] * reduced + units[1] * bytes_per_element) * (dp - 1) / dp * psi


# ---- activations (Korthikanti et al. 2022) ----------------------------------------------------

RECOMPUTE = ("none", "selective", "full")


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Bytes one transformer layer keeps for backward (16-bit activations, 1-byte dropout masks).

    recompute="selective" recomputes the attention core (drops the 5as/h term); "full" keeps only
    the layer's input, 2sbh (2sbh/t with sequence parallelism)."""
    _check_positive(s=s, b=b, h=h, a=a, t=t)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attention_core = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    if sequence_parallel:
        return sbh * (34 / t + attention_core)
    return sbh * (10 + 24 / t + attention_core)


def in_flight_microbatches(schedule: str, pp: int, microbatches: int, stage: int = 0) -> int:
    """Microbatches whose activations a pipeline stage holds at its peak.

    GPipe runs every forward before any backward: all m. 1F1B lets stage i (0-based) start
    backward after pp - i forwards: min(pp - i, m). Stage 0 holds the most."""
    _check_positive(pp=pp, microbatches=microbatches)
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}), got {stage}")
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(pp - stage, microbatches)
    raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")


# ---- one rank of a 3D-parallel job: the calculator behind the widget -----------------------------

def transformer_parameters(layers: int, hidden: int, vocab: int = 0) -> int:
    """12 h^2 + 13 h per layer (attention 4h^2 + 4h, MLP 8h^2 + 5h, two LayerNorms 4h) and a
    V x h embedding (tied with the output layer)."""
    return layers * (12 * hidden * hidden + 13 * hidden) + vocab * hidden


def per_rank_ledger(layers, hidden, heads, seq, micro_batch, vocab=0, dp=1, tp=1, pp=1,
                    zero_stage=0, recompute="none", sequence_parallel=False, schedule="1f1b",
                    microbatches=1, recipe=MIXED_ADAMW, bucket_bytes=25e6,
                    allocator_slack=0.05) -> dict:
    """Bytes one rank holds at its peak, by category, for a GPT-like model on a dp x tp x pp mesh.

    Steady: parameters, gradients, optimizer_states (ZeRO `zero_stage` over dp; tp and pp split
    everything), activations (per layer from Korthikanti et al., times the layers of a stage,
    times the microbatches stage 0 holds under `schedule`). Transients, each named: the layer
    stage 3 gathers (and the next one, prefetched), the gradient buckets being reduced, the fp32
    logits and their gradient on the last stage, the optimizer step's temporaries (torch's foreach
    AdamW: about one fp32 copy of what the rank steps), and allocator slack on top of it all."""
    _check_positive(layers=layers, hidden=hidden, heads=heads, seq=seq, micro_batch=micro_batch,
                    dp=dp, tp=tp, pp=pp, microbatches=microbatches)
    if layers % pp:
        raise ValueError(f"layers ({layers}) must be divisible by pp ({pp})")
    recipe = recipe_named(recipe)
    psi = transformer_parameters(layers, hidden, vocab)
    psi_rank = psi / (tp * pp)                                 # this rank's slice before ZeRO
    states = model_states(psi_rank, dp, zero_stage, recipe)
    per_layer = activation_bytes_per_layer(seq, micro_batch, hidden, heads, tp,
                                           sequence_parallel, recompute)
    in_flight = in_flight_microbatches(schedule, pp, microbatches)
    activations = per_layer * (layers // pp) * in_flight
    layer_params = (12 * hidden * hidden + 13 * hidden) / tp
    transients = {
        "gathered layers (stage 3)": 2 * layer_params * recipe.param if zero_stage == 3 else 0.0,
        "gradient buckets": 0.0 if dp == 1 else min(2 * bucket_bytes, psi_rank * recipe.grad),
        "logits and their gradient": 2 * 4 * seq * micro_batch * vocab / tp,
        "optimizer step temporaries": 4 * psi_rank / (dp if zero_stage >= 1 else 1),
    }
    subtotal = sum(states.values()) + activations + sum(transients.values())
    transients["allocator slack"] = allocator_slack * subtotal
    ledger = dict(states, activations=activations, transients=sum(transients.values()))
    ledger["peak"] = sum(ledger.values())
    ledger["transient_items"] = transients
    ledger["parameters_total"] = psi
    return ledger


def interleaving_penalty(pp: int, chunks: int = 1) -> float:
    """Megatron-LM's factor on the first stage's activations under the interleaved 1F1B schedule
    with v = `chunks` model chunks per stage: 1 + (p - 1) / (p v)
    (megatron/training/theoretical_memory_usage.py, `interleaved_schedule_memory_penalty`); 1 when
    not interleaved (v = 1)."""
    _check_positive(pp=pp, chunks=chunks)
    return 1.0 if chunks == 1 else 1 + (pp - 1) / (pp * chunks)


def stage_ledger(stage, layers, hidden, heads, seq, micro_batch, vocab=0, dp=1, tp=1, pp=1,
                 zero_stage=0, recompute="none", sequence_parallel=False, schedule="1f1b",
                 microbatches=1, recipe=MIXED_ADAMW, chunks=1, bucket_bytes=25e6,
                 allocator_slack=0.05) -> dict:
    """One rank of pipeline stage `stage`: what `per_rank_ledger` counts, with each part where it
    lives. Activations: the microbatches this stage holds (`in_flight_microbatches`; the first
    stage the most, times `interleaving_penalty` for chunks > 1); the fp32 logits and their
    gradient: the last stage only; the V x h embedding: the first stage, and a tied copy for the
    output layer on the last (one copy when pp = 1)."""
    _check_positive(layers=layers, hidden=hidden, heads=heads, seq=seq, micro_batch=micro_batch,
                    dp=dp, tp=tp, pp=pp, microbatches=microbatches, chunks=chunks)
    if layers % pp:
        raise ValueError(f"layers ({layers}) must be divisible by pp ({pp})")
    if not isinstance(stage, int) or not 0 <= stage < pp:
        raise ValueError(f"stage must be an int in [0, pp = {pp}), got {stage!r}")
    recipe = recipe_named(recipe)
    layer_params = (12 * hidden * hidden + 13 * hidden) / tp
    embedding_copies = int(stage == 0) + int(stage == pp - 1 and pp > 1)
    psi_rank = layer_params * (layers // pp) + embedding_copies * vocab * hidden / tp
    states = model_states(psi_rank, dp, zero_stage, recipe)
    per_layer = activation_bytes_per_layer(seq, micro_batch, hidden, heads, tp,
                                           sequence_parallel, recompute)
    in_flight = in_flight_microbatches(schedule, pp, microbatches, stage)
    if schedule == "1f1b":
        in_flight *= interleaving_penalty(pp, chunks)
    activations = per_layer * (layers // pp) * in_flight
    transients = {
        "gathered layers (stage 3)": 2 * layer_params * recipe.param if zero_stage == 3 else 0.0,
        "gradient buckets": 0.0 if dp == 1 else min(2 * bucket_bytes, psi_rank * recipe.grad),
        "logits and their gradient": (2 * 4 * seq * micro_batch * vocab / tp
                                      if stage == pp - 1 else 0.0),
        "optimizer step temporaries": 4 * psi_rank / (dp if zero_stage >= 1 else 1),
    }
    subtotal = sum(states.values()) + activations + sum(transients.values())
    transients["allocator slack"] = allocator_slack * subtotal
    out = dict(states, activations=activations, transients=sum(transients.values()))
    out["peak"] = sum(out.values())
    out.update(transient_items=transients, stage=stage,
               parameters_total=transformer_parameters(layers, hidden, vocab))
    return out


def peak_rank_ledger(layers, hidden, heads, seq, micro_batch, **config) -> dict:
    """The calculator's "one rank": the stage whose rank peaks highest (`stage_ledger` for every
    stage; its "stage" names which, "stage_peaks" lists them all)."""
    pp = config.get("pp", 1)
    _check_positive(pp=pp)
    stages = [stage_ledger(i, layers, hidden, heads, seq, micro_batch, **config) for i in range(pp)]
    worst = max(stages, key=lambda s: s["peak"])
    return dict(worst, stage_peaks=[s["peak"] for s in stages])
