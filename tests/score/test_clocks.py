"""Clock evidence: the in-band clock's arithmetic, the settle and discard rules, NVML through a fake
``pynvml`` (present, partly unsupported, absent)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from megatron_tuning.score import clocks


def test_inband_mhz_is_the_median_over_sms_seen_in_both_stamps() -> None:
    start = np.array([[1_000, 10_000], [0, 0], [5_000, 20_000], [7, 30_000]], dtype=np.int64)
    end = np.array([[1_756_000, 1_010_000], [9, 9], [1_755_000, 1_020_000], [0, 0]], dtype=np.int64)
    # SM 0: 1,755,000 cycles in 1 ms; SM 2: 1,750,000; SM 1 ran no start stamp, SM 3 no end stamp
    assert clocks.clock_mhz(start, end) == pytest.approx(1752.5)
    assert clocks.clock_mhz(start, np.zeros_like(end)) is None


def test_settled_needs_enough_blocks_within_the_spread() -> None:
    assert not clocks.settled([1980.0, 1980.0, 1980.0])  # too few blocks to say
    assert clocks.settled([1755.0, 1760.0, 1750.0, None, 1758.0])
    assert not clocks.settled([1980.0, 1900.0, 1760.0, 1755.0])


def test_rounds_below_90_percent_of_the_highest_clock_are_dropped() -> None:
    kept = clocks.kept_rounds(np.array([1980.0, 1700.0, np.nan, 1790.0, 1781.0]))
    assert kept.tolist() == [True, False, True, True, False]
    assert clocks.kept_rounds(np.array([np.nan, np.nan])).tolist() == [True, True]  # no clock: keep all


def test_throttle_reasons_are_named_and_idle_is_ignored() -> None:
    assert clocks.throttle_names([0x1, 0x4, None, 0x20 | 0x1]) == ["sw_power_cap", "sw_thermal_slowdown"]
    assert clocks.throttle_names([None, None]) is None and clocks.throttle_names([0x1]) == []


class _NVMLError(Exception):
    pass


def _fake_pynvml(*, power_supported: bool = True, app_clock: int = 1980) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM, nv.NVML_CLOCK_GRAPHICS, nv.NVML_TEMPERATURE_GPU = 1, 2, 0, 0
    handles = {b"GPU-1234": "h0"}

    def power(handle: str) -> int:
        if not power_supported:
            raise _NVMLError("Not Supported")
        return 651_000

    nv.nvmlInit = lambda: None
    nv.nvmlDeviceGetHandleByUUID = lambda uuid: handles[uuid]
    nv.nvmlDeviceGetClockInfo = lambda h, kind: {1: 1755, 2: 2619}[kind]
    nv.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x4
    nv.nvmlDeviceGetTemperature = lambda h, kind: 61
    nv.nvmlDeviceGetPowerUsage = power
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=1),
        types.SimpleNamespace(pid=2),
    ]
    nv.nvmlDeviceGetApplicationsClock = lambda h, kind: app_clock
    nv.nvmlDeviceGetDefaultApplicationsClock = lambda h, kind: 1980
    nv.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    nv.nvmlSystemGetDriverVersion = lambda: "570.86.15"
    return nv


def test_nvml_reads_what_the_driver_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    nv = clocks.Nvml.open("1234")
    assert nv is not None
    assert nv.sample() == {
        "sm_mhz": 1755,
        "mem_mhz": 2619,
        "throttle": 0x4,
        "temperature_c": 61,
        "power_w": 651.0,
    }
    assert nv.processes() == {"on_gpu": 2, "others": 1}
    assert nv.locked() is None  # applications clocks at their default: NVML cannot tell about a lock
    assert nv.device() == {"name": "NVIDIA H100 80GB HBM3", "driver": "570.86.15"}


def test_nvml_fields_it_cannot_read_are_none_never_guessed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(power_supported=False, app_clock=1410))
    nv = clocks.Nvml.open("GPU-1234")
    assert nv is not None and nv.sample()["power_w"] is None
    assert nv.locked() is True  # applications clocks set away from the default


def test_no_nvml_means_no_nvml_evidence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert clocks.Nvml.open("1234") is None
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    assert clocks.Nvml.open("no-such-uuid") is None  # another machine's GPU


def test_summary_of_readings() -> None:
    assert clocks.summary([1755.0, None, 1745.0, float("nan")]) == {
        "median": 1750.0,
        "min": 1745.0,
        "max": 1755.0,
    }
    assert clocks.summary([None]) is None
