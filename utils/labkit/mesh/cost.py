"""The step-time and memory model of a 3D-parallel configuration (chapter 6, sections 2 and 4).

    config = {"dp": 24, "tp": 8, "pp": 8, "zero_stage": 1, "microbatches": 96}
    cost = predict(model, cluster.with_nodes(192), config, global_batch=2304)
    cost["step_time"], cost["memory"], cost["fits"], cost["breakdown"]

Every piece is a formula of an earlier chapter, per rank and per step (b = global_batch / (dp m)
sequences per microbatch, s tokens each, h hidden, 2-byte activations and weights):

    compute    F / (N peak eff)        F: Narayanan et al.'s FLOPs per step (eq. 3): 72 B s L h^2
                                       (1 + s/(6h) + V/(12 L h)), 96 ... V/(16 L h) with full
                                       recomputation (the forward runs twice)
    bubble     compute x (pp - 1) / m  1F1B (chapter 5: bubble over ideal time)
    tp         k (L/pp) m x 2(tp-1)/tp x b s h 2 / bw_tp    k = 4 all-reduces per layer (chapter
                                       4), 6 with full recomputation (the forward's two again);
                                       plus, with the pipeline's scatter/gather, one all-gather
                                       (tp-1)/tp x b s h 2 per message a stage receives
    pp         2 m x b s h 2 / tp / bw_pp   an activation forward and a gradient back per
                                       microbatch; each tp rank sends its 1/tp of it (Narayanan et
                                       al. 2021, section 4.1, "scatter/gather": the receiving
                                       stage all-gathers it over tp; Megatron-LM's default,
                                       scatter_gather_tensors_in_pipeline; with sequence
                                       parallelism Megatron-Core sends [s/t, b, h] anyway);
                                       pp_scatter_gather=False charges every tp rank the whole;
                                       sequence_parallel=True: the same tp bytes in twice the
                                       collectives, the pp message [s/t, b, h] (`axis_bytes`)
    dp         `dp_wire_bytes` of the rank's Psi' = Psi / (tp pp) parameters, / bw_dp: gradients
               in `grad_bytes` (default 4: FP32, Megatron-LM's default for BF16 training and
               FSDP2 recipes' reduce_dtype=float32), weights gathered in 2 bytes
    latency    alpha x (collectives and messages of the step)

An MoE model folds expert parallelism into dp (Megatron-Core, torchtitan, DeepSpeed): the world
stays dp x tp x pp, ep divides dp, and `moe_dp_wire_bytes` charges the dense parameters over dp
and each rank's experts over its expert-data-parallel group of dp / ep ranks.

bw_axis is the fast link inside a node when every group of the axis stays inside one node
(`layout.inside_node`, the course's order (dp, pp, tp)), else the link between nodes. Nothing
overlaps by default (dp_overlap=0): the model adds the parts. It is *not* a bound on a real job:
`efficiency` is a constant, so it errs optimistic where real matrix products run slower than
that (chapter 6, section 5 compares it with Megatron-LM's measurements, and it predicts more
than they measured in most rows). Memory is chapter 3's per-rank ledger
(`memory.ledger.per_rank_ledger`, 1F1B, the peak with transients).

ZeRO-2 and ZeRO-3 inside a pipeline (`reshard`):
    "microbatch"  reshard and reduce-scatter at every microbatch, DeepSpeed's ZeRO-3 as chapter 3
                  built it: ZeRO-3 sends (2 m w + m g) Psi', ZeRO-2 (w + m g) Psi'; the rank holds
                  1/dp of its weights (ZeRO-3) and gradients between uses
    "step"        keep the weights gathered and the gradients unsharded for the whole step, one
                  all-gather and one reduce-scatter per step, (w + g) Psi', as ZeRO-1; the price
                  is holding the whole Psi' of weights and gradients during the step (the ledger
                  of ZeRO-1). torch's pipelining stage does this to an FSDP stage
                  (`torch/distributed/pipelining/stage.py`: `backward_maybe_with_nosync` sets
                  reshard_after_backward and requires_gradient_sync False for every microbatch,
                  `perform_reduce_grad` turns them back on once, after the last); torchtitan
                  also sets reshard_after_forward=False when pp > 1.
(each times (dp - 1)/dp, w = 2 bytes a weight, g = `grad_bytes` a gradient)

Assumed, not measured, and stated where used: `efficiency` (the fraction of peak a GPU reaches on
this model's matrix products; Narayanan et al. report 44-52% of peak end to end) and `alpha` (a
collective's fixed cost, tens of microseconds on GPU clusters).
"""
from __future__ import annotations

from labkit.memory import ledger
from labkit.mesh import layout
from labkit.mesh.figures import Cluster, Model

EFFICIENCY = 0.6
ALPHA = 20e-6
BYTES = 2                      # BF16 activations and weights on the wire
GRAD_BYTES = 4                 # FP32 gradients on the data-parallel wire (Megatron-LM's default
                               # for BF16: accumulate_allreduce_grads_in_fp32; FSDP2's
                               # MixedPrecisionPolicy(reduce_dtype=torch.float32) in recipes)
RESHARD = ("microbatch", "step")


def flops_per_step(model: Model, global_batch: int, recompute: str = "full") -> float:
    """Narayanan et al. 2021, eq. 3: matrix-product FLOPs of one step of `global_batch` sequences.
    Per layer and token a forward costs 24 h^2 + 4 s h, the logits 2 V h; backward twice that."""
    B, s, L, h, V = global_batch, model.seq, model.layers, model.hidden, model.vocab
    if recompute == "full":
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def dp_wire_bytes(psi: float, dp: int, zero_stage: int, microbatches: int = 1,
                  reshard: str = "microbatch", grad_bytes: float = GRAD_BYTES,
                  weight_bytes: float = BYTES) -> float:
    """Bytes one rank sends per step over its dp group for Psi' = `psi` parameters, (dp-1)/dp of
    each collective (a ring): ZeRO-0 all-reduces the gradients, 2 g; ZeRO-1 reduce-scatters them
    and all-gathers the weights, g + w; ZeRO-2 and 3 as the module docstring says for `reshard`
    ("microbatch": (w + m g) and (2 m w + m g); "step": g + w, as ZeRO-1)."""
    if zero_stage not in ledger.STAGES:
        raise ValueError(f"zero_stage must be one of {ledger.STAGES}, got {zero_stage!r}")
    if reshard not in RESHARD:
        raise ValueError(f"reshard must be one of {RESHARD}, got {reshard!r}")
    for name, value in (("dp", dp), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    m, g, w = microbatches, grad_bytes, weight_bytes
    if zero_stage >= 2 and reshard == "step":
        zero_stage = 1
    per_psi = {0: 2 * g, 1: g + w, 2: w + m * g, 3: 2 * m * w + m * g}[zero_stage]
    return per_psi * (dp - 1) / dp * psi


def moe_dp_wire_bytes(dense_psi: float, expert_psi: float, dp: int, ep: int, zero_stage: int = 1,
                      microbatches: int = 1, reshard: str = "microbatch",
                      grad_bytes: float = GRAD_BYTES, weight_bytes: float = BYTES) -> float:
    """Bytes one rank sends per step over its data-parallel groups when expert parallelism is
    folded into dp (`layout.expert_groups`; Megatron-Core's expert-data-parallel group): the
    rank's `dense_psi` dense parameters over its whole dp group of d ranks, and its share of the
    stage's `expert_psi` expert parameters, expert_psi / ep (its E / ep experts), over its
    expert-data-parallel group of d / ep ranks:

        dp_wire_bytes(dense_psi, d) + dp_wire_bytes(expert_psi / ep, d / ep)

    (each with `dp_wire_bytes`' ZeRO stage, reshard and byte sizes; per (tp, pp) rank: pass
    Psi / (tp pp) of each kind). The all-to-all of the tokens is chapter 7's, not counted here."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or dp % ep:
        raise ValueError(f"ep ({ep!r}) must be a positive int that divides dp ({dp}): expert "
                         f"parallelism is carved out of the data-parallel ranks")
    dense = dp_wire_bytes(dense_psi, dp, zero_stage, microbatches, reshard, grad_bytes,
                          weight_bytes) if dp > 1 else 0.0
    edp = dp // ep
    experts = dp_wire_bytes(expert_psi / ep, edp, zero_stage, microbatches, reshard, grad_bytes,
                            weight_bytes) if edp > 1 else 0.0
    return dense + experts


def problems(model: Model, cluster: Cluster, config: dict, global_batch: int) -> list:
    """Why `config` cannot run `model` on `cluster` (empty when it can)."""
    found = []
    keys = ("dp", "tp", "pp", "zero_stage", "microbatches")
    missing = [k for k in keys if k not in config]
    if missing:
        return [f"config needs {', '.join(keys)}; missing {missing}"]
    dp, tp, pp, stage, m = (config[k] for k in keys)
    for name in ("dp", "tp", "pp", "microbatches"):
        value = config[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            found.append(f"{name} must be a positive int, got {value!r}")
    if found:
        return found
    if stage not in ledger.STAGES:
        found.append(f"zero_stage must be one of {ledger.STAGES}, got {stage!r}")
    if dp * tp * pp != cluster.gpus:
        found.append(f"GPUs ({cluster.gpus}) != dp ({dp}) x tp ({tp}) x pp ({pp}) = {dp * tp * pp}")
    if model.heads % tp:
        found.append(f"tp ({tp}) does not divide the heads ({model.heads})")
    if model.layers % pp:
        found.append(f"pp ({pp}) does not divide the layers ({model.layers})")
    if global_batch % (dp * m):
        found.append(f"global batch ({global_batch}) is not dp ({dp}) x microbatches ({m}) x "
                     f"a whole micro-batch")
    return found


def axis_bytes(model: Model, config: dict, global_batch: int, recompute: str = "full", *,
               reshard: str = "microbatch", grad_bytes: float = GRAD_BYTES,
               pp_scatter_gather: bool = True, sequence_parallel: bool = False) -> dict:
    """Bytes one rank sends per step on each axis, and the collectives or messages it issues.

    sequence_parallel (chapter 4; Korthikanti et al. 2022): each tp all-reduce becomes a
    reduce-scatter and an all-gather, the same (t-1)/t + (t-1)/t bytes in twice the collectives;
    the activation between stages is already sharded [s/t, b, h] (Megatron-Core's
    `get_tensor_shapes`), so the pipeline sends 1/t of it and nothing is all-gathered on arrival."""
    dp, tp, pp, stage, m = (config[k] for k in ("dp", "tp", "pp", "zero_stage", "microbatches"))
    b = global_batch // (dp * m)
    activation = b * model.seq * model.hidden * BYTES                 # one [b, s, h] tensor
    per_layer = 6 if recompute == "full" else 4
    layers = model.layers // pp
    tp_calls = per_layer * layers * m if tp > 1 else 0
    tp_bytes = tp_calls * 2 * (tp - 1) / tp * activation
    pp_calls = 2 * m if pp > 1 else 0
    pp_bytes = pp_calls * activation
    if sequence_parallel and tp > 1:
        tp_calls *= 2                             # reduce-scatter + all-gather per all-reduce
        pp_bytes /= tp                            # [s/t, b, h] between stages, kept sharded
    elif pp_scatter_gather and pp > 1 and tp > 1:
        pp_bytes /= tp                            # each tp rank sends its 1/tp of [b, s, h] ...
        tp_calls += pp_calls                      # ... and the receiver all-gathers it over tp
        tp_bytes += pp_calls * (tp - 1) / tp * activation
    psi_rank = model.parameters / (tp * pp)
    dp_bytes = (dp_wire_bytes(psi_rank, dp, stage, m, reshard, grad_bytes) if dp > 1 else 0.0)
    units = {0: 2, 1: 2, 2: 1 + m, 3: 3 * m}[1 if stage >= 2 and reshard == "step" else stage]
    dp_calls = units * layers if dp > 1 else 0
    return {"tp": tp_bytes, "pp": pp_bytes, "dp": dp_bytes,
            "calls": {"tp": tp_calls, "pp": pp_calls, "dp": dp_calls}}


def bandwidths(cluster: Cluster, config: dict) -> dict:
    """{axis: bytes/s}: the link inside a node if every group of the axis fits in one node."""
    dp, tp, pp = config["dp"], config["tp"], config["pp"]
    return {axis: cluster.intra_bw if layout.inside_node(axis, dp, pp, tp, cluster.gpus_per_node)
            else cluster.inter_bw for axis in ("tp", "pp", "dp")}


def memory(model: Model, config: dict, global_batch: int, recompute: str = "full", *,
           reshard: str = "microbatch", sequence_parallel: bool = False) -> dict:
    """Chapter 3's per-rank ledger for this configuration (1F1B, peak with transients). With
    reshard="step", ZeRO-2 and 3 hold the whole weights and gradients of the rank during the step:
    their peak is ZeRO-1's ledger."""
    m, stage = config["microbatches"], config["zero_stage"]
    if reshard not in RESHARD:
        raise ValueError(f"reshard must be one of {RESHARD}, got {reshard!r}")
    if reshard == "step" and stage >= 2:
        stage = 1
    return ledger.per_rank_ledger(
        model.layers, model.hidden, model.heads, model.seq, global_batch // (config["dp"] * m),
        vocab=model.vocab, dp=config["dp"], tp=config["tp"], pp=config["pp"],
        zero_stage=stage, recompute=recompute, schedule="1f1b", microbatches=m,
        sequence_parallel=sequence_parallel)


def predict(model: Model, cluster: Cluster, config: dict, global_batch: int,
            recompute: str = "full", efficiency: float = EFFICIENCY, alpha: float = ALPHA,
            memory_limit: float | None = None, dp_overlap: float = 0.0, *,
            reshard: str = "microbatch", grad_bytes: float = GRAD_BYTES,
            pp_scatter_gather: bool = True, sequence_parallel: bool = False) -> dict:
    """Step time (seconds, and its parts), peak memory per rank and whether it fits, throughput.

    Raises ValueError listing every reason when the configuration cannot run (see `problems`).
    memory_limit: bytes a rank may use (default: the GPU's memory). dp_overlap: the fraction of
    the dp time hidden behind backward (0: none, the model's default; today's stacks overlap it:
    Megatron-Core's --overlap-grad-reduce (2023), FSDP2, DeepSpeed. Megatron-LM's 2021 runs did
    not). reshard, grad_bytes, pp_scatter_gather: see the module docstring; sequence_parallel:
    `axis_bytes` and chapter 3's ledger (activations that were whole on every tp rank split by t)."""
    found = problems(model, cluster, config, global_batch)
    if found:
        raise ValueError("; ".join(found))
    dp, tp, pp, m = config["dp"], config["tp"], config["pp"], config["microbatches"]
    flops = flops_per_step(model, global_batch, recompute)
    compute = flops / (cluster.gpus * cluster.peak_flops * efficiency)
    sent = axis_bytes(model, config, global_batch, recompute, reshard=reshard,
                      grad_bytes=grad_bytes, pp_scatter_gather=pp_scatter_gather,
                      sequence_parallel=sequence_parallel)
    bw = bandwidths(cluster, config)
    parts = {"compute": compute, "bubble": compute * (pp - 1) / m}
    for axis in ("tp", "pp", "dp"):
        parts[axis] = sent[axis] / bw[axis]
    parts["dp"] *= 1.0 - dp_overlap
    parts["latency"] = alpha * sum(sent["calls"].values())
    step = sum(parts.values())
    ledger_ = memory(model, config, global_batch, recompute, reshard=reshard,
                     sequence_parallel=sequence_parallel)
    limit = cluster.memory if memory_limit is None else memory_limit
    return {"step_time": step, "breakdown": parts,
            "bytes": {k: sent[k] for k in ("tp", "pp", "dp")},
            "bandwidth": bw, "memory": ledger_["peak"], "ledger": ledger_,
            "fits": ledger_["peak"] <= limit, "limit": limit,
            "tokens_per_second": global_batch * model.seq / step,
            "tflops_per_gpu": flops / step / cluster.gpus / 1e12}


def show(cost: dict) -> str:
    """One line per part of the step, and the memory."""
    parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in cost["breakdown"].items())
    return (f"step {cost['step_time'] * 1e3:.0f} ms ({parts}); {cost['tflops_per_gpu']:.0f} "
            f"TFLOP/s per GPU; peak {cost['memory'] / 1e9:.1f} GB per rank "
            f"({'fits' if cost['fits'] else 'does NOT fit'} in {cost['limit'] / 1e9:.0f} GB)")
