"""Summaries of a sample (medians, spreads, quantiles) and the rotated orders of interleaved rounds."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    """``items`` starting at position ``shift`` (mod length): interleaved rounds rotate their start
    so slow drift hits every item alike."""
    start = shift % len(items)
    return list(items[start:]) + list(items[:start])


def alternated(items: Sequence[Any], round_index: int) -> list[Any]:
    """``items`` forward in even rounds, backward in odd ones (ABBA...): load that changes over
    minutes biases neither end."""
    return list(items) if round_index % 2 == 0 else list(items)[::-1]


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and (max - min) / median of a sample (the spread RESULTS.md reports)."""
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if not finite:
        return {
            "median": float("nan"),
            "min": float("nan"),
            "max": float("nan"),
            "rel_range": float("nan"),
            "n": 0,
        }
    med = statistics.median(finite)
    return {
        "median": med,
        "min": min(finite),
        "max": max(finite),
        "rel_range": (max(finite) - min(finite)) / med if med else float("nan"),
        "n": len(finite),
    }


def quantiles(samples: Sequence[float]) -> dict[str, float]:
    """Median, p20, p80 (nearest rank), min and count of a non-empty sample."""
    ordered = sorted(samples)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    return {
        "median": statistics.median(ordered),
        "p20": q(0.2),
        "p80": q(0.8),
        "min": ordered[0],
        "n": len(ordered),
    }


def median_or_none(values: Sequence[Any]) -> Any:
    """The median of the values that are not ``None``; ``None`` when there are none."""
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None
