"""Lab 8's checkers. Task 1 is here; task 2 in checks_resume.py, tasks 3-4 in checks_async.py.

Task 1: snapshots whose parts live on every rank's own disk (lab 8 asks for these functions):

    commit_part(folder, snapshot_id, shards, metadata) -> str   # this rank's part, atomically
    verify_part(folder, snapshot_id) -> dict                     # its manifest, or ValueError
    load_latest(folder) -> dict | None                           # collective: newest complete

How the checks are built (docs/AUTHORS.md): each rank gets only its own shards (run_each), works
in a folder of its own (under `labkit grade`, its private /tmp), runs the student's commit in a
victim process forked by a lean helper (crash.py) that may be killed at a chosen point, and
hands back plain observations: what its folder holds, what the file-system calls were, what
load_latest returned. What is right is decided here, from the bytes this process drew.
"""
from __future__ import annotations

import hashlib
import json
import os

from labkit import checks as base
from labkit.checkpoint import crash
from labkit.checkpoint._guard import switched_off
from labkit.checkpoint.layout import FORMAT, manifest_path, snapshot_id

TASK1 = "Lab 8, task 1"
# The victims' helper imports torch once: a student's commit that uses torch then costs a fork
# (~40 ms) per trial instead of an import of torch (~1 s) per trial.
HELPER = ("torch", "labkit.checkpoint.store")
SHARD_NAMES = ("model.bin", "optimizer.bin")


def call(world, fn, args=(), shares=None, ranks=None, timeout=None):
    """world.call(fn, args), or world.run_each(fn, shares, *args) when shares are given."""
    if shares is not None:
        return world.run_each(fn, shares, *args, timeout=timeout)
    return world.call(fn, args=tuple(args), ranks=ranks, timeout=timeout)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _guarded(fn, *args):
    """In a victim: the student's function with the course's store switched off."""
    with switched_off(TASK1):
        return fn(*args)


def _error_of(call):
    """(type name, message) of what call() raised, or ("no error", repr of its result)."""
    try:
        result = call()
    except BaseException as error:  # noqa: BLE001 (the student's error is an observation)
        return [type(error).__name__, str(error)[:300], [c.__name__ for c in type(error).__mro__]]
    return ["no error", repr(result)[:300], []]


def _listing(folder: str) -> dict:
    """Every file under folder: {relative path: [size, sha256]} (what is on this rank's disk)."""
    found = {}
    for here, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(here, name)
            with open(path, "rb") as stream:
                data = stream.read()
            found[os.path.relpath(path, folder)] = [len(data), _sha(data)]
    return found


def _observe(folder: str, sid: str) -> dict:
    """This rank's part of snapshot sid as plain data: its manifest's bytes and its files."""
    path = manifest_path(folder, sid)
    manifest = open(path, "rb").read() if os.path.exists(path) else None
    files = {rel: info for rel, info in _listing(folder).items() if rel.startswith(sid + "/")}
    return {"manifest": manifest, "files": files}


def _found(result) -> dict | None:
    """What load_latest returned, as plain data (shard bytes replaced by their SHA-256)."""
    if result is None:
        return None
    if not isinstance(result, dict) or not isinstance(result.get("shards"), dict):
        return {"malformed": repr(result)[:300]}
    return {"snapshot_id": result.get("snapshot_id"), "metadata": result.get("metadata"),
            "shards": {str(k): _sha(bytes(v)) if isinstance(v, (bytes, bytearray)) else repr(v)
                       for k, v in result["shards"].items()}}


def _load_latest(load_latest, folder):
    """The student's load_latest on this rank. An error propagates: the other ranks may be
    waiting in one of its collectives, and only stopping the call frees them."""
    with switched_off(TASK1):
        return {"found": _found(load_latest(folder))}


def part_is_complete(observed: dict, sid: str, shards: dict, metadata: dict) -> str | None:
    """None if this rank's part of sid is complete and right, else what is wrong (decided from
    the observed bytes and the shards the checker handed out)."""
    if observed["manifest"] is None:
        return "no manifest"
    try:
        manifest = json.loads(observed["manifest"])
    except ValueError:
        return "manifest is not JSON"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("snapshot_id") != sid or manifest.get("metadata") != metadata:
        return "manifest has the wrong format, id or metadata"
    listed = {entry.get("path"): entry for entry in manifest.get("shards", [])
              if isinstance(entry, dict)}
    for name, data in shards.items():
        entry = listed.get(f"{sid}/{name}")
        if entry is None or entry.get("bytes") != len(data) or entry.get("sha256") != _sha(data):
            return f"manifest entry of {name} missing or wrong"
        if observed["files"].get(f"{sid}/{name}") != [len(data), _sha(data)]:
            return f"shard {name} is missing, truncated or wrong on disk"
    return None


# ---- the rank programs ----------------------------------------------------------------------

def _commit_verify_program(share, commit_part, verify_part, load_latest):
    """Commit, verify, bad inputs, and load_latest after damage, in this rank's own folder."""
    import tempfile
    import torch.distributed as dist
    folder = tempfile.mkdtemp(prefix="lab08-")
    out = {}
    with switched_off(TASK1):
        s1 = share["ids"][0]
        returned = []
        out["commit"] = _error_of(lambda: returned.append(
            commit_part(folder, s1, share["shards"][0], share["meta"][0])))
        out["returned_manifest_path"] = bool(returned) and isinstance(
            returned[0], (str, os.PathLike)) and os.path.realpath(os.fspath(returned[0])) == \
            os.path.realpath(manifest_path(folder, s1))
        out["after_commit"] = _observe(folder, s1)
        out["verify"] = _error_of(lambda: verify_part(folder, s1))
        try:
            out["verify_value"] = json.loads(json.dumps(verify_part(folder, s1)))
        except BaseException as error:  # noqa: BLE001
            out["verify_value"] = repr(error)[:200]
        before = _listing(folder)
        out["bad_ids"] = {}
        for bad in share["bad_ids"]:
            out["bad_ids"][repr(bad)] = _error_of(
                lambda: commit_part(folder, bad, share["shards"][1], {}))
        out["bad_ids_left_alone"] = _listing(folder) == before
        out["again"] = _error_of(lambda: commit_part(folder, s1, share["shards"][1], {"again": 1}))
        out["again_left_alone"] = _listing(folder) == before
        # damaged parts: each commits cleanly, then one thing is broken on disk
        damages = {}
        for sid, shards, meta, damage in zip(share["ids"][1:5], share["shards"][1:5],
                                             share["meta"][1:5], share["damages"]):
            seen = {"commit": _error_of(lambda: commit_part(folder, sid, shards, meta))}
            untouchable = _damage(folder, sid, damage) if damage else {}
            before = _listing(folder)
            seen["verify"] = _error_of(lambda: verify_part(folder, sid))
            seen["left_alone"] = _listing(folder) == before and all(
                _sha(open(path, "rb").read()) == digest for path, digest in untouchable.items())
            damages[sid] = dict(seen, damage=damage)
        out["damages"] = damages
    dist.barrier()
    out["load_after_damage"] = _load_latest(load_latest, folder)
    with switched_off(TASK1):
        if share["commit_only_here"] is not None:
            commit_part(folder, *share["commit_only_here"])
    dist.barrier()
    out["load_one_rank_ahead"] = _load_latest(load_latest, folder)
    with switched_off(TASK1):
        commit_part(folder, share["ids"][-1], share["shards"][-1], share["meta"][-1])
    dist.barrier()
    out["load_all_ahead"] = _load_latest(load_latest, folder)
    return out


def _damage(folder: str, sid: str, damage: str) -> dict:
    """Break snapshot sid on disk one way; return what a verifier must not touch."""
    shard = os.path.join(folder, sid, SHARD_NAMES[1])
    untouchable = {}
    if damage == "missing shard":
        os.remove(shard)
    elif damage == "truncated shard":
        data = open(shard, "rb").read()
        with open(shard, "wb") as stream:
            stream.write(data[:len(data) // 2])
    elif damage == "manifest points outside":
        outside = os.path.join(os.path.dirname(folder), f"outside-{os.path.basename(folder)}.bin")
        data = open(shard, "rb").read()
        with open(outside, "wb") as stream:
            stream.write(data)                          # the right bytes, in the wrong place
        path = manifest_path(folder, sid)
        manifest = json.loads(open(path).read())
        for entry in manifest["shards"]:
            if entry["path"].endswith(SHARD_NAMES[1]):
                entry["path"] = os.path.relpath(outside, folder)      # "../outside-....bin"
        with open(path, "w") as stream:
            json.dump(manifest, stream)
        untouchable[outside] = _sha(data)
    elif damage == "torn manifest":
        path = manifest_path(folder, sid)
        text = open(path, "rb").read()
        with open(path, "wb") as stream:
            stream.write(text[:len(text) // 2])
    else:
        raise ValueError(f"unknown damage {damage!r}")
    return untouchable


def _durability_program(share, commit_part):
    """One commit watched call by call, then two commits of one id, one paused before it
    publishes while the other runs."""
    import tempfile
    folder = os.path.realpath(tempfile.mkdtemp(prefix="lab08-"))
    victims = crash.shared(HELPER)
    sid = share["id"]
    watched = victims.run(_guarded, commit_part, folder, sid, share["shards"], share["meta"],
                          plan={"watch": manifest_path(folder, sid), "timeout": 60})
    stats = {}
    for name in list(share["shards"]) + ["manifest"]:
        path = manifest_path(folder, sid) if name == "manifest" else os.path.join(folder, sid, name)
        if os.path.exists(path):
            st = os.stat(path)
            stats[name] = [st.st_ino, st.st_size]
    events = [[k, name, info] for k, name, info in watched["events"]
              if name in ("fsync", "fdatasync", "link", "rename", "replace")]
    race_id = share["race_id"]
    target = manifest_path(folder, race_id)
    jobs = [(_guarded, (commit_part, folder, race_id, share["race_shards"][i], {"who": i}),
             {"pause_before_dst": target, "timeout": 60} if i == 0 else {"timeout": 60})
            for i in (0, 1)]
    raced = victims.run_group(jobs, [("start", 0), ("until_paused", 0), ("start", 1),
                                     ("finish", 1), ("release", 0), ("finish", 0)])
    return {"status": watched["status"], "error": watched["error"], "events": events,
            "stats": stats, "folder": folder, "shard_folder": os.path.join(folder, sid),
            "race": [[o["status"], (o["error"] or {}).get("type"),
                      (o["error"] or {}).get("message")] for o in raced],
            "raced": _observe(folder, race_id)}


def _clean_commit_program(share, commit_part):
    import tempfile
    import torch.distributed as dist
    folder = tempfile.mkdtemp(prefix="lab08-")
    out = crash.shared(HELPER).run(_guarded, commit_part, folder, share["id"], share["shards"],
                             share["meta"], plan={"timeout": 60})
    dist.barrier()
    return {"folder": folder, "status": out["status"], "error": out["error"],
            "events": len(out["events"]), "seconds": out["seconds"]}


def _trials_program(share, commit_part, load_latest):
    import torch.distributed as dist
    victims, folder, records = crash.shared(HELPER), share["folder"], []
    for sid, shards, meta, plan in zip(share["ids"], share["shards"], share["meta"],
                                       share["plans"]):
        out = victims.run(_guarded, commit_part, folder, sid, shards, meta,
                          plan=dict(plan, timeout=60))
        dist.barrier()
        records.append({"status": out["status"], "killed_at": out["killed_at"],
                        "error": out["error"], "observed": _observe(folder, sid),
                        "load": _load_latest(load_latest, folder)})
    return records


# ---- the checks (run where the test cell runs) ------------------------------------------------

def _shards(case, sizes=(1, 2049)) -> dict:
    """Random shard contents from the case: {name: bytes} of sizes[0] to sizes[1] bytes."""
    import torch
    return {name: case.integers(0, 255, (case.integer(*sizes),)).to(torch.uint8).numpy().tobytes()
            for name in SHARD_NAMES}


def _expect_found(got, sid, shards, meta, rank, what, case):
    if "error" in got:
        raise AssertionError(f"rank {rank}: load_latest raised {got['error'][0]}: "
                             f"{got['error'][1]} ({what}) [{case}]")
    found = got["found"]
    if found is None or "malformed" in found:
        raise AssertionError(f"rank {rank}: load_latest returned {found!r} ({what}); expected "
                             f"{sid!r}, a dict with 'snapshot_id', 'metadata' and 'shards' "
                             f"(name -> bytes) [{case}]")
    if found["snapshot_id"] != sid:
        raise AssertionError(
            f"rank {rank}: load_latest returned {found['snapshot_id']!r}, expected {sid!r} "
            f"({what}) [{case}]; the newest snapshot is the newest one whose part verifies on "
            "every rank: verify your own part, then agree with the others (a collective), and "
            "take the newest id all of them hold, not the smallest of the ranks' newest ones")
    if found["shards"] != {n: _sha(d) for n, d in shards.items()} or found["metadata"] != meta:
        raise AssertionError(f"rank {rank}: load_latest returned {sid!r} with shards or metadata "
                             f"that are not what this rank committed ({what}) [{case}]: a torn "
                             "load; return the bytes you verified")


def check_commit_verify(world, commit_part, verify_part, load_latest, shard_sizes=(1, 2049),
                        timeout=120, case=None):
    """Task 1 (commit and verify): a clean commit and its manifest, bad ids, a second commit of
    a published id, four kinds of damage, and load_latest when some parts are damaged or missing
    on some rank. Shards have shard_sizes[0] to shard_sizes[1] bytes."""
    case = case or base.Case("lab 8, task 1: commit and verify")
    P = world.size
    steps = [10, 20, 30, 40, 50, 60, 70]
    ids = [snapshot_id(s) for s in steps]
    damages = ["missing shard", "truncated shard", "manifest points outside", "torn manifest"]
    bad_ids = ["", ".", "..", "a/b", "../escape", "/absolute", "back\\slash", f"{ids[0]}/../x", 7]
    shares, kept = [], []
    for rank in range(P):
        shards = [_shards(case, shard_sizes) for _ in steps]
        meta = [{"step": s, "rank": rank, "world_size": P, "note": "λ"} for s in steps]
        shares.append({"ids": ids, "shards": shards, "meta": meta, "bad_ids": bad_ids,
                       # snapshot i (1..4) is damaged on one rank only, a different one each
                       "damages": [d if (i % P) == rank else None for i, d in enumerate(damages)],
                       "commit_only_here": (ids[5], shards[5], meta[5]) if rank == 0 and P > 1
                       else None})
        kept.append((shards, meta))
    results = call(world, _commit_verify_program, (commit_part, verify_part, load_latest),
                   shares=shares, timeout=timeout)
    base.one_result_per_rank(results, P, case)
    for rank, out in enumerate(results):
        shards, meta = kept[rank]
        where = f"rank {rank}"
        if out["commit"][0] != "no error":
            raise AssertionError(f"{where}: commit_part raised {out['commit'][0]}: "
                                 f"{out['commit'][1]} on a fresh folder [{case}]")
        problem = part_is_complete(out["after_commit"], ids[0], shards[0], meta[0])
        if problem:
            raise AssertionError(f"{where}: after commit_part, the part of {ids[0]} is not "
                                 f"complete: {problem} [{case}]; the manifest is JSON with keys "
                                 f"format={FORMAT!r}, snapshot_id, shards (path, bytes, sha256; "
                                 "paths like '<id>/<name>') and metadata")
        if not out["returned_manifest_path"]:
            raise AssertionError(f"{where}: commit_part should return the manifest's path, "
                                 f"<folder>/{ids[0]}.manifest.json [{case}]")
        if out["verify"][0] != "no error" or \
                out["verify_value"] != json.loads(out["after_commit"]["manifest"]):
            raise AssertionError(f"{where}: verify_part of a complete part should return its "
                                 f"manifest as a dict; got {out['verify'][:2]} [{case}]")
        for bad, (kind, message, mro) in out["bad_ids"].items():
            allowed = ("ValueError", "TypeError") if bad == "7" else ("ValueError",)
            if not set(allowed) & set(mro):
                raise AssertionError(f"{where}: commit_part with snapshot id {bad} gave "
                                     f"{kind} ({message}); expected ValueError: an id is one "
                                     f"path component, never '.', '..' or empty [{case}]")
        if not out["bad_ids_left_alone"]:
            raise AssertionError(f"{where}: a refused snapshot id still changed the folder: "
                                 f"check the id before creating anything [{case}]")
        if "FileExistsError" not in out["again"][2] or not out["again_left_alone"]:
            raise AssertionError(f"{where}: a second commit_part of the published id {ids[0]} "
                                 f"gave {out['again'][0]} and the folder "
                                 f"{'was' if not out['again_left_alone'] else 'was not'} "
                                 f"changed; expected FileExistsError and nothing touched [{case}]")
        for sid, seen in out["damages"].items():
            if seen["commit"][0] != "no error":
                raise AssertionError(f"{where}: commit_part of {sid} raised {seen['commit'][:2]}"
                                     f" [{case}]")
            if seen["damage"] is None and seen["verify"][0] != "no error":
                raise AssertionError(f"{where}: verify_part of the intact part {sid} raised "
                                     f"{seen['verify'][:2]} [{case}]")
            if seen["damage"] is not None:
                kind, message, mro = seen["verify"]
                if "ValueError" not in mro or not message:
                    raise AssertionError(
                        f"{where}: verify_part of a part with a {seen['damage']} gave {kind} "
                        f"({message!r}); expected a ValueError that says what is wrong "
                        f"[{case}]; check that every shard exists, has the size and SHA-256 of "
                        "the manifest, and lies inside <folder>/<id>/ (resolve the path)")
            if not seen["left_alone"]:
                raise AssertionError(f"{where}: verify_part changed files ({seen['damage']}); "
                                     f"a verifier only reads [{case}]")
        _expect_found(out["load_after_damage"], ids[0], shards[0], meta[0], rank,
                      "snapshots 20-50 are damaged on one rank each", case)
        _expect_found(out["load_one_rank_ahead"], ids[0], shards[0], meta[0], rank,
                      f"{ids[5]} is published on rank 0 only", case)
        _expect_found(out["load_all_ahead"], ids[6], shards[6], meta[6], rank,
                      f"{ids[6]} is published on every rank", case)


def check_durability(world, commit_part, timeout=120, case=None):
    """Task 1 (durable before published): every shard and the manifest fsynced before the
    manifest's name appears, the shard folder fsynced before and the checkpoint folder after;
    and of two commits of one id, the second (paused right before it publishes while the first
    runs) fails with FileExistsError instead of replacing the first."""
    case = case or base.Case("lab 8, task 1: durability and one winner")
    P = world.size
    shares = [{"id": snapshot_id(5), "shards": _shards(case, (1, 70_000)),
               "meta": {"rank": r}, "race_id": snapshot_id(6),
               "race_shards": [_shards(case), _shards(case)]} for r in range(P)]
    results = call(world, _durability_program, (commit_part,), shares=shares, timeout=timeout)
    base.one_result_per_rank(results, P, case)
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        if out["status"] != "ok":
            raise AssertionError(f"{where}: commit_part ended with {out['status']} "
                                 f"{out['error']} [{case}]")
        fsyncs = [info for _, name, info in out["events"] if name in ("fsync", "fdatasync")]

        def synced(ino=None, size=None, path=None, published=False):
            return any((ino is None or f.get("ino") == ino) and
                       (size is None or f.get("size") == size) and
                       (path is None or (f.get("dir") and f.get("path") == path)) and
                       f.get("watched_exists") == published for f in fsyncs)
        for name in shares[rank]["shards"]:
            ino, size = out["stats"][name]
            if not synced(ino=ino, size=size):
                raise AssertionError(
                    f"{where}: shard {name} ({size} bytes) was not fsynced with its final "
                    f"contents before the manifest was published [{case}]; after writing a "
                    "shard, flush and os.fsync(file.fileno()), then publish the manifest")
        if not synced(path=out["shard_folder"]):
            raise AssertionError(f"{where}: the snapshot's shard folder was not fsynced before "
                                 f"the manifest was published [{case}]; a new file's name is "
                                 "data of its folder: os.fsync an fd of the folder "
                                 "(os.open(folder, os.O_RDONLY))")
        ino, size = out["stats"].get("manifest", (None, None))
        if not synced(ino=ino, size=size):
            raise AssertionError(f"{where}: the manifest was not fsynced with its final contents "
                                 f"before its name appeared [{case}]; write it to a temporary "
                                 "file in the folder, flush, os.fsync, then os.link it into place")
        if not synced(path=out["folder"], published=True):
            raise AssertionError(f"{where}: the checkpoint folder was not fsynced after the "
                                 f"manifest was linked into it [{case}]: without that, a power "
                                 "cut can lose the publication itself")
        statuses = [status for status, _, _ in out["race"]]
        winners = [i for i, (status, _, _) in enumerate(out["race"]) if status == "ok"]
        if len(winners) != 1:
            raise AssertionError(
                f"{where}: two commits of one id: {len(winners)} succeeded (statuses "
                f"{out['race']}) [{case}]; exactly one may: publish with os.link(temp, final), "
                "which raises FileExistsError when final exists; os.replace and os.rename "
                "silently replace the other commit's manifest")
        loser = out["race"][1 - winners[0]]
        if loser[1] != "FileExistsError":
            raise AssertionError(f"{where}: the commit that lost the race gave {loser} [{case}]; "
                                 "expected FileExistsError")
        problem = part_is_complete(out["raced"], shares[rank]["race_id"],
                                   shares[rank]["race_shards"][winners[0]], {"who": winners[0]})
        if problem:
            raise AssertionError(f"{where}: after the race, the published part is not the "
                                 f"winner's: {problem} (statuses {statuses}) [{case}]")


def plan_trials(case, world_size: int, trials: int, events: list, seconds: float) -> list:
    """Per trial, per rank: a crash plan (most ranks {}). First two trials leave a gap: rank 1
    misses a snapshot that rank 0 has, then rank 0 misses the next one."""
    plans = []
    for t in range(trials):
        row = [{} for _ in range(world_size)]
        if t < 2 and world_size > 1:
            row[1 - t] = {"kill_before": 1}
        else:
            victim = case.integer(0, world_size - 1)
            if case.integer(0, 99) < 15:
                row[victim] = {"kill_after_seconds": float(case.integer(0, 1000)) / 1000 * 1.5
                               * seconds}
            else:
                k = case.integer(1, max(1, events[victim]))
                row[victim] = {"kill_before": k} if case.integer(0, 1) else {"kill_after": k}
        plans.append(row)
    return plans


def check_crash_trials(world, commit_part, load_latest, trials=40, timeout=300, case=None):
    """Task 1 (crash trials): one rank's commit killed at a random point in every trial; after
    each, every rank's load_latest must return the same snapshot, the newest one complete on
    every rank, with exactly the bytes committed. Returns counts per outcome."""
    case = case or base.Case("lab 8, task 1: crash trials")
    P = world.size
    first = [{"id": snapshot_id(0), "shards": _shards(case), "meta": {"step": 0, "rank": r}}
             for r in range(P)]
    clean = call(world, _clean_commit_program, (commit_part,), shares=first, timeout=timeout)
    base.one_result_per_rank(clean, P, case)
    for rank, out in enumerate(clean):
        if out["status"] != "ok":
            raise AssertionError(f"rank {rank}: a clean commit_part ended with {out['status']} "
                                 f"{out['error']} [{case}]")
    plans = plan_trials(case, P, trials, [c["events"] for c in clean],
                        max(c["seconds"] for c in clean))
    ids = [snapshot_id(t + 1) for t in range(trials)]
    shards = [[_shards(case, (1, 3000)) for _ in range(trials)] for _ in range(P)]
    metas = [[{"step": t + 1, "rank": r} for t in range(trials)] for r in range(P)]
    shares = [{"folder": clean[r]["folder"], "ids": ids, "shards": shards[r], "meta": metas[r],
               "plans": [plans[t][r] for t in range(trials)]} for r in range(P)]
    records = world.run_each(_trials_program, shares, commit_part, load_latest, timeout=timeout)
    base.one_result_per_rank(records, P, case)
    complete = {snapshot_id(0): (lambda r: (first[r]["shards"], first[r]["meta"]))}
    tally = {"trials": trials, "commits killed": 0, "torn loads": 0, "newest found": 0}
    for t, sid in enumerate(ids):
        for rank in range(P):
            record = records[rank][t]
            tally["commits killed"] += record["status"] == "killed"
            if record["status"] not in ("ok", "killed"):
                raise AssertionError(f"rank {rank}, trial {t + 1}: commit_part ended with "
                                     f"{record['status']} {record['error']} (plan "
                                     f"{plans[t][rank] or 'no kill'}) [{case}]")
        if all(part_is_complete(records[r][t]["observed"], sid, shards[r][t], metas[r][t]) is None
               for r in range(P)):
            complete[sid] = (lambda r, t=t: (shards[r][t], metas[r][t]))
        newest = max(complete)
        victim = next((r for r in range(P) if plans[t][r]), None)
        what = f"trial {t + 1}: " + ("no kill" if victim is None else (
            f"rank {victim}'s commit_part under plan {plans[t][victim]} ended "
            f"{records[victim][t]['status']} at {records[victim][t]['killed_at']}"))
        for rank in range(P):
            expected_shards, expected_meta = complete[newest](rank)
            _expect_found(records[rank][t]["load"], newest, expected_shards, expected_meta, rank,
                          what, case)
        tally["newest found"] += 1
    return tally
