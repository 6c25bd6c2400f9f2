"""Scoring kernels with an interval: ``measure`` (a candidate against its reference), ``noise_floor``
(A/A) and ``compare`` (two results). docs/score.md"""

from .measure import measure, noise_floor
from .pooling import compare, load
from .report import Score

__all__ = ["Score", "compare", "load", "measure", "noise_floor"]
