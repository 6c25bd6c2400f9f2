"""The tuner's decision rules, pure: candidates tied with the fastest (``analyze``) are decided by
static cost (``order_by_cost``), so noise inside the tie band cannot move the choice."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.errors import PolicyError
from ..core.policy import ENV_TUNE_ROUNDS, ENV_TUNE_TIE_BAND, default

TIMINGS_FORMAT = "megatron_tuning.tuner/1"  # tags the ``timings`` of a tuned decision or table entry
MAX_ROUNDS = 10_000  # each round times every candidate: more is a typo (``1e308`` was once accepted)


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneSettings:
    """How hard the tuner measures and how wide it calls a tie."""

    rounds: int = default(ENV_TUNE_ROUNDS)
    """Timed rounds; each round takes one sample of every live candidate."""

    warmup_rounds: int = 1
    """Untimed rounds before the timed ones (clocks ramp up, caches and allocators settle)."""

    tie_band: float = default(ENV_TUNE_TIE_BAND)
    """Candidates whose median is within this fraction of the best median are tied with it."""

    overlap_cap: float | None = None
    """Overlapping p20-p80 ranges tie only within this fraction of the best median (default 1.5 x
    ``tie_band``), so a noisy, clearly slower config is not called a tie."""

    sample_ms: float = 1.0
    """Target device time of one sample; short kernels are launched several times per sample."""

    max_launches: int = 256
    """Upper bound on launches per sample (bounds host time for very short kernels)."""

    flush_l2: bool = True
    """Flush the L2 cache on a GPU: before each sample, and in cold timing before every launch."""

    cold_below_ms: float = 0.02
    """Keys whose fastest candidate takes less are timed *cold*, as ``triton.testing.do_bench`` does
    (L2 flushed, events around each launch): back to back, operands stay in L2 and can rank short
    kernels differently (RESULTS section 5). ``0`` times every key back to back."""

    cold_launches: int = 25
    """Launches per sample in cold timing; a sample is their median."""

    warmup_ms: float = 50.0
    """Sustained GPU work before the first timed round of a key, so clocks have ramped and
    settled (the first timings after idle ran fast: RESULTS section 1). ``0``: none."""

    def __post_init__(self) -> None:
        if type(self.rounds) is not int or not 1 <= self.rounds <= MAX_ROUNDS:
            raise PolicyError("rounds", self.rounds, f"an integer from 1 to {MAX_ROUNDS}")
        if type(self.warmup_rounds) is not int or self.warmup_rounds < 0:
            raise PolicyError("warmup_rounds", self.warmup_rounds, "an integer >= 0")
        if not 0.0 <= self.tie_band < 1.0:  # also refuses nan
            raise PolicyError("tie_band", self.tie_band, "a fraction in [0, 1), e.g. 0.02")
        if self.overlap_cap is not None and not self.tie_band <= self.overlap_cap < 1.0:
            raise PolicyError("overlap_cap", self.overlap_cap, f"a fraction in [tie_band={self.tie_band}, 1)")
        if not 0 < self.sample_ms < math.inf:
            raise PolicyError("sample_ms", self.sample_ms, "a positive number of milliseconds")
        if type(self.max_launches) is not int or self.max_launches < 1:
            raise PolicyError("max_launches", self.max_launches, "an integer >= 1")
        if not 0 <= self.cold_below_ms < math.inf:
            raise PolicyError("cold_below_ms", self.cold_below_ms, "milliseconds >= 0 (0: never cold)")
        if type(self.cold_launches) is not int or self.cold_launches < 1:
            raise PolicyError("cold_launches", self.cold_launches, "an integer >= 1")
        if not 0 <= self.warmup_ms < math.inf:
            raise PolicyError("warmup_ms", self.warmup_ms, "milliseconds >= 0")

    @property
    def effective_overlap_cap(self) -> float:
        return self.overlap_cap if self.overlap_cap is not None else min(1.5 * self.tie_band, 0.999)


def timing_method(estimates_ms: Sequence[float], settings: TuneSettings) -> str:
    """``"cold"`` or ``"batched"``, one method for all of a key's candidates (their samples are
    compared): cold when the fastest single-launch estimate is below ``settings.cold_below_ms``."""
    finite = [e for e in estimates_ms if math.isfinite(e)]
    return "cold" if finite and min(finite) < settings.cold_below_ms else "batched"


@dataclass(frozen=True, slots=True)
class CandidateStats:
    """One candidate's samples (milliseconds per launch) and their summary; ``inf`` when it failed."""

    signature: str
    samples: tuple[float, ...]
    median: float
    low: float  # p20
    high: float  # p80
    error: str | None = None

    @property
    def failed(self) -> bool:
        return not math.isfinite(self.median)


@dataclass(frozen=True, slots=True)
class TuneResult:
    """The outcome for one (kernel, key): per-candidate statistics, the tie set and the winner."""

    stats: tuple[CandidateStats, ...]  # in candidate order
    winner: int  # index into ``stats`` of the chosen candidate
    fastest: int  # index of the lowest median (what one noise-free argmin would pick)
    tied: tuple[int, ...]  # indices tied with the fastest, in static cost order; the winner is the first
    reason: str
    tie_band: float
    overlap_cap: float

    @property
    def winner_signature(self) -> str:
        return self.stats[self.winner].signature

    def to_timings(self) -> dict[str, Any]:
        """``Decision.timings``, as stored in decision logs and tables."""

        def triple(s: CandidateStats) -> list[float | None]:
            return [None, None, None] if s.failed else [s.median, s.low, s.high]

        return {
            "format": TIMINGS_FORMAT,
            "unit": "ms",
            "winner": self.winner_signature,
            "fastest": self.stats[self.fastest].signature,
            "tied": [self.stats[i].signature for i in self.tied],
            "reason": self.reason,
            "tie_band": self.tie_band,
            "overlap_cap": self.overlap_cap,
            "candidates": {s.signature: triple(s) for s in self.stats},
            "samples": {s.signature: list(s.samples) for s in self.stats},
            "errors": {s.signature: s.error for s in self.stats if s.error},
        }


def _quantile(ordered: Sequence[float], q: float) -> float:
    """numpy's default (linear) quantile of sorted data."""
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(signature: str, samples: Sequence[float], error: str | None = None) -> CandidateStats:
    """Median and p20/p80 of ``samples``; a candidate with an error or no finite sample is ``inf``."""
    kept = tuple(float(s) for s in samples)
    finite = sorted(s for s in kept if math.isfinite(s))
    if error is not None or not finite:
        return CandidateStats(signature, kept, math.inf, math.inf, math.inf, error or "no samples")
    # p20/p80 bound the spread: robust to the odd preempted sample, unlike min/max
    median, low, high = (_quantile(finite, q) for q in (0.5, 0.2, 0.8))
    return CandidateStats(signature, kept, median, low, high, None)


def analyze(
    signatures: Sequence[str],
    samples: Sequence[Sequence[float]],
    cost_order: Sequence[int],
    *,
    tie_band: float = 0.02,
    overlap_cap: float = 0.03,
    errors: Sequence[str | None] | None = None,
) -> TuneResult:
    """Decide among candidates from their samples. ``cost_order``: candidate indices cheapest first
    (``order_by_cost``, independent of list position), so reordered candidates give the same winner."""
    n = len(signatures)
    if n == 0 or len(samples) != n or sorted(cost_order) != list(range(n)):
        raise ValueError("analyze needs one sample list per candidate and a cost order over all of them")
    errs = list(errors) if errors is not None else [None] * n
    stats = tuple(summarize(signatures[i], samples[i], errs[i]) for i in range(n))
    rank = {index: position for position, index in enumerate(cost_order)}
    fastest = min(range(n), key=lambda i: (stats[i].median, rank[i]))
    best = stats[fastest]
    if best.failed:
        tied = tuple(cost_order)
        reason = "every candidate failed to compile or run; kept the cheapest by static cost"
    else:

        def is_tied(s: CandidateStats) -> bool:
            in_band = s.median <= best.median * (1.0 + tie_band)
            overlaps = s.low <= best.high and s.median <= best.median * (1.0 + overlap_cap)
            return not s.failed and (in_band or overlaps)

        tied = tuple(i for i in cost_order if is_tied(stats[i]))
        if len(tied) == 1:
            reason = "fastest, outside every other candidate's tie band"
        else:
            reason = (
                f"{len(tied)} candidates tied within {tie_band:.1%} of the best median "
                "(or overlapping spreads); kept the cheapest by static cost"
            )
    return TuneResult(stats, tied[0], fastest, tied, reason, tie_band, overlap_cap)


def analyze_configs(
    configs: Sequence[Any],
    samples: Sequence[Sequence[float]],
    *,
    settings: TuneSettings | None = None,
    errors: Sequence[str | None] | None = None,
) -> TuneResult:
    """``analyze`` for ``triton.Config`` objects (or ``config_data`` dicts), using selection's order."""
    from ..core.fallback import order_by_cost
    from ..core.identity import config_signature

    settings = settings or TuneSettings()
    # order_by_cost returns the objects themselves; map them back to positions by identity,
    # since Config objects before Triton 3.4 hash by identity and dicts compare by value.
    remaining = list(range(len(configs)))
    order: list[int] = []
    for config in order_by_cost(configs):
        position = next(i for i in remaining if configs[i] is config)
        remaining.remove(position)
        order.append(position)
    signatures, cap = [config_signature(c) for c in configs], settings.effective_overlap_cap
    return analyze(signatures, samples, order, tie_band=settings.tie_band, overlap_cap=cap, errors=errors)
