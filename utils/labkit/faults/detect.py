"""Detection rules: which rank is a straggler, which expert is overloaded, when a step spikes.

Plain functions of plain numbers (lists of floats), taught in chapter 9 and reused by the
interview drill. Notation: P ranks, S steps; c[r][s] is rank r's *compute time* in step s, the
seconds from the step's start to the moment the rank enters the step's gradient collective.

Straggler rules (chapter 9, section 3):

- `robust_z(values)`: the modified z-score of Iglewicz and Hoaglin (1993),
  z_i = 0.6745 (x_i - median(x)) / MAD(x), with MAD(x) = median_i |x_i - median(x)|. 0.6745 is
  the 75th percentile of the standard normal, so for normal data MAD / 0.6745 estimates sigma,
  and one outlier cannot inflate it the way it inflates a standard deviation. Their threshold
  for an outlier: |z| > 3.5.
- `straggler_scores(c)`: one z per rank that works at every P >= 2. Each rank's median compute
  time m_r = median_s c[r][s] (one slow step of a healthy rank does not move it); the centre
  M = median_r m_r; the noise scale D = median over every (r, s) of |c[r][s] - m_r|, the typical
  step-to-step wobble of a rank around its own median, estimated from all P * S samples instead
  of from P medians (at P = 2 the MAD of two medians is half their gap, and every z is +-0.6745
  whatever the gap: across-rank statistics alone cannot find a straggler at P = 2).
  z_r = 0.6745 (m_r - M) / D.
- `stragglers(c, threshold=Z_THRESHOLD, min_excess=MIN_EXCESS)`: the ranks whose z_r exceeds
  the threshold *and* whose median is more than `min_excess` (200%: three times) above the median
  of the *other* ranks' medians (not M: at P = 2, M is the mean of the straggler and the healthy
  rank, and no rank can be twice that). The z
  says the gap is not noise; the margin says it is worth acting on: when a run's noise is tiny
  (compute times steady to a few percent), a rank 60% slower for a dozen steps because the
  operating system shared its core is "significant" to the z and still no straggler to page
  anyone about. Measured while writing the course, on a heavily loaded 2-core machine: healthy
  windows of 4-12 steps had one rank's median up to ~2x another's, and z up to ~3.7. On
  dedicated accelerators the noise is far smaller and a smaller margin (20-50%) is usual.
- `stragglers_relative(c, ratio)`: the source material's relative rule, on the mean of each
  rank's times: a rank is slow when its mean exceeds the mean over ranks by `ratio` (0.25 there).

Spike rules (chapter 9, section 5):

- `window_spike(history, value, factor=5, window=100)`: the source material's rule: a step spikes
  when its statistic (an activation norm there, a gradient norm here too) exceeds `factor` times
  the mean of the last `window` accepted steps. Not a spike while fewer than `min_history` steps
  are known, and never when `value` is finite and the window is empty.
- `is_finite(value)`: NaN and infinities are spikes whatever the window says.

Imbalance of experts (chapter 7, section 3, and seed 004's second lab): `labkit.moe.imbalance`
gives the coefficient of variation, max over mean and the Gini coefficient; `hot_expert` applies
a threshold to max over mean.
"""
from __future__ import annotations

import math

MAD_SCALE = 0.6745           # Phi^{-1}(0.75): MAD of a normal sample = 0.6745 sigma
Z_THRESHOLD = 3.5            # Iglewicz and Hoaglin (1993): |modified z| > 3.5 is an outlier
RELATIVE_RATIO = 0.25        # the source material's "25% above the average" rule
MIN_EXCESS = 2.0             # a straggler's median is more than 3x the other ranks' median
SPIKE_FACTOR = 5.0           # the source material: above 5x the mean of the last 100 steps
SPIKE_WINDOW = 100
SPIKE_MIN_HISTORY = 10       # steps to see before judging (the first steps have no baseline)
HOT_EXPERT_RATIO = 2.0       # max over mean above which one expert is called overloaded


def median(values) -> float:
    """The median of a non-empty sequence of numbers (the mean of the middle two when even)."""
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("median of an empty sequence")
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def mad(values) -> float:
    """Median absolute deviation: median_i |x_i - median(x)|."""
    centre = median(values)
    return median(abs(float(v) - centre) for v in values)


def robust_z(values) -> list[float]:
    """Modified z-scores 0.6745 (x_i - median) / MAD (Iglewicz and Hoaglin, 1993).

    With MAD = 0 (more than half the values equal), a value equal to the median scores 0 and any
    other +-inf: it differs from a majority that does not vary at all.
    """
    values = [float(v) for v in values]
    centre, spread = median(values), mad(values)
    if spread == 0:
        return [0.0 if v == centre else math.copysign(math.inf, v - centre) for v in values]
    return [MAD_SCALE * (v - centre) / spread for v in values]


def _rows(times) -> list[list[float]]:
    rows = [[float(t) for t in row if t is not None and math.isfinite(float(t))] for row in times]
    if len(rows) < 2:
        raise ValueError(f"straggler rules compare ranks: need times of at least 2 ranks, got "
                         f"{len(rows)}")
    empty = [r for r, row in enumerate(rows) if not row]
    if empty:
        raise ValueError(f"ranks {empty} have no finite step time: nothing to compare")
    return rows


def straggler_scores(times) -> list[float]:
    """z_r = 0.6745 (m_r - M) / D for every rank r (see the module docstring).

    times[r][s]: rank r's compute time in step s (None or non-finite entries are ignored, so a
    step that never finished does not count). Returns one score per rank; +inf for a rank above
    the centre when the noise scale D is 0.
    """
    rows = _rows(times)
    medians = [median(row) for row in rows]                       # m_r
    centre = median(medians)                                      # M
    noise = median(abs(t - m) for row, m in zip(rows, medians) for t in row)   # D
    if noise == 0:
        return [0.0 if m == centre else math.copysign(math.inf, m - centre) for m in medians]
    return [MAD_SCALE * (m - centre) / noise for m in medians]


def stragglers(times, threshold: float = Z_THRESHOLD, min_excess: float = MIN_EXCESS) -> list[int]:
    """Ranks whose straggler score exceeds `threshold` and whose median compute time exceeds
    the median of the other ranks' medians by more than `min_excess` times it (slow ones only:
    a fast rank is no problem), most suspicious first."""
    scores = straggler_scores(times)
    medians = [median(row) for row in _rows(times)]

    def others(r):
        return median(m for q, m in enumerate(medians) if q != r)
    flagged = [r for r, z in enumerate(scores)
               if z > threshold and medians[r] > (1 + min_excess) * others(r)]
    return sorted(flagged, key=lambda r: -scores[r])


def stragglers_relative(times, ratio: float = RELATIVE_RATIO) -> list[int]:
    """The source material's rule: ranks whose mean time exceeds the mean over all ranks by more
    than `ratio` (0.25: 25% above the average). Means, not medians: one slow step moves them."""
    rows = _rows(times)
    means = [sum(row) / len(row) for row in rows]
    overall = sum(means) / len(means)
    return [r for r, m in enumerate(means) if m > overall * (1 + ratio)]


def is_finite(value) -> bool:
    return value is not None and math.isfinite(float(value))


def window_spike(history, value, factor: float = SPIKE_FACTOR, window: int = SPIKE_WINDOW,
                 min_history: int = SPIKE_MIN_HISTORY) -> bool:
    """True when `value` spikes: non-finite, or above `factor` x the mean of the last `window`
    entries of `history` (the values of steps that were accepted), once `history` holds at least
    `min_history` of them. The source material's rule is factor 5, window 100."""
    if not is_finite(value):
        return True
    recent = [float(v) for v in list(history)[-window:]]
    if len(recent) < max(1, min_history):
        return False
    return float(value) > factor * (sum(recent) / len(recent))


def hot_expert(load, ratio: float = HOT_EXPERT_RATIO):
    """The index of the busiest expert when its load exceeds `ratio` x the mean load, else None.
    load[e]: tokens (or time) of expert e."""
    values = [float(v) for v in load]
    if not values or sum(values) <= 0:
        return None
    mean = sum(values) / len(values)
    busiest = max(range(len(values)), key=values.__getitem__)
    return busiest if values[busiest] > ratio * mean else None
