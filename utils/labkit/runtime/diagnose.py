"""Kernel side: turn what each rank says about itself into a hang diagnosis a student can read.

Every rank keeps its last communication ops (see `_hooks`). When a call times out, is
interrupted, or a rank is left waiting after another failed, the kernel asks each live rank (over
its diagnostics channel, served by a thread that answers even while the rank sits inside a
collective) for those ops and its current stack, and this module writes the report:

    rank 0: waiting in all_reduce #2 on ranks [0, 1]: float32[4] (for 2.9 s)
    rank 1: not in a collective; last: broadcast #1 on ranks [0, 1] (finished)
    => rank 1 never issued all_reduce #2 on ranks [0, 1], which rank 0 is waiting in.

Ranks that wait in the same call on the same ranks but on two process groups (two `new_group`
calls with the same members) are named with their groups instead.

What a rank answers comes from a process that runs the student's code, which can replace the
helper that answers: `collect` reads each answer with a size bound and leaves it unparsed, so the
caller can stop the ranks first; `report` then parses and checks every answer (`parse`), and an
answer that is not JSON or not shaped as labkit's snapshot is no diagnosis, never an error.
"""

import json
import re
import time
from multiprocessing.connection import wait

_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                          r"SequenceNumber=(\d+), OpType=(\w+), TensorShape=\[([^\]]*)\], "
                          r"TensorDtypes=(\w+)")
_DIFFERENCE = re.compile(r"Collectives differ in the following aspects:\s*(.*)", re.S)


def summarize_mismatch(message):
    """A one-line reading of torch's DETAIL collective-mismatch error, or None if it is not one.

    torch prints two long fingerprints; a student needs: who called what, and what differs.
    """
    prints = _FINGERPRINT.findall(message)
    if len(prints) < 2:
        return None
    calls = [f"rank {rank} called {op.lower()}(shape [{shape}], {dtype}) as its collective #{seq}"
             for rank, seq, op, shape, dtype in prints[:2]]
    difference = _DIFFERENCE.search(message)
    aspects = " ".join(difference.group(1).split()) if difference else "their fingerprints"
    aspects = re.sub(r"\s*vs\s*", " vs ", re.sub(r"\s*Tensor Tensor", " tensor", aspects)).strip()
    return (f"collective mismatch: {calls[0]}, but {calls[1]}; they differ in: {aspects}. "
            f"Every rank must call the same collectives, in the same order, with the same "
            f"sizes and dtypes.")


MAX_ANSWER_BYTES = 4 << 20     # a rank's diagnosis: its last ops and its stack


def collect(connections, seconds=2.0):
    """Ask every rank in `connections` ({rank: diag Connection}) where it is: {rank: the answer's
    bytes, unparsed, or None if no answer came within `seconds`}. Each answer is read with a
    bound (MAX_ANSWER_BYTES); a larger one counts as none."""
    answers = {rank: None for rank in connections}
    asked = {}
    for rank, connection in connections.items():
        try:
            connection.send("diag")
            asked[connection] = rank
        except (OSError, BrokenPipeError):
            pass
    deadline = time.monotonic() + seconds
    while asked and time.monotonic() < deadline:
        for connection in wait(list(asked), timeout=max(0.0, deadline - time.monotonic())):
            rank = asked.pop(connection)
            try:
                answers[rank] = connection.recv_bytes(MAX_ANSWER_BYTES)
            except (EOFError, OSError, ValueError):
                pass
    return answers


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _valid_record(record):
    return (isinstance(record, dict) and isinstance(record.get("op"), str)
            and _is_int(record.get("seq")) and isinstance(record.get("finished"), bool)
            and _is_number(record.get("t_start"))
            and (record.get("peer") is None or _is_int(record.get("peer")))
            and (record.get("group_name") is None or isinstance(record.get("group_name"), str))
            and isinstance(record.get("group"), list) and all(map(_is_int, record["group"]))
            and isinstance(record.get("dtypes"), list)
            and all(isinstance(d, str) for d in record["dtypes"])
            and isinstance(record.get("shapes"), list)
            and all(isinstance(shape, list) and all(map(_is_int, shape))
                    for shape in record["shapes"]))


def parse(answer):
    """A rank's diagnosis (bytes of JSON, or already a dict) checked against the shape of labkit's
    snapshot; None when it is not one (no answer, not JSON, a forged or partial snapshot)."""
    if isinstance(answer, (bytes, bytearray)):
        try:
            answer = json.loads(answer)          # JSON: never unpickled
        except (ValueError, RecursionError):
            return None
    if not (isinstance(answer, dict) and _is_number(answer.get("now"))
            and isinstance(answer.get("stack"), str)
            and isinstance(answer.get("current"), list) and isinstance(answer.get("recent"), list)
            and all(map(_valid_record, answer["current"] + answer["recent"]))
            and isinstance(answer.get("collective_counts"), dict)
            and all(isinstance(k, str) and _is_int(v)
                    for k, v in answer["collective_counts"].items())):
        return None
    return answer


def describe_op(record):
    tensors = ", ".join(f"{dtype}{list(shape)}"
                        for dtype, shape in zip(record["dtypes"], record["shapes"]))
    where = (f"peer {record['peer']}" if record["peer"] is not None
             else f"ranks {list(record['group'])}")
    return f"{record['op']} #{record['seq']} on {where}" + (f": {tensors}" if tensors else "")


def _indent(text, prefix="      "):
    return "".join(prefix + line + "\n" for line in text.rstrip("\n").splitlines())


def report(answers, exited=None, finished=()):
    """The per-rank text, then who never joined the collective that others wait in.

    `answers`: {rank: what `collect` read (bytes), a snapshot, or None}; `exited`: {rank: why}
    for ranks that are gone; `finished`: ranks that had already returned from this call.
    """
    exited = exited or {}
    unreadable = {rank for rank, answer in answers.items()
                  if answer is not None and parse(answer) is None}
    answers = {rank: parse(answer) for rank, answer in answers.items()}
    lines = []
    waiting = {}  # (group, seq) -> (op, [ranks waiting], {rank: its group's name})
    for rank in sorted(set(answers) | set(exited)):
        if rank in exited:
            lines.append(f"rank {rank}: {exited[rank]}")
            continue
        answer = answers[rank]
        if rank in unreadable:
            lines.append(f"rank {rank}: no diagnosis (its answer was not labkit's snapshot: "
                         f"did the code replace labkit.runtime.hooks.snapshot?)")
            continue
        if answer is None:
            lines.append(f"rank {rank}: did not answer (stuck outside Python, e.g. in C++ "
                         f"holding the interpreter lock)")
            continue
        now = answer["now"]
        current = [r for r in answer["current"] if not r["finished"]]
        if rank in finished:
            lines.append(f"rank {rank}: finished this call (idle)")
            done = [r for r in answer["recent"] if r["finished"]][-3:]
            if done:
                lines.append("    last finished: " + "; ".join(describe_op(r) for r in done))
            continue
        if current:
            record = current[0]
            lines.append(f"rank {rank}: waiting in {describe_op(record)} "
                         f"(for {now - record['t_start']:.1f} s)")
            if record["peer"] is None:
                key = (tuple(record["group"]), record["seq"])
                entry = waiting.setdefault(key, (record["op"], [], {}))
                entry[1].append(rank)
                entry[2][rank] = record.get("group_name")
        else:
            lines.append(f"rank {rank}: not in a collective")
        done = [r for r in answer["recent"] if r["finished"]][-3:]
        if done:
            lines.append("    last finished: " + "; ".join(describe_op(r) for r in done))
        lines.append("    stack (your code):")
        lines.append(_indent(answer["stack"]).rstrip("\n"))
    lines.append("")
    lines += _missing(waiting, answers, exited)
    return "\n".join(lines)


def _missing(waiting, answers, exited):
    """For each collective someone waits in, the ranks of its group that never issued it; or,
    when the waiters are on different process groups with the same ranks, those groups."""
    verdicts = []
    for (group, seq), (op, waiters, names) in sorted(waiting.items()):
        named = {rank: name for rank, name in names.items() if name is not None}
        if len(set(named.values())) > 1:
            on = "; ".join(f"rank {rank} on group {name!r}" for rank, name in sorted(named.items()))
            verdicts.append(f"=> ranks {', '.join(map(str, waiters))} wait in {op} #{seq} on the "
                            f"same ranks {list(group)} but on different process groups ({on}): "
                            f"every rank must call a collective on the same group object; each "
                            f"dist.new_group call makes a new group, even with the same ranks.")
            continue
        absent = []
        for rank in group:
            if rank in waiters:
                continue
            answer = answers.get(rank)
            issued = 0 if answer is None else answer["collective_counts"].get(str(list(group)), 0)
            if rank in exited or answer is None or issued < seq:
                absent.append(rank)
        if absent:
            # a rank that raised or died is named with what happened to it: it never issued
            # the collective because it had stopped, not because its code skipped it
            who = ", ".join(f"{r} ({exited[r]})" if r in exited else str(r) for r in absent)
            verdicts.append(f"=> rank{'s' if len(absent) > 1 else ''} {who} never issued {op} #{seq} "
                            f"on ranks {list(group)}, which rank"
                            f"{'s' if len(waiters) > 1 else ''} "
                            f"{', '.join(map(str, waiters))} "
                            f"{'are' if len(waiters) > 1 else 'is'} waiting in.")
        else:
            verdicts.append(f"=> every rank of {list(group)} issued {op} #{seq}; they wait on "
                            f"each other: check that all ranks call the same collectives in "
                            f"the same order with matching sizes and dtypes.")
    return verdicts
