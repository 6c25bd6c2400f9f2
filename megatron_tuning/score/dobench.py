"""The zero-edit route: in a process of a ``score --do-bench`` job (or of ``run --score-do-bench``),
``triton.testing.do_bench`` scores through ``measure``. The harness gets the median back as its
float; each call's record, named ``do_bench@<file>:<line>#<n>``, is written as ``measure`` writes any.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

from ..core.notices import warn_once
from .measure import measure
from .pooling import join_job


def activate(raw: str, name: str) -> None:
    """Join the ``score`` job the launcher passed (``raw``, from its variable ``name``) and route
    ``do_bench`` when it asks for that (the launcher calls this at ``import triton``)."""
    if join_job(raw, name).get("do_bench"):
        route_do_bench()


def route_do_bench() -> None:
    """Replace ``triton.testing.do_bench`` (Triton's own callers, its autotuner, keep the original)."""
    import numpy as np
    import triton.testing as testing

    original = testing.do_bench
    if getattr(original, "_megatron_tuning_routed", False):
        return
    calls: collections.Counter[str] = collections.Counter()

    def do_bench(
        fn: Any,
        warmup: Any = 25,
        rep: Any = 100,
        grad_to_none: Any = None,
        quantiles: Any = None,
        return_mode: str = "mean",
        **extra: Any,
    ) -> Any:
        caller = sys._getframe(1)
        if str(caller.f_globals.get("__name__", "")).startswith("triton."):
            return original(fn, warmup, rep, grad_to_none, quantiles, return_mode, **extra)
        site = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
        calls[site] += 1

        def call() -> Any:
            for tensor in grad_to_none or ():  # as do_bench does before each run (here: inside the timing)
                tensor.grad = None
            return fn()

        score = measure(call, name=f"do_bench@{site}#{calls[site]}", check=None)
        samples = score.record["samples"]
        kept = [v for v, k in zip(samples["candidate_ms"], samples["kept"]) if k]
        if quantiles is not None:
            return [float(q) for q in np.quantile(kept, list(quantiles))]
        summary = {"mean": score.median_ms, "median": score.median_ms, "min": min(kept), "max": max(kept)}
        return kept if return_mode == "all" else summary[return_mode]

    do_bench._megatron_tuning_routed = True  # type: ignore[attr-defined]
    testing.do_bench = do_bench
    message = (
        "megatron_tuning: triton.testing.do_bench is scored by megatron_tuning.score.measure (docs/score.md)"
    )
    warn_once(("do_bench-routed",), message, rank_local=True)
