"""Chapter 8, section 2: naming where a crash trial's kill landed, and the table of trials.

A record is what the course's `crash_trials` returns per trial and rank: the victim
(("writer", r) or ("committer",)), its number of events in a clean run, its status ("ok",
"killed", ..., or "not reached" when a writer died before the agreement), where it was killed
(`(k, "before"|"after", call name)` or "timer"), the step loaded afterwards, the newest complete
step (checked by the course without the store's code) and whether the load was torn.
"""
import collections


def kill_phase(record):
    """A readable name for where a trial's kill landed (from the record of the rank that ran the
    victim)."""
    if record["status"] == "not reached":
        return "committer: never started (a writer died)"
    who = "writer" if record["victim"][0] == "writer" else "committer"
    if record["status"] == "ok":
        return f"{who}: finished before its timer"
    if record["killed_at"] == "timer":
        return f"{who}: killed by a timer"
    k, when, name = record["killed_at"]
    if who == "writer":
        if name == "write":
            return "writer: while writing its shard"
        if k == record["n_events"] and when == "after":
            return "writer: shard durable, before the agreement"
        return f"writer: {when} an fsync of its shard or folder"
    if name == "write":
        return "committer: while writing the temp manifest"
    if name == "link":
        return f"committer: {when} the link (the commit point)"
    if name == "unlink":
        return f"committer: {when} removing the temp name"
    return f"committer: {when} an fsync (manifest or folder)"


def owner(victim):
    """The rank that ran the victim: a writer's own rank, or rank 0 for the committer."""
    return victim[1] if victim[0] == "writer" else 0


def phase_table(per_rank):
    """{phase: [trials, torn loads, newest complete loaded]}, each trial read from the rank that
    ran its victim. per_rank: one list of records per rank, trial t at index t."""
    if not per_rank or any(len(records) != len(per_rank[0]) for records in per_rank):
        raise ValueError(f"every rank must return one record per trial; got "
                         f"{[len(records) for records in per_rank]} records per rank")
    rows = collections.defaultdict(lambda: [0, 0, 0])
    for t in range(len(per_rank[0])):
        record = per_rank[owner(per_rank[0][t]["victim"])][t]
        row = rows[kill_phase(record)]
        row[0] += 1
        row[1] += record["torn"]
        row[2] += record["loaded"] == record["newest_complete"]
    return dict(rows)
