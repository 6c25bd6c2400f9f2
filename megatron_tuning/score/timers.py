"""What times a block of launches for ``measure``: CUDA events on a GPU, the host clock elsewhere.

A backend is a parameter of ``measure`` (CPU tests pass a fake device). The CUDA backend is the
tuner's event timer with the flush sized from the device's L2 (twice it), per-launch events in
cold-L2 blocks, CUDA-graph blocks, and the probes the integrity flags read.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..core.notices import warn_once
from ..tuning.tuner import ClockTimer, CudaEventTimer
from .clocks import InbandClock, InbandSource, Nvml, NvmlSource

Call = Callable[[], Any]


class Backend(Protocol):
    """Times blocks of launches; ``kind`` names the timer in the result (``host-clock`` is flagged)."""

    kind: str
    flush_bytes: int | None

    def synchronize(self) -> None: ...

    def time_block(self, call: Call, launches: int, cold: bool) -> list[float]:
        """ms per launch: one value per launch when ``cold`` (an L2 flush before each), else one
        value, the mean of ``launches`` back-to-back launches."""
        ...

    def prepare(self, call: Call, launch: str, launches: int) -> tuple[Call, int]:
        """What one timed call runs and how many launches it holds: ``call`` itself (``eager``), or a
        CUDA graph replaying ``launches`` of them (``graph``)."""
        ...

    def probe_escape(self, call: Call, launches: int) -> tuple[float, float] | None:
        """``(event ms, synchronized wall ms)`` of ``launches`` back-to-back calls; ``None``: cannot tell."""
        ...

    def tamper(self) -> str | None:
        """What replaced part of the timing machinery, if anything did."""
        ...

    def clock_sources(self) -> tuple[NvmlSource | None, InbandSource | None]: ...

    def device(self) -> dict[str, Any]: ...


class CudaBackend(CudaEventTimer):
    """CUDA events on the current stream; durations read through torch's C event method, so a
    patched ``torch.cuda.Event.elapsed_time`` cannot change a score (it is flagged instead)."""

    kind = "cuda-events"
    flush_bytes: int | None

    def __init__(self, torch_module: Any = None) -> None:
        if torch_module is None:
            import torch as torch_module
        torch = torch_module
        self._props = torch.cuda.get_device_properties(torch.cuda.current_device())
        l2 = int(getattr(self._props, "L2_cache_size", 0) or 0)
        self.l2_bytes = l2 or None
        self.flush_bytes = 2 * l2 if l2 else 256 << 20  # unknown L2: do_bench's 256 MiB
        super().__init__(flush_l2=True, torch_module=torch, flush_bytes=self.flush_bytes)
        self._c_elapsed = torch._C._CudaEventBase.elapsed_time

    def _elapsed(self, start: Any, end: Any) -> float:
        return float(self._c_elapsed(start, end))

    def time_block(self, call: Call, launches: int, cold: bool) -> list[float]:
        if cold:
            return self.launch_times(call, launches)
        self._spin(launches)
        self._start.record()
        for _ in range(launches):
            call()
        self._end.record()
        self._end.synchronize()
        per_launch = self._elapsed(self._start, self._end) / launches
        self._gpu_s_per_launch = per_launch * 1e-3
        return [per_launch]

    def prepare(self, call: Call, launch: str, launches: int) -> tuple[Call, int]:
        if launch == "eager":
            return call, 1
        torch = self._torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # capture needs its allocations made off the capture
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(launches):
                call()
        torch.cuda.synchronize()
        return graph.replay, launches

    def probe_escape(self, call: Call, launches: int) -> tuple[float, float]:
        self._torch.cuda.synchronize()
        started = time.perf_counter()
        self._start.record()
        for _ in range(launches):
            call()
        self._end.record()
        self._torch.cuda.synchronize()  # device-wide: waits for work on every stream
        wall_ms = (time.perf_counter() - started) * 1e3
        return self._elapsed(self._start, self._end), wall_ms

    def tamper(self) -> str | None:
        return elapsed_time_problem(self._torch.cuda.Event)

    def clock_sources(self) -> tuple[NvmlSource | None, InbandSource | None]:
        uuid = getattr(self._props, "uuid", None)
        return (Nvml.open(str(uuid)) if uuid is not None else None), InbandClock(self._torch)

    def device(self) -> dict[str, Any]:
        p = self._props
        return {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "sms": p.multi_processor_count,
            "l2_bytes": self.l2_bytes,
            "cuda": self._torch.version.cuda,
        }


class HostBackend:
    """The host clock around each launch (after ``synchronize``): for CPU runs and smoke tests. Its
    results carry the ``host_clock`` flag: they time the host, not a GPU."""

    kind = "host-clock"
    flush_bytes: int | None = None

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, synchronize: Call | None = None
    ) -> None:
        self._timer = ClockTimer(clock, synchronize)

    def synchronize(self) -> None:
        self._timer.synchronize()

    def time_block(self, call: Call, launches: int, cold: bool) -> list[float]:
        if cold:
            return [self._timer.sample(call, 1) for _ in range(launches)]
        return [self._timer.sample(call, launches)]

    def prepare(self, call: Call, launch: str, launches: int) -> tuple[Call, int]:
        if launch != "eager":
            raise ValueError(
                f"launch={launch!r} needs a CUDA GPU (CUDA graphs); on the host clock use 'eager'"
            )
        return call, 1

    def probe_escape(self, call: Call, launches: int) -> None:
        return None  # one clock: nothing to compare it with

    def tamper(self) -> None:
        return None

    def clock_sources(self) -> tuple[None, None]:
        return None, None

    def device(self) -> dict[str, Any]:
        return {"name": platform.processor() or platform.machine() or "cpu", "capability": None}


def elapsed_time_problem(event_class: Any) -> str | None:
    """Whether ``event_class.elapsed_time`` is still the method torch defines (a function of torch's
    own package named ``Event.elapsed_time``)."""
    import torch

    method = getattr(event_class, "elapsed_time", None)
    code = getattr(method, "__code__", None)
    home = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    named = getattr(method, "__qualname__", None) == "Event.elapsed_time"
    if code is not None and named and os.path.abspath(code.co_filename).startswith(home):
        return None
    where = getattr(code, "co_filename", None) or getattr(method, "__module__", None) or repr(method)
    return f"torch.cuda.Event.elapsed_time is not torch's (it comes from {where})"


def default_backend() -> Backend:
    """CUDA events on a visible GPU outside Triton's interpreter, else the host clock (with a notice)."""
    interpreted = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        import torch

        if torch.cuda.is_available() and not interpreted:
            return CudaBackend(torch)
    except ImportError:
        pass
    warn_once(
        ("score-host-clock",),
        "no GPU (or the Triton interpreter is active): score times with the host clock, and every "
        "result carries the host_clock flag. Score on the GPU the kernel is meant for.",
    )
    return HostBackend()
