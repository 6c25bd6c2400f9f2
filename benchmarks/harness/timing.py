"""Timing inside a child: a call (``do_bench`` on a GPU, the host clock in smoke), one config of
an autotuned kernel, and the host-clock benchmarker that lets stock autotuning run on CPU."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


def time_ms(fn: Callable[[], Any], smoke: bool, *, warmup: int = 25, rep: int = 100) -> float:
    """Milliseconds of ``fn``: the median of ``triton.testing.do_bench`` on a GPU; in smoke, one host-clock
    call after one warm-up (interpreted launches are slow, and the number means nothing)."""
    if smoke:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    # Three quantiles: do_bench returns a list for several (a bare float for exactly one).
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.2, 0.5, 0.8])[1])


def synchronize(smoke: bool) -> None:
    if not smoke:
        import torch

        torch.cuda.synchronize()


def cpu_do_bench(kernel_call: Callable[[], Any], quantiles: Any = None, **_: Any) -> list[float]:
    """Stand-in for Triton's GPU benchmarker in smoke mode, so stock autotuning runs on CPU."""
    start = time.perf_counter()
    kernel_call()
    elapsed = (time.perf_counter() - start) * 1e3
    return [elapsed, elapsed, elapsed] if quantiles else elapsed  # type: ignore[return-value]


def allow_stock_autotune_on_cpu(autotuner: Any) -> None:
    """Smoke mode only: give a stock autotuner a host-clock benchmarker (no GPU driver on CPU)."""
    autotuner.__dict__["do_bench"] = cpu_do_bench


def launch_config(autotuner: Any, config: Any, args: tuple, grid: Any) -> None:
    """Launch one specific config of an autotuned kernel, bypassing the autotuner (fixed-config timing)."""
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(autotuner.arg_names, args)), **config.all_kwargs()})
    autotuner.fn[grid](*args, **config.all_kwargs())


def time_configs_interleaved(
    autotuner: Any, configs: Sequence[Any], args: tuple, grid: Any, *, rounds: int, rep_ms: int, smoke: bool
) -> list[list[float]]:
    """Per config, ``rounds`` samples (ms) of launching exactly that config, bypassing the autotuner.

    Rounds are interleaved with a rotating start so clock drift hits every config alike; a config
    that cannot compile or run scores ``inf`` (as in Triton's autotuner).
    """
    samples: list[list[float]] = [[] for _ in configs]
    order = list(range(len(configs)))
    for r in range(rounds):
        start = r % len(configs)
        for i in order[start:] + order[:start]:

            def call(c: Any = configs[i]) -> None:
                launch_config(autotuner, c, args, grid)

            try:
                samples[i].append(time_ms(call, smoke, warmup=5, rep=rep_ms))
            except Exception as exc:  # out of resources / compile errors: this config cannot run
                samples[i].append(float("inf"))
                print(f"config {i}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return samples
