"""Numeric drills of chapters 6-9: the 3D mesh, mixture of experts, checkpoint intervals and
failures. Each answer comes from the chapter's own function (named in `uses`, imported by name
when a problem is posed: see `numeric.formula`)."""
from __future__ import annotations

import math

from labkit.drill.base import bytes_text, factor, sig
from labkit.drill.numeric import draws, register


def _in_bytes(value: float) -> dict:
    """{"answer", "unit"}: bytes in MB below 1 GB, else in GB."""
    unit = "GB" if value >= 1e9 else "MB"
    return {"answer": value / factor(unit), "unit": unit}

# ---- chapter 6: the 3D mesh --------------------------------------------------------------------


def _draw_world(rng):
    tp, pp, dp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8, 16]), rng.choice([2, 8, 16, 64])
    return {"tp": tp, "pp": pp, "dp": dp, "ask": rng.choice(["dp", "world"])}


@register("mesh-size", "mesh", "3D world size", 6, "section 1",
          ["labkit.mesh.world_size", "labkit.mesh.check_world_size"])
@draws(_draw_world)
def _mesh_size(p, formula):
    tp, pp, dp = p["tp"], p["pp"], p["dp"]
    world = formula("labkit.mesh.world_size")(dp=dp, tp=tp, pp=pp)
    formula("labkit.mesh.check_world_size")(world, dp=dp, tp=tp, pp=pp)   # the chapter's check
    if p["ask"] == "dp":
        return {"question": f"A job on {world} GPUs uses tensor parallelism tp = {tp} and "
                            f"pipeline parallelism pp = {pp}. What data-parallel degree dp fills "
                            "the world?",
                "answer": dp, "unit": "", "rel_tol": 0.0,
                "solution": ["world size = dp x tp x pp, so dp = world / (tp x pp).",
                             f"dp = {world} / ({tp} x {pp}) = {dp}."]}
    return {"question": f"A 3D-parallel job with dp = {dp}, tp = {tp}, pp = {pp}. How many ranks "
                        "does it need?",
            "answer": world, "unit": "", "rel_tol": 0.0,
            "solution": [f"world size = dp x tp x pp = {dp} x {tp} x {pp} = {world}."]}


def _draw_groups(rng):
    dp, pp, tp = rng.choice([2, 3, 4]), rng.choice([2, 3, 4]), rng.choice([2, 4, 8])
    return {"dp": dp, "pp": pp, "tp": tp, "rank": rng.randrange(dp * pp * tp),
            "ask": rng.choice(["coordinates", "tp", "pp", "dp"])}


@register("mesh-groups", "mesh", "A rank's coordinates and groups on a 3D mesh", 6, "section 1",
          ["labkit.mesh.coordinates", "labkit.mesh.my_groups"])
@draws(_draw_groups)
def _mesh_groups(p, formula):
    dp, pp, tp, rank, ask = p["dp"], p["pp"], p["tp"], p["rank"], p["ask"]
    c = formula("labkit.mesh.coordinates")(rank, dp=dp, pp=pp, tp=tp)
    groups = formula("labkit.mesh.my_groups")(rank, dp=dp, pp=pp, tp=tp)
    layout = (f"A mesh dp = {dp}, pp = {pp}, tp = {tp} in the course's order (dp outermost, tp "
              f"innermost: rank = (dp_rank x pp + pp_rank) x tp + tp_rank).")
    steps = [f"rank {rank} = ({c['dp']} x {pp} + {c['pp']}) x {tp} + {c['tp']}: "
             f"dp_rank {c['dp']}, pp_rank {c['pp']}, tp_rank {c['tp']}."]
    if ask == "coordinates":
        return {"question": f"{layout} What are rank {rank}'s (dp_rank, pp_rank, tp_rank)?",
                "answer": (c["dp"], c["pp"], c["tp"]), "unit": "", "kind": "tuple",
                "solution": [f"tp_rank = {rank} mod {tp} = {c['tp']}; then "
                             f"{rank // tp} = dp_rank x {pp} + pp_rank.", *steps]}
    stride = {"tp": "1 (consecutive ranks)", "pp": f"tp = {tp}", "dp": f"pp x tp = {pp * tp}"}
    size = {"tp": tp, "pp": pp, "dp": dp}[ask]
    return {"question": f"{layout} Which ranks form rank {rank}'s {ask} group?",
            "answer": tuple(groups[ask]), "unit": "", "kind": "set",
            "solution": steps + [f"The {ask} group varies {ask}_rank only, with stride "
                                 f"{stride[ask]}: {size} ranks, {groups[ask]}.",
                                 "tp innermost keeps a tp group inside a node whenever tp "
                                 "divides the GPUs per node."]}


# ---- chapter 7: mixture of experts -------------------------------------------------------------

_NOT_FLAT = ("DeepSeek-V3 itself does not send flat: its routing limits each token to 4 nodes, "
             "and DeepEP sends the token over InfiniBand once per target node, then forwards it "
             "over NVLink to that node's experts (the drill moe-node-limited).")


def _draw_moe(rng):
    return {"N": rng.choice([1024, 2048, 4096, 8192]), "P": rng.choice([8, 16, 32, 64]),
            "scope": rng.choice(["forward", "forward and backward", "per token"])}


@register("moe-bytes", "moe", "All-to-all bytes of a flat expert-parallel layer", 7, "section 5",
          ["labkit.moe.ep_bytes_per_rank", "labkit.moe.DEEPSEEK_V3"],
          source="seed 004, whiteboard question 1")
@draws(_draw_moe)
def _moe_bytes(p, formula):
    N, P, scope = p["N"], p["P"], p["scope"]
    v3 = formula("labkit.moe.DEEPSEEK_V3")
    H, K = v3["hidden"], v3["top_k"]
    ep_bytes = formula("labkit.moe.ep_bytes_per_rank")
    forward = ep_bytes(N, K, H, P)
    both = ep_bytes(N, K, H, P, backward=True)
    common = [f"Each of the N K = {N * K:,} assignments goes to a rank chosen evenly: (P - 1)/P "
              "of them leave the rank.",
              f"Dispatch sends each such row (H x 2 bytes) out; combine brings the expert's output "
              "back to the token's rank: every routed token crosses the network twice.",
              f"forward = 2 x (P - 1)/P x K N H x 2 bytes = {bytes_text(forward)}."]
    if scope == "forward":
        return {"question": f"An MoE layer with DeepSeek-V3's sizes (H = {H}, top-{K}), sent "
                            f"flat: experts spread evenly over P = {P} ranks, every assignment "
                            f"to another rank its own row, N = {N} tokens per rank, BF16 on "
                            "the wire, even routing. How many bytes does one rank send for this "
                            "layer in forward?",
                **_in_bytes(forward), "solution": common + [_NOT_FLAT]}
    backward = ["Backward runs both all-to-alls in reverse with the gradients: the same bytes "
                f"again, 8 (P - 1)/P K N H = {bytes_text(both)}."]
    if scope == "forward and backward":
        return {"question": f"An MoE layer with DeepSeek-V3's sizes (H = {H}, top-{K}), sent "
                            f"flat over P = {P} expert-parallel ranks (every remote assignment "
                            f"its own row), N = {N} tokens per rank, BF16, even routing. "
                            "How many bytes does one rank send for this layer in one training "
                            "step (forward and backward)?",
                **_in_bytes(both), "solution": common + backward + [_NOT_FLAT]}
    return {"question": f"An MoE layer with DeepSeek-V3's sizes (H = {H}, top-{K}), sent flat "
                        f"over P = {P} expert-parallel ranks (every remote assignment its own "
                        "row), BF16, even routing. How many bytes does one token "
                        "cost on the wire per MoE layer, forward and backward?",
            "answer": both / N / 1e3, "unit": "KB",
            "solution": common + backward + [
                f"Per token: {bytes_text(both)} / {N} = {bytes_text(both / N)} "
                "(8 K H (P - 1)/P bytes; 8 K H with (P - 1)/P rounded to 1).",
                "The source material's 917.5 KB counts BF16's 2 bytes twice.", _NOT_FLAT],
            "slips": ((2 * P / (P - 1), "That is 16 K H bytes: BF16's 2 bytes counted twice, "
                                        "as the source material's 917.5 KB does (and (P - 1)/P "
                                        "rounded to 1)."),
                      (2, "That is BF16's 2 bytes counted twice, as the source material's "
                          "917.5 KB does."),
                      (1 / K, f"That is one copy per token: top-{K} sends each token to K "
                              "experts, K rows."))}


@register("moe-fp8", "moe", "FP8 dispatch, BF16 combine: bytes on the wire", 7, "section 7",
          ["labkit.moe.ep_bytes_per_rank", "labkit.moe.fp8.row_bytes", "labkit.moe.DEEPSEEK_V3"])
@draws(lambda rng: {"N": rng.choice([1024, 2048, 4096, 8192]), "P": rng.choice([8, 16, 32, 64])})
def _moe_fp8(p, formula):
    N, P = p["N"], p["P"]
    v3 = formula("labkit.moe.DEEPSEEK_V3")
    H, K = v3["hidden"], v3["top_k"]
    row = formula("labkit.moe.fp8.row_bytes")(H)
    forward = formula("labkit.moe.ep_bytes_per_rank")(N, K, H, P, dispatch_bytes=row / H)
    return {"question": f"A flat expert-parallel layer with DeepSeek-V3's sizes (H = {H}, "
                        f"top-{K}, P = {P} ranks, every remote assignment its own row, N = {N} "
                        "tokens per rank, even routing) dispatches in FP8 e4m3 with one float32 "
                        "scale per 128 values and combines in BF16. Bytes one rank sends in "
                        "forward?",
            **_in_bytes(forward),
            "solution": [f"An FP8 row: H + 4 H/128 = {row:,} bytes (BF16: {2 * H:,}).",
                         "Remote assignments: (P - 1)/P x K N.",
                         f"(P - 1)/P x K N x ({row:,} + {2 * H:,}) bytes = {bytes_text(forward)}.",
                         "Only dispatch shrinks: combine's outputs go straight into the residual "
                         "stream, so they stay BF16.", _NOT_FLAT]}


@register("moe-node-limited", "moe", "DeepSeek-V3's node-limited dispatch over InfiniBand", 7,
          "section 5", ["labkit.moe.DEEPSEEK_V3", "labkit.moe.fp8.row_bytes"],
          source="DeepSeek-V3 Technical Report, sections 2.1.2 and 3.2.2; DeepEP's normal kernels")
@draws(lambda rng: {"N": rng.choice([1024, 2048, 4096, 8192]), "nodes": rng.choice([8, 16, 32, 64]),
                    "ask": rng.choice(["dispatch", "forward"])})
def _moe_node_limited(p, formula):
    N, nodes, ask = p["N"], p["nodes"], p["ask"]
    v3 = formula("labkit.moe.DEEPSEEK_V3")
    H, K, M = v3["hidden"], v3["top_k"], v3["max_nodes_per_token"]
    row = formula("labkit.moe.fp8.row_bytes")(H)                 # FP8 values + float32 scales
    remote_nodes = M * (nodes - 1) / nodes                       # per token, on average
    dispatch = N * remote_nodes * row
    combine = N * remote_nodes * 2 * H                           # BF16, summed per node first
    answer = dispatch if ask == "dispatch" else dispatch + combine
    what = ("in the dispatch (FP8 rows of H + 4 H/128 bytes)" if ask == "dispatch" else
            "in forward: the FP8 dispatch and the BF16 combine, which sums the outputs of a "
            "node's experts over NVLink and sends one row back per node")
    solution = [f"Node-limited routing: a token's K = {K} experts lie on at most M = {M} nodes; "
                "take exactly M, chosen evenly among the nodes.",
                f"The token's own node is one of them with probability M/n = {M}/{nodes}: on "
                f"average M (n - 1)/n = {sig(remote_nodes)} target nodes are remote.",
                "One send per remote target node crosses InfiniBand; the copies for that node's "
                "other experts travel on NVLink from the GPU that received it.",
                f"dispatch = N x M (n - 1)/n x {row:,} B = {bytes_text(dispatch)}."]
    if ask == "forward":
        solution.append(f"combine = N x M (n - 1)/n x 2H = {bytes_text(combine)}; forward = "
                        f"{bytes_text(answer)}.")
    solution.append(f"Sent flat, each of the K copies would cross on its own: K/M = {K // M} "
                    "times more on InfiniBand.")
    return {"question": f"DeepSeek-V3 (H = {H}, top-{K}, experts on n = {nodes} nodes of 8 GPUs, "
                        f"at most M = {M} nodes per token) on one GPU with N = {N} tokens, even "
                        f"routing. How many bytes does it send over InfiniBand for one MoE layer "
                        f"{what}?",
            **_in_bytes(answer), "solution": solution,
            "slips": ((K / M, f"That is K/M = {K // M} times the answer: one copy per expert; "
                              "DeepSeek-V3 sends a token once per target node over InfiniBand "
                              "and forwards it on NVLink inside the node."),
                      (nodes / (nodes - 1), "That is n/(n-1) times the answer: a token's own "
                                            "node, when it is one of the M, is reached on "
                                            "NVLink, not InfiniBand."),
                      (2 * H / row, "That is the answer with BF16 dispatch rows: DeepSeek-V3 "
                                    "dispatches in FP8 (H + 4 H/128 bytes a row)."))}


@register("capacity", "moe", "An expert's capacity", 7, "section 2", ["labkit.moe.capacity"])
@draws(lambda rng: {"N": rng.choice([1000, 1024, 2048, 4096, 8192]), "K": rng.choice([1, 2, 4, 8]),
                    "E": rng.choice([8, 16, 64, 128, 256]),
                    "factor": rng.choice([1.0, 1.1, 1.25, 1.5, 2.0])})
def _capacity(p, formula):
    N, K, E, f = p["N"], p["K"], p["E"], p["factor"]
    c = formula("labkit.moe.capacity")(tokens=N, top_k=K, experts=E, factor=f)
    return {"question": f"N = {N} tokens, top-{K} routing, E = {E} experts, capacity factor {f}. "
                        "How many assignments may one expert accept (its capacity C)?",
            "answer": c, "unit": "", "rel_tol": 0.0,
            "solution": ["C = ceil(N K / E x factor): the even share of the N K assignments, "
                         "plus headroom.",
                         f"{N} x {K} / {E} x {f} = {sig(N * K / E * f)}; round up: C = {c}.",
                         "Assignments beyond C are dropped (the token skips that expert and keeps "
                         "its residual)."],
            "slips": tuple((other / c, why) for other, why in (
                (math.ceil(N / E * f),
                 f"That is ceil(N/E x factor): top-{K} routes each token to K experts, so the "
                 "even share is N K / E."),
                (math.ceil(N * K / E), "That leaves out the capacity factor, the headroom over "
                 "the even share."),
                (N * K / E * f, "That is N K / E x factor before rounding up: capacity is a "
                 "whole number of slots.")) if other != c)}


def _draw_imbalance(rng):
    load = [round(1000 * rng.uniform(0.5, 1.1)) for _ in range(8)]
    load[rng.randrange(8)] = round(1000 * rng.choice([1.5, 2.5, 3.2, 5.0]))
    return {"load": load, "ask": rng.choice(["max_over_mean", "max_over_mean", "cv"])}


@register("moe-imbalance", "moe", "A hot expert: how much longer the layer takes", 7,
          "sections 3 and 6", ["labkit.moe.imbalance"],
          source="seed 004, second lab (expert imbalance)")
@draws(_draw_imbalance)
def _imbalance(p, formula):
    load, ask = p["load"], p["ask"]
    metrics = formula("labkit.moe.imbalance")(load)
    mean = sum(load) / len(load)
    if ask == "max_over_mean":
        return {"question": f"Tokens routed to each of 8 experts, one per rank: {load}. Combine "
                            "waits for the busiest expert: how many times longer than a balanced "
                            "layer does the expert phase take (max over mean)?",
                "answer": metrics["max_over_mean"], "unit": "",
                "solution": [f"mean = {sum(load)} / 8 = {sig(mean)}; max = {max(load)}.",
                             f"max / mean = {sig(metrics['max_over_mean'])}: every rank waits "
                             "in combine until the busiest expert is done."]}
    return {"question": f"Tokens routed to each of 8 experts: {load}. What is the coefficient of "
                        "variation of the load (population standard deviation over mean)?",
            "answer": metrics["cv"], "unit": "",
            "solution": [f"mean = {sig(mean)}; population std = sqrt(mean of squared "
                         f"deviations) = {sig(metrics['cv'] * mean)}.",
                         f"cv = {sig(metrics['cv'] * mean)} / {sig(mean)} = {sig(metrics['cv'])} "
                         "(0 when even; sqrt(E - 1) when one expert takes all)."]}


# ---- chapter 8: how often to checkpoint -------------------------------------------------------

def _draw_young(rng):
    if rng.random() < 0.5:
        return {"C_s": rng.choice([10, 30, 60, 120, 300]), "M_h": rng.choice([1, 2, 3, 6, 12, 24])}
    return {"C_s": rng.choice([2, 10, 30, 60]), "gpus": rng.choice([1024, 2048, 4096, 8192, 16384])}


@register("young-interval", "checkpoint", "How often to checkpoint (Young)", 8, "section 7",
          ["labkit.checkpoint.interval.young_interval",
           "labkit.checkpoint.interval.llama3_mtbf_hours"])
@draws(_draw_young)
def _young(p, formula):
    C = p["C_s"]
    steps = []
    if "gpus" in p:
        llama = formula("labkit.checkpoint.interval.llama3_mtbf_hours")()
        M_h = llama * 16384 / p["gpus"]
        setting = (f"{p['gpus']:,} GPUs that fail as often as Llama 3's did (419 unexpected "
                   "interruptions in 54 days on 16,384 GPUs)")
        steps = [f"Llama 3's job: M = 54 x 24 h / 419 = {sig(llama)} h on 16,384 GPUs; failures "
                 f"scale with the GPU count: M = {sig(llama)} h x 16,384 / {p['gpus']:,} = "
                 f"{sig(M_h)} h."]
    else:
        M_h = p["M_h"]
        setting = f"a job whose mean time between failures is M = {M_h} h"
    tau = formula("labkit.checkpoint.interval.young_interval")(C, M_h * 3600)
    return {"question": f"A checkpoint stops training for C = {C} s; {setting}. What is Young's "
                        "checkpoint interval, in minutes?",
            "answer": tau / 60, "unit": "min", "rel_tol": 0.03,
            "solution": steps + ["waste(tau) ~= C/tau + tau/(2M); its derivative is zero at "
                                 "tau* = sqrt(2 C M).",
                                 f"tau* = sqrt(2 x {C} s x {sig(M_h * 3600)} s) = {sig(tau)} s = "
                                 f"{sig(tau / 60)} min.",
                                 "The waste at tau* is about sqrt(2C/M): cutting C (async "
                                 "checkpoints) pays as its square root."],
            "slips": ((2 ** -0.5, "That is sqrt(C M): the 2 of sqrt(2 C M) is missing (the "
                                  "lost work averages tau/2, so waste = C/tau + tau/(2M))."),
                      (60 ** -0.5, "That is the interval with M in minutes and C in seconds: "
                                   "put both in the same unit."),
                      (3600 ** -0.5, "That is the interval with M in hours and C in seconds: "
                                     "put both in the same unit."),
                      (60, "That is the answer in seconds, not minutes."))}


@register("daly-interval", "checkpoint", "How often to checkpoint (Daly)", 8, "section 7",
          ["labkit.checkpoint.interval.daly_interval"])
@draws(lambda rng: {"C_min": rng.choice([1, 5, 10, 20]), "M_h": rng.choice([0.5, 1, 3, 6, 24])})
def _daly(p, formula):
    C, M = p["C_min"] * 60, p["M_h"] * 3600
    tau = formula("labkit.checkpoint.interval.daly_interval")(C, M)
    x = C / (2 * M)
    young = (2 * C * M) ** 0.5
    return {"question": f"C = {p['C_min']} min per checkpoint, M = {p['M_h']} h between failures "
                        "(exponential). What is Daly's higher-order optimal interval, in minutes?",
            "answer": tau / 60, "unit": "min",
            "solution": ["tau* = sqrt(2CM) [1 + (1/3) sqrt(C/2M) + (1/9)(C/2M)] - C, for C < 2M.",
                         f"sqrt(2CM) = {sig(young / 60)} min; C/2M = {sig(x)}.",
                         f"tau* = {sig(young / 60)} x {sig(1 + x ** 0.5 / 3 + x / 9)} - "
                         f"{p['C_min']} = {sig(tau / 60)} min (Young alone: {sig(young / 60)})."],
            "slips": ((young / tau, "That is Young's sqrt(2CM): Daly adds the higher-order terms "
                                    "and subtracts C."),
                      ((young * (1 + x ** 0.5 / 3 + x / 9)) / tau,
                       "That is Daly's bracket without the final - C."))}


# ---- chapter 9: failures -----------------------------------------------------------------------

def _draw_straggler(rng):
    times = [round(2200 + rng.uniform(-30, 30)) for _ in range(8)]
    slow = rng.randrange(8)
    times[slow] = round(2200 * rng.choice([1.03, 1.1, 1.2, 1.4]))
    return {"times_ms": times, "slow": slow}


@register("straggler-z", "faults", "A straggler's robust z-score", 9, "section 3",
          ["labkit.faults.detect.robust_z", "labkit.faults.detect.Z_THRESHOLD"],
          source="seed 004, second lab (a diagnoser of slow ranks)")
@draws(_draw_straggler)
def _straggler(p, formula):
    times, slow = p["times_ms"], p["slow"]
    z = formula("labkit.faults.detect.robust_z")(times)[slow]
    threshold = formula("labkit.faults.detect.Z_THRESHOLD")
    ordered = sorted(times)
    median = (ordered[3] + ordered[4]) / 2
    deviations = sorted(abs(t - median) for t in times)
    mad = (deviations[3] + deviations[4]) / 2
    return {"question": f"Step times of 8 ranks, in ms: {times}. What is the modified z-score "
                        f"of rank {slow} (Iglewicz and Hoaglin: 0.6745 (x - median) / MAD)?",
            "answer": z, "unit": "", "rel_tol": 0.03,
            "solution": [f"median = {median:g} ms (the mean of the middle two of 8).",
                         f"MAD = median |t - median| = {mad:g} ms.",
                         f"z = 0.6745 x ({times[slow]} - {median:g}) / {mad:g} = {sig(z)}.",
                         f"{'Above' if z > threshold else 'Not above'} the usual threshold "
                         f"{threshold}: {'a straggler' if z > threshold else 'within the noise'}. "
                         "Median and MAD ignore the outlier itself, unlike a mean and a standard "
                         "deviation, which it inflates."]}


def _draw_spike(rng):
    window = rng.choice([5, 8, 10])
    base = rng.choice([0.8, 1.2, 2.0, 3.5])
    history = [round(base * rng.uniform(0.7, 1.3), 2) for _ in range(window + 3)]
    return {"history": history, "window": window, "factor": rng.choice([3, 5, 10])}


@register("spike-threshold", "faults", "When a spike guard fires", 9, "section 5",
          ["labkit.faults.detect.window_spike"], source="seed 004, section 3.2 (the 5x rule)")
@draws(_draw_spike)
def _spike(p, formula):
    history, window, factor = p["history"], p["window"], p["factor"]
    spikes = formula("labkit.faults.detect.window_spike")
    low, high = 0.0, 1e6             # the norm at which the chapter's rule starts to fire
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (low, mid) if spikes(history, mid, factor=factor, window=window,
                                         min_history=1) else (mid, high)
    recent = history[-window:]
    return {"question": f"A spike guard keeps the gradient norms of accepted steps: {history} "
                        f"(oldest first). It fires when a norm exceeds {factor} x the mean of "
                        f"the last {window}. Above what norm does the next step fire it?",
            "answer": high, "unit": "",
            "solution": [f"The last {window}: {recent}; their mean is "
                         f"{sig(sum(recent) / window)}.",
                         f"{factor} x {sig(sum(recent) / window)} = {sig(high)}.",
                         "A fired step is skipped (or rolled back) and not added to the window, "
                         "so one spike does not raise the bar for the next."]}
