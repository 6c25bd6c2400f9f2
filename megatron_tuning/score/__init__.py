"""Scoring kernels with an interval: ``measure`` (a candidate against its reference), ``noise_floor``
(A/A), ``compare`` (two results), ``pool`` (records of several processes). docs/score.md"""

from .measure import measure, noise_floor
from .pooling import compare, load, pool
from .report import Score

__all__ = ["Score", "compare", "load", "measure", "noise_floor", "pool"]
