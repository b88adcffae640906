"""Lab 8's checkers. Task 1 is here; task 2 in checks_resume.py, tasks 3-4 in checks_async.py.

Task 1: a retention policy for the chapter's store (lab 8 asks for this function):

    collect(folder, keep)        # keep the newest `keep` verified snapshots (and leased ones),
                                 # remove every other snapshot's files: older, torn, uncommitted

Snapshots are saved with the chapter's own `store.write_shard` + `store.commit` (chapter 8, s. 1):
the save is not the task. A reader announces itself with a lease file `<folder>/<id>.lease.<who>`
(see LEASE); a leased snapshot is never collected. The three checks, one requirement each:

- check_retention: after collect, the folder holds exactly the newest `keep` snapshots that
  verify (sizes and SHA-256: one damage flips a byte in place and changes nothing else), plus
  files that are not a snapshot's; torn, uncommitted and older ones are gone.
- check_collect_crash_trials: a save (the course's) or a collect (the student's) SIGKILLed at any
  point; after each trial the newest snapshot that verified still verifies, and no snapshot
  that verified is left published with shards gone or changed (a loader that trusts a published
  manifest would load it torn): unpublish first, then delete.
- check_leases: a leased snapshot keeps every file, the lease files stay; once its lease is
  gone, the next collect removes it.

How the checks are built (docs/AUTHORS.md): each rank works in a folder of its own (under
`labkit grade`, its private /tmp), runs saves and the student's collect in victim processes
forked by a lean helper (crash.py) that may SIGKILL them at a chosen point, and hands back plain
observations: every file's size and SHA-256, every manifest's bytes. What verifies, and what is
right, is decided here from those observations and the bytes this process drew.
"""
from __future__ import annotations

import hashlib
import json
import os

from labkit import checks as base
from labkit.checkpoint import crash, store
from labkit.checkpoint.layout import MANIFEST_SUFFIX, CheckpointError, parse_manifest, snapshot_id

# The victims' helper preloads the store without torch: a victim forks in ~2 ms, not ~40 ms
# (crash.py), so a cell's hundreds of victims take seconds.
HELPER = ("labkit.checkpoint.store",)
SHARD_NAMES = ("rank0.bin", "rank1.bin")
LEASE = "{sid}.lease.{reader}"       # a reader's lease on snapshot sid, in the snapshot's folder
FOREIGN = "notes.txt"                # a file that belongs to no snapshot: collect leaves it alone


def call(world, fn, args=(), shares=None, ranks=None, timeout=None):
    """world.call(fn, args), or world.run_each(fn, shares, *args) when shares are given."""
    if shares is not None:
        return world.run_each(fn, shares, *args, timeout=timeout)
    return world.call(fn, args=tuple(args), ranks=ranks, timeout=timeout)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- what runs on a rank (and in its victims) -----------------------------------------------

def observe(folder: str) -> dict:
    """Everything under folder as plain data: {"files": {path: [size, sha256]}, "dirs": [path],
    "manifests": {id: bytes}} (paths relative to folder, '/'-separated)."""
    files, dirs, manifests = {}, [], {}
    for here, subdirs, names in os.walk(folder):
        for name in subdirs:
            dirs.append(os.path.relpath(os.path.join(here, name), folder).replace(os.sep, "/"))
        for name in names:
            path = os.path.join(here, name)
            with open(path, "rb") as stream:
                data = stream.read()
            relative = os.path.relpath(path, folder).replace(os.sep, "/")
            files[relative] = [len(data), _sha(data)]
            if here == folder and name.endswith(MANIFEST_SUFFIX) and not name.startswith("."):
                manifests[name[:-len(MANIFEST_SUFFIX)]] = data
    return {"files": files, "dirs": sorted(dirs), "manifests": manifests}


def _damage(folder: str, sid: str, damage: str) -> None:
    """Break snapshot sid on disk one way (a published snapshot that must not verify)."""
    shard = os.path.join(folder, sid, SHARD_NAMES[1])
    if damage == "flipped byte":                     # same size, same path, same JSON
        with open(shard, "r+b") as stream:
            data = stream.read()
            stream.seek(len(data) // 2)
            stream.write(bytes([data[len(data) // 2] ^ 0xFF]))
    elif damage == "truncated shard":
        data = open(shard, "rb").read()
        with open(shard, "wb") as stream:
            stream.write(data[:len(data) // 2])
    elif damage == "missing shard":
        os.remove(shard)
    elif damage == "torn manifest":
        path = os.path.join(folder, sid + MANIFEST_SUFFIX)
        text = open(path, "rb").read()
        with open(path, "wb") as stream:
            stream.write(text[:len(text) // 2])
    else:
        raise ValueError(f"unknown damage {damage!r}")


def _leftovers(folder: str, sid: str, data: bytes) -> None:
    """What a save killed before its commit leaves: a shard folder, a temporary manifest."""
    os.makedirs(os.path.join(folder, sid), exist_ok=True)
    with open(os.path.join(folder, sid, SHARD_NAMES[0]), "wb") as stream:
        stream.write(data)
    with open(os.path.join(folder, f".{sid}.k3x9q.tmp"), "wb") as stream:
        stream.write(b'{"format": "labkit-snap')


def _prepare(folder: str, share: dict) -> None:
    """Saves (clean), damages, leftovers, a foreign file and leases, as the share says."""
    for sid, shards in zip(share["ids"], share["shards"]):
        store.save(folder, sid, shards, {"id": sid})
    for sid, damage in share.get("damages", {}).items():
        _damage(folder, sid, damage)
    for sid in share.get("leftovers", ()):
        _leftovers(folder, sid, b"half a shard")
    with open(os.path.join(folder, FOREIGN), "w") as stream:
        stream.write("a file that belongs to no snapshot\n")
    for sid, reader in share.get("leases", ()):
        with open(os.path.join(folder, LEASE.format(sid=sid, reader=reader)), "w") as stream:
            stream.write(f"{reader} reads {sid}\n")


def _in_a_scratch_folder(program):
    """The rank program runs in a folder of its own under TMPDIR, removed when it returns or
    raises: a checker run leaves nothing behind (it used to leave one folder per rank and check,
    hundreds in a day of grading)."""
    import functools

    @functools.wraps(program)
    def run(share, collect):
        import shutil
        import tempfile
        folder = tempfile.mkdtemp(prefix="lab08-")
        try:
            return program(share, collect, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return run


@_in_a_scratch_folder
def _retention_program(share, collect, folder):
    """Bad `keep` values, then rounds of saves + damage + collect, in this rank's own folder."""
    victims = crash.shared(HELPER)
    out = {"rounds": []}
    _prepare(folder, share["rounds"][0])
    before = observe(folder)
    out["bad_keep"] = {}
    for bad in share["bad_keep"]:
        ran = victims.run(collect, folder, bad, plan={"timeout": 60})
        error = ran["error"] or {}
        out["bad_keep"][repr(bad)] = [error.get("type", ran["status"]),
                                      error.get("message", "")[:300], error.get("classes", [])]
    out["bad_keep_left_alone"] = observe(folder) == before
    for i, round_ in enumerate(share["rounds"]):
        if i:
            _prepare(folder, round_)
        seen = observe(folder)
        ran = victims.run(collect, folder, share["keep"], plan={"timeout": 60})
        out["rounds"].append({"before": seen, "after": observe(folder), "status": ran["status"],
                              "error": ran["error"]})
    return out


@_in_a_scratch_folder
def _trials_program(share, collect, folder):
    """Crash trials: in each, a save then a collect, one of them killed as the plan says."""
    victims, records = crash.shared(HELPER), []
    _prepare(folder, share["start"])
    for sid, shards, plan in zip(share["ids"], share["shards"], share["plans"]):
        saved = victims.run(store.save, folder, sid, shards, {"id": sid},
                            plan=dict(plan["save"], timeout=60))
        before = observe(folder)
        collected = victims.run(collect, folder, share["keep"],
                                plan=dict(plan["collect"], timeout=60))
        records.append({"save": [saved["status"], saved["killed_at"], saved["error"]],
                        "collect": [collected["status"], collected["killed_at"],
                                    collected["error"]],
                        "before": before, "after": observe(folder)})
    return records


@_in_a_scratch_folder
def _leases_program(share, collect, folder):
    """Collect with leases held, then again after one lease is given back."""
    victims = crash.shared(HELPER)
    _prepare(folder, share)
    out = {"before": observe(folder)}
    ran = victims.run(collect, folder, share["keep"], plan={"timeout": 60})
    out["held"] = {"after": observe(folder), "status": ran["status"], "error": ran["error"]}
    sid, reader = share["leases"][0]
    os.remove(os.path.join(folder, LEASE.format(sid=sid, reader=reader)))   # the reader is done
    ran = victims.run(collect, folder, share["keep"], plan={"timeout": 60})
    out["released"] = {"after": observe(folder), "status": ran["status"], "error": ran["error"]}
    return out


# ---- deciding, where the test cell runs -------------------------------------------------------

def verified_ids(observed: dict) -> list[str]:
    """The ids whose published manifest verifies against the observed files (store.verify's
    rules: structure, shards inside <id>/, present, right size and SHA-256), oldest first."""
    good = []
    for sid, text in observed["manifests"].items():
        try:
            manifest = parse_manifest(text, sid)
        except CheckpointError:
            continue
        if all(isinstance(e["path"], str) and e["path"].startswith(sid + "/") and
               ".." not in e["path"].split("/") and
               observed["files"].get(e["path"]) == [e["bytes"], e["sha256"]]
               for e in manifest["shards"]):
            good.append(sid)
    return sorted(good)


def snapshot_files(observed: dict, sid: str) -> dict:
    """Every file of snapshot sid (its manifest and everything under <sid>/): {path: info}."""
    return {path: info for path, info in observed["files"].items()
            if path == sid + MANIFEST_SUFFIX or path.startswith(sid + "/")}


def _shards(case, sizes=(1, 3000)) -> dict:
    """Random shard contents from the case: {name: bytes} of sizes[0] to sizes[1] bytes."""
    import torch
    return {name: case.integers(0, 255, (case.integer(*sizes),)).to(torch.uint8).numpy().tobytes()
            for name in SHARD_NAMES}


def _failed(where, ran, what, case):
    status, error = ran["status"], ran["error"]
    if status != "ok":
        raise AssertionError(f"{where}: collect ended with {status} "
                             f"{(error or {}).get('type', '')}: "
                             f"{(error or {}).get('message', '')[:300]} ({what}) [{case}]")


def check_retention(world, collect, keep=None, timeout=120, case=None):
    """Task 1 (retention): bad `keep` values refused with ValueError before anything changes;
    then two rounds of saves, damages (a byte flipped in place, a shard cut short, a shard
    deleted, a manifest cut short), leftovers of killed saves (a shard folder, a temporary
    manifest) and a foreign file: after each collect, exactly the newest `keep` snapshots that
    verify are left, whole, with the foreign file."""
    case = case or base.Case("lab 8, task 1: retention")
    P = world.size
    keep = keep or case.integer(1, 3)
    shares, plans = [], []
    for rank in range(P):
        step, rounds = 0, []
        for round_ in range(2):
            n = case.integer(keep + 3, keep + 5)
            ids = [snapshot_id(step + 10 * (i + 1)) for i in range(n)]
            step += 10 * n
            damages = {ids[-1]: "flipped byte"}            # the newest published one
            others = ["truncated shard", "missing shard", "torn manifest"]
            for sid, damage in zip([ids[case.integer(0, n - 2)]], others[round_::2]):
                damages.setdefault(sid, damage)
            if round_ == 0:
                damages.setdefault(ids[0], "torn manifest")
            leftovers = [snapshot_id(step + 5)]
            rounds.append({"ids": ids, "shards": [_shards(case) for _ in ids],
                           "damages": damages, "leftovers": leftovers})
        shares.append({"rounds": rounds, "keep": keep, "bad_keep": [0, -1, "2", 1.5]})
    results = call(world, _retention_program, (collect,), shares=shares, timeout=timeout)
    base.one_result_per_rank(results, P, case)
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        for bad, (kind, message, mro) in out["bad_keep"].items():
            if not {"ValueError", "TypeError"} & set(mro):
                raise AssertionError(f"{where}: collect(folder, keep={bad}) gave {kind} "
                                     f"({message}); expected ValueError: keep is an int >= 1, "
                                     f"checked before anything is removed [{case}]")
        if not out["bad_keep_left_alone"]:
            raise AssertionError(f"{where}: a refused keep value still changed the folder: "
                                 f"check keep before removing anything [{case}]")
        for i, seen in enumerate(out["rounds"]):
            what = f"round {i + 1}, keep={keep}, damaged: " + ", ".join(
                f"{sid} ({d})" for sid, d in sorted(shares[rank]["rounds"][i]["damages"].items()))
            _failed(where, seen, what, case)
            before, after = seen["before"], seen["after"]
            kept = verified_ids(before)[-keep:]
            expected = {FOREIGN: before["files"][FOREIGN]}
            for sid in kept:
                expected.update(snapshot_files(before, sid))
            if after["files"] != expected or sorted(after["dirs"]) != sorted(kept):
                left = sorted({p.split("/")[0].replace(MANIFEST_SUFFIX, "") for p in
                               set(after["files"]) | set(after["dirs"])} - {FOREIGN})
                missing = sorted(set(expected) - set(after["files"]))
                extra = sorted((set(after["files"]) - set(expected)) |
                               (set(after["dirs"]) - set(kept)))
                raise AssertionError(
                    f"{where}: after collect ({what}), the folder holds {left}; expected the "
                    f"newest {keep} that verify: {kept} [{case}]. Missing or changed: "
                    f"{missing[:4]}; not collected: {extra[:4]}. A snapshot counts only if its "
                    "manifest verifies (every shard present, of the manifest's size and SHA-256: "
                    "store.verify); every other snapshot's manifest, shards, folder and "
                    "temporary manifest go; files of no snapshot stay")


def plan_trials(case, trials: int, save_events: int) -> list:
    """Per trial: {"save": plan, "collect": plan}, one of them a kill. Kills of collect go
    through its first 10 events in turn (before and after each), so every early point is hit."""
    plans, turn = [], 0
    for t in range(trials):
        row = {"save": {}, "collect": {}}
        if case.integer(0, 99) < 10:
            row["save" if t % 2 else "collect"] = {
                "kill_after_seconds": float(case.integer(0, 1000)) / 1000 * 0.01}
        elif t % 2:
            k = case.integer(1, save_events)
            row["save"] = {"kill_before": k} if case.integer(0, 1) else {"kill_after": k}
        else:
            k = turn // 2 % 10 + 1
            row["collect"] = {"kill_before": k} if turn % 2 == 0 else {"kill_after": k}
            turn += 1
        plans.append(row)
    return plans


def check_collect_crash_trials(world, collect, trials=40, keep=2, timeout=300, case=None):
    """Task 1 (crash trials): each trial saves a snapshot (the course's store) then collects
    (yours); the save or the collect is SIGKILLed at a chosen point. After every trial the
    newest snapshot that verified before the collect still verifies, and no snapshot that
    verified is left published while its shards are gone or changed (torn); and after every
    collect that returned, at most `keep` verified snapshots are published (a collect that never
    removes anything cannot tear one either). Returns counts."""
    case = case or base.Case("lab 8, task 1: crash trials")
    P = world.size
    start_ids = [snapshot_id(i) for i in (1, 2, 3)]
    save_events = 2 * 3 + 5          # write, fsync, fsync per shard (+ a folder fsync) + commit
    shares, all_plans = [], []
    for rank in range(P):
        plans = plan_trials(case, trials, save_events)
        all_plans.append(plans)
        shares.append({"start": {"ids": start_ids, "shards": [_shards(case) for _ in start_ids]},
                       "ids": [snapshot_id(10 + t) for t in range(trials)],
                       "shards": [_shards(case) for _ in range(trials)],
                       "plans": plans, "keep": keep})
    records = call(world, _trials_program, (collect,), shares=shares, timeout=timeout)
    base.one_result_per_rank(records, P, case)
    tally = {"trials": trials * P, "saves killed": 0, "collects killed": 0,
             "newest lost": 0, "torn left": 0}
    for rank in range(P):
        for t, record in enumerate(records[rank]):
            what = (f"rank {rank}, trial {t + 1}: save {record['save'][0]}"
                    f"{' at ' + str(record['save'][1]) if record['save'][1] else ''}, collect "
                    f"{record['collect'][0]}"
                    f"{' at ' + str(record['collect'][1]) if record['collect'][1] else ''}")
            tally["saves killed"] += record["save"][0] == "killed"
            tally["collects killed"] += record["collect"][0] == "killed"
            if record["save"][0] not in ("ok", "killed"):
                raise AssertionError(f"{what}: the course's save ended with {record['save']} "
                                     f"[{case}]; did collect remove files of a save in flight?")
            if record["collect"][0] not in ("ok", "killed"):
                error = record["collect"][2] or {}
                raise AssertionError(f"{what}: collect ended with {record['collect'][0]} "
                                     f"{error.get('type', '')}: "
                                     f"{error.get('message', '')[:300]} [{case}]")
            good_before, after = verified_ids(record["before"]), record["after"]
            good_after = verified_ids(after)
            if good_before and good_before[-1] not in good_after:
                raise AssertionError(
                    f"{what}: the newest snapshot that verified before the collect, "
                    f"{good_before[-1]}, no longer verifies after it [{case}]; a load must find "
                    "it after any kill: never touch the newest verified snapshot")
            torn = [sid for sid in good_before if sid in after["manifests"]
                    and sid not in good_after]
            if torn:
                raise AssertionError(
                    f"{what}: {torn[0]} is still published (its manifest is there) but its "
                    f"shards are gone or changed [{case}]: a loader that trusts a published "
                    "manifest loads it torn. Unpublish first (unlink the manifest, fsync the "
                    "folder), then remove the shards and the folder")
            if record["collect"][0] == "ok" and len(good_after) > keep:
                # issue 26, class 3: a collect that never removes anything tears nothing; the
                # ordinary behaviour is judged on the same trials (only the count, so a wrong
                # choice of which to keep stays the retention cell's)
                raise AssertionError(
                    f"{what}: collect(keep={keep}) returned, and {len(good_after)} snapshots "
                    f"that verify are still published ({good_after}) [{case}]; a collect that "
                    "removes nothing never tears a snapshot, and never frees the disk either: "
                    f"keep the newest {keep} that verify (and the leased ones)")
    return tally


def check_leases(world, collect, keep=1, timeout=120, case=None):
    """Task 1 (readers): two leases, on an old snapshot that verifies and on one that does not;
    collect must leave every file of both and the lease files untouched; once the first lease
    is removed (its reader is done), the next collect removes that snapshot."""
    case = case or base.Case("lab 8, task 1: leases")
    P = world.size
    shares = []
    for rank in range(P):
        n = case.integer(keep + 3, keep + 5)
        ids = [snapshot_id(10 * (i + 1)) for i in range(n)]
        old, damaged = ids[case.integer(0, n - keep - 2)], ids[n - keep - 1]
        shares.append({"ids": ids, "shards": [_shards(case) for _ in ids], "keep": keep,
                       "damages": {damaged: "truncated shard"},
                       "leases": [(old, f"eval-{rank}"), (damaged, "resume")]})
    results = call(world, _leases_program, (collect,), shares=shares, timeout=timeout)
    base.one_result_per_rank(results, P, case)
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        (old, reader), (damaged, _) = shares[rank]["leases"]
        before = out["before"]
        leases = {path: info for path, info in before["files"].items() if ".lease." in path}
        for stage, what in (("held", "with both leases held"),
                            ("released", f"after the lease on {old} was given back")):
            seen = out[stage]
            _failed(where, seen, what, case)
            after = seen["after"]
            still = dict(leases)
            if stage == "released":
                still.pop(LEASE.format(sid=old, reader=reader))
            if {p: after["files"].get(p) for p in still} != still:
                raise AssertionError(f"{where}: collect removed or changed a lease file ({what})"
                                     f" [{case}]: leases belong to their readers")
            held = [damaged] if stage == "released" else [old, damaged]
            for sid in held:
                files = snapshot_files(before, sid)
                if {p: after["files"].get(p) for p in files} != files:
                    raise AssertionError(
                        f"{where}: collect (keep={keep}) removed or changed files of {sid} "
                        f"while a reader held a lease on it ({what}) [{case}]: a snapshot with "
                        f"a file <folder>/{LEASE.format(sid=sid, reader='<reader>')} is in use; "
                        "leave every file of it alone")
            if stage == "released" and snapshot_files(after, old):
                raise AssertionError(
                    f"{where}: {old} is older than the newest {keep} and its lease is gone, but "
                    f"collect left {sorted(snapshot_files(after, old))[:3]} [{case}]: a lease "
                    "protects a snapshot only while its file exists")
