"""How often to checkpoint: Young's and Daly's intervals, and a Monte-Carlo check (chapter 8, s. 7).

Notation (seconds): C the time a checkpoint stops training, M the mean time between failures,
R the time a restart takes, tau the compute time between checkpoints, W the work to do.

- First order (Young, CACM 1974): a checkpoint costs C every tau, a failure loses tau/2 on
  average, one every M:  waste(tau) ~= C/tau + tau/(2M),  minimised at  tau* = sqrt(2 C M).
- Daly (Future Generation Computer Systems 22, 2006), exponential failures that can also hit
  checkpoints and restarts: expected wall time  T(tau) = M e^{R/M} (e^{(tau+C)/M} - 1) W / tau,
  and its minimum, to higher order,  tau* = sqrt(2CM) [1 + (1/3) sqrt(C/2M) + (1/9)(C/2M)] - C
  for C < 2M (else tau* = M).
- `simulate` replays failures drawn from a distribution (exponential, or Weibull of the same
  mean) against that schedule and measures the wall time.

Nothing here imports torch.
"""
from __future__ import annotations

import math

import numpy as np

# Daly (2006), figures 3-5: M, W = 500 h, R = 10 min, C = 5 min -> the paper's tau* (minutes).
DALY_EXAMPLES = [{"M_min": 24 * 60, "tau_opt_min": 117.0},
                 {"M_min": 6 * 60, "tau_opt_min": 57.0},
                 {"M_min": 15, "tau_opt_min": 9.1}]
DALY_SETUP = {"W_min": 500 * 60, "R_min": 10, "C_min": 5}
# Llama 3 (arXiv:2407.21783, s. 3.3.4, Table 5): a 54-day snapshot of pre-training on 16,384 H100
# GPUs had 466 job interruptions, 47 planned and 419 unexpected.
LLAMA3 = {"days": 54, "gpus": 16384, "interruptions": 466, "planned": 47, "unexpected": 419}


def _positive(**values) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def young_interval(C: float, M: float) -> float:
    """tau* = sqrt(2 C M)."""
    _positive(C=C, M=M)
    return math.sqrt(2 * C * M)


def daly_interval(C: float, M: float) -> float:
    """Daly's higher-order tau*: sqrt(2CM)(1 + sqrt(C/2M)/3 + (C/2M)/9) - C, or M if C >= 2M."""
    _positive(C=C, M=M)
    if C >= 2 * M:
        return M
    x = C / (2 * M)
    return math.sqrt(2 * C * M) * (1 + math.sqrt(x) / 3 + x / 9) - C


def first_order_waste(tau: float, C: float, M: float) -> float:
    """Fraction of time lost, to first order: C/tau + tau/(2M)."""
    _positive(tau=tau, C=C, M=M)
    return C / tau + tau / (2 * M)


def daly_wall_time(tau: float, C: float, M: float, R: float, W: float) -> float:
    """Expected wall time with exponential failures: M e^{R/M} (e^{(tau+C)/M} - 1) W / tau."""
    _positive(tau=tau, C=C, M=M, W=W)
    if R < 0:
        raise ValueError(f"R must be >= 0, got {R}")
    return M * math.exp(R / M) * math.expm1((tau + C) / M) * W / tau


def failure_sampler(kind: str, M: float, shape: float = 0.7):
    """draw(rng, n) -> n times between failures with mean M: "exponential", or "weibull" with
    `shape` (< 1: failures come in bursts, as early-life hardware faults do)."""
    _positive(M=M, shape=shape)
    if kind == "exponential":
        return lambda rng, n: rng.exponential(M, n)
    if kind == "weibull":
        scale = M / math.gamma(1 + 1 / shape)
        return lambda rng, n: scale * rng.weibull(shape, n)
    raise ValueError(f"kind must be 'exponential' or 'weibull', got {kind!r}")


def simulate(W: float, tau: float, C: float, R: float, draw, trials: int = 2000,
             seed: int = 0) -> np.ndarray:
    """Wall time of `trials` runs: compute W in segments of tau, each followed by a checkpoint
    of C; a failure (times between failures from `draw`) loses the segment in progress and costs
    a restart of R, during which another failure may strike. Returns [trials] wall times."""
    _positive(W=W, tau=tau, C=C, trials=trials)
    rng = np.random.default_rng(seed)
    t = np.zeros(trials)                      # wall clock of each run
    done = np.zeros(trials)                   # work saved by a checkpoint
    failure = draw(rng, trials)               # when each run's next failure strikes
    active = np.ones(trials, dtype=bool)
    while active.any():
        i = np.flatnonzero(active)
        segment = np.minimum(tau, W - done[i])
        finish = t[i] + segment + C
        ok = finish <= failure[i]
        good, bad = i[ok], i[~ok]
        t[good] = finish[ok]
        done[good] += segment[ok]
        t[bad] = failure[bad]                 # the segment is lost; restart
        restarting = bad
        while restarting.size:
            failure[restarting] = t[restarting] + draw(rng, restarting.size)
            hit = t[restarting] + R > failure[restarting]
            t[restarting[hit]] = failure[restarting[hit]]        # failed again while restarting
            t[restarting[~hit]] += R
            restarting = restarting[hit]
        active[i] = done[i] < W - 1e-9
    return t


def llama3_mtbf_hours() -> float:
    """The job's mean time between unexpected interruptions: 54 days * 24 h / 419."""
    return LLAMA3["days"] * 24 / LLAMA3["unexpected"]
