"""A simulated GPU for the score's CPU tests: a virtual clock that kernels advance, an SM clock that
can throttle (globally, or per kernel), in-band and NVML readings of it, and a backend timing it.

Shared by tests/score and the ``score`` command's subprocess test (tests/commands/score_child.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

MAX_MHZ = 1980.0


class FakeDevice:
    """Virtual time in seconds; a kernel of ``ms`` at ``MAX_MHZ`` takes ``ms * MAX_MHZ / mhz``."""

    def __init__(
        self,
        *,
        mhz_at: Callable[[float], float] | None = None,
        noise: float = 0.01,
        drift: Callable[[float], float] | None = None,
        host_s: float = 20e-6,
        seed: int = 0,
    ) -> None:
        self.now = 0.0
        self.cycles = 0.0
        self.hidden_s = 0.0  # work a kernel left on another stream: the probe's wall time sees it
        self.mhz_at = mhz_at or (lambda t: MAX_MHZ)
        self.noise = noise
        self.drift = drift or (lambda t: 1.0)
        self.host_s = host_s
        self.rng = np.random.default_rng(seed)
        self.launches = 0

    def clock(self) -> float:
        return self.now

    def advance(self, seconds: float, mhz: float | None = None) -> None:
        self.cycles += seconds * 1e6 * (mhz if mhz is not None else self.mhz_at(self.now))
        self.now += seconds

    def kernel(
        self,
        ms: float,
        *,
        mhz: float | None = None,
        hidden_ms: float = 0.0,
        result: Callable[..., Any] | None = None,
    ) -> Callable[..., Any]:
        """A launch of ``ms`` (at full clock), run at ``mhz`` if given (its own throttle), leaving
        ``hidden_ms`` on another stream; returns ``result(*args)``."""

        def launch(*args: Any) -> Any:
            clock = mhz if mhz is not None else self.mhz_at(self.now)
            seconds = (
                ms
                * 1e-3
                * MAX_MHZ
                / clock
                * self.drift(self.now)
                * float(np.exp(self.rng.normal(0, self.noise)))
            )
            self.advance(seconds, clock)
            self.hidden_s += hidden_ms * 1e-3
            self.launches += 1
            return result(*args) if result is not None else None

        return launch


class FakeBackend:
    """``timers.Backend`` on a ``FakeDevice``: exact virtual times, host overhead between launches."""

    kind = "fake"
    flush_bytes = 1 << 20

    def __init__(
        self, device: FakeDevice, *, tamper: str | None = None, nvml: Any = None, inband: Any = None
    ) -> None:
        self.dev = device
        self._tamper = tamper
        self._sources = (nvml, inband)

    def synchronize(self) -> None:
        pass

    def _timed(self, call: Callable[[], Any]) -> float:
        self.dev.advance(self.dev.host_s)  # the flush and the host, outside the events
        start = self.dev.now
        call()
        return (self.dev.now - start) * 1e3

    def time_block(self, call: Callable[[], Any], launches: int, cold: bool) -> list[float]:
        times = [self._timed(call) for _ in range(launches)]
        return times if cold else [sum(times) / launches]

    def prepare(self, call: Callable[[], Any], launch: str, launches: int) -> tuple[Callable[[], Any], int]:
        if launch == "eager":
            return call, 1
        return (lambda: [call() for _ in range(launches)]), launches

    def probe_escape(self, call: Callable[[], Any], launches: int) -> tuple[float, float]:
        hidden, event = self.dev.hidden_s, sum(self._timed(call) for _ in range(launches))
        return event, event + (self.dev.hidden_s - hidden) * 1e3 + 0.05

    def tamper(self) -> str | None:
        return self._tamper

    def clock_sources(self) -> tuple[Any, Any]:
        return self._sources

    def device(self) -> dict[str, Any]:
        return {"name": "fake GPU", "capability": "9.0"}


class FakeInband:
    """``clocks.InbandSource``: the device's cycle counter and nanosecond timer."""

    def __init__(self, device: FakeDevice) -> None:
        self.dev = device

    def stamp(self) -> tuple[float, float]:
        return self.dev.cycles, self.dev.now * 1e9

    def mhz(self, start: tuple[float, float], end: tuple[float, float]) -> float | None:
        return None if end[1] <= start[1] else (end[0] - start[0]) / (end[1] - start[1]) * 1e3


class FakeNvml:
    """``clocks.NvmlSource``: the device's current clock; other fields fixed or ``None`` (unknown)."""

    def __init__(
        self, device: FakeDevice, *, throttle: int = 0x4, others: int = 0, locked: bool | None = None
    ) -> None:
        self.dev = device
        self.throttle, self.others, self._locked = throttle, others, locked

    def sample(self) -> dict[str, Any]:
        return {
            "sm_mhz": self.dev.mhz_at(self.dev.now),
            "mem_mhz": 2619.0,
            "throttle": self.throttle,
            "temperature_c": 60.0,
            "power_w": None,
        }

    def processes(self) -> dict[str, int | None]:
        return {"on_gpu": 1 + self.others, "others": self.others}

    def locked(self) -> bool | None:
        return self._locked

    def device(self) -> dict[str, Any]:
        return {"name": "fake GPU", "driver": "999.99"}


def seams(device: FakeDevice, **backend: Any) -> dict[str, Any]:
    """``measure``'s seams, all on ``device``: pass as ``measure(fn, **seams(device))``."""
    return {
        "backend": FakeBackend(device, **backend),
        "inband": FakeInband(device),
        "nvml": FakeNvml(device),
        "clock": device.clock,
    }
