"""Noise-aware tuning (``make_measure``): candidates compiled, warmed up, then timed in interleaved
rounds (short kernels cold, one launch after an L2 flush, as ``do_bench``); near-ties are ties, broken
by static cost (``stats``), so a re-tune is reproducible."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from ..core.identity import arch_tag
from ..core.notices import warn_once
from ..core.policy import TuningPolicy
from ..runtime.pinning import Measure
from .stats import TuneSettings, analyze_configs, timing_method

logger = logging.getLogger(__name__)
T = TypeVar("T")
# The per-key "tuned ..." and "audited ..." lines (INFO), apart so an application can keep just them.
progress_logger = logging.getLogger(__name__ + ".progress")


class Timer(Protocol):
    """Times launches: ``sample``, ms per launch over ``launches`` back-to-back launches;
    ``sample_cold``, the median ms of single launches, each after an L2 flush (as ``do_bench``).
    Optional: ``warm_up(ms)``."""

    def synchronize(self) -> None: ...

    def sample(self, launch: Callable[[], None], launches: int) -> float: ...

    def sample_cold(self, launch: Callable[[], None], launches: int) -> float: ...


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
        return statistics.median(self.sample(launch, 1) for _ in range(launches))


class CudaEventTimer:
    """CUDA events around launches on the current stream. A GPU spin (``torch.cuda._sleep``) first
    lets the host queue every launch, so the events time the kernels, not the host; an L2 flush (a
    256 MiB memset, as in ``do_bench``) keeps one candidate from inheriting another's cached data."""

    def __init__(
        self, *, flush_l2: bool = True, torch_module: Any = None, flush_bytes: int = 256 << 20
    ) -> None:
        if torch_module is None:
            import torch as torch_module
        torch = self._torch = torch_module  # injectable: CPU tests drive this class with a fake
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        words = flush_bytes // 4  # int32s: 256 MiB by default, as do_bench's
        self._flush = torch.empty(words, dtype=torch.int32, device="cuda") if flush_l2 else None
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        # _sleep counts SM clock cycles; assume ~2 GHz where torch does not report the clock.
        self._cycles_per_s = float(getattr(props, "clock_rate", 0) or 2.0e6) * 1e3
        self._host_s_per_launch = 50e-6
        self._gpu_s_per_launch = 0.0  # unknown until a block is timed: the first spin covers it all
        self._pairs: list[tuple[Any, Any]] = []  # event pairs of cold samples, reused

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()

    def _spin(self, launches: int) -> None:
        """Hold the GPU while the host queues: the first launch, then the host's deficit (where
        queueing a launch takes longer than running it). More would idle a GPU-bound block: a 4096^3
        GEMM's 7-launch block lost 0.6 ms of 1.6 to a spin sized by host time alone."""
        deficit = max(0.0, self._host_s_per_launch - self._gpu_s_per_launch)
        spin_s = min(0.05, 20e-6 + 2 * self._host_s_per_launch + 1.5 * launches * deficit)
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
        per_launch = self._elapsed(self._start, self._end) / launches
        self._gpu_s_per_launch = per_launch * 1e-3
        return per_launch

    def _elapsed(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))

    def sample_cold(self, launch: Callable[[], None], launches: int) -> float:
        """Median ms of ``launches`` launches, each after an L2 flush between its own events (the
        flush also keeps the GPU busy while the host queues the next launch)."""
        return statistics.median(self.launch_times(launch, launches))

    def launch_times(self, launch: Callable[[], None], launches: int) -> list[float]:
        """``sample_cold``'s launches: the ms of each."""
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
        times = [self._elapsed(start, end) for start, end in pairs]
        self._gpu_s_per_launch = statistics.median(times) * 1e-3
        return times

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
    if arch_tag() != "unknown":
        return CudaEventTimer(flush_l2=settings.flush_l2)
    warn_once(
        ("host-clock",),
        "no GPU (or the Triton interpreter is active): tuning times candidates with the host clock, "
        "so what it picks is only meaningful for smoke tests. Tune on the GPU the job runs on, or "
        "use MEGATRON_TUNING_MODE=deterministic with a table tuned there.",
        rank_local=True,
    )
    return ClockTimer()


def benchmark_failures() -> tuple[type[BaseException], ...]:
    """Errors that score a candidate as infinitely slow: those ``Autotuner._bench`` catches."""
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime.errors import OutOfResources, PTXASError

    return (OutOfResources, PTXASError, CompileTimeAssertionFailure)


def make_launcher(
    autotuner: Any,
    config: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    observe: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """One benchmark launch of ``config`` with exactly ``Autotuner._bench``'s hooks: ``Config.pre_hook``,
    the autotuner's ``pre_hook`` (zeroes ``reset_to_zero``, snapshots ``restore_value``), the kernel,
    ``observe`` (the audit's digest, before any restore), then ``post_hook``, also when the kernel raises."""
    conflicts = kwargs.keys() & config.kwargs.keys()
    if conflicts:
        raise ValueError(
            f"Conflicting meta-parameters: {', '.join(sorted(conflicts))}. "
            "Make sure that you don't re-define auto-tuned symbols."
        )
    current = dict(kwargs, **config.all_kwargs())
    full_nargs = {**dict(zip(autotuner.arg_names, args)), **current}

    def launch() -> None:
        if config.pre_hook:
            config.pre_hook(full_nargs)
        autotuner.pre_hook(full_nargs)
        try:
            autotuner.fn.run(*args, **current)
            if observe is not None:
                observe()
        except Exception as exc:
            try:
                autotuner.post_hook(full_nargs, exception=exc)
            finally:
                raise  # the kernel's error, after the hook ran: what Triton does
        autotuner.post_hook(full_nargs, exception=None)

    return launch


class Timed(NamedTuple):
    """What ``time_candidates`` measured for one key."""

    samples: list[list[float]]  # per candidate, ms per launch of each timed round; [] if it failed
    errors: list[str | None]
    method: str  # "cold" (each launch alone after an L2 flush) or "batched": stats.timing_method


def time_candidates(
    launchers: Sequence[Callable[[], None]],
    *,
    timer: Timer,
    settings: TuneSettings,
    on_step: Callable[[], None] | None = None,
    failures: tuple[type[BaseException], ...] | None = None,
) -> Timed:
    """Compile and warm up each candidate, then sample them in interleaved, rotating rounds: cold
    when the fastest is under ``settings.cold_below_ms``, else ``sample_ms`` of launches a sample. One
    that raised one of ``failures`` gets no samples and an error text; other errors propagate."""
    failures = benchmark_failures() if failures is None else failures
    step = on_step or (lambda: None)
    n = len(launchers)
    samples: list[list[float]] = [[] for _ in range(n)]
    errors: list[str | None] = [None] * n
    estimates = [math.nan] * n
    for i, launch in enumerate(launchers):
        try:
            launch()  # compiles on first use; compile errors surface here
            timer.synchronize()
            estimates[i] = min(timer.sample(launch, 1) for _ in range(3))  # sizes the samples
        except failures as exc:
            errors[i] = f"{type(exc).__name__}: {exc}"
            logger.info("candidate %d failed to compile or launch: %s", i, errors[i])
        step()
    method = timing_method([e for e, err in zip(estimates, errors) if err is None], settings)
    sample = timer.sample if method == "batched" else timer.sample_cold
    if method == "cold":
        launches = [min(settings.cold_launches, settings.max_launches)] * n
    else:  # a NaN estimate (a timer that failed to time) gets single launches, not a crash
        per_sample = [1 if math.isnan(e) else math.ceil(settings.sample_ms / max(e, 1e-6)) for e in estimates]
        launches = [max(1, min(settings.max_launches, k)) for k in per_sample]
    warm_up = getattr(timer, "warm_up", None)
    if warm_up is not None and settings.warmup_ms > 0 and any(err is None for err in errors):
        warm_up(settings.warmup_ms)
    rounds = interleave(
        lambda i: sample(launchers[i], launches[i]),
        errors,
        range(settings.warmup_rounds + settings.rounds),
        failures=failures,
        on_step=step,
    )
    for round_index, taken in rounds:
        if round_index >= settings.warmup_rounds:
            for i, value in taken:
                samples[i].append(value)
    return Timed([[] if errors[i] else s for i, s in enumerate(samples)], errors, method)


def rotating(round_index: int, live: Sequence[int]) -> list[int]:
    """Each live arm once, the first rotating, so slow drift hits every position in a round alike."""
    start = round_index % len(live)
    return [*live[start:], *live[:start]]


def interleave(
    sample: Callable[[int], T],
    errors: list[str | None],
    rounds: Iterable[int],
    *,
    order: Callable[[int, Sequence[int]], Sequence[int]] = rotating,
    failures: tuple[type[BaseException], ...] = (),
    on_step: Callable[[], None] | None = None,
) -> Iterator[tuple[int, list[tuple[int, T]]]]:
    """The interleaved round loop (the tuner's and ``score``'s): in each round, ``sample(arm)`` for the
    live arms (those whose ``errors`` entry is ``None``) in ``order(round, live)`` (an arm may come
    more than once); yields ``(round, [(arm, value), ...])``. An arm raising one of ``failures`` gets
    its error text and leaves; the loop ends when none is live or the caller stops iterating."""
    for round_index in rounds:
        live = [i for i, error in enumerate(errors) if error is None]
        if not live:
            return
        taken: list[tuple[int, T]] = []
        for i in order(round_index, live):
            if errors[i] is not None:
                continue  # failed earlier in this round
            try:
                taken.append((i, sample(i)))
            except failures as exc:
                errors[i] = f"{type(exc).__name__}: {exc}"
            finally:
                if on_step is not None:
                    on_step()
        yield round_index, [(i, value) for i, value in taken if errors[i] is None]


def make_measure(
    settings: TuneSettings | TuningPolicy | None = None, *, timer: Timer | None = None, progress: bool = True
) -> Measure:
    """The ``measure`` of ``tune`` and ``auto``: ``measure(autotuner, candidates, args, kwargs, kernel,
    key) -> (live config, timings)`` times the candidates on the real arguments with ``timer`` (default:
    CUDA events on a GPU). With ``progress``, a tqdm bar on a terminal and a ``progress_logger`` line."""
    if isinstance(settings, TuningPolicy):  # what ``session`` passes: its tuner settings
        settings = TuneSettings(rounds=settings.tune_rounds, tie_band=settings.tune_tie_band)
    settings = settings or TuneSettings()
    timers = [timer] if timer is not None else []  # the default made at first use: it allocates on the GPU

    def measure(
        autotuner: Any,
        candidates: list[Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        kernel: str,
        key: str,
    ) -> tuple[Any, dict[str, Any]]:
        started = time.perf_counter()
        launchers = [make_launcher(autotuner, config, args, kwargs) for config in candidates]
        total = len(candidates) * (1 + settings.warmup_rounds + settings.rounds)
        bar = _progress_bar(total, _bar_label(kernel, key)) if progress else None
        try:
            if not timers:
                timers.append(default_timer(settings))
            timed = time_candidates(
                launchers, timer=timers[0], settings=settings, on_step=(bar.update if bar else None)
            )
        finally:
            if bar is not None:
                bar.close()
        result = analyze_configs(candidates, timed.samples, settings=settings, errors=timed.errors)
        timings = result.to_timings()
        chosen = candidates[result.winner]
        # As Triton does after benchmarking: zero reset_to_zero tensors once more so the real
        # launch starts from the state the caller prepared, not from the last benchmark's output.
        full_nargs = {**dict(zip(autotuner.arg_names, args)), **kwargs, **chosen.all_kwargs()}
        autotuner.pre_hook(full_nargs, reset_only=True)
        elapsed = time.perf_counter() - started
        # What Triton exposes after its own tuning: [median, p20, p80], inf for a failed candidate.
        autotuner.configs_timings = {c: [s.median, s.low, s.high] for c, s in zip(candidates, result.stats)}
        autotuner.bench_time = elapsed
        best, fastest = result.stats[result.winner], result.stats[result.fastest].signature
        line = "tuned %s [%s] in %.1fs: %s (median %.4f ms; %d tied; fastest %s)"
        (progress_logger if progress else logger).info(
            line, kernel, key, elapsed, best.signature, best.median, len(result.tied), fastest
        )
        timings.update(method=timed.method, rounds=settings.rounds, tune_seconds=round(elapsed, 3))
        return chosen, timings

    return measure


def _bar_label(kernel: str, key: str, width: int = 60) -> str:
    """``tune <qualname> [<key>]``, the key cut to ``width`` characters: the bar names the shape."""
    shape = key if len(key) <= width else key[: width - 3] + "..."
    return f"tune {kernel.rsplit(':', 1)[-1]} [{shape}]"


def _progress_bar(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: tqdm turns itself off when stderr is not a terminal (batch jobs, CI logs).
    return tqdm(total=total, desc=desc, unit="sample", leave=False, disable=None)
