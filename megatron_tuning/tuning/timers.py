"""The tuner's clocks: CUDA events on a GPU, the host clock elsewhere (tests, smoke runs).

``Timer`` is what ``tuner.time_candidates`` needs. ``CudaEventTimer`` times a sample of short
launches either back to back behind a GPU spin (``sample``) or one launch at a time after an L2
flush (``sample_cold``, what ``triton.testing.do_bench`` measures); ``warm_up`` keeps the GPU busy
before a key's timed rounds. Tests drive it with a fake ``torch`` (``torch_module``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

from .stats import TuneSettings


class Timer(Protocol):
    """Times launches. ``sample`` returns milliseconds per launch over ``launches`` back-to-back launches.

    A timer may also offer ``sample_cold(launch, launches)`` (the median milliseconds of
    ``launches`` launches, each timed alone after an L2 flush: what ``do_bench`` measures) and
    ``warm_up(ms)`` (keep the device busy for ``ms``). Without ``sample_cold``, cold timing takes
    the median of single-launch ``sample`` calls; without ``warm_up``, there is no warm-up.
    """

    def synchronize(self) -> None: ...

    def sample(self, launch: Callable[[], None], launches: int) -> float: ...


class ClockTimer:
    """Host clock around a synchronize. For the interpreter, smoke runs and tests (inject ``clock``)."""

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, synchronize: Callable[[], None] | None = None
    ) -> None:
        self._clock = clock
        self._sync = synchronize or (lambda: None)

    def synchronize(self) -> None:
        self._sync()

    def sample(self, launch: Callable[[], None], launches: int) -> float:
        self._sync()
        start = self._clock()
        for _ in range(launches):
            launch()
        self._sync()
        return (self._clock() - start) * 1e3 / launches

    def sample_cold(self, launch: Callable[[], None], launches: int) -> float:
        """Median of single launches, each between two synchronizes (no cache to flush here)."""
        return statistics.median(self.sample(launch, 1) for _ in range(launches))


class CudaEventTimer:
    """CUDA events around ``launches`` back-to-back launches on the current stream.

    Short kernels launched from Python are host-bound: the GPU would idle between launches
    and the events would time the host. So each sample first enqueues a GPU spin
    (``torch.cuda._sleep``) long enough for the host to queue every launch behind it; the
    events then time the kernels back to back. The L2 flush before a sample (a 256 MiB memset,
    as in ``triton.testing.do_bench``) keeps one candidate from inheriting another's cached data.
    """

    _FLUSH_BYTES = 256 * 1024 * 1024

    def __init__(self, *, flush_l2: bool = True, torch_module: Any = None) -> None:
        if torch_module is None:
            import torch as torch_module
        torch = torch_module  # injectable so CPU tests can drive this class with a fake
        self._torch = torch
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._flush = (
            torch.empty(self._FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush_l2 else None
        )
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        # _sleep counts SM clock cycles; assume ~2 GHz where torch does not report the clock.
        self._cycles_per_s = float(getattr(props, "clock_rate", 0) or 2.0e6) * 1e3
        self._host_s_per_launch = 50e-6
        self._pairs: list[tuple[Any, Any]] = []  # event pairs of cold samples, reused

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()

    def _spin(self, launches: int) -> None:
        # Long enough for the host to queue every launch behind it (a sample times the GPU only).
        spin_s = min(0.05, 20e-6 + 1.5 * launches * self._host_s_per_launch)
        self._torch.cuda._sleep(int(spin_s * self._cycles_per_s))

    def sample(self, launch: Callable[[], None], launches: int) -> float:
        if self._flush is not None:
            self._flush.zero_()
        self._spin(launches)
        self._start.record()
        host_start = time.perf_counter()
        for _ in range(launches):
            launch()
        self._host_s_per_launch = max(1e-6, (time.perf_counter() - host_start) / launches)
        self._end.record()
        self._end.synchronize()
        return float(self._start.elapsed_time(self._end)) / launches

    def sample_cold(self, launch: Callable[[], None], launches: int) -> float:
        """Median milliseconds of ``launches`` launches, each after an L2 flush between its own events.

        What ``triton.testing.do_bench`` measures per call: the flush (a 256 MiB memset, longer
        than the host needs to queue the next launch) keeps the GPU from idling between launches,
        and each launch starts with cold L2 and pays its own start-up, as a lone launch does.
        """
        torch = self._torch
        while len(self._pairs) < launches:
            self._pairs.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        pairs = self._pairs[:launches]
        self._spin(launches)
        host_start = time.perf_counter()
        for start, end in pairs:
            if self._flush is not None:
                self._flush.zero_()
            start.record()
            launch()
            end.record()
        self._host_s_per_launch = max(1e-6, (time.perf_counter() - host_start) / launches)
        pairs[-1][1].synchronize()
        return statistics.median(float(start.elapsed_time(end)) for start, end in pairs)

    def warm_up(self, ms: float) -> None:
        """Keep the GPU busy for about ``ms`` (memsets of the flush buffer, else a spin) and wait."""
        torch = self._torch
        if self._flush is None:
            torch.cuda._sleep(int(ms * 1e-3 * self._cycles_per_s))
        else:
            self._start.record()
            self._flush.zero_()
            self._end.record()
            self._end.synchronize()
            per_memset_ms = max(1e-3, float(self._start.elapsed_time(self._end)))
            for _ in range(min(100_000, math.ceil(ms / per_memset_ms))):
                self._flush.zero_()
        torch.cuda.synchronize()


def default_timer(settings: TuneSettings) -> Timer:
    """CUDA events on a GPU, else the host clock (timings then only mean something for smoke tests)."""
    from ..core.identity import arch_tag

    if arch_tag() != "unknown":
        return CudaEventTimer(flush_l2=settings.flush_l2)
    from ..core.warn import warn_once

    warn_once(
        ("host-clock",),
        "no GPU (or the Triton interpreter is active): tuning times candidates with the host clock, "
        "so what it picks is only meaningful for smoke tests. Tune on the GPU the job runs on, or "
        "use MEGATRON_TUNING_MODE=deterministic with a table tuned there.",
    )
    return ClockTimer()
