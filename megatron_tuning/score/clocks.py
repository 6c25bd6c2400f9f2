"""Clock evidence bound to a score: NVML per round, an in-band clock per block, and the rules on them.

NVML (nvidia-ml-py, optional) says what the driver reports: clocks, throttle reasons, temperature,
power, processes. The in-band clock is a one-warp Triton kernel per SM reading ``%clock64`` and
``%globaltimer`` before and after a block: cycles per nanosecond on each SM is the SM clock the block
ran at, whatever NVML can see. A missing source gives ``None``, never a guess.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)

DISCARD_BELOW = 0.9  # a round whose clock is under this fraction of the run's highest is discarded
ARM_OFFSET = 0.01  # arms whose clocks differ by more than this demote the verdict
SETTLE_BLOCKS = 4  # the settle phase ends once a window of at least this many blocks ...
SETTLE_SPREAD = 0.01  # ... has clocks (or times) within this fraction of their median
# NVML's clock event ("throttle") reason bits, stable across driver releases (nvml.h).
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


class NvmlSource(Protocol):
    """What the score reads from NVML; each value ``None`` where the driver does not say."""

    def sample(self) -> dict[str, Any]: ...  # sm_mhz, mem_mhz, throttle (bitmask), temperature_c, power_w

    def processes(self) -> dict[str, int | None]: ...  # on_gpu, others

    def locked(self) -> bool | None: ...

    def device(self) -> dict[str, Any]: ...  # name, driver


class InbandSource(Protocol):
    """An in-band clock on the timed stream: ``stamp()`` enqueues a reading and returns its handle;
    after the stream synchronized, ``mhz(start, end)`` is the SM clock between two stamps."""

    def stamp(self) -> Any: ...

    def mhz(self, start: Any, end: Any) -> float | None: ...


class Nvml:
    """``NvmlSource`` through ``pynvml`` for one device, found by its UUID (never by a guessed index)."""

    def __init__(self, pynvml: Any, handle: Any) -> None:
        self._nv = pynvml
        self._handle = handle

    @classmethod
    def open(cls, uuid: str) -> Nvml | None:
        """The device with this UUID (``torch.cuda.get_device_properties(i).uuid``), or ``None`` when
        nvidia-ml-py is not installed or NVML cannot find it (then NVML fields stay ``null``)."""
        try:
            import pynvml

            pynvml.nvmlInit()
            name = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(name.encode())
            except (TypeError, AttributeError):  # releases that take (and encode) a str
                handle = pynvml.nvmlDeviceGetHandleByUUID(name)
            return cls(pynvml, handle)
        except Exception as exc:  # noqa: BLE001 - absent or unusable NVML: no NVML evidence, said so
            logger.info("no NVML clock evidence: %s", exc)
            return None

    def _ask(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._nv, name)(self._handle, *args)
        except Exception:  # noqa: BLE001 - not supported on this device or driver: unknown
            return None

    def sample(self) -> dict[str, Any]:
        nv = self._nv
        power = self._ask("nvmlDeviceGetPowerUsage")
        new_name = "nvmlDeviceGetCurrentClocksEventReasons"  # the older name is deprecated in newer releases
        reasons = new_name if hasattr(nv, new_name) else "nvmlDeviceGetCurrentClocksThrottleReasons"
        return {
            "sm_mhz": self._ask("nvmlDeviceGetClockInfo", nv.NVML_CLOCK_SM),
            "mem_mhz": self._ask("nvmlDeviceGetClockInfo", nv.NVML_CLOCK_MEM),
            "throttle": self._ask(reasons),
            "temperature_c": self._ask("nvmlDeviceGetTemperature", nv.NVML_TEMPERATURE_GPU),
            "power_w": None if power is None else power / 1000.0,
        }

    def processes(self) -> dict[str, int | None]:
        found = self._ask("nvmlDeviceGetComputeRunningProcesses")
        if found is None:
            return {"on_gpu": None, "others": None}
        # This process is one of them (in a container NVML lists it under its host pid).
        return {"on_gpu": len(found), "others": max(0, len(found) - 1)}

    def locked(self) -> bool | None:
        """``True`` when NVML reports applications clocks set away from their defaults; otherwise
        unknown (``None``): NVML has no query for ``nvidia-smi --lock-gpu-clocks``."""
        clock = self._nv.NVML_CLOCK_GRAPHICS
        current = self._ask("nvmlDeviceGetApplicationsClock", clock)
        default = self._ask("nvmlDeviceGetDefaultApplicationsClock", clock)
        return True if current is not None and default is not None and current != default else None

    def device(self) -> dict[str, Any]:
        name = self._ask("nvmlDeviceGetName")
        try:
            driver = self._nv.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001
            driver = None
        decode = lambda v: v.decode() if isinstance(v, bytes) else v
        return {"name": decode(name), "driver": decode(driver)}


class InbandClock:
    """``InbandSource`` on a CUDA GPU: ``inband.clock_stamp`` with one program per SM writes each SM's
    ``(clock64, globaltimer)``; the clock between two stamps is the median over SMs seen in both."""

    SLOTS, MAX_SM = 64, 1024

    def __init__(self, torch_module: Any) -> None:
        from .inband import clock_stamp

        torch = torch_module
        self._kernel = clock_stamp
        self._sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self._buffer = torch.zeros((self.SLOTS, self.MAX_SM, 2), dtype=torch.int64, device="cuda")
        self._next = 0

    def stamp(self) -> int:
        slot, self._next = self._next, (self._next + 1) % self.SLOTS
        self._buffer[slot].zero_()
        self._kernel[(self._sms,)](self._buffer[slot], self.MAX_SM, num_warps=1)
        return slot

    def mhz(self, start: int, end: int) -> float | None:
        both = self._buffer[[start, end]].cpu().numpy()  # one copy: each is a wait for the GPU
        return clock_mhz(both[0], both[1])


def clock_mhz(start: np.ndarray, end: np.ndarray) -> float | None:
    """The SM clock between two stamps, each ``(SMs, 2)`` rows of ``(clock64, globaltimer ns)`` (zero:
    that SM ran no stamp program): the median over SMs seen in both of cycles per microsecond."""
    seen = (start[:, 1] > 0) & (end[:, 1] > start[:, 1])
    if not seen.any():
        return None
    cycles = end[seen, 0].astype(np.float64) - start[seen, 0]
    return float(np.median(cycles / (end[seen, 1] - start[seen, 1]) * 1e3))


def settled(signal: Sequence[float | None]) -> bool:
    """Whether a window of settle blocks held steady (clock, or time without one): at least
    ``SETTLE_BLOCKS`` of them, all within ``SETTLE_SPREAD`` of their median."""
    known = [v for v in signal if v is not None]
    if len(known) < SETTLE_BLOCKS:
        return False
    return (max(known) - min(known)) <= SETTLE_SPREAD * float(np.median(known))


def kept_rounds(round_mhz: np.ndarray) -> np.ndarray:
    """Rounds to keep: clock at least ``DISCARD_BELOW`` of the run's highest (no clock: kept)."""
    mhz = np.asarray(round_mhz, dtype=float)
    if not np.isfinite(mhz).any():
        return np.ones(mhz.shape, dtype=bool)
    return ~(mhz < DISCARD_BELOW * np.nanmax(mhz))


def throttle_names(masks: Sequence[int | None]) -> list[str] | None:
    """The reasons NVML gave in any of ``masks`` (``gpu_idle`` ignored: rounds sample between
    blocks); ``None`` when NVML gave none."""
    known = [m for m in masks if m is not None]
    if not known:
        return None
    seen = 0
    for mask in known:
        seen |= int(mask)
    return [name for bit, name in THROTTLE_REASONS.items() if seen & bit and bit != 0x1]


def summary(values: Sequence[float | None]) -> dict[str, float] | None:
    """Median, min and max of the known values; ``None`` when there are none."""
    known = [float(v) for v in values if v is not None and np.isfinite(v)]
    if not known:
        return None
    return {"median": float(np.median(known)), "min": min(known), "max": max(known)}


def candidate_clock(*records: dict[str, Any]) -> tuple[str, list[float]] | None:
    """The SM clock each result's candidate ran at, from one source all have: NVML's first, the
    clock the driver set, which reads alike in any process; else the in-band one. Between processes
    the in-band reading (cycles over a block's wall time) also moves with how the blocks ran: in
    RESULTS §31's cold/hot pairs it differed by 2%, NVML's by 0.8%, the latency by 0.3% or less;
    under a GEMM it reads 0.87 of NVML's clock."""
    for source in ("nvml", "inband"):
        arms = [(r["clocks"].get(source) or {}).get("candidate") or {} for r in records]
        mhz = [(arm.get("sm_mhz") if source == "nvml" else arm) or {} for arm in arms]
        if all(m.get("median") for m in mhz):
            return source, [m["median"] for m in mhz]
    return None
