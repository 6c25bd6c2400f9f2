"""The score's statistics, pure numpy (tested on simulated round streams, docs/score.md#statistics).

Every function takes round values along the last axis, so one call scores one run or 2,000
simulated ones. A run's interval for a median is the order-statistic interval that the percentile
bootstrap of the median converges to, computed exactly (no resampling noise), with the rank
half-width widened by the rounds' autocorrelation (an AR(1) fit on ranks); processes are pooled
by a seeded hierarchical bootstrap.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import NamedTuple

import numpy as np

FIRST_LOOK = 8  # rounds at the first look; then 16, 32, ...
MAX_LAG1 = 0.9  # an estimated autocorrelation above this is clipped (the factor would explode)
OUTCOMES = ("faster", "slower", "same", "inconclusive")


class Interval(NamedTuple):
    """A point estimate and its interval (arrays when the input held several runs)."""

    estimate: np.ndarray
    low: np.ndarray
    high: np.ndarray


def normal_quantile(p: float) -> float:
    return NormalDist().inv_cdf(p)


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile: exact for 1 and 2 degrees of freedom, else a Cornish-Fisher expansion
    (within 0.3% of the exact value from 3 degrees of freedom on, at the levels used here)."""
    if df <= 1:
        return math.tan(math.pi * (p - 0.5))
    if df <= 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = normal_quantile(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def dependence(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lag-1 autocorrelation of the rounds' ranks (bias-corrected, clipped to [0, MAX_LAG1]) and the
    factor it inflates a median's variance by, if the rounds are AR(1): ``1 + 2 sum_k (2/pi)
    asin(rho^k)`` (the sign process of a Gaussian AR(1) at lag k has that correlation). The factor
    stays 1 unless the autocorrelation exceeds its own standard error, ``1/sqrt(n)``."""
    x = np.asarray(values, dtype=float)
    n = x.shape[-1]
    if n < 4:
        shape = x.shape[:-1]
        return np.zeros(shape), np.ones(shape)
    ranks = np.argsort(np.argsort(x, axis=-1), axis=-1).astype(float)
    centred = ranks - ranks.mean(axis=-1, keepdims=True)
    lag1 = (centred[..., 1:] * centred[..., :-1]).sum(axis=-1) / (centred**2).sum(axis=-1)
    rho = np.clip(lag1 + (1 + 3 * lag1) / n, 0.0, MAX_LAG1)  # Kendall's small-sample bias correction
    lags = np.arange(1, 60)
    used = np.where(rho > 1 / math.sqrt(n), rho, 0.0)
    factor = 1 + 2 * (2 / np.pi * np.arcsin(used[..., None] ** lags)).sum(axis=-1)
    return rho, factor


def median_interval(values: np.ndarray, level: float = 0.95, factor: np.ndarray | None = None) -> Interval:
    """The median of the rounds and a ``level`` interval for it, along the last axis.

    The interval runs between the order statistics of ranks ``(n+1)/2 -/+ z sqrt(n F)/2``
    (interpolated), ``F`` the autocorrelation factor (``dependence``). For independent rounds
    (``F = 1``) this is the distribution-free interval for a median, which the percentile
    bootstrap approaches as its draws grow."""
    x = np.sort(np.asarray(values, dtype=float), axis=-1)
    n = x.shape[-1]
    if factor is None:
        factor = dependence(x if n < 4 else np.asarray(values, dtype=float))[1]
    half = normal_quantile(0.5 + level / 2) * np.sqrt(n * np.asarray(factor, dtype=float)) / 2

    def at(rank: np.ndarray) -> np.ndarray:
        rank = np.clip(rank, 1, n) - 1
        low = np.floor(rank).astype(int)
        high = np.minimum(low + 1, n - 1)
        weight = rank - low
        pick = lambda i: np.take_along_axis(x, np.broadcast_to(i, x.shape[:-1])[..., None], axis=-1)[..., 0]
        return pick(low) * (1 - weight) + pick(high) * weight

    centre = (n + 1) / 2
    return Interval(np.median(x, axis=-1), at(centre - half), at(centre + half))


def pooled_interval(
    groups: list[np.ndarray], level: float = 0.95, *, seed: int = 0, draws: int = 2000
) -> Interval:
    """Processes pooled: the geometric mean of the process medians, and a hierarchical bootstrap
    (processes drawn with replacement, then each one's rounds) giving its standard error; the
    interval is ``t_{P-1}`` standard errors wide, the error scaled by ``sqrt(P/(P-1))`` (the
    bootstrap of a mean of P is that much too narrow). One process: its own ``median_interval``."""
    if len(groups) == 1:
        return median_interval(groups[0], level)
    rng = np.random.default_rng(seed)
    logs = [np.log(np.asarray(g, dtype=float)) for g in groups]
    count = len(logs)
    inner = np.stack([np.median(g[rng.integers(0, len(g), (draws, len(g)))], axis=1) for g in logs])
    chosen = rng.integers(0, count, (draws, count))
    replicates = inner[chosen, np.arange(draws)[:, None]].mean(axis=1)
    estimate = float(np.mean([np.median(g) for g in logs]))
    error = float(np.std(replicates, ddof=1)) * math.sqrt(count / (count - 1))
    half = t_quantile(0.5 + level / 2, count - 1) * error
    return Interval(np.exp(estimate), np.exp(estimate - half), np.exp(estimate + half))


def planned_looks(rounds_possible: int) -> int:
    """How many looks fit: 8, 16, 32, ... rounds up to ``rounds_possible``, plus one at the end."""
    return max(1, int(math.floor(math.log2(max(rounds_possible, FIRST_LOOK) / FIRST_LOOK))) + 2)


def look_level(looks: int, alpha: float = 0.05) -> float:
    """The confidence level a verdict is decided at: alpha split evenly over the looks (Bonferroni)."""
    return 1 - alpha / looks


def verdict(low: np.ndarray, high: np.ndarray, delta: float) -> np.ndarray:
    """faster / slower / same / inconclusive from a ratio interval (candidate time / reference time):
    slower when it lies above ``1 + delta``, faster below ``1 / (1 + delta)``, same inside both."""
    bound = math.log1p(delta)
    lo, hi = np.log(low), np.log(high)
    out = np.full(np.shape(lo), "inconclusive", dtype=object)
    out[lo > bound] = "slower"
    out[hi < -bound] = "faster"
    out[(lo > -bound) & (hi < bound)] = "same"
    return out


def rounds_to_decide(rounds: int, estimate: float, low: float, high: float, delta: float) -> int | None:
    """Rounds likely to decide an inconclusive ratio: the interval narrows as ``1/sqrt(rounds)``
    until it clears the margin on the estimate's side; ``None`` when the estimate sits on it."""
    bound, centre = math.log1p(delta), math.log(estimate)
    half = (math.log(high) - math.log(low)) / 2
    gap = abs(abs(centre) - bound)
    if gap < 1e-4 or half <= 0:
        return None
    return max(rounds, math.ceil(rounds * (half / gap) ** 2))


def processes_to_decide(
    processes: int, estimate: float, low: float, high: float, delta: float, cap: int = 10_000
) -> int | None:
    """Processes likely to decide an inconclusive pooled ratio: its interval is ``t_{P-1}`` standard
    errors wide and the error narrows as ``1/sqrt(P)``, until the half-width clears the margin on the
    estimate's side; ``None`` when the estimate sits on it or ``cap`` processes would not do."""
    bound, centre = math.log1p(delta), math.log(estimate)
    gap = abs(abs(centre) - bound)
    spread = (math.log(high) - math.log(low)) / 2 / t_quantile(0.975, processes - 1) * math.sqrt(processes)
    if gap < 1e-4 or spread <= 0:
        return None
    enough = (n for n in range(processes, cap + 1) if t_quantile(0.975, n - 1) * spread / math.sqrt(n) <= gap)
    return next(enough, None)


def minimum_detectable(
    low: float, high: float, level: float = 0.95, power: float = 0.8, df: float = math.inf
) -> float:
    """The smallest true ratio difference this interval detects with ``power``: (t_level + t_power)
    standard errors on ``df`` degrees of freedom (normal quantiles at the default, one process's
    rounds; ``P - 1`` for P pooled processes), the error read off the interval's log half-width."""
    wide = t_quantile(0.5 + level / 2, df)
    error = (math.log(high) - math.log(low)) / 2 / wide
    return math.expm1((wide + t_quantile(power, df)) * error)


def aa_reach(centres: np.ndarray, level: float = 0.95) -> float:
    """How far from 1 one more process's A/A ratio lies, at ``level``, from P >= 2 processes' A/A
    log-ratio medians (``centres``): the prediction bound ``|mean| + t_{P-1} s sqrt(1 + 1/P)``,
    ``s`` their spread (which holds each median's own noise too). It estimates a quantile of the
    spread, so unlike a pooled interval's reach it does not shrink as processes are added; returned
    as a fraction (``expm1``)."""
    logs = np.asarray(centres, dtype=float)
    count = logs.shape[-1]
    spread = float(np.std(logs, ddof=1)) * math.sqrt(1 + 1 / count)
    return math.expm1(abs(float(np.mean(logs))) + t_quantile(0.5 + level / 2, count - 1) * spread)


def half_width(interval: Interval) -> np.ndarray:
    """The interval's larger side, as a fraction of its estimate."""
    est = np.asarray(interval.estimate)
    return np.maximum(est - interval.low, interval.high - est) / est
