"""The self-checks of chapter 8 (`course/08_checkpoints.ipynb`): the reader answers first, then
these functions say what is right and why, so that no answer stands in the visible source below
its question. None of them answers a graded task of lab 8.

    from labkit.checkpoint import selfcheck
    selfcheck.naive_torn(answer, measured)       # section 1: which kill points tear the naive save
    selfcheck.young_4096(tau_minutes)            # section 7: Young's tau* for 4,096 GPUs at 30 s
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
