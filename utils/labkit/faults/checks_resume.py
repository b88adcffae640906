"""Lab 9, task 3's checker: a resume validator that refuses what cannot be resumed and plans what
can.

    validate_resume(snapshot, run) -> plan, or ValueError naming what does not match

A snapshot's metadata and the new run's settings are plain dicts (the lab's notebook shows the
format). Cases are drawn fresh: a compatible resume (the same world size, or another one that
divides the global batch) must return the plan; each kind of mismatch (another tokenizer with the
same name and vocabulary size, another data mixture or data seed, a data cursor that disagrees
with the step, ranks whose cursors disagree, another global batch, a world size that does not
divide it) must raise ValueError whose message names what differs.
"""
from __future__ import annotations

import copy
import hashlib

from labkit import checks as base
from labkit import released

TASK3 = "Lab 9, task 3"
SOURCES = ("web", "code", "books", "math")
# what a message must mention for each kind of mismatch (any one of the words)
WORDS = {"tokenizer": ("tokenizer",), "mixture": ("mixture",), "seed": ("seed", "mixture"),
         "cursor": ("cursor",), "rank_cursors": ("cursor",), "global_batch": ("global batch",
                                                                               "global_batch"),
         "world_size": ("world size", "world_size")}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def draw_snapshot(case) -> dict:
    """A consistent snapshot: step, world size P, global batch B (a multiple of P), tokenizer,
    mixture, and a cursor of step * B samples spread over the sources and the ranks."""
    P = case.integer(1, 8)
    B = P * case.integer(1, 16)
    step = case.integer(0, 5000)
    sources = SOURCES[:case.integer(1, len(SOURCES))]
    raw = [case.integer(1, 9) for _ in sources]
    mixture = {s: r / sum(raw) for s, r in zip(sources, raw)}
    seen = step * B
    cursor, left = {}, seen
    for s in sources[:-1]:
        cursor[s] = min(left, round(seen * mixture[s]))
        left -= cursor[s]
    cursor[sources[-1]] = left
    vocab = case.integer(1000, 200000)
    name = f"bpe-{vocab // 1000}k"
    return {"step": step, "world_size": P, "global_batch": B,
            "tokenizer": {"name": name, "vocab_size": vocab, "sha256": _sha(f"{name}/{vocab}")},
            "data": {"mixture": mixture, "seed": case.integer(0, 10 ** 6), "samples_seen": seen,
                     "cursor": cursor, "rank_cursors": [seen // P] * P}}


def run_of(snapshot: dict, world_size: int | None = None) -> dict:
    """The settings of a run that resumes `snapshot` compatibly (at `world_size` if given)."""
    return {"world_size": world_size or snapshot["world_size"],
            "global_batch": snapshot["global_batch"],
            "tokenizer": copy.deepcopy(snapshot["tokenizer"]),
            "data": {"mixture": dict(snapshot["data"]["mixture"]),
                     "seed": snapshot["data"]["seed"]}}


def mismatch(case, kind: str):
    """(snapshot, run) that differ in `kind` only (one of WORDS)."""
    return mismatch_pair(case, kind)[:2]


def mismatch_pair(case, kind: str):
    """(snapshot, run, good snapshot, good run): a resume that differs in `kind` only, and the
    compatible resume it was made from."""
    snap = draw_snapshot(case)
    while kind in ("world_size", "rank_cursors") and snap["global_batch"] < 2:
        snap = draw_snapshot(case)
    good = (copy.deepcopy(snap), run_of(snap))
    return _mismatch(case, kind, snap) + good


def _mismatch(case, kind, snap):
    if kind == "seed":
        run = run_of(snap)
        run["data"]["seed"] += case.integer(1, 100)
        return snap, run
    run = run_of(snap)
    if kind == "tokenizer":      # same name, same vocabulary size, other merges
        run["tokenizer"]["sha256"] = _sha(f"{run['tokenizer']['name']}/other-merges")
    elif kind == "mixture":
        sources = list(run["data"]["mixture"])
        if len(sources) == 1:
            run["data"]["mixture"] = {sources[0]: 0.5, "math": 0.5} if sources[0] != "math" \
                else {"math": 0.5, "web": 0.5}
        else:
            a, b = sources[0], sources[1]
            shift = min(run["data"]["mixture"][b], 0.05)
            run["data"]["mixture"][a] += shift
            run["data"]["mixture"][b] -= shift
    elif kind == "cursor":       # the data state saved at another step than the model's
        delta = snap["global_batch"] * case.integer(1, 3)
        first = next(iter(snap["data"]["cursor"]))
        snap["data"]["cursor"][first] += delta
        snap["data"]["samples_seen"] += delta
        snap["data"]["rank_cursors"] = [c + delta // snap["world_size"]
                                        for c in snap["data"]["rank_cursors"]]
    elif kind == "rank_cursors":
        if snap["world_size"] == 1:
            snap["data"]["rank_cursors"] = [snap["data"]["rank_cursors"][0] + 1]
        else:
            r = case.integer(0, snap["world_size"] - 1)
            snap["data"]["rank_cursors"][r] += snap["global_batch"] // snap["world_size"]
    elif kind == "global_batch":
        run["global_batch"] = snap["global_batch"] * 2
    elif kind == "world_size":
        B = snap["global_batch"]
        run["world_size"] = next(p for p in range(2, B + 2) if B % p)
    else:
        raise ValueError(f"unknown kind {kind!r}; known: {sorted(WORDS)}")
    return snap, run


def compatible(case, cases: int) -> list:
    """(snapshot, run) pairs that must be accepted: the same world size, and another one that
    divides the global batch."""
    pairs = []
    for _ in range(cases):
        snap = draw_snapshot(case)
        divisors = [p for p in range(1, snap["global_batch"] + 1) if snap["global_batch"] % p == 0]
        for P in sorted({snap["world_size"], divisors[case.integer(0, len(divisors) - 1)]}):
            pairs.append((snap, run_of(snap, P)))
    return pairs


def check_accepts(validate_resume, cases=6, seed=None):
    """Compatible resumes, at the same world size and at another one that divides the global
    batch: the plan comes back, and the arguments are left as they were."""
    reference = released.reference("faults")
    if reference is None:    # the student copy: the visible cases' plans, written at release
        table = released.load("lab09_failures_at_scale")["plans"]
        seed, cases = table["seed"], table["cases"]
        expected_plan = lambda snap, run: table["plans"][released.key(snap, run)]  # noqa: E731
    else:
        expected_plan = reference.expected_plan
    case = base.Case(f"{TASK3}: compatible resumes", seed)
    for snap, run in compatible(case, cases):
        before = (copy.deepcopy(snap), copy.deepcopy(run))
        try:
            plan = validate_resume(snap, run)
        except ValueError as error:
            raise AssertionError(f"validate_resume refused a compatible resume (saved on "
                                 f"{snap['world_size']} ranks, resumed on {run['world_size']}): {error} "
                                 f"[{case}]; snapshot {snap}") from None
        base.check(plan, expected_plan(snap, run), "the plan", case=case,
                   hint="per_rank_batch = global batch // the new world size; reshard is "
                        "whether the world size changed; cursor and samples_seen are the "
                        "snapshot's")
        if (snap, run) != before:
            raise AssertionError(f"validate_resume changed its arguments [{case}]")


def check_refuses(validate_resume, kinds=("tokenizer", "cursor", "world_size"), seed=None):
    """For each kind: a resume that differs in that only must raise ValueError naming it, and the
    compatible resume it was made from (the same snapshot before the change, its own run) must
    be accepted on the same call (issue 26, class 3: a validator that always raises refuses
    everything and plans nothing). Only the acceptance is required here; the plan's values are
    check_accepts's."""
    case = base.Case(f"{TASK3}: resumes that must be refused ({', '.join(kinds)})", seed)
    for kind in kinds:
        snap, run, good_snap, good_run = mismatch_pair(case, kind)
        try:
            validate_resume(good_snap, good_run)
        except ValueError as error:
            raise AssertionError(f"validate_resume refused a compatible resume (the one the "
                                 f"{kind} mismatch below was made from: same world size, same "
                                 f"tokenizer, data and cursor): {error} [{case}]; refuse only "
                                 "what differs: a validator that refuses everything protects "
                                 "nothing") from None
        try:
            plan = validate_resume(snap, run)
        except ValueError as error:
            text = str(error).lower()
            if not any(word in text for word in WORDS[kind]):
                raise AssertionError(f"the refusal of a {kind} mismatch says {str(error)!r}; it "
                                     f"should name what differs (one of {WORDS[kind]}) [{case}]")
            continue
        raise AssertionError(f"validate_resume accepted a resume whose {kind} does not match "
                             f"(returned {plan!r}) [{case}]\nsnapshot: {snap}\nrun: {run}")
