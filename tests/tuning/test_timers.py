"""The CUDA event timer's enqueue order, driven by a fake ``torch`` (no GPU), and the host clock."""

from __future__ import annotations

import time

import pytest

from megatron_tuning.core.notices import warn_once
from megatron_tuning.tuning.stats import TuneSettings
from megatron_tuning.tuning.tuner import ClockTimer, CudaEventTimer, default_timer


class _FakeCuda:
    def __init__(self, log: list) -> None:
        self.spins: list = []
        self.log = log
        test = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.at = None

            def record(self) -> None:
                test.log.append("record")
                self.at = len(test.log)

            def synchronize(self) -> None:
                test.log.append("event_sync")

            def elapsed_time(self, end) -> float:  # noqa: ANN001
                return 2.0 * (end.at - self.at - 1)  # 2 ms per launch logged in between

        self.Event = Event

    def _sleep(self, cycles: int) -> None:
        assert cycles > 0
        self.log.append("spin")
        self.spins.append(cycles)

    def get_device_properties(self, index: int) -> object:
        return object()  # no clock_rate: the timer assumes ~2 GHz

    def current_device(self) -> int:
        return 0

    def synchronize(self) -> None:
        self.log.append("sync")


class _FakeTorch:
    int32 = "int32"

    def __init__(self) -> None:
        self.log: list = []
        self.cuda = _FakeCuda(self.log)

    def empty(self, n: int, dtype: str, device: str):  # noqa: ANN201
        log = self.log

        class Buffer:
            def zero_(self) -> None:
                log.append("flush")

        assert device == "cuda" and n * 4 == 256 * 1024 * 1024
        return Buffer()


def test_cuda_event_timer_flushes_spins_then_times_back_to_back_launches() -> None:
    fake = _FakeTorch()
    timer = CudaEventTimer(torch_module=fake)
    per_launch = timer.sample(lambda: fake.log.append("launch"), 3)
    assert fake.log == ["flush", "spin", "record", "launch", "launch", "launch", "record", "event_sync"]
    assert per_launch == pytest.approx(2.0)
    fake.log.clear()
    CudaEventTimer(flush_l2=False, torch_module=fake).sample(lambda: fake.log.append("launch"), 1)
    assert fake.log[0] == "spin"


def test_the_spin_covers_the_host_s_deficit_not_a_gpu_bound_block() -> None:
    fake = _FakeTorch()
    timer = CudaEventTimer(torch_module=fake)

    def launch() -> None:  # 1 ms to queue on the host; the fake GPU takes 2 ms to run it
        time.sleep(0.001)
        fake.log.append("launch")

    timer.sample_cold(launch, 20)
    timer.sample_cold(launch, 20)
    # Once the GPU is known to outrun the host, the spin covers queueing the first launch only
    # (a few ms at most), not all 20 (30 ms or more).
    assert fake.cuda.spins[1] <= 0.004 * 2e9


def _launcher(fake: _FakeTorch, widths: list[int]):  # noqa: ANN202
    """A fake launch that logs ``widths[i]`` entries on its i-th call (so it "takes" 2*w ms)."""
    calls = iter(widths)

    def launch() -> None:
        fake.log.extend(["launch"] * next(calls))

    return launch


def test_cold_samples_flush_before_every_launch_time_each_alone_and_take_the_median() -> None:
    fake = _FakeTorch()
    timer = CudaEventTimer(torch_module=fake)
    value = timer.sample_cold(_launcher(fake, [1, 5, 2]), 3)
    assert fake.log == ["spin"] + ["flush", "record", "launch", "record"] + [
        "flush",
        "record",
        *["launch"] * 5,
        "record",
    ] + ["flush", "record", "launch", "launch", "record", "event_sync"]
    assert value == pytest.approx(4.0)  # median of 2, 10 and 4 ms: each launch's own event pair
    fake.log.clear()
    again = timer.sample_cold(_launcher(fake, [1, 1]), 2)  # event pairs are reused, fewer is fine
    assert again == pytest.approx(2.0) and fake.log.count("flush") == 2
    fake.log.clear()
    CudaEventTimer(flush_l2=False, torch_module=fake).sample_cold(_launcher(fake, [1, 1]), 2)
    assert "flush" not in fake.log and fake.log.count("record") == 4


def test_warm_up_keeps_the_gpu_busy_for_the_time_asked() -> None:
    fake = _FakeTorch()
    CudaEventTimer(torch_module=fake).warm_up(50.0)
    # One timed memset (2 ms in the fake), then 25 more for 50 ms, then a device synchronize.
    assert fake.log == ["record", "flush", "record", "event_sync"] + ["flush"] * 25 + ["sync"]
    fake.log.clear()
    CudaEventTimer(flush_l2=False, torch_module=fake).warm_up(5.0)
    assert fake.log == ["spin", "sync"]


def test_clock_timer_cold_samples_are_the_median_of_single_launches() -> None:
    now = [0.0]
    costs = iter([0.001, 0.005, 0.002])

    def launch() -> None:
        now[0] += next(costs)

    timer = ClockTimer(clock=lambda: now[0])
    assert timer.sample_cold(launch, 3) == pytest.approx(2.0)


def test_whichever_rank_times_on_the_host_clock_says_so_once(monkeypatch, notices):
    monkeypatch.setenv("RANK", "3")  # e.g. rank 0 adopted every key: only rank 3 ever timed one
    assert isinstance(default_timer(TuneSettings()), ClockTimer)
    assert isinstance(default_timer(TuneSettings()), ClockTimer)
    (notice,) = notices.matching("with the host clock")
    assert "only meaningful for smoke tests" in notice and "MEGATRON_TUNING_MODE=deterministic" in notice
    warn_once(("job-wide",), "every rank meets this cause")  # rank 0 says those, once per job
    assert notices.matching("every rank meets") == []
