"""``measure`` on a simulated GPU (tests/score/fakes.py): the budget, the looks, the settle phase,
clock evidence, and each integrity flag firing on its fake and staying quiet on a clean run."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
import torch

from megatron_tuning.score import measure, noise_floor, pooling
from megatron_tuning.score.timers import HostBackend, elapsed_time_problem
from tests.score.fakes import MAX_MHZ, FakeDevice, FakeNvml, seams

measure_module = importlib.import_module("megatron_tuning.score.measure")  # `measure` is the function too


def _names(score) -> list[str]:
    return [f["name"] for f in score.record["flags"]]


def test_a_clean_run_is_ok_flag_free_and_decided() -> None:
    dev = FakeDevice()
    score = measure(dev.kernel(0.50), reference=dev.kernel(0.53), **seams(dev))
    record = score.record
    assert score.status == "ok" and record["flags"] == [] and score.verdict == "faster"
    assert score.ratio == pytest.approx(0.50 / 0.53, rel=0.01)
    assert record["rounds"]["looks"][0] == 8 and record["rounds"]["stopped_by"] == "verdict"
    assert record["clocks"]["inband"]["candidate"]["median"] == pytest.approx(MAX_MHZ)
    assert record["clocks"]["nvml"]["reference"]["throttle_reasons"] == ["sw_power_cap"]
    assert record["timing"]["order"] == "ABBA/BAAB" and record["timing"]["settle"]["steady"]


@pytest.mark.parametrize(("kernel_ms", "budget_s"), [(0.05, 0.5), (2.0, 1.0), (7.0, 3.0), (30.0, 0.4)])
def test_the_stopping_rule_never_exceeds_the_budget(kernel_ms: float, budget_s: float) -> None:
    dev = FakeDevice(noise=0.05)
    score = measure(
        dev.kernel(kernel_ms),
        reference=dev.kernel(kernel_ms),
        target_ci=1e-6,
        margin=0.0,
        budget_s=budget_s,
        **seams(dev),
    )
    rounds = score.record["rounds"]
    assert rounds["seconds"] <= budget_s and rounds["stopped_by"] == "budget"
    assert rounds["looks"] == sorted(rounds["looks"]) and rounds["looks"][-1] == rounds["used"]


def test_looks_double_until_the_interval_is_tight() -> None:
    dev = FakeDevice(noise=0.03)
    score = measure(dev.kernel(0.2), target_ci=0.004, **seams(dev))
    rounds = score.record["rounds"]
    assert rounds["stopped_by"] == "target_ci" and rounds["looks"][:3] == [8, 16, 32]
    assert score.record["latency"]["half_width"] <= 0.004 and score.verdict is None


def test_throttled_rounds_are_discarded_and_counted() -> None:
    throttle = lambda t: 900.0 if 0.4 <= t < 0.5 else MAX_MHZ  # a step throttle, 100 ms long
    dev = FakeDevice(mhz_at=throttle)
    score = measure(
        dev.kernel(1.0), reference=dev.kernel(1.0), target_ci=0.002, margin=0.0, budget_s=2.0, **seams(dev)
    )
    rounds = score.record["rounds"]
    assert rounds["discarded"] > 5 and rounds["used"] + rounds["discarded"] == len(
        score.record["samples"]["kept"]
    )
    assert score.median_ms == pytest.approx(1.0, rel=0.02)  # the slow rounds left out
    assert score.record["clocks"]["discard_below_mhz"] == pytest.approx(0.9 * MAX_MHZ, rel=1e-6)


def test_arms_at_different_clocks_demote_the_verdict_saying_why() -> None:
    dev = FakeDevice(noise=0.002)  # the reference heats the GPU: its blocks run at 1700 MHz, 14% slower
    score = measure(dev.kernel(1.0), reference=dev.kernel(1.0, mhz=1700.0), **seams(dev))
    verdict = score.record["verdict"]
    assert verdict["outcome"] == "inconclusive" and verdict["demoted_from"] == "faster"
    assert verdict["cycle_outcome"] == "same"
    assert {"clock_offset", "cycles_disagree"} <= set(_names(score)) and score.status == "demoted"
    messages = " ".join(f["message"] for f in score.record["flags"])
    assert "% the reference's SM clock" in messages and "in SM cycles same" in messages
    assert score.record["clocks"]["arm_offset"] == pytest.approx(MAX_MHZ / 1700 - 1, abs=0.01)


def test_the_settle_phase_waits_for_the_clock_to_drop_from_boost() -> None:
    boost = lambda t: MAX_MHZ if t < 0.25 else 1750.0  # a cold GPU boosts, then the power limit bites
    dev = FakeDevice(mhz_at=boost)
    settle = measure(dev.kernel(0.5), **seams(dev)).record["timing"]["settle"]
    assert settle["steady"] and settle["signal"] == "inband"
    assert settle["before"] == pytest.approx(MAX_MHZ) and settle["after"] == pytest.approx(1750.0)
    assert 0.34 <= settle["seconds"] <= 0.4  # steady for 0.1 s after the drop


def test_a_clock_that_never_holds_still_ends_the_settle_phase_at_its_cap() -> None:
    wobble = lambda t: MAX_MHZ * (1 - 0.05 * (int(t * 50) % 2))  # 5% down every other 20 ms
    dev = FakeDevice(mhz_at=wobble)
    settle = measure(dev.kernel(0.5), budget_s=4.0, **seams(dev)).record["timing"]["settle"]
    assert not settle["steady"] and settle["seconds"] == pytest.approx(1.0, abs=0.01)  # 0.25 x budget


def test_side_stream_work_is_flagged() -> None:
    dev = FakeDevice()
    score = measure(dev.kernel(0.5, hidden_ms=2.0), reference=dev.kernel(0.5), **seams(dev))
    flag = next(f for f in score.record["flags"] if f["name"] == "work_escapes_stream")
    assert "runs work on another stream" in flag["message"] and score.status == "demoted"


def test_a_result_cached_by_address_is_flagged_after_timing() -> None:
    dev = FakeDevice()
    cache: dict[int, torch.Tensor] = {}

    def cached(x: torch.Tensor) -> torch.Tensor:  # returns the first answer it computed for this tensor
        dev.kernel(0.3)()
        return cache.setdefault(x.data_ptr(), x * 2)

    def honest(x: torch.Tensor) -> torch.Tensor:
        dev.kernel(0.3)()
        return x * 2

    inputs = lambda: (torch.randn(64),)
    bad = measure(cached, reference=honest, make_inputs=inputs, **seams(dev))
    assert bad.record["correctness"]["before"] == "pass" and bad.record["correctness"]["after"] == "fail"
    assert "stale_output" in _names(bad) and bad.status == "incorrect"
    assert "same addresses" in next(f["message"] for f in bad.record["flags"] if f["name"] == "stale_output")
    good = measure(honest, reference=honest, make_inputs=inputs, **seams(dev))
    assert good.record["correctness"] == {"checked": True, "before": "pass", "after": "pass", "message": None}
    assert good.record["shape"] == [{"shape": [64], "dtype": "torch.float32"}]


def test_a_wrong_answer_fails_before_timing_and_stops_at_the_first_look() -> None:
    dev = FakeDevice()
    wrong = lambda x: (dev.kernel(0.3)(), x * 3)[1]
    right = lambda x: (dev.kernel(0.3)(), x * 2)[1]
    score = measure(wrong, reference=right, make_inputs=lambda: torch.ones(8), **seams(dev))
    assert score.status == "incorrect" and score.record["rounds"]["stopped_by"] == "incorrect"
    assert "8 of 8 elements differ" in score.record["correctness"]["message"]


def test_a_patched_elapsed_time_is_flagged() -> None:
    dev = FakeDevice()
    score = measure(dev.kernel(0.5), **seams(dev, tamper="torch.cuda.Event.elapsed_time is not torch's"))
    assert (
        "timer_patched" in _names(score)
        and "the score reads CUDA's own" in score.record["flags"][0]["message"]
    )


def test_the_elapsed_time_detector_reads_torchs_method(monkeypatch: pytest.MonkeyPatch) -> None:
    assert elapsed_time_problem(torch.cuda.Event) is None
    monkeypatch.setattr(torch.cuda.Event, "elapsed_time", lambda self, end: 0.001)
    assert "is not torch's (it comes from" in elapsed_time_problem(torch.cuda.Event)


def test_an_implausible_speedup_is_flagged() -> None:
    dev = FakeDevice()
    score = measure(dev.kernel(0.05), reference=dev.kernel(1.0), **seams(dev))
    assert "implausible_speedup" in _names(score) and score.verdict == "inconclusive"


def test_a_budget_that_times_fewer_than_10_launches_is_flagged() -> None:
    dev = FakeDevice()
    score = measure(dev.kernel(20.0), budget_s=0.1, **seams(dev))
    assert {"few_launches", "few_rounds"} <= set(_names(score))
    assert "raise budget_s" in next(
        f["message"] for f in score.record["flags"] if f["name"] == "few_launches"
    )


@pytest.mark.parametrize(("candidate_ms", "over"), [(150.0, False), (300.0, True)])
def test_a_candidate_too_slow_for_the_budget_is_scored_on_the_rounds_it_took(
    candidate_ms: float, over: bool
) -> None:
    """budget_s=0.5 raised "holds no round" for a slow candidate (its blocks' time taken for the
    reference's too, so also for a round that fit): a pipeline got an error, not a score. Now the
    rounds run, at least one, past the budget by at most that round (flagged), and few_rounds demotes."""
    dev = FakeDevice(noise=0.002)
    score = measure(dev.kernel(candidate_ms), reference=dev.kernel(1.0), budget_s=0.5, **seams(dev))
    record = score.record
    assert record["rounds"]["used"] == 1 and record["rounds"]["stopped_by"] == "budget"
    assert "few_rounds" in _names(score) and score.status == "demoted"
    assert score.verdict == "inconclusive" and record["verdict"]["demoted_from"] == "slower"
    assert score.median_ms == pytest.approx(candidate_ms, rel=0.01)
    assert (record["rounds"]["seconds"] > 0.5) == over and ("over_budget" in _names(score)) == over
    if over:
        (flag,) = [f for f in record["flags"] if f["name"] == "over_budget"]
        assert not flag["demotes"] and flag["message"].endswith(
            "and 1 round(s) 0.604 s, past budget_s=0.5: scored on those; 8 rounds need budget_s of about 7.3"
        )
        # that budget holds them: settled to its larger cap, the loop runs a round while 1.5 fit
        again = FakeDevice(noise=0.002)
        enough = measure(
            again.kernel(candidate_ms), reference=again.kernel(1.0), budget_s=7.3, **seams(again)
        )
        assert enough.record["rounds"]["looks"][0] == 8 and "over_budget" not in _names(enough)


def test_the_budget_over_budget_suggests_counts_the_settle_phase_and_eight_and_a_half_rounds() -> None:
    # It counted 12 rounds (1.5 * 8), not the 8.5 the loop needs; a settle phase cut off at its cap
    # grows with the budget: a quarter of it, at most 2 s, and a block past that.
    def needed(settle: dict[str, object], rounds_s: float, rounds: int) -> str:
        return measure_module._over_budget(0.5, settle, rounds_s, rounds)["message"].rsplit(" ", 1)[1]

    assert needed({"seconds": 0.4, "steady": True, "block_s": 0.1}, 2.0, 2) == "8.9"  # 0.4 + 8.5 * 1
    assert needed({"seconds": 0.1, "steady": False, "block_s": 0.1}, 0.4, 1) == "4.7"  # (3.4 + .1) / .75
    assert needed({"seconds": 0.1, "steady": False, "block_s": 0.1}, 1.0, 1) == "11"  # 8.5 + .1 + 2, up


def test_a_round_that_runs_long_past_the_budget_is_counted_in_the_flag() -> None:
    """The second round ran 10x slower (a throttle): it passed the budget, and the flag counts it."""
    dev = FakeDevice(noise=0.002, drift=lambda t: 1.0 if t < 0.5 else 10.0)  # from within round 2
    score = measure(dev.kernel(50.0), reference=dev.kernel(1.0), budget_s=0.5, **seams(dev))
    (flag,) = [f for f in score.record["flags"] if f["name"] == "over_budget"]
    assert score.record["rounds"]["used"] == 2 and " and 2 round(s) " in flag["message"]


def test_the_host_clock_works_and_is_flagged() -> None:
    score = measure(lambda: sum(range(200)), budget_s=0.3, backend=HostBackend())
    assert score.record["timing"]["timer"] == "host-clock" and "host_clock" in _names(score)
    assert score.record["clocks"]["inband"] is None and score.record["clocks"]["nvml"] is None
    assert score.record["clocks"]["locked"] is None and score.status == "demoted"


def test_graph_mode_times_several_launches_per_replay() -> None:
    dev = FakeDevice()
    score = measure(dev.kernel(0.01), launch="graph", **seams(dev))
    assert score.record["timing"]["l2"] == "warm" and score.record["timing"]["launches_per_block"][0] > 10
    assert score.median_ms == pytest.approx(0.01, rel=0.02)


def test_noise_floor_is_an_aa_run_that_widens_later_margins() -> None:
    dev = FakeDevice(noise=0.02)
    floor = noise_floor(dev.kernel(0.5), **seams(dev))
    assert floor.verdict in ("same", "inconclusive") and 0 < floor.record["noise_floor"]["aa_p95"] < 0.02
    later = measure(dev.kernel(0.5), reference=dev.kernel(0.5), noise_floor=floor, margin=0.001, **seams(dev))
    assert later.record["verdict"]["delta"] == floor.record["noise_floor"]["aa_p95"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"l2": "hot"}, "l2='hot': expected one of cold, warm"),
        ({"launch": "graph", "l2": "cold"}, "use l2='warm' with launch='graph'"),
        ({"target_ci": 0}, "target_ci=0: expected a fraction in (0, 1)"),
        ({"budget_s": float("inf")}, "budget_s=inf: expected a positive number"),
        ({"margin": 1.5}, "margin=1.5: expected a fraction in [0, 1)"),
    ],
)
def test_bad_options_are_refused_naming_the_option(options: dict, message: str) -> None:
    dev = FakeDevice()
    with pytest.raises(ValueError) as refused:
        measure(dev.kernel(0.5), **options, **seams(dev))
    assert message in str(refused.value)


@pytest.fixture
def job() -> Any:
    """Join a ``score`` job's settings (as the launcher does); left after the test."""
    yield lambda settings: pooling.join_job(json.dumps(settings), "the test's job")
    pooling.join_job("{}", "the test's job")


def test_a_score_job_gets_each_record_written_and_its_options(tmp_path, job) -> None:
    job({"dir": str(tmp_path), "budget_s": 0.5, "target_ci": 1e-6})
    dev = FakeDevice()
    score = measure(dev.kernel(0.5), name="k", budget_s=100.0, **seams(dev))
    assert score.record["timing"]["budget_s"] == 0.5 and score.record["rounds"]["stopped_by"] == "budget"
    (written,) = tmp_path.glob("score-*.json")
    assert [r["name"] for r in json.loads(written.read_text())] == ["k"]


def test_costly_nvml_reads_are_spread_over_rounds() -> None:
    dev = FakeDevice()

    class SlowNvml(FakeNvml):
        def sample(self) -> dict:
            dev.advance(0.002)  # a 2 ms read: more than 2% of a round
            return super().sample()

    score = measure(dev.kernel(0.5), target_ci=1e-6, budget_s=1.0, **{**seams(dev), "nvml": SlowNvml(dev)})
    read = [v for v in score.record["samples"]["nvml_sm_mhz"] if v is not None]
    assert 0 < len(read) < len(score.record["samples"]["kept"]) / 5
    assert score.record["clocks"]["nvml"]["candidate"]["sm_mhz"]["median"] == MAX_MHZ


def test_a_noise_floor_job_makes_every_measure_an_aa_run(job) -> None:
    job({"noise_floor": True})  # what `score noise-floor` asks
    dev = FakeDevice()
    score = measure(dev.kernel(0.5), reference=dev.kernel(0.6), **seams(dev))
    assert score.ratio == pytest.approx(1.0, abs=0.01) and score.record["noise_floor"]["aa_p95"] is not None


def test_blocks_are_sized_by_a_launch_s_steady_cost_not_by_the_first_block_s() -> None:
    dev = FakeDevice(noise=0.0)
    backend = seams(dev)["backend"]
    first = [True]
    time_block = backend.time_block

    def slow_first_block(call: Any, launches: int, cold: bool) -> list[float]:
        if first[0]:  # the timer's own kernels load on first use (CUDA lazy loading): 30 ms, once
            first[0] = False
            dev.advance(0.03)
        return time_block(call, launches, cold)

    backend.time_block = slow_first_block
    score = measure(dev.kernel(0.2), budget_s=0.5, **{**seams(dev), "backend": backend})
    # 2 ms blocks of 0.2 ms launches with 20 us of host each: 10 launches, not 1
    assert score.record["timing"]["launches_per_block"] == [10]
