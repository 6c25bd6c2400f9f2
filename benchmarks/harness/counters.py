"""Counting inside a child: Triton's benchmarks and kernel launches, and the warnings a run gave.

Install the counters before ``megatron_tuning``: the library then wraps these wrappers, so a
count is what reached Triton itself.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import warnings
from typing import Any


class LaunchCounters:
    """Process-wide counts of Triton's benchmarking and of kernel launches (``install`` them first).

    ``bench_calls``: ``Autotuner._bench`` calls that reach Triton's own benchmarking (installed
    before ``megatron_tuning``, whose guard then wraps this wrapper); ``do_bench_calls``:
    ``triton.testing.do_bench`` calls; ``launches``: ``JITFunction.run`` (and interpreted) calls.
    While ``launch_log`` is a list, each launch appends ``(jit function, keyword arguments with
    "__positional__")``; while ``events`` is a list, each launch is timed with CUDA events and
    appends ``(function id, start, end)``.
    """

    def __init__(self) -> None:
        self.bench_calls = 0
        self.do_bench_calls = 0
        self.launches = 0
        self.launch_log: list[tuple[Any, dict[str, Any]]] | None = None
        self.events: list[tuple[str, Any, Any]] | None = None

    def install(self) -> None:
        import functools

        import triton
        import triton.testing
        from triton.runtime.autotuner import Autotuner

        original_bench = Autotuner.__dict__.get("_bench") or Autotuner._bench

        @functools.wraps(original_bench)
        def _bench(autotuner: Any, *args: Any, **kwargs: Any) -> Any:
            self.bench_calls += 1
            return original_bench(autotuner, *args, **kwargs)

        Autotuner._bench = _bench
        original_do_bench = triton.testing.do_bench

        @functools.wraps(original_do_bench)
        def do_bench(*args: Any, **kwargs: Any) -> Any:
            self.do_bench_calls += 1
            return original_do_bench(*args, **kwargs)

        triton.testing.do_bench = do_bench  # the CUDA driver's get_benchmarker() imports it at call time
        classes = [triton.runtime.jit.JITFunction]
        with contextlib.suppress(ImportError, AttributeError):
            from triton.runtime.interpreter import InterpretedFunction

            classes.append(InterpretedFunction)
        for cls in classes:
            self._wrap_run(cls)

    def _wrap_run(self, cls: Any) -> None:
        import functools

        original_run = cls.__dict__.get("run") or cls.run

        @functools.wraps(original_run)
        def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
            self.launches += 1
            if self.launch_log is not None:
                self.launch_log.append((fn, dict(kwargs, __positional__=args)))
            events = self.events
            if events is None:
                return original_run(fn, *args, **kwargs)
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = original_run(fn, *args, **kwargs)
            end.record()
            inner = getattr(fn, "fn", None)
            name = getattr(inner, "__qualname__", getattr(inner, "__name__", "?"))
            events.append((f"{getattr(inner, '__module__', '?')}:{name}", start, end))
            return result

        cls.run = run


def count_triton_benchmarks() -> collections.Counter[str]:
    """Count, per kernel name, the calls that reach Triton's own ``Autotuner._bench``.

    Install it before the library: the interception then wraps this wrapper, so a count is a
    config Triton really benchmarked (our tuner never goes through ``_bench``).
    """
    from triton.runtime.autotuner import Autotuner

    counts: collections.Counter[str] = collections.Counter()
    original = Autotuner._bench

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts[getattr(getattr(self, "base_fn", None), "__name__", "?")] += 1
        return original(self, *args, **kwargs)

    Autotuner._bench = counted
    return counts


class _Collected(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())


def collect_log_warnings(logger: str = "megatron_tuning") -> list[str]:
    """A list that every later WARNING-or-worse record of ``logger`` (and its children) joins."""
    messages: list[str] = []
    logging.getLogger(logger).addHandler(_Collected(messages))
    return messages


def collect_warnings(logger: str = "megatron_tuning") -> list[str]:
    """``collect_log_warnings`` plus every ``warnings.warn`` of this process, each one shown
    (the library's notices are TuningWarnings, its diagnostics log records)."""
    messages = collect_log_warnings(logger)
    warnings.showwarning = lambda message, *_args, **_kw: messages.append(str(message))
    warnings.simplefilter("always")
    return messages
