"""Numeric drills of chapter 6's decisions: a 3D configuration's memory per rank, which axis runs
on which link, and the interview question "choose tp, pp and dp for model X on cluster Y" as a
choice among four named configurations. Each answer comes from the chapter's own functions
(`labkit.mesh.cost`, `labkit.mesh.layout`), named in `uses`; each drill names the slips its ratios
give away (`slips`).

Lab 6's task 3 (`choose_config`) searches every configuration; nothing here searches: the choice
drill prices four configurations written out by hand and asks which of those four wins.
"""
from __future__ import annotations

from labkit.drill.base import bytes_text, sig
from labkit.drill.numeric import draws, register

AXES_BY_LINK = ("tp", "pp", "dp")     # the order a link answer is typed in


# ---- a 3D configuration's memory per rank ------------------------------------------------------

def _draw_memory(rng):
    model = rng.choice([(40, 6144, 48), (48, 8192, 64), (60, 10240, 80), (80, 12288, 96)])
    tp, pp = rng.choice([(2, 4), (4, 2), (4, 4), (8, 2), (8, 4), (4, 5), (8, 5)])
    layers = model[0]
    if layers % pp:
        pp = 2
    return {"layers": layers, "hidden": model[1], "heads": model[2], "tp": tp, "pp": pp,
            "dp": rng.choice([4, 8, 16, 32]), "m": rng.choice([4, 8, 16, 32]),
            "ask": rng.choice(["states", "states", "with_activations"])}


@register("mesh-memory", "mesh", "A 3D configuration's memory per rank", 6, "section 4",
          ["labkit.mesh.cost.memory", "labkit.mesh.Model"])
@draws(_draw_memory)
def _mesh_memory(p, formula):
    L, h, heads, tp, pp, dp, m = (p[k] for k in ("layers", "hidden", "heads", "tp", "pp", "dp",
                                                 "m"))
    model = formula("labkit.mesh.Model")("drill", L, h, heads, seq=2048, vocab=51200)
    config = {"dp": dp, "tp": tp, "pp": pp, "zero_stage": 1, "microbatches": m}
    ledger = formula("labkit.mesh.cost.memory")(model, config, global_batch=dp * m,
                                                recompute="full")
    states = ledger["parameters"] + ledger["gradients"] + ledger["optimizer_states"]
    psi = ledger["parameters_total"]
    psi_rank = psi / (tp * pp)
    held = min(pp, m)
    setting = (f"A GPT with L = {L} layers, h = {h}, {heads} heads, vocabulary 51,200 "
               f"(tied embedding): Psi = 12 L h^2 + 13 L h + V h = {sig(psi / 1e9)}B parameters. "
               f"Mixed-precision AdamW (2 + 2 + 12 bytes a parameter), tp = {tp}, pp = {pp}, "
               f"dp = {dp} with ZeRO-1 over dp. Count Psi split evenly over the tp x pp ranks "
               "(the chapter's ledger).")
    steps = [f"Psi' = Psi / (tp pp) = {sig(psi / 1e9)}B / {tp * pp} = {sig(psi_rank / 1e9)}B "
             "on each rank: tp splits every layer's matrices, pp the layers.",
             f"Weights 2 Psi' and gradients 2 Psi' stay whole on the rank; ZeRO-1 splits the 12 "
             f"bytes of optimizer state over dp: (4 + 12/{dp}) x Psi' = {bytes_text(states)}."]
    if p["ask"] == "states":
        slips = ((16 * psi_rank / states, "That is the answer without ZeRO-1: 16 Psi' with the "
                  f"12 bytes of optimizer state whole; ZeRO-1 keeps 12/{dp} of them."),
                 (4 * psi_rank / states, "That is only the weights and gradients: the optimizer "
                  "state's 12 Psi'/dp is missing."),
                 (16 * psi_rank / dp / states, "That is 16 Psi'/dp: ZeRO-1 splits the optimizer "
                  "states only, not the weights and gradients (that would be ZeRO-3)."),
                 (tp * pp, f"That is tp pp = {tp * pp} times the answer: Psi not divided over "
                  "the tp x pp ranks that share the model."),
                 (tp, f"That is tp = {tp} times the answer: tensor parallelism splits the "
                  "weights, gradients and optimizer states too (Psi / (tp pp))"
                  + (f"; or pp = {pp}: each stage holds only its L/pp layers." if tp == pp
                     else ".")),
                 (pp, f"That is pp = {pp} times the answer: each stage holds only its L/pp "
                  "layers."))
        return {"question": f"{setting} How many GB of model states (weights, gradients, "
                            "optimizer states) does one rank hold?",
                "answer": states / 1e9, "unit": "GB", "solution": steps, "slips": slips}
    activations = ledger["activations"]
    total = states + activations
    per_layer = 2 * 2048 * 1 * h
    steps += [f"Full recomputation keeps each layer's input, 2 s b h = 2 x 2048 x 1 x {h} = "
              f"{bytes_text(per_layer)} (not split by tp without sequence parallelism).",
              f"1F1B: the first stage holds min(pp, m) = min({pp}, {m}) = {held} microbatches, "
              f"each of L/pp = {L // pp} layers: {bytes_text(activations)}.",
              f"Total {bytes_text(states)} + {bytes_text(activations)} = {bytes_text(total)} "
              "(the chapter's peak adds transients: the logits, the buckets, the optimizer "
              "step's temporaries, allocator slack)."]
    extra = [((states + activations * m / held) / total if m > held else 0,
              f"That counts the activations of all m = {m} microbatches (GPipe); 1F1B's first "
              f"stage holds only pp = {pp} of them."),
             ((states + activations / tp) / total, f"That divides the kept inputs by tp = {tp}: "
              "without sequence parallelism every tp rank keeps the whole 2 s b h."),
             (states / total, "That is only the model states: add the activations of the "
              "microbatches in flight.")]
    return {"question": f"{setting} Sequences of s = 2048 tokens, micro-batch b = 1, m = {m} "
                        "microbatches, 1F1B, full activation recomputation, 2-byte activations. "
                        "How many GB does the first stage's rank hold: model states plus "
                        "activations (no transients)?",
            "answer": total / 1e9, "unit": "GB", "solution": steps,
            "slips": tuple(s for s in extra if s[0] and abs(s[0] - 1) > 0.02)}


# ---- which axis on which link --------------------------------------------------------------------

def _draw_links(rng):
    tp, pp, dp = rng.choice([(8, 4, 4), (4, 2, 8), (2, 4, 4), (4, 4, 2), (8, 1, 16), (2, 2, 8),
                             (16, 2, 2), (1, 8, 4), (4, 8, 2)])
    return {"tp": tp, "pp": pp, "dp": dp, "G": rng.choice([4, 8, 8])}


@register("mesh-links", "mesh", "Which axis runs on which link", 6, "sections 1 and 2",
          ["labkit.mesh.layout.inside_node", "labkit.mesh.layout.axis_groups",
           "labkit.mesh.layout.nodes_spanned"])
@draws(_draw_links)
def _mesh_links(p, formula):
    tp, pp, dp, G = p["tp"], p["pp"], p["dp"], p["G"]
    inside = formula("labkit.mesh.layout.inside_node")
    groups = formula("labkit.mesh.layout.axis_groups")(dp, pp, tp)
    spanned = formula("labkit.mesh.layout.nodes_spanned")
    flags = tuple(int(inside(axis, dp, pp, tp, G)) for axis in AXES_BY_LINK)
    stride = {"tp": 1, "pp": tp, "dp": pp * tp}
    size = {"tp": tp, "pp": pp, "dp": dp}
    solution = ["Ranks are numbered node by node (node = rank // G) and the course's order puts "
                "tp innermost: an axis of size n and stride s spans s n consecutive ranks.",
                *(f"{axis}: size {size[axis]}, stride {stride[axis]}, span "
                  f"{size[axis] * stride[axis]}; its first group {groups[axis][0]} lies on "
                  f"node(s) {spanned(groups[axis][0], G)}: "
                  + ("inside a node (NVLink)." if flags[i] else "across nodes (InfiniBand).")
                  for i, axis in enumerate(AXES_BY_LINK)),
                "tp sends the most per step (an all-reduce of [b, s, h] per block, every "
                "microbatch), so it gets the fast link first; pp sends one activation per "
                "microbatch, point to point; dp sends the gradients once a step and can hide "
                "behind backward."]
    return {"question": f"A job of {dp * pp * tp} GPUs on nodes of G = {G} GPUs, tp = {tp}, "
                        f"pp = {pp}, dp = {dp}, in the course's order (dp outermost, tp "
                        "innermost: rank = (dp_rank x pp + pp_rank) x tp + tp_rank). For tp, "
                        "pp and dp in that order, type 1 if every group of the axis stays "
                        "inside one node (NVLink) and 0 if its groups cross nodes (InfiniBand).",
            "answer": flags, "unit": "", "kind": "tuple", "solution": solution}


# ---- choose tp, pp and dp: four configurations priced by the chapter's model --------------------

# (Megatron-LM 2021 row, cluster, nodes, global batch) and four (tp, pp) of that world: one with a
# tp group wider than a node, pure data parallelism, and two that keep tp inside a node. Lab 6's
# hidden tests use other (model, cluster, batch) triples.
_SCENES = {
    "39B-A100": (4, "DGX A100", 8, 512, ((16, 1), (1, 1), (8, 2), (2, 8))),
    "76B-A100": (5, "DGX A100", 16, 1024, ((16, 1), (1, 1), (8, 2), (4, 4))),
    "146B-H100": (6, "DGX H100", 32, 1536, ((16, 1), (1, 1), (8, 1), (4, 8))),
    "39B-H100": (4, "DGX H100", 16, 768, ((16, 1), (1, 1), (8, 4), (2, 8))),
}


def _draw_choice(rng):
    scene = rng.choice(sorted(_SCENES))
    order = list(range(4))
    rng.shuffle(order)
    return {"scene": scene, "order": order}


@register("mesh-choose", "mesh", "Choose tp, pp and dp for a model on a cluster", 6, "section 4",
          ["labkit.mesh.cost.predict", "labkit.mesh.figures.megatron_rows", "labkit.mesh.CLUSTERS"],
          source="the most asked interview question of this material; Megatron-LM 2021's models")
@draws(_draw_choice)
def _mesh_choose(p, formula):
    row, cluster_name, nodes, batch, pairs = _SCENES[p["scene"]]
    model = formula("labkit.mesh.figures.megatron_rows")()[row]["model"]
    cluster = formula("labkit.mesh.CLUSTERS")[cluster_name].with_nodes(nodes)
    predict = formula("labkit.mesh.cost.predict")
    G, gpus = cluster.gpus_per_node, cluster.gpus
    candidates = []
    for i in p["order"]:
        tp, pp = pairs[i]
        dp = gpus // (tp * pp)
        config = {"dp": dp, "tp": tp, "pp": pp, "zero_stage": 1, "microbatches": batch // dp}
        candidates.append((config, predict(model, cluster, config, batch)))
    fitting = [(c, r) for c, r in candidates if r["fits"]]
    best, best_cost = min(fitting, key=lambda cr: cr[1]["step_time"])
    listed = "; ".join(f"({chr(65 + i)}) tp = {c['tp']}, pp = {c['pp']}, dp = {c['dp']}"
                       for i, (c, _) in enumerate(candidates))
    solution = []
    for i, (c, r) in enumerate(candidates):
        parts = r["breakdown"]
        solution.append(f"({chr(65 + i)}) tp {c['tp']}, pp {c['pp']}, dp {c['dp']}, m = "
                        f"{c['microbatches']}: peak {sig(r['memory'] / 1e9, 3)} GB "
                        + ("(fits); " if r["fits"] else f"(does NOT fit in "
                           f"{cluster.memory / 1e9:.0f} GB); ")
                        + f"step {sig(r['step_time'], 3)} s = compute {sig(parts['compute'], 3)}"
                        f" + bubble {sig(parts['bubble'], 3)} + tp {sig(parts['tp'], 3)} + pp "
                        f"{sig(parts['pp'], 3)} + dp {sig(parts['dp'], 3)} + latency "
                        f"{sig(parts['latency'], 3)} s.")
    solution += [f"tp wider than a node of {G} puts its all-reduces, 6 per layer and "
                 "microbatch with full recomputation, on InfiniBand: several times the step. "
                 "Pure dp keeps every weight and gradient on every GPU (4 bytes a parameter "
                 "even with ZeRO-1): too much for one GPU at this size.",
                 "Between the two that keep tp inside a node, the model trades tp's bytes on "
                 "NVLink (they grow with tp) against the bubble (pp - 1)/m and the memory each "
                 f"rank holds. Here ({chr(65 + candidates.index((best, best_cost)))}) wins: "
                 f"{sig(best_cost['step_time'], 3)} s.",
                 "The model assumes a fixed 60% of peak and overlaps nothing; chapter 6, section "
                 "5 compares it with Megatron-LM's measurements. Lab 6 searches every "
                 "configuration; this question prices four."]
    return {"question": f"Megatron-LM's {model.name} model (L = {model.layers}, h = "
                        f"{model.hidden}, {model.heads} heads, s = {model.seq}) on {nodes} "
                        f"{cluster_name} nodes ({gpus} GPUs, {G} per node, "
                        f"{cluster.memory / 1e9:.0f} GB each), global batch {batch} sequences, "
                        "micro-batch 1, ZeRO-1, full recomputation, 1F1B. Of these four, which "
                        "fits and has the shortest step in chapter 6's cost model? " + listed
                        + ". Answer with its tp, pp, dp.",
            "answer": (best["tp"], best["pp"], best["dp"]), "unit": "", "kind": "tuple",
            "solution": solution}
