"""Layer 4: measuring. The noise-aware tuner (timers, interleaved rounds), its statistics, the
pooling of per-process results into tables, and plots.

Imports ``core`` and ``tables``; independent of ``distributed``.
"""
