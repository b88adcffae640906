"""Numeric drills of chapters 1, 3, 4 and 5: collectives, memory and ZeRO, tensor and pipeline
parallelism. Each answer comes from the chapter's own function (named in `uses`); the worked
solution shows the same derivation with the drawn numbers. Registered in `numeric.DRILLS`."""
from __future__ import annotations

from fractions import Fraction

from labkit.drill.base import bytes_text, factor, sig
from labkit.drill.numeric import draws, register

MIB_SIZES = (1, 1.5, 2, 2.5, 4, 5, 8)


def _in(value: float, units=("MB", "GB")) -> tuple:
    """(value in the largest of `units` that keeps it >= 1, that unit)."""
    unit = units[0]
    for candidate in units:
        if value >= factor(candidate):
            unit = candidate
    return value / factor(unit), unit


# ---- chapter 1: collectives --------------------------------------------------------------------

@register("ring-bytes", "collectives", "Bytes a rank sends in a ring collective", 1,
          "sections 3-4", ["labkit.collectives.ring_bytes_sent"])
@draws(lambda rng: {"collective": rng.choice(["all_reduce", "all_reduce", "reduce_scatter",
                                              "all_gather"]),
                    "P": rng.choice([3, 4, 6, 8, 12, 16, 64, 256, 1024]),
                    "n": rng.choice(MIB_SIZES) * 10 ** rng.choice([8, 9])})
def _ring_bytes(p, formula):
    c, P, n = p["collective"], p["P"], p["n"]
    sent = formula("labkit.collectives.ring_bytes_sent")(c, n, P)
    answer, unit = _in(sent)
    whole = {"all_gather": " (the output of the all-gather)"}.get(c, "")
    if c == "all_reduce":
        steps = ["A ring all-reduce is a reduce-scatter followed by an all-gather: 2(P - 1) steps,",
                 "each sending one chunk of n/P bytes to the next rank on the ring.",
                 f"2(P - 1)/P x n = 2 x {P - 1}/{P} x {bytes_text(n)} = {bytes_text(sent)}.",
                 "The factor 2(P - 1)/P stays below 2: the bytes per rank barely grow with P;",
                 "the number of steps (latencies) does."]
    else:
        steps = [f"A ring {c.replace('_', '-')} takes P - 1 steps, each sending one chunk of "
                 "n/P bytes.",
                 f"(P - 1)/P x n = {P - 1}/{P} x {bytes_text(n)} = {bytes_text(sent)}."]
    return {"question": f"A ring {c} over P = {P} ranks; the whole tensor is n = "
                        f"{bytes_text(n)}{whole}. How many bytes does each rank send?",
            "answer": answer, "unit": unit, "solution": steps}


@register("ring-time", "collectives", "Time of a ring all-reduce (alpha-beta model)", 1,
          "section 3", ["labkit.collectives.ring_all_reduce_time"])
@draws(lambda rng: {"P": rng.choice([4, 8, 16, 32, 64]),
                    "n": rng.choice([4e6, 16e6, 40e6, 256e6, 1e9]),
                    "alpha_us": rng.choice([2, 5, 10, 20]),
                    "bandwidth_GBps": rng.choice([10, 25, 50, 100, 200])})
def _ring_time(p, formula):
    P, n, a, bw = p["P"], p["n"], p["alpha_us"], p["bandwidth_GBps"]
    seconds = formula("labkit.collectives.ring_all_reduce_time")(n, P, a * 1e-6, 1 / (bw * 1e9))
    chunk_us = n / P / (bw * 1e9) * 1e6
    latency = 2 * (P - 1) * a * 1e-6
    return {"question": f"A ring all-reduce of n = {bytes_text(n)} over P = {P} ranks, with "
                        f"alpha = {a} us per message and a bandwidth 1/beta = {bw} GB/s. "
                        "How long does it take?",
            "answer": seconds * 1e3, "unit": "ms",
            "solution": ["t = 2(P - 1) (alpha + n/P x beta): 2(P - 1) steps, each one message "
                         "of n/P bytes.",
                         f"n/P = {bytes_text(n / P)} takes {sig(chunk_us)} us at {bw} GB/s.",
                         f"t = {2 * (P - 1)} x ({a} us + {sig(chunk_us)} us) = "
                         f"{sig(seconds * 1e3)} ms.",
                         f"Latency is {latency / seconds:.0%} of it "
                         f"({'latency-bound' if latency > seconds / 2 else 'bandwidth-bound'})."]}


def _draw_bandwidth(rng):
    n = rng.choice([64e6, 256e6, 1e9, 4e9])
    algbw = rng.choice([5, 10, 20, 40, 80, 150]) * 1e9 * rng.uniform(0.8, 1.2)
    return {"collective": rng.choice(["all_reduce", "all_reduce", "all_gather",
                                      "reduce_scatter", "all_to_all"]),
            "P": rng.choice([4, 8, 16, 64]), "n": n,
            "ms": float(sig(n / algbw * 1e3, 3).replace(",", "")),
            "ask": rng.choice(["busbw", "busbw", "algbw"])}


@register("bandwidth", "collectives", "Algorithm and bus bandwidth", 1, "section 5",
          ["labkit.collectives.algbw", "labkit.collectives.busbw",
           "labkit.collectives.bus_factor"])
@draws(_draw_bandwidth)
def _bandwidth(p, formula):
    c, P, n, t = p["collective"], p["P"], p["n"], p["ms"] * 1e-3
    alg = formula("labkit.collectives.algbw")(n, t)
    bus = formula("labkit.collectives.busbw")(c, n, t, P)
    bus_factor = formula("labkit.collectives.bus_factor")(c, P)
    shape = "2(P - 1)/P" if c == "all_reduce" else "(P - 1)/P"
    return {"question": f"An {c} of n = {bytes_text(n)} over P = {P} ranks takes {p['ms']} ms. "
                        f"What is its {'bus' if p['ask'] == 'busbw' else 'algorithm'} "
                        "bandwidth (nccl-tests' definition)?",
            "answer": (bus if p["ask"] == "busbw" else alg) / 1e9, "unit": "GB/s",
            "solution": [f"algbw = n / t = {bytes_text(n)} / {p['ms']} ms = {sig(alg / 1e9)} GB/s.",
                         f"busbw = algbw x {shape} (the bytes a link carries) = "
                         f"{sig(alg / 1e9)} x {sig(bus_factor)} = {sig(bus / 1e9)} GB/s.",
                         "busbw, unlike algbw, is comparable across P: it is what each link "
                         "must carry."]}


@register("alpha-beta-crossover", "collectives",
          "Where a ring all-reduce stops being latency-bound", 1, "section 3",
          ["labkit.collectives.ring_all_reduce_time"])
@draws(lambda rng: {"P": rng.choice([2, 4, 8, 16, 64, 512]),
                    "alpha_us": rng.choice([1, 2, 5, 10, 20]),
                    "bandwidth_GBps": rng.choice([10, 25, 50, 100, 400])})
def _crossover(p, formula):
    P, a, bw = p["P"], p["alpha_us"], p["bandwidth_GBps"]
    ring = formula("labkit.collectives.ring_all_reduce_time")
    latency = ring(0, P, a * 1e-6, 0.0)                 # 2(P - 1) alpha
    per_byte = ring(1, P, 0.0, 1 / (bw * 1e9))          # 2(P - 1)/P beta
    n = latency / per_byte
    answer, unit = _in(n, ("KB", "MB", "GB"))
    return {"question": f"Ring all-reduce on P = {P} ranks, alpha = {a} us, 1/beta = {bw} GB/s. "
                        "At what message size n do its latency term and its bandwidth term "
                        "cost the same time?",
            "answer": answer, "unit": unit,
            "solution": ["t = 2(P - 1) alpha + 2(P - 1)/P x n beta.",
                         "Equal terms: 2(P - 1) alpha = 2(P - 1)/P x n beta, so "
                         "n = P alpha / beta.",
                         f"n = {P} x {a} us x {bw} GB/s = {bytes_text(n)}.",
                         "Below it latency dominates; at it the ring reaches half its peak bus "
                         "bandwidth (busbw = n / (P alpha + n beta))."]}


# ---- chapter 3: memory and ZeRO ----------------------------------------------------------------

_SPLIT_ONLY = {0: "nothing", 1: "only the optimizer states", 2: "the optimizer states and the "
               "gradients", 3: "the weights, gradients and optimizer states"}


@register("zero-states", "memory", "Model states per GPU under a ZeRO stage", 3,
          "sections 1 and 3", ["labkit.memory.model_states"])
@draws(lambda rng: {"psi": rng.choice([1.3e9, 7.5e9, 13e9, 30e9, 70e9, 175e9]),
                    "dp": rng.choice([4, 8, 16, 64, 128, 256]),
                    "stage": rng.choice([0, 1, 2, 3])})
def _zero_states(p, formula):
    psi, dp, stage = p["psi"], p["dp"], p["stage"]
    states = formula("labkit.memory.model_states")(psi, dp, stage)
    total = sum(states.values())
    split = {0: "nothing is split", 1: "the optimizer states (12 bytes) are split",
             2: "optimizer states and gradients are split", 3: "everything is split"}[stage]
    return {"question": f"A {sig(psi / 1e9)}B-parameter model, mixed-precision AdamW, ZeRO stage "
                        f"{stage} over dp = {dp} data-parallel GPUs, no tensor or pipeline "
                        "parallelism. How many GB of model states does each GPU hold?",
            "answer": total / 1e9, "unit": "GB",
            "solution": ["Bytes per parameter: 2 (BF16 weights) + 2 (BF16 gradients) + 12 "
                         "(FP32 master copy, momentum, variance).",
                         f"Stage {stage}: {split} over the {dp} ranks.",
                         f"parameters {bytes_text(states['parameters'])} + gradients "
                         f"{bytes_text(states['gradients'])} + optimizer states "
                         f"{bytes_text(states['optimizer_states'])} = {bytes_text(total)}."],
            "slips": tuple((sum(formula("labkit.memory.model_states")(psi, dp, other).values())
                            / total, f"That is stage {other}'s figure: stage {stage} splits "
                            f"{_SPLIT_ONLY[stage]} over dp.")
                           for other in (0, 1, 2, 3) if other != stage)}


@register("zero3-pipeline", "memory", "ZeRO-3 inside a pipeline: the bytes it multiplies", 3,
          "section 6", ["labkit.memory.wire_bytes_per_rank", "labkit.mesh.cost.dp_wire_bytes"],
          source="seed 004, self-check question 1; torch/distributed/pipelining/stage.py")
@draws(lambda rng: {"m": rng.choice([4, 8, 12, 16, 32, 64]), "dp": rng.choice([2, 4, 8, 16]),
                    "reshard": rng.choice(["microbatch", "step"])})
def _zero3_pipeline(p, formula):
    m, dp, reshard = p["m"], p["dp"], p.get("reshard", "microbatch")
    if reshard == "step":
        wire = formula("labkit.mesh.cost.dp_wire_bytes")
        ratio = (wire(1.0, dp, 3, m, "step", grad_bytes=2)
                 / wire(1.0, dp, 1, m, "step", grad_bytes=2))
        return {"question": f"A pipeline stage pushes m = {m} microbatches through each step; "
                            f"its weights are sharded over dp = {dp} ranks with ZeRO stage 3 "
                            "(FSDP), and, as torch's pipelining stage does, it reshards and "
                            "reduce-scatters only after the last microbatch. How many times "
                            "the bytes of ZeRO stage 1 does each rank send per step?",
                "answer": ratio, "unit": "",
                "solution": ["Stage 1: one reduce-scatter of the gradients and one all-gather of "
                             "the weights per step, 2 Psi (times (dp - 1)/dp).",
                             "Kept gathered across microbatches (torch's stage.py turns "
                             "reshard-after-backward and gradient sync off for every "
                             "microbatch but the last; torchtitan does not reshard after "
                             "forward with PP): one all-gather before the first forward, one "
                             "reduce-scatter after the last backward: 2 Psi too.",
                             f"Ratio 1 (here {sig(ratio)}). The price is memory, not bytes: the "
                             "whole gathered weights and gradients are held during the step, "
                             "ZeRO-1's peak."],
                "slips": ((3 * m / 2, f"That is 3m/2 = {sig(3 * m / 2)}: resharding every "
                                      "microbatch; this stage keeps the weights gathered until "
                                      "the last one."),
                          (3 / 2, "That is 3/2: a second all-gather for backward; kept "
                                  "gathered, the weights are gathered once per step."))}
    wire = formula("labkit.memory.wire_bytes_per_rank")
    ratio = wire(1.0, dp, 3, microbatches=m) / wire(1.0, dp, 1, microbatches=m)
    return {"question": f"A pipeline stage pushes m = {m} microbatches through each step; its "
                        f"weights are sharded over its dp = {dp} data-parallel ranks, resharded "
                        "after every forward and backward. How many times more bytes does each "
                        "rank send per step under ZeRO stage 3 than under stage 1?",
            "answer": ratio, "unit": "",
            "solution": ["Stage 1: the optimizer step comes once, after all microbatches: one "
                         "reduce-scatter of the gradients and one all-gather of the weights, "
                         "2 Psi.",
                         "Stage 3 resharding every microbatch gathers each block's weights "
                         "before every use and frees them: in the forward and again in the "
                         "backward of every microbatch, and reduce-scatters its gradients every "
                         "backward: 3 m Psi.",
                         f"3m / 2 = 3 x {m} / 2 = {sig(ratio)} (each times (dp - 1)/dp).",
                         "It buys memory: the rank holds 1/dp of its weights. Production stacks "
                         "often choose the other side of the trade: keep the weights gathered "
                         "for the step (torch's pipelining, torchtitan), ZeRO-1's bytes at "
                         "ZeRO-1's peak."],
            "slips": ((2 / 3, f"That is 2m/2 = m = {m}: the weights gathered for forward only; "
                              "resharded after forward, backward gathers them again."),
                      (1 / m, "That is 3/2: one microbatch's bytes; stage 3 pays them at every "
                              f"one of the m = {m}."),
                      (2 / (3 * m), "That is 1: ZeRO-1's bytes, what the stage sends when it "
                                    "keeps the weights gathered for the whole step, not when "
                                    "it reshards every microbatch."))}


_MODES = {"none": ("no parallelism, no recomputation", "s b h (34 + 5 a s / h)"),
          "tp": ("tensor parallel", "s b h (10 + 24/t + 5 a s / (h t))"),
          "tp+sp": ("tensor and sequence parallel", "s b h (34/t + 5 a s / (h t))"),
          "selective": ("tensor and sequence parallel, selective recomputation",
                        "s b h x 34/t (the 5as/h attention core is recomputed)"),
          "full": ("full recomputation, no parallelism", "2 s b h (only the layer's input)")}


@register("activations", "memory", "Activation memory of one transformer layer", 3, "section 7",
          ["labkit.memory.activation_bytes_per_layer"])
@draws(lambda rng: {"s": rng.choice([1024, 2048, 4096]), "b": rng.choice([1, 2, 4]),
                    "h": rng.choice([2048, 4096, 5120, 8192]), "t": rng.choice([2, 4, 8]),
                    "mode": rng.choice(list(_MODES))})
def _activations(p, formula):
    s, b, h, mode = p["s"], p["b"], p["h"], p["mode"]
    a = h // 128
    t = 1 if mode in ("none", "full") else p["t"]
    total = formula("labkit.memory.activation_bytes_per_layer")(
        s, b, h, a, t, sequence_parallel=mode in ("tp+sp", "selective"),
        recompute={"selective": "selective", "full": "full"}.get(mode, "none"))
    words, shape = _MODES[mode]
    return {"question": f"One transformer layer, s = {s}, b = {b}, h = {h}, a = {a} heads"
                        + (f", t = {t}" if t > 1 else "") + f"; {words}; 16-bit activations. "
                        "How many MB (1 MB = 1e6 B) of activations does it keep for backward "
                        "(Korthikanti et al.)?",
            "answer": total / 1e6, "unit": "MB",
            "solution": [f"Korthikanti et al.: {shape}.",
                         f"s b h = {s * b * h:,}"
                         + (f"; 5 a s / h = {sig(5 * a * s / h)}." if mode in ("none", "tp",
                                                                            "tp+sp") else "."),
                         f"= {bytes_text(total)} per layer, per microbatch in flight."],
            "slips": _activation_slips(formula, s, b, h, a, t, mode, total)}


def _activation_slips(formula, s, b, h, a, t, mode, total):
    """The neighbouring modes' figures, each with what tells it from this one."""
    per_layer = formula("labkit.memory.activation_bytes_per_layer")
    figure = lambda tt, sp, rc: per_layer(s, b, h, a, tt, sequence_parallel=sp, recompute=rc)
    near = {"tp": ((figure(t, True, "none"), "sequence parallelism's 34/t: without it the "
                    "LayerNorm and dropout inputs (10 s b h) are not split over t."),
                   (figure(1, False, "none"), "the layer without tensor parallelism: t splits "
                    "24 s b h and the attention core.")),
            "tp+sp": ((figure(t, False, "none"), "tensor parallelism without sequence "
                       "parallelism: with it the 10 s b h of LayerNorm and dropout inputs are "
                       "split over t too."),),
            "selective": ((figure(t, True, "none"), "the attention core 5as/(ht) kept: "
                           "selective recomputation drops it and recomputes it in backward."),),
            "none": ((figure(1, False, "selective"), "the attention core 5 a s / h left out: "
                      "nothing is recomputed here."),),
            "full": ((figure(1, False, "none"), "the whole layer's activations: full "
                      "recomputation keeps only its input, 2 s b h."),)}[mode]
    return tuple((other / total, f"That is {why}") for other, why in near
                 if abs(other / total - 1) > 0.02)


# ---- chapter 4: tensor parallelism ------------------------------------------------------------

@register("tp-bytes", "tensor_parallel", "Bytes a tensor-parallel layer sends per step", 4,
          "section 7", ["labkit.tensor_parallel.tp_layer_bytes"])
@draws(lambda rng: {"B": rng.choice([1, 2, 4, 8]), "T": rng.choice([1024, 2048, 4096]),
                    "H": rng.choice([4096, 8192, 12288]), "tp": rng.choice([2, 4, 8])})
def _tp_bytes(p, formula):
    B, T, H, tp = p["B"], p["T"], p["H"], p["tp"]
    sent = formula("labkit.tensor_parallel.tp_layer_bytes")(B, T, H, tp, itemsize=2)
    n = B * T * H * 2
    return {"question": f"A transformer layer split Megatron-style over tp = {tp} ranks; "
                        f"B = {B}, T = {T}, H = {H}, BF16 activations. How many bytes does each "
                        "rank send for this layer in one training step (forward and backward)?",
            "answer": sent / 1e6, "unit": "MB",
            "solution": ["Attention and MLP each end in g (an all-reduce in forward) and begin "
                         "with f (an all-reduce in backward): 4 all-reduces of [B, T, H].",
                         f"n = B T H x 2 bytes = {bytes_text(n)}; a ring all-reduce sends "
                         f"2(t - 1)/t x n = {bytes_text(2 * (tp - 1) / tp * n)}.",
                         f"4 x that = {bytes_text(sent)} per layer per step (sequence "
                         "parallelism sends the same on a ring)."]}


# ---- chapter 5: pipeline parallelism ----------------------------------------------------------

def _draw_bubble(rng):
    p = rng.choice([2, 3, 4, 8, 16])
    v = rng.choice([1, 1, 1, 2, 4])
    m = rng.choice([p, 2 * p, 4 * p]) if v > 1 else rng.choice([p, 2 * p, 8, 16, 32, 64])
    return {"p": p, "m": m, "v": v}


@register("bubble", "pipeline", "The pipeline bubble", 5, "section 4",
          ["labkit.pipeline.bubble_formula"])
@draws(_draw_bubble)
def _bubble(p, formula):
    stages, m, v = p["p"], p["m"], p["v"]
    bubble = formula("labkit.pipeline.bubble_formula")(stages, m, v)
    schedule = "1F1B (or GPipe)" if v == 1 else f"interleaved 1F1B with v = {v} chunks per rank"
    return {"question": f"A pipeline of p = {stages} stages runs m = {m} microbatches per step "
                        f"under {schedule}, equal stages. What fraction of the step is bubble "
                        "(idle)?",
            "answer": 100 * float(bubble), "unit": "%",
            "solution": ["Each stage is idle (p - 1) forward+backward slots per step"
                         + (", each 1/v as long when interleaved" if v > 1 else "") + ".",
                         "bubble = (p - 1) / (v m + p - 1) "
                         f"= {stages - 1} / ({v * m} + {stages - 1}) = {bubble} "
                         f"= {100 * float(bubble):.1f}%.",
                         "More microbatches shrink it; so does interleaving, at v times the "
                         "messages."],
            "slips": (((stages - 1) / (v * m) / float(bubble), "That is (p - 1)/(v m): the bubble "
                       "over the ideal time, not the fraction of the step it takes (divide by "
                       "v m + p - 1)."),) + ((((stages - 1) / (m + stages - 1)) / float(bubble),
                      "That is the bubble without interleaving: v chunks cut it v times."),)
            * (v > 1)}


@register("bubble-microbatches", "pipeline", "Microbatches for a bubble budget", 5, "section 4",
          ["labkit.pipeline.bubble_formula"])
@draws(lambda rng: {"p": rng.choice([4, 8, 16, 32]), "v": rng.choice([1, 1, 2]),
                    "target_percent": rng.choice([5, 10, 15, 20, 25])})
def _bubble_microbatches(p, formula):
    stages, v = p["p"], p["v"]
    x = Fraction(p["target_percent"], 100)      # exact: 0.15 in binary is a little below 15/100
    bubble = formula("labkit.pipeline.bubble_formula")
    m = 1
    while bubble(stages, m, v) > x:
        m += 1
    how = "" if v == 1 else f", interleaved with v = {v} chunks per rank"
    return {"question": f"A pipeline of p = {stages} stages{how}. What is the smallest number of "
                        f"microbatches m that keeps the bubble at or below {p['target_percent']}% "
                        "of the step (ignore any divisibility rule)?",
            "answer": m, "unit": "", "rel_tol": 0.0,
            "solution": ["(p - 1) / (v m + p - 1) <= x  <=>  m >= (p - 1)(1 - x) / (v x).",
                         f"(p - 1)(1 - x) / (v x) = {stages - 1} x {float(1 - x):g} / ({v} x "
                         f"{float(x):g}) = "
                         f"{sig((stages - 1) * (1 - x) / (v * x))}; round up: m = {m}.",
                         f"Check: m = {m} gives {100 * float(bubble(stages, m, v)):.1f}%"
                         + (f", m = {m - 1} gives {100 * float(bubble(stages, m - 1, v)):.1f}%."
                            if m > 1 else ".")]}
