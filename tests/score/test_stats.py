"""The score's statistics on simulated round streams, 2,000 runs at a time (numpy, seeded).

``PER_ROUND_CV`` is the noise of one arm's round value. Measured on an H100 (benchmarks/bench_score.py,
``per_round_cv``; RESULTS §26): 0.06% for a 4096^3 bf16 GEMM, 0.08% over 40 A/A runs. The tests use
1%, a dozen times more, so that power and coverage hold with room to spare.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_tuning.score import stats
from megatron_tuning.score.measure import abba

PER_ROUND_CV = 0.01  # 12x the per-round noise measured on an H100 (0.06-0.08%)
RUNS = 2000


def _ar1(rng: np.random.Generator, runs: int, rounds: int, rho: float) -> np.ndarray:
    noise = rng.normal(size=(runs, rounds))
    out = np.empty_like(noise)
    out[:, 0] = noise[:, 0]
    for t in range(1, rounds):
        out[:, t] = rho * out[:, t - 1] + math.sqrt(1 - rho**2) * noise[:, t]
    return out


def _mixture_median(weights: list[float], centres: list[float], sigma: float) -> float:
    """The median of a mixture of lognormals (bisection on its CDF)."""
    cdf = lambda m: sum(
        w * 0.5 * (1 + math.erf((math.log(m) - math.log(c)) / (sigma * math.sqrt(2))))
        for w, c in zip(weights, centres)
    )
    low, high = 0.5, 2.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < 0.5 else (low, mid)
    return (low + high) / 2


def _stream(kind: str, rng: np.random.Generator, rounds: int) -> tuple[np.ndarray, float]:
    """``RUNS`` streams of round values of one kind, and their true median."""
    if kind == "iid":
        return np.exp(PER_ROUND_CV * rng.normal(size=(RUNS, rounds))), 1.0
    if kind == "ar1":
        return np.exp(PER_ROUND_CV * _ar1(rng, RUNS, rounds, 0.3)), 1.0
    base = PER_ROUND_CV * rng.normal(size=(RUNS, rounds))
    if kind == "spikes":  # 5% of rounds preempted: 30% slower
        hit = rng.random((RUNS, rounds)) < 0.05
        return np.exp(base + np.log(1.3) * hit), _mixture_median([0.95, 0.05], [1.0, 1.3], PER_ROUND_CV)
    # bimodal: 30% of rounds in a second mode 4% slower
    hit = rng.random((RUNS, rounds)) < 0.3
    return np.exp(base + np.log(1.04) * hit), _mixture_median([0.7, 0.3], [1.0, 1.04], PER_ROUND_CV)


@pytest.mark.parametrize("kind", ["iid", "ar1", "spikes", "bimodal"])
def test_ci95_covers_the_true_median_in_93_to_97_percent_of_2000_runs(kind: str) -> None:
    values, true = _stream(kind, np.random.default_rng(11), rounds=64)
    found = stats.median_interval(values)
    coverage = float(np.mean((found.low <= true) & (true <= found.high)))
    assert 0.93 <= coverage <= 0.97, f"{kind}: {coverage:.3f}"


def test_autocorrelation_is_estimated_and_widens_the_interval() -> None:
    rng = np.random.default_rng(3)
    iid = stats.dependence(_ar1(rng, RUNS, 64, 0.0))
    ar = stats.dependence(_ar1(rng, RUNS, 64, 0.3))
    assert abs(float(np.median(ar[0])) - 0.3) < 0.06 and float(np.median(iid[0])) < 0.05
    assert float(np.median(iid[1])) == 1.0 and 1.3 < float(np.median(ar[1])) < 1.8  # AR(1) 0.3: 1.55


def _sequential(ratios: np.ndarray, *, delta: float, target_ci: float) -> tuple[np.ndarray, np.ndarray]:
    """``measure``'s stopping rule on simulated per-round ratios: looks at 8, 16, ... rounds, the
    verdict decided at alpha/looks, stop once decided or the 95% half-width is within target_ci."""
    runs, rounds = ratios.shape
    level = stats.look_level(stats.planned_looks(rounds))
    outcome = np.full(runs, "", dtype=object)
    stopped = np.zeros(runs, dtype=int)
    looks = [stats.FIRST_LOOK << k for k in range(int(math.log2(rounds / stats.FIRST_LOOK)) + 1)]
    for n in looks if looks[-1] == rounds else [*looks, rounds]:
        live = np.flatnonzero(outcome == "")
        decided = stats.median_interval(ratios[live, :n], level)
        verdict = stats.verdict(decided.low, decided.high, delta)
        precise = stats.half_width(stats.median_interval(ratios[live, :n])) <= target_ci
        done = (verdict != "inconclusive") | precise | (n == rounds)
        outcome[live[done]], stopped[live[done]] = verdict[done], n
    return outcome, stopped


def _paired(rng: np.random.Generator, true_ratio: float, rounds: int = 256, rho: float = 0.0) -> np.ndarray:
    a = PER_ROUND_CV * _ar1(rng, RUNS, rounds, rho)
    b = PER_ROUND_CV * _ar1(rng, RUNS, rounds, rho)
    return np.exp(a - b) * true_ratio


@pytest.mark.parametrize(("margin", "rho"), [(0.0, 0.0), (0.01, 0.0), (0.01, 0.3)])
def test_aa_runs_say_faster_or_slower_in_at_most_5_5_percent(margin: float, rho: float) -> None:
    # margin 0 is the hard case: no "same" to stop at, every look a chance for a false verdict.
    outcome, _ = _sequential(_paired(np.random.default_rng(5), 1.0, rho=rho), delta=margin, target_ci=0.0)
    false = float(np.mean((outcome == "faster") | (outcome == "slower")))
    assert false <= 0.055, f"margin {margin}, rho {rho}: {false:.3%}"


def test_power_for_a_true_3_percent_difference_is_at_least_90_percent() -> None:
    outcome, stopped = _sequential(_paired(np.random.default_rng(7), 1.03), delta=0.01, target_ci=0.01)
    assert float(np.mean(outcome == "slower")) >= 0.90
    assert float(np.mean(outcome == "faster")) == 0.0
    assert float(np.median(stopped)) <= 16  # decided early: the budget is rarely the limit


def test_paired_interleaving_is_unbiased_under_linear_drift_where_sequential_is_not() -> None:
    rng = np.random.default_rng(9)
    rounds, slope = 64, 0.10 / (64 * 4)  # the kernel gets 10% slower over the run
    true = 1.03
    noise = PER_ROUND_CV * rng.normal(size=(RUNS, rounds * 4))
    drift = 1 + slope * np.arange(rounds * 4)  # one value per block slot, in time order
    base = {0: true, 1: 1.0}  # arm 0 (candidate) is 3% slower
    # Interleaved: each round's four slots in measure's ABBA / BAAB order.
    slots = [arm for r in range(rounds) for arm in abba(r, [0, 1])]
    values = np.array([base[arm] for arm in slots]) * drift * np.exp(noise)
    arm_of = np.array(slots).reshape(rounds, 4)
    per_round = values.reshape(RUNS, rounds, 4)
    a = np.where(arm_of == 0, per_round, np.nan)
    b = np.where(arm_of == 1, per_round, np.nan)
    interleaved = np.median(np.nanmean(a, axis=2) / np.nanmean(b, axis=2), axis=1)
    # Sequential: all of A's blocks, then all of B's (what an A-then-B harness does).
    seq = np.concatenate([np.full(rounds * 2, true), np.ones(rounds * 2)]) * drift * np.exp(noise)
    sequential = np.median(
        seq[:, : rounds * 2].reshape(RUNS, rounds, 2).mean(axis=2)
        / seq[:, rounds * 2 :].reshape(RUNS, rounds, 2).mean(axis=2),
        axis=1,
    )
    bias = lambda estimates: float(np.mean(np.log(estimates)) - math.log(true))
    assert abs(bias(interleaved)) < 0.001
    assert bias(sequential) < -0.04  # B ran later, on a slower GPU: A looks 5% better than it is


def test_verdict_outcomes_at_the_margin() -> None:
    low = np.array([1.02, 0.95, 0.995, 1.005, 0.97])
    high = np.array([1.05, 0.97, 1.005, 1.02, 1.03])
    assert list(stats.verdict(low, high, 0.01)) == [
        "slower",
        "faster",
        "same",
        "inconclusive",
        "inconclusive",
    ]
    assert stats.rounds_to_decide(16, 1.0, 0.95, 1.05, 0.0) is None  # the estimate sits on the margin


def test_rounds_to_decide_grows_as_the_estimate_nears_the_margin() -> None:
    far = stats.rounds_to_decide(16, 1.03, 1.005, 1.055, 0.01)
    near = stats.rounds_to_decide(16, 1.015, 0.99, 1.04, 0.01)
    assert far is not None and near is not None and 16 <= far < near


def test_t_quantiles_and_minimum_detectable_effect() -> None:
    for df, exact in [(1, 12.706), (2, 4.303), (3, 3.182), (5, 2.571), (9, 2.262), (30, 2.042)]:
        assert stats.t_quantile(0.975, df) == pytest.approx(exact, rel=3e-3)
    # a 95% interval of +/-1% detects about 1.43% with 80% power
    assert stats.minimum_detectable(0.99, 1 / 0.99) == pytest.approx(0.0143, rel=0.02)


def test_pooled_interval_over_processes_covers_with_between_process_variation() -> None:
    rng = np.random.default_rng(13)
    hits = 0
    for _ in range(300):  # 10 processes, each off by 1.5% of process-to-process noise
        offsets = rng.normal(0, 0.015, 10)
        groups = [np.exp(o + PER_ROUND_CV * rng.normal(size=32)) for o in offsets]
        found = stats.pooled_interval(groups, seed=int(rng.integers(1 << 30)), draws=400)
        hits += bool(found.low <= 1.0 <= found.high)
    assert 0.90 <= hits / 300 <= 0.99


@pytest.mark.parametrize("processes", [3, 5, 10])
def test_the_pooled_a_a_floor_bounds_one_more_process_in_95_percent_and_does_not_shrink(
    processes: int,
) -> None:
    """A pooled A/A's floor must hold for the next process (a later verdict in one process): 0.35%
    between processes (RESULTS §32) plus 0.1% of noise in each median. The reach of the pooled
    interval, a mean's, shrinks as processes are added and undercovers; ``aa_reach`` does not."""
    rng = np.random.default_rng(5)
    sigma = math.hypot(0.0035, 0.001)
    floors, hits, mean_hits = [], 0, 0
    for _ in range(RUNS):
        centres = rng.normal(0, sigma, processes)
        floor = stats.aa_reach(centres)
        fresh = math.expm1(abs(rng.normal(0, sigma)))
        width = stats.t_quantile(0.975, processes - 1) * np.std(centres, ddof=1) / math.sqrt(processes)
        floors.append(floor)
        hits += fresh <= floor
        mean_hits += fresh <= math.expm1(abs(np.mean(centres)) + width)
    assert 0.95 <= hits / RUNS <= 0.99, hits / RUNS
    if processes >= 5:
        assert mean_hits / RUNS < 0.9, mean_hits / RUNS
    if processes == 10:  # about 1.3x the true 95th percentile, 1.96 x 0.36% (1.1x at 40)
        assert 1.0 <= np.median(floors) / math.expm1(1.96 * sigma) <= 1.5


def test_processes_to_decide_is_the_first_count_whose_interval_clears_the_margin() -> None:
    low, high = 0.9457, 1.0574  # two processes' pooled A/A ratio (review of 2026-12): t_1 = 12.7 wide
    needed = stats.processes_to_decide(2, 1.0, low, high, 0.01)
    spread = math.log(high / low) / 2 / stats.t_quantile(0.975, 1) * math.sqrt(2)
    clears = lambda n: stats.t_quantile(0.975, n - 1) * spread / math.sqrt(n) <= math.log1p(0.01)
    assert needed is not None and clears(needed) and not clears(needed - 1) and needed < 10
    assert stats.processes_to_decide(5, 1.01, 0.99, 1.03, 0.01) is None  # the estimate sits on the margin
    # a pooled interval is t_{P-1} errors wide: its error, and the power, read with t (0.941 at 80%, 4 df)
    half = -math.log(0.99) / stats.t_quantile(0.975, 4)
    assert stats.minimum_detectable(0.99, 1 / 0.99, df=4) == pytest.approx(
        math.expm1(half * (2.776 + 0.941)), rel=1e-3
    )
