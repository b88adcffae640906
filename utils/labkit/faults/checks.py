"""Lab 9's checkers: the diagnoser (task 1, here), the spike guard (task 2, checks_guard.py), the
resume validator (task 3, checks_resume.py).

    checks.check_no_alarm(world, diagnose)           # healthy runs with ordinary pauses
    checks.check_straggler(world, diagnose)          # one rank sleeps in every step
    checks.check_missing(world, diagnose)            # one rank never joins a collective
    checks.check_hot_expert(world, diagnose)         # one expert gets 30-60% of the tokens
    checks.check_guard_clean(world, SpikeGuard)      # clean streams with hard batches
    checks.check_guard_spike(world, SpikeGuard)      # streams with a bad batch (or two)

Task 1 is graded by rates. Every call records a batch of fresh runs on real ranks (labkit.faults
.rates: one launch, each run drawn from a seed of its own, the fault's size stratified over its
range and the faulty rank or expert running through all of them), hands the traces to the
student's `diagnose` on the world's ranks (with chapter 9's rules, labkit.faults.detect, refused:
the task asks for a rule of the student's own), and counts:

- misses: faulty runs whose fault is not named (None, or another rank or expert), on the run's
  trace or on one of its copies with the ranks (experts) renamed so that each is the faulty one
  once (`renamed`: a rule blind to one rank misses every run);
- false alarms: runs with an alarm of a kind the run does not have (any alarm of a healthy run;
  a straggler named in a run where a rank is missing, ...).

A call passes with at most MAX_MISSES misses and at most MAX_FALSE_ALARMS false alarms, whatever
the batch's size; a failure prints both rates, measured against allowed, and the seed and the
injected fault of every run missed or falsely alarmed. Every call holds faulty runs and runs
without that fault, so a rule that never fires (misses all) and one that always fires (a false
alarm on each run without the fault) both fail every cell.

Measured on the reference rule (medians of compute time, 3x the others' median; the busiest
expert above 2x the mean) and on chapter 9's (detect.stragglers, detect.hot_expert) while writing
the lab, on the shared 2-core machine (load 5-30): 12 healthy runs with 3 pauses and 12 straggler
runs (sleeps 0.06-0.2 s) at P = 2 and at P = 3: no false alarm, no miss, for both rules; the
straggler's median compute time was 8-24x the others'. At sleeps of 0.03-0.04 s (below the
lab's range, under load 9) the reference missed 1 of 8 and chapter 9's rule 2 of 8: the
range starts at 0.05 s, and the allowance of one miss is for a machine that busy.
(tests/chapters/test_ch09_failures_at_scale.py records a batch of each kind at P = 3 and checks
both rules against the allowances.)
"""
from __future__ import annotations

from labkit import checks as base
from labkit.faults import rates, traces

TASK1 = "Lab 9, task 1"
KEYS = ("straggler", "missing", "hot_expert")
CLOCK_SKEW = 1.0
MAX_MISSES = 1             # faulty runs a call may miss
MAX_FALSE_ALARMS = 1       # runs a call may raise a false alarm on
HICCUPS = (0.05, 0.2)      # a healthy rank's one-off pause, seconds (at most two per rank)
DELAY = (0.05, 0.15)       # a straggler's sleep in every step, seconds (the lab's range)
SHARE = (0.3, 0.6)         # a hot expert's share of the tokens (of 8 experts)
MISSING_TIMEOUT = 0.5      # the others give up on a rank that never joins after this, seconds

HINTS = {
    "straggler": "a straggler is slow in its compute (the time from a step's start to its "
                 "entering the step's collective), not in its step time: every rank of a "
                 "synchronous step waits for the slowest, so all step times look alike. Take "
                 "each rank's median over the finished steps (one or two long pauses of a healthy "
                 "rank do not move it) and compare it with the other ranks' (a ratio, or a gap "
                 "that the smallest straggler's sleep in the text clears); compare times within a "
                 "rank only (the clocks are skewed)",
    "missing": "the rank that never joined is the one that never issued the collective (the same "
               "seq) that the others entered and never left",
    "hot_expert": "sum the tokens per expert over the steps; call the busiest expert hot when "
                  "its load is far above the mean (the text's smallest hot share is 30% of 8 "
                  "experts, 2.4x the mean), and say None when routing is merely noisy",
}


def _verdict(got, what, case):
    """The shape of one answer: a dict with exactly KEYS, each an int or None."""
    if not isinstance(got, dict) or sorted(got) != sorted(KEYS):
        raise AssertionError(f"{what}: diagnose returned {got!r}; expected a dict with exactly "
                             f"the keys {list(KEYS)} [{case}]")
    for key in KEYS:
        value = got[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise AssertionError(f"{what}: diagnose(...)[{key!r}] is {value!r}; expected an int "
                                 f"or None [{case}]")
    return got


def _said(got) -> str:
    return ", ".join(f"{k}={v}" for k, v in got.items() if v is not None) or "nothing"


def tally(runs, verdicts) -> dict:
    """{"misses": [(run, verdict)], "false_alarms": [(run, verdict)], "faulty": n, "runs": n}:
    a faulty run is missed when its fault's key is not its rank (expert); a run raises a false
    alarm when a key whose fault it does not have is not None. `verdicts[i]` may be a list: the
    answers on run i's renamed copies (`renamed`), each against its own expected answer; the run
    counts once, missed (falsely alarmed) when any copy is."""
    misses, false = [], []
    for run, got in zip(runs, verdicts):
        copies = got if isinstance(got, list) else [(got, run["expected"])]
        for i, (answer, expected) in enumerate(copies):
            if any(expected[k] is not None and answer[k] != expected[k] for k in KEYS):
                misses.append((_as_renamed(run, i, expected), answer))
                break
        for i, (answer, expected) in enumerate(copies):
            if any(expected[k] is None and answer[k] is not None for k in KEYS):
                false.append((_as_renamed(run, i, expected), answer))
                break
    return {"misses": misses, "false_alarms": false, "runs": len(runs),
            "faulty": sum(run["kind"] != "healthy" for run in runs)}


def _as_renamed(run, i, expected):
    """The run as a failure names it: copy i > 0 is the trace renamed (`renamed`)."""
    if i == 0:
        return run
    fault = ", ".join(f"{'expert' if k == 'hot_expert' else 'rank'} {v}"
                      for k, v in expected.items() if v is not None)
    return dict(run, what=f"{run['what']}; the trace renamed by {i}, so that the fault is "
                          f"{fault}'s")


def renamed(run, trace, size):
    """The run's trace with its ranks (its experts, for a hot expert) renamed i -> (i + k) mod
    P (mod 8), for every k, each with its expected answer (issue 26, class 4): a rule that never
    reads one rank's record, or names a constant rank, misses the run on some renaming whatever
    rank the run drew; a rule that reads the data answers every renaming alike."""
    key = {"straggler": "straggler", "missing": "missing", "hot": "hot_expert"}.get(run["kind"])
    if key is None:
        return [(trace, run["expected"])]
    count, relabel = (rates.EXPERTS, relabel_experts) if key == "hot_expert" else \
        (size, relabel_ranks)
    return [(relabel(trace, k) if k else trace,
             dict(run["expected"], **{key: (run["expected"][key] + k) % count}))
            for k in range(count)]


def relabel_ranks(trace, shift):
    """The same trace with rank r renamed (r + shift) mod P (its record, clock and all, moved to
    that place in `ranks`): the run where another rank had the fault."""
    size = trace["world_size"]
    ranks = sorted((dict(r, rank=(r["rank"] + shift) % size) for r in trace["ranks"]),
                   key=lambda r: r["rank"])
    return dict(trace, ranks=ranks)


def relabel_experts(trace, shift):
    """The same trace with expert e renamed (e + shift) mod E in every step's loads."""
    ranks = []
    for r in trace["ranks"]:
        loads = r.get("expert_tokens")
        if loads is not None:
            loads = [[row[(e - shift) % len(row)] for e in range(len(row))] for row in loads]
        ranks.append(dict(r, expert_tokens=loads))
    return dict(trace, ranks=ranks)


def _judge(counted, case, what, hint):
    misses, false = counted["misses"], counted["false_alarms"]
    if len(misses) <= MAX_MISSES and len(false) <= MAX_FALSE_ALARMS:
        return
    found = counted["faulty"] - len(misses)
    lines = [f"{what}: your diagnose found the fault in {found} of {counted['faulty']} faulty "
             f"runs (at least {counted['faulty'] - MAX_MISSES} needed) and raised a false alarm "
             f"in {len(false)} of {counted['runs']} runs (at most {MAX_FALSE_ALARMS} allowed) "
             f"[{case}]"]
    for label, items in (("missed", misses), ("false alarm", false)):
        for run, got in items[:6]:
            lines.append(f"  {label}: {run['what']}: you said {_said(got)}; to record it "
                         f"again: {rates.replay(run, CLOCK_SKEW)}")
    raise AssertionError("\n".join(lines) + "\n" + hint)


def _batch(world, diagnose, case, kinds, ranges):
    """Draw and record the runs (kinds: [(kind, count)]; stratum i of count each), then run
    diagnose on each. Returns (runs, traces, verdicts)."""
    runs = []
    offset = case.integer(0, 2 ** 20)            # the batch's first faulty rank (expert)
    for kind, count in kinds:
        for i in range(count):
            runs.append(rates.draw(kind, case.integer(0, 2 ** 40), world.size,
                                   dict(ranges[kind], offset=offset), (i, count)))
    recorded = rates.record(world, runs, CLOCK_SKEW)
    copies = [renamed(run, trace, world.size) for run, trace in zip(runs, recorded)]
    answers = rates.diagnose_each(world, diagnose, [t for group in copies for t, _ in group])
    verdicts, at = [], 0
    for run, group in zip(runs, copies):
        verdicts.append([(_verdict(got, run["what"], case), expected)
                         for got, (_, expected) in zip(answers[at:at + len(group)], group)])
        at += len(group)
    return runs, recorded, verdicts


def _ranges(steps, hiccups=(0,) + HICCUPS, experts=None, **more):
    healthy = {"steps": steps, "hiccups": hiccups, "experts": experts}
    return {kind: dict(healthy, **more) for kind in rates.KINDS}


def check_no_alarm(world, diagnose, runs=3, steps=6, hiccups=3, seed=None):
    """`runs` healthy runs, each with `hiccups` one-off pauses of HICCUPS seconds (in the first
    two runs, on purpose, one rank paused twice for the longest allowed and nothing else: a mean
    or a maximum of compute times calls it a straggler), half of them with 8 experts routed at
    random: no alarm (at most MAX_FALSE_ALARMS runs with one). And the same traces with
    a fault written in (a rank cut off before a step's all-reduce; one expert given half the
    tokens) must raise some alarm: a rule silent on both of a trace's faulty copies misses it
    (at most MAX_MISSES such traces); any key counts, so a rule that misses one kind of fault
    loses that kind's cell only."""
    case = base.Case(f"{TASK1}: {runs} healthy runs of {steps} steps on {world.size} ranks "
                     f"with {hiccups} pauses each", seed)
    ranges = _ranges(steps, (hiccups,) + HICCUPS)
    cases = [rates.draw("healthy", case.integer(0, 2 ** 40), world.size, ranges["healthy"],
                        (i, runs)) for i in range(runs)]
    recorded = rates.record(world, cases, CLOCK_SKEW)
    written, notes = [], []
    for run, trace in zip(cases, recorded):
        rank, step = case.integer(0, world.size - 1), case.integer(steps // 2, steps - 1)
        hot = case.integer(0, rates.EXPERTS - 1)
        written += [with_missing_rank(trace, rank, step), with_hot_expert(trace, hot)]
        notes.append(f"rank {rank} cut before step {step}'s all-reduce / expert {hot} given "
                     "half the tokens")
    verdicts = [_verdict(got, "a healthy run (or a copy with a fault written in)", case)
                for got in rates.diagnose_each(world, diagnose, recorded + written)]
    counted = tally(cases, verdicts[:runs])
    silent = [(dict(run, what=run["what"] + ", copies: " + note), verdicts[runs + 2 * i])
              for i, (run, note) in enumerate(zip(cases, notes))
              if not any(v is not None for got in verdicts[runs + 2 * i:runs + 2 * i + 2]
                         for v in got.values())]
    _judge(dict(counted, misses=silent, faulty=runs), case,
           "healthy runs (nothing is wrong in them), and their copies with a fault written in",
           "this run has no straggler, only a few one-off pauses: the slowest rank of a healthy "
           "run is not a straggler, and the busiest expert of random routing is not hot; but a "
           "rule that never fires has no false alarms and no use: the copies with a rank cut "
           "off (or an expert given half the tokens) must raise an alarm. "
           + HINTS["straggler"])
    return verdicts[:runs]


def check_straggler(world, diagnose, runs=2, healthy=1, steps=6, delay=(0.13, 0.15), seed=None):
    """`runs` runs where one rank sleeps a time drawn from `delay` (stratified) before its
    collective in every step from a step in the first third on, the slow rank running through
    every rank; `healthy` runs beside them. Expected: that rank, nothing else. (No pauses in
    these runs: they are check_no_alarm's, so a rule that pauses fool loses that cell only.)"""
    case = base.Case(f"{TASK1}: stragglers sleeping {delay[0]}-{delay[1]} s among "
                     f"{world.size} ranks, {runs} runs", seed)
    ranges = _ranges(steps, delay=tuple(delay))
    runs_, _, verdicts = _batch(world, diagnose, case, [("straggler", runs),
                                                        ("healthy", healthy)], ranges)
    _judge(tally(runs_, verdicts), case, "runs with a straggler (and healthy runs)",
           HINTS["straggler"])
    return [group[0][0] for group in verdicts]


def check_missing(world, diagnose, runs=2, healthy=1, steps=6, seed=None):
    """`runs` runs where one rank (each rank in turn) stops before the collective of a step in
    the second half; the others wait in it and give up after MISSING_TIMEOUT s. Expected: that
    rank is missing, nobody is a straggler; `healthy` runs beside them: nothing."""
    case = base.Case(f"{TASK1}: a rank that never joins a collective, {world.size} ranks, "
                     f"{runs} runs", seed)
    ranges = _ranges(steps, timeout=MISSING_TIMEOUT)
    runs_, _, verdicts = _batch(world, diagnose, case, [("missing", runs),
                                                        ("healthy", healthy)], ranges)
    _judge(tally(runs_, verdicts), case, "runs with a rank that never joins (and healthy runs)",
           HINTS["missing"] + "; the ranks that waited in the last collective are not "
           "stragglers: leave out steps that did not finish")
    return [group[0][0] for group in verdicts]


def check_hot_expert(world, diagnose, runs=3, healthy=1, steps=6, share=(0.45, 0.6), seed=None):
    """`runs` runs where a share of every rank's tokens drawn from `share` (stratified) goes to
    one expert of 8 (each run another), top-1 routing; `healthy` runs with 8 experts routed at
    random. Expected: that expert, nothing else."""
    case = base.Case(f"{TASK1}: a hot expert with {share[0]:.0%}-{share[1]:.0%} of the tokens, "
                     f"{world.size} ranks, {runs} runs", seed)
    ranges = _ranges(steps, experts=rates.EXPERTS, share=tuple(share))
    runs_, _, verdicts = _batch(world, diagnose, case, [("hot", runs), ("healthy", healthy)],
                                ranges)
    _judge(tally(runs_, verdicts), case, "runs with a hot expert (and healthy MoE runs)",
           HINTS["hot_expert"])
    return [group[0][0] for group in verdicts]


def with_missing_rank(trace, rank, step):
    """The trace as if `rank` had stopped before step `step`'s gradient all-reduce: every rank's
    record ends in that step, the others inside its collective (never left), the rank without
    it. Plain data from a real run, cut; the clocks stay as they were."""
    ranks = []
    for r in trace["ranks"]:
        kept = [dict(c) for c in r["collectives"] if c["step"] < step]
        if r["rank"] != rank:
            entered = [dict(c, leave=None) for c in r["collectives"]
                       if c["step"] == step and c["what"] == "grads"]
            kept += entered[:1]
        loads = r.get("expert_tokens")
        ranks.append(dict(r, step_start=list(r["step_start"][:step + 1]),
                          step_end=list(r["step_end"][:step]) + [None], collectives=kept,
                          expert_tokens=None if loads is None else [list(x) for x in loads[:step]]))
    return dict(trace, ranks=ranks)


def with_hot_expert(trace, hot, experts=rates.EXPERTS):
    """The trace with expert `hot` given half of every step's tokens (the others share the rest
    evenly); a run without experts gets `experts` of them."""
    ranks = []
    for r in trace["ranks"]:
        loads = r.get("expert_tokens") or [[traces.TOKENS_PER_RANK * trace["world_size"]
                                            // experts] * experts for _ in r["step_end"]]
        rows = []
        for counts in loads:
            n, total = len(counts), sum(counts)
            row = [(total - total // 2) // max(n - 1, 1)] * n
            row[hot % n] = total // 2
            rows.append(row)
        ranks.append(dict(r, expert_tokens=rows))
    return dict(trace, ranks=ranks)


from labkit.faults.checks_guard import (GUARD_TOLERANCE, check_guard_clean,  # noqa: E402,F401
                                        check_guard_spike, guarded_stream, stream_shares)
