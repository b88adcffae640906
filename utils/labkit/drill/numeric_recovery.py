"""Numeric drills of the decisions of chapters 8 and 9 taken on call: how big a snapshot is, how
often a job of G GPUs is interrupted, how much work a failure costs. Each answer comes from the
chapter's own function (named in `uses`, imported by name when a problem is posed: see
`numeric.formula`); each drill names the slips its ratios give away (`slips`).

The asynchronous checkpoint interval is lab 8's task 4, so no drill computes it here: labkit never
holds a graded task's answer. Its two ingredients are drilled (the stall in `young-interval`, the
job's M here)."""
from __future__ import annotations

from labkit.drill.base import bytes_text, factor, sig
from labkit.drill.numeric import draws, register

HOURS_PER_YEAR = 365 * 24             # chapter 8, section 7 counts a year as 365 days


# ---- chapter 8: what a snapshot holds ------------------------------------------------------------

def _draw_snapshot(rng):
    return {"psi": rng.choice([7e9, 13e9, 70e9, 200e9, 405e9]),
            "bf16": rng.choice([False, True]), "dp": rng.choice([8, 16, 64, 128]),
            "ask": rng.choice(["total", "per_rank", "write"]),
            "GBps": rng.choice([2, 5, 10, 40])}


@register("snapshot-bytes", "checkpoint", "How big a snapshot is, and how long it takes to write",
          8, "sections 4 and 6", ["labkit.memory.model_states"],
          source="seed 004's '3.2 TB for 200B' (which counts gradients)")
@draws(_draw_snapshot)
def _snapshot(p, formula):
    psi, bf16, dp, ask = p["psi"], p["bf16"], p["dp"], p["ask"]
    states = formula("labkit.memory.model_states")(psi, 1, 0)      # chapter 3's mixed AdamW
    optimizer, weights, gradients = (states[k] for k in ("optimizer_states", "parameters",
                                                         "gradients"))
    total = optimizer + (weights if bf16 else 0.0)                 # no gradients: recomputed
    held = ("the FP32 master weights, AdamW's two moments and the BF16 working weights" if bf16
            else "the FP32 master weights and AdamW's two moments (the BF16 weights are rebuilt "
                 "from the master copy)")
    per_param = (optimizer + (weights if bf16 else 0)) / psi
    solution = [f"A checkpoint holds {held}: {per_param:g} bytes per parameter. No gradients: the "
                "first step after a resume computes them afresh.",
                f"{sig(psi / 1e9)}B x {per_param:g} B = {bytes_text(total)}."]
    wrong = {(optimizer + weights + gradients) / psi:
             "chapter 3's training ledger, gradients included, and a checkpoint holds no gradients "
             "(the first step after a resume computes them)."}
    if bf16:
        wrong[optimizer / psi] = "it leaves out the BF16 working weights, which this job saves too."
    else:
        wrong[(optimizer + gradients) / psi] = ("2 more than this snapshot holds: the BF16 weights "
                                                "(not saved here) or the gradients (never in a "
                                                "checkpoint)?")
    slips = [(b / per_param, f"That is {b:g} bytes per parameter: {why}") for b, why in wrong.items()]
    setting = (f"A {sig(psi / 1e9)}B-parameter model trained with mixed-precision AdamW (BF16 "
               "weights and gradients, FP32 master weights and moments) saves its full training "
               "state" + (", BF16 working weights included" if bf16 else
                          ", the FP32 master copy but not the BF16 weights"))
    if ask == "total":
        return {"question": f"{setting}. How big is one snapshot?",
                **_big(total), "solution": solution, "slips": tuple(slips)}
    if ask == "per_rank":
        shard = total / dp
        solution.append(f"ZeRO-1 over dp = {dp}: each rank writes 1/dp of it, "
                        f"{bytes_text(shard)}.")
        return {"question": f"{setting}, sharded by ZeRO-1 over dp = {dp} ranks (no tensor or "
                            "pipeline parallelism); each rank writes its own shard. How big is "
                            "one rank's shard?",
                **_big(shard), "solution": solution, "slips": tuple(slips)}
    minutes = total / (p["GBps"] * 1e9) / 60
    solution.append(f"At {p['GBps']} GB/s: {bytes_text(total)} / {p['GBps']} GB/s = "
                    f"{sig(minutes * 60)} s = {sig(minutes)} min of stall, if the save is "
                    "synchronous.")
    return {"question": f"{setting}, to storage that sustains {p['GBps']} GB/s for this job. How "
                        "many minutes does a synchronous save stall training?",
            "answer": minutes, "unit": "min", "solution": solution, "slips": tuple(slips)}


def _big(value: float) -> dict:
    unit = "TB" if value >= 1e12 else "GB"
    return {"answer": value / factor(unit), "unit": unit}


# ---- chapter 8: a job's mean time between failures -------------------------------------------------

def _draw_mtbf(rng):
    gpus = rng.choice([1024, 4096, 8192, 16384, 32768, 100_000])
    if rng.random() < 0.5:
        return {"gpus": gpus, "given": "llama3"}
    return {"gpus": gpus, "given": "years", "years": rng.choice([2, 5, 6, 10, 20])}


@register("job-mtbf", "checkpoint", "A job's mean time between failures from a per-GPU rate", 8,
          "section 7", ["labkit.checkpoint.interval.llama3_mtbf_hours",
                        "labkit.checkpoint.interval.LLAMA3"],
          source="Llama 3 report (arXiv:2407.21783), section 3.3.4: 419 unexpected "
                 "interruptions in 54 days on 16,384 GPUs")
@draws(_draw_mtbf)
def _mtbf(p, formula):
    gpus = p["gpus"]
    if p["given"] == "llama3":
        llama = formula("labkit.checkpoint.interval.LLAMA3")
        job_h = formula("labkit.checkpoint.interval.llama3_mtbf_hours")()
        per_gpu_h = job_h * llama["gpus"]
        given = (f"Llama 3's pre-training had {llama['unexpected']} unexpected interruptions in "
                 f"{llama['days']} days on {llama['gpus']:,} GPUs. At the same rate per GPU")
        steps = [f"Llama 3's job: M = {llama['days']} x 24 h / {llama['unexpected']} = "
                 f"{sig(job_h)} h on {llama['gpus']:,} GPUs.",
                 f"Per GPU: {sig(job_h)} h x {llama['gpus']:,} = {sig(per_gpu_h)} h "
                 f"({sig(per_gpu_h / HOURS_PER_YEAR)} years), every cause counted, not only "
                 "the GPU's own faults."]
    else:
        per_gpu_h = p["years"] * HOURS_PER_YEAR
        given = (f"Each GPU of a cluster is the cause of an interruption (counting every cause "
                 f"charged to it) once every {p['years']} years on average. Then")
        steps = [f"Per GPU: {p['years']} x {HOURS_PER_YEAR:,} h = {sig(per_gpu_h)} h."]
    job = per_gpu_h / gpus
    steps += [f"Independent failures add their rates: G GPUs fail G times as often, so the job's "
              f"M = {sig(per_gpu_h)} h / {gpus:,} = {sig(job)} h ({sig(job * 60)} min).",
              "Any one GPU's interruption stops the whole job: every rank waits in the next "
              "collective."]
    return {"question": f"{given}, what is the mean time between interruptions of one job on "
                        f"{gpus:,} GPUs, in hours?",
            "answer": job, "unit": "h", "rel_tol": 0.03, "solution": steps,
            "slips": ((gpus, "That is G times the answer: the per-GPU figure, not divided by "
                             "the GPUs. The job stops when any one of them fails."),
                      (gpus ** 2, "That is the per-GPU figure multiplied by G: a job of more "
                                  "GPUs fails more often, not less."),
                      (1 / gpus, "That is 1/G of the answer: divided by the GPUs twice?"))}


# ---- chapter 9: the work a failure costs ----------------------------------------------------------

def _draw_lost(rng):
    tau = rng.choice([4, 5, 8, 10, 16, 20, 25, 50, 100])
    ask = rng.choice(["one", "boundary", "random_time"])
    draw = {"tau": tau, "ask": ask}
    if ask == "one":
        draw["kill_at"] = rng.randint(tau + 2, 6 * tau)
        if (draw["kill_at"] - 1) % tau == 0:          # a kill right after a snapshot: nothing
            draw["kill_at"] += 1                      # lost, and no slip can be read from 0
    return draw


@register("steps-lost", "faults", "Steps lost to a failure between snapshots", 9, "section 4",
          ["labkit.faults.elastic.lost_steps"])
@draws(_draw_lost)
def _lost(p, formula):
    tau, ask = p["tau"], p["ask"]
    lost_steps = formula("labkit.faults.elastic.lost_steps")
    setting = (f"A job publishes a snapshot after every {tau} steps (after steps {tau}, "
               f"{2 * tau}, ...), and a restarted job resumes from the newest one.")
    if ask == "one":
        k = p["kill_at"]
        lost = lost_steps(k, tau)
        return {"question": f"{setting} A rank is SIGKILLed as step {k} begins. How many steps "
                            "that had completed does the restarted job do again?",
                "answer": lost, "unit": "", "rel_tol": 0.0, "abs_tol": 0.01,
                "solution": [f"When step {k} begins, steps 1 to {k - 1} are done.",
                             f"The newest snapshot is after step {k - 1 - lost} (a multiple of "
                             f"{tau}).",
                             f"Redone: steps {k - lost} to {k - 1}: (k - 1) mod tau = {lost}. "
                             f"Step {k} itself never completed, so it is not lost work."],
                "slips": (((lost + 1) / lost, f"That counts step {k}, which had not completed: "
                                              "it was only beginning."),)}
    boundary = sum(lost_steps(k, tau) for k in range(tau + 1, 2 * tau + 1)) / tau
    if ask == "boundary":
        return {"question": f"{setting} Failures kill the job as a step begins, at any step "
                            "equally likely. On average, how many completed steps does a "
                            "failure make the job redo?",
                "answer": boundary, "unit": "", "rel_tol": 0.0, "abs_tol": 0.01,
                "solution": [f"Over one period, a kill as step k begins loses (k - 1) mod {tau}: "
                             f"0, 1, ..., {tau - 1}, each as likely.",
                             f"Their mean is (tau - 1)/2 = {sig(boundary)} steps."],
                "slips": ((tau / (tau - 1), "That is tau/2: the average for a failure at a "
                                            "random time, which also loses the half step in "
                                            "progress. Killed as a step begins, nothing of "
                                            "that step is lost."),)}
    random_time = boundary + 0.5
    return {"question": f"{setting} Failures come at a uniformly random time, in the middle of "
                        "a step as often as not. On average, how many steps' worth of compute "
                        "does a failure waste (completed steps redone plus the step it cut "
                        "short)?",
            "answer": random_time, "unit": "", "rel_tol": 0.0, "abs_tol": 0.01,
            "solution": [f"Completed steps since the snapshot: 0 .. {tau - 1}, mean (tau - 1)/2 "
                         f"= {sig(boundary)}.",
                         "The step in progress is lost too: half a step on average.",
                         f"(tau - 1)/2 + 1/2 = tau/2 = {sig(random_time)} steps: Young's tau/2 "
                         "(chapter 8, section 7) in steps."],
            "slips": (((tau - 1) / tau, "That is (tau - 1)/2: whole steps only; the step the "
                                        "failure cut short is lost too, half a step on "
                                        "average."),)}
