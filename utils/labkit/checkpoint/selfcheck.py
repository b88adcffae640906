"""The self-checks of chapter 8 (`course/08_checkpoints.ipynb`): the reader answers first, then
these functions say what is right and why, so that no answer stands in the visible source below
its question. None of them answers a graded task of lab 8.

    from labkit.checkpoint import selfcheck
    selfcheck.naive_torn(answer, measured)       # section 1: which kill points tear the naive save
    selfcheck.young_4096(tau_minutes)            # section 7: Young's tau* for 4,096 GPUs at 30 s
    selfcheck.dcp_writers(answer, seen, plan)    # section 3: which rank writes each plain key
"""
from __future__ import annotations

from labkit.checkpoint import interval

# Section 1: the naive save of step 2 (2 shards), killed at one of four points.
_WHY_TORN = {
    "a": "open(O_CREAT) already made rank1.bin, empty: the loader takes an empty shard",
    "b": "half of rank1.bin exists: the loader takes a file cut short",
    "c": "rank1.bin does not exist yet: the loader skips the folder and takes step 1",
    "d": "the save finished: step 2 is complete",
}
_TORN = "ab"


def naive_torn(answer: str, measured: str) -> bool:
    """`measured`: the letters whose kill left a torn load (the chapter ran each). Prints the
    verdict and, once an answer is given, why each point tears or not; raises if the measurement
    is not the one the chapter's prose describes. Returns whether the answer is right."""
    if "".join(sorted(measured)) != _TORN:
        raise AssertionError(f"the naive save tore at {measured!r}; the chapter's prose expects "
                             f"{_TORN!r}: did the loader or the save change?")
    if not answer:
        print("put your letters in `answer` first (e.g. \"ac\"), then run the cell again")
        return False
    right = sorted(set(answer)) == sorted(measured)
    print("correct!" if right else f"the torn ones are {measured!r}, you said {answer!r}")
    for point in "abcd":
        print(f"  ({point}) {'torn    ' if point in measured else 'not torn'}: {_WHY_TORN[point]}")
    return right


def young_4096(tau_minutes, stall_s: float = 30.0, gpus: int = 4096) -> bool:
    """Section 7: Young's tau* for a job on `gpus` GPUs at Llama 3's interruption budget per GPU,
    with a checkpoint that stalls `stall_s`; right within 5%."""
    M = interval.llama3_mtbf_hours() * 3600 * interval.LLAMA3["gpus"] / gpus      # seconds
    truth = interval.young_interval(stall_s, M) / 60
    if tau_minutes is None:
        print("put your answer in tau_minutes first")
        return False
    ratio = interval.LLAMA3["gpus"] / gpus
    how = (f"M = {ratio:g} x {interval.llama3_mtbf_hours():.2f} h = {M / 3600:.1f} h ({ratio:g} "
           f"times fewer GPUs), tau* = sqrt(2 x {stall_s:g} s x M) = {truth:.0f} min")
    right = abs(tau_minutes - truth) <= 0.05 * truth
    print(("right: " if right else "not quite: ") + how)
    return right


def dcp_writers(answer: str, seen: dict, plan: list) -> bool:
    """Section 3: which rank's file holds each plain key of the quiz's state dict. `seen`: DCP's
    `.metadata` read back ({(key, offsets): rank}, `dcp_files.writers`), `plan`: the first rank's
    save plan in the walk's order ([(key or (key, offsets), bytes)]). Prints the verdict and, once
    an answer is given, the walk with the bytes planned on each rank after every item; returns
    whether the answer is right."""
    plain = [item for item, _ in plan if not isinstance(item, tuple)]
    truth = "".join(str(seen[(key, (0,))]) for key in plain)
    if not answer:
        print(f"put the {len(plain)} ranks in `answer` first (e.g. \"0101\"), then run the cell "
              "again")
        return False
    right = answer == truth
    print("right" if right else f"not quite: .metadata says {truth}, you said {answer}")
    planned, steps = [0] * (1 + max(seen.values())), []
    for item, size in plan:
        key = item if isinstance(item, tuple) else (item, (0,))
        planned[seen[key]] += size
        name = f"{item[0]}[{item[1][0]}:]" if isinstance(item, tuple) else item
        steps.append(f"{name} -> {seen[key]} {planned}")
    print("the walk, with the planned bytes after each item: " + "; ".join(steps))
    sharded = [item for item, _ in plan if isinstance(item, tuple)]
    for key, offsets in sharded:
        print(f"{key}[{offsets[0]}:] counts all of {key} on the rank that meets it first, though "
              f"that rank holds only its own shard; the other shards of {key} are met later, in "
              "the other ranks' plans, after the first rank's whole plan")
    return right
