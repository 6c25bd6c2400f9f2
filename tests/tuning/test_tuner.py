"""The tuner's statistics, tie band and tie-break, and its timing loop, with fake timings (no GPU)."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import triton
from triton.runtime.autotuner import Autotuner

from megatron_tuning.core.errors import PolicyError
from megatron_tuning.core.fallback import order_by_cost
from megatron_tuning.core.identity import config_signature
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.tuning.stats import (
    TuneSettings,
    analyze,
    analyze_configs,
    summarize,
    timing_method,
)
from megatron_tuning.tuning.tuner import ClockTimer, make_launcher, make_measure, time_candidates


def _cfg(block: int, warps: int = 4, stages: int = 3) -> triton.Config:
    return triton.Config({"BLOCK": block}, num_warps=warps, num_stages=stages)


# Cheapest first by static cost (block * stages, then warps, then stages).
SMALL, MID, BIG = _cfg(32), _cfg(64), _cfg(128)


# --------------------------------------------------------------------------- statistics


def test_summarize_median_and_quantiles() -> None:
    stats = summarize("c", [5.0, 1.0, 3.0, 2.0, 4.0])
    assert (stats.median, stats.low, stats.high) == (3.0, 1.8, 4.2)
    assert stats.samples == (5.0, 1.0, 3.0, 2.0, 4.0)  # kept in measurement order
    assert not stats.failed


def test_summarize_failed_candidate_is_infinitely_slow() -> None:
    assert summarize("c", [], None).failed
    failed = summarize("c", [1.0], "OutOfResources: shared memory")
    assert failed.failed and failed.error.startswith("OutOfResources")


def test_tie_band_ties_candidates_near_the_best_and_keeps_the_cheapest() -> None:
    # Candidate 2 (the most expensive) is fastest; 0 is within 2%; 1 is 5% slower.
    samples = [[1.015] * 5, [1.05] * 5, [1.0] * 5]
    result = analyze(["cheap", "mid", "costly"], samples, [0, 1, 2], tie_band=0.02)
    assert result.fastest == 2
    assert result.tied == (0, 2)  # in static cost order
    assert result.winner == 0 and result.winner_signature == "cheap"
    assert "tied" in result.reason


def test_clear_winner_outside_the_band() -> None:
    result = analyze(["cheap", "costly"], [[1.10] * 5, [1.0] * 5], [0, 1], tie_band=0.02)
    assert result.tied == (1,) and result.winner == 1
    assert result.reason.startswith("fastest")


def test_overlapping_spreads_tie_only_up_to_the_cap() -> None:
    best = [0.96, 0.98, 1.0, 1.02, 1.04]  # median 1.0, p80 1.024
    near = [1.0, 1.02, 1.025, 1.03, 1.05]  # median 1.025 (outside 2%), p20 1.016 (overlaps)
    far = [1.02, 1.03, 1.045, 1.06, 1.08]  # median 1.045: overlaps but beyond the 3% cap
    result = analyze(["near", "far", "best"], [near, far, best], [0, 1, 2], tie_band=0.02, overlap_cap=0.03)
    assert result.tied == (0, 2)
    assert result.winner_signature == "near"
    strict = analyze(["near", "far", "best"], [near, far, best], [0, 1, 2], tie_band=0.02, overlap_cap=0.02)
    assert strict.winner_signature == "best"


def test_all_candidates_failed_keeps_the_cheapest() -> None:
    result = analyze(["a", "b"], [[], []], [1, 0], errors=["boom", "boom"])
    assert result.winner == 1
    assert "failed" in result.reason


def test_analyze_rejects_inconsistent_inputs() -> None:
    with pytest.raises(ValueError):
        analyze(["a", "b"], [[1.0]], [0, 1])
    with pytest.raises(ValueError):
        analyze(["a", "b"], [[1.0], [1.0]], [0, 0])


def test_tie_break_uses_selection_cost_order() -> None:
    configs = [BIG, SMALL, MID]
    result = analyze_configs(configs, [[1.0] * 3, [1.01] * 3, [1.005] * 3])
    assert config_signature(configs[result.winner]) == config_signature(order_by_cost(configs)[0])


def test_same_samples_in_any_candidate_order_give_the_same_winner() -> None:
    configs = [_cfg(b, w, s) for b in (32, 64, 128) for w in (2, 4) for s in (2, 3)]
    rng = random.Random(0)
    samples = [[1.0 + rng.uniform(-0.01, 0.015) for _ in range(9)] for _ in configs]
    expected = analyze_configs(configs, samples).winner_signature
    for seed in range(25):
        order = list(range(len(configs)))
        random.Random(seed).shuffle(order)
        shuffled = analyze_configs([configs[i] for i in order], [samples[i] for i in order])
        assert shuffled.winner_signature == expected


def test_noisy_timings_flip_a_single_argmin_but_not_the_tuner() -> None:
    # Two configs within 0.4% of each other (the costly one truly faster) and one clearly slower.
    configs = [BIG, SMALL, MID]
    truth = {0: 1.000, 1: 1.004, 2: 1.30}
    one_pass, tuned = set(), set()
    for seed in range(30):  # 30 "fresh processes"
        rng = random.Random(seed)
        samples = [[truth[i] * (1 + rng.gauss(0, 0.01)) for _ in range(10)] for i in range(3)]
        one_pass.add(min(range(3), key=lambda i: samples[i][0]))  # one noisy pass, like Triton
        tuned.add(config_signature(configs[analyze_configs(configs, samples).winner]))
    assert one_pass == {0, 1}  # the single-pass argmin flips between the two near-tied configs
    assert tuned == {config_signature(SMALL)}  # the tuner always keeps the cheap one


def test_timings_are_plain_data() -> None:
    import json

    timings = analyze_configs([BIG, SMALL], [[1.0], []], errors=[None, "OutOfResources"]).to_timings()
    assert json.loads(json.dumps(timings, allow_nan=False)) == timings
    assert timings["candidates"][config_signature(SMALL)] == [None, None, None]
    assert timings["errors"] == {config_signature(SMALL): "OutOfResources"}


def test_settings_validate_and_come_from_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PolicyError, match="rounds"):
        TuneSettings(rounds=0)
    with pytest.raises(PolicyError, match="tie_band"):
        TuneSettings(tie_band=1.5)
    with pytest.raises(PolicyError, match="overlap_cap"):
        TuneSettings(tie_band=0.05, overlap_cap=0.01)
    monkeypatch.setenv("MEGATRON_TUNING_TUNE_ROUNDS", "7")
    monkeypatch.setenv("MEGATRON_TUNING_TUNE_TIE_BAND", "0.04")
    policy = TuningPolicy()
    assert (TuneSettings().rounds, TuneSettings().tie_band) == (policy.tune_rounds, policy.tune_tie_band)
    tuner = _hooked_autotuner([])
    measure = make_measure(TuningPolicy.from_env(), timer=ClockTimer(), progress=False)
    _, timings = measure(tuner, list(tuner.configs), _args(), {"grid": (1,)}, "pkg.mod:k", "n=4 | x:f")
    assert timings["rounds"] == 7  # the policy's: make_measure reads no variable itself
    assert TuneSettings(tie_band=0.04).effective_overlap_cap == pytest.approx(0.06)
    monkeypatch.setenv("MEGATRON_TUNING_TUNE_ROUNDS", "2.5")
    with pytest.raises(PolicyError, match="MEGATRON_TUNING_TUNE_ROUNDS"):
        TuningPolicy.from_env()


def test_cold_timing_settings_are_validated_and_name_the_field() -> None:
    for field, bad in (("cold_below_ms", -1.0), ("cold_below_ms", float("nan")), ("cold_launches", 0)):
        with pytest.raises(PolicyError, match=field):
            TuneSettings(**{field: bad})
    with pytest.raises(PolicyError, match="warmup_ms"):
        TuneSettings(warmup_ms=float("inf"))
    quiet = TuneSettings(cold_below_ms=0.0, cold_launches=1, warmup_ms=0.0)
    assert (quiet.cold_below_ms, quiet.cold_launches, quiet.warmup_ms) == (0.0, 1, 0.0)


def test_the_fastest_candidate_decides_cold_or_batched_for_the_whole_key() -> None:
    settings = TuneSettings()  # cold below 0.02 ms
    assert timing_method([0.007, 0.5, float("nan")], settings) == "cold"
    assert timing_method([0.02, 0.5], settings) == "batched"
    assert timing_method([float("nan"), float("inf")], settings) == "batched"  # nothing timed
    assert timing_method([0.007], TuneSettings(cold_below_ms=0.0)) == "batched"


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1e308", "1e3", "١٠", "1_0", "100000"])
def test_non_finite_rounds_in_the_environment_are_a_policy_error(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("MEGATRON_TUNING_TUNE_ROUNDS", value)
    with pytest.raises(PolicyError, match="MEGATRON_TUNING_TUNE_ROUNDS"):
        TuningPolicy.from_env()


@pytest.mark.parametrize("value", ["nan", "inf", "1e400", "-0.1", "1", "٠.٠٢"])
def test_tie_band_in_the_environment_is_a_finite_fraction(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("MEGATRON_TUNING_TUNE_TIE_BAND", value)
    with pytest.raises(PolicyError, match="MEGATRON_TUNING_TUNE_TIE_BAND"):
        TuningPolicy.from_env()


def test_infinite_sample_time_is_rejected_up_front() -> None:
    # Accepted, it crashed the first tuning with OverflowError (ceil of inf launches).
    with pytest.raises(PolicyError, match="sample_ms"):
        TuneSettings(sample_ms=float("inf"))


# --------------------------------------------------------------------------- timing with a fake clock


class FakeClock:
    """Time advances only when a fake kernel runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fake_launchers(clock: FakeClock, costs_ms: list[float], log: list[int]) -> list:
    def make(i: int):
        def launch() -> None:
            log.append(i)
            clock.now += costs_ms[i] / 1e3

        return launch

    return [make(i) for i in range(len(costs_ms))]


def test_rounds_interleave_with_a_rotating_start() -> None:
    clock, log = FakeClock(), []
    settings = TuneSettings(rounds=3, warmup_rounds=1, sample_ms=1.0)
    samples, errors, _ = time_candidates(
        _fake_launchers(clock, [1.0, 1.0, 1.0], log), timer=ClockTimer(clock), settings=settings
    )
    assert errors == [None, None, None]
    assert [len(s) for s in samples] == [3, 3, 3]  # the warm-up round is not kept
    assert samples[0] == pytest.approx([1.0, 1.0, 1.0])
    warm = log[:12]  # per candidate: compile launch + 3 single-launch estimates
    assert warm == [0] * 4 + [1] * 4 + [2] * 4
    assert log[12:] == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]


def test_short_kernels_get_several_launches_per_sample() -> None:
    clock, log = FakeClock(), []
    settings = TuneSettings(rounds=2, warmup_rounds=0, sample_ms=1.0, max_launches=8, cold_below_ms=0.0)
    samples, _, _ = time_candidates(
        _fake_launchers(clock, [0.25, 0.01], log), timer=ClockTimer(clock), settings=settings
    )
    assert log[8:].count(0) == 2 * 4  # 1 ms / 0.25 ms
    assert log[8:].count(1) == 2 * 8  # capped by max_launches
    assert samples[0] == pytest.approx([0.25, 0.25])


class RecordingTimer:
    """Host-clock timer (fake clock) that logs which sampling method each sample used."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = ClockTimer(clock)
        self.calls: list[tuple[str, int]] = []

    def synchronize(self) -> None:
        pass

    def sample(self, launch, launches: int) -> float:  # noqa: ANN001
        self.calls.append(("sample", launches))
        return self.clock.sample(launch, launches)

    def sample_cold(self, launch, launches: int) -> float:  # noqa: ANN001
        self.calls.append(("cold", launches))
        return self.clock.sample_cold(launch, launches)

    def warm_up(self, ms: float) -> None:
        self.calls.append(("warm_up", int(ms)))


def test_short_keys_are_timed_cold_for_every_candidate_after_a_warm_up() -> None:
    clock, log = FakeClock(), []
    timer = RecordingTimer(clock)
    settings = TuneSettings(rounds=2, warmup_rounds=1, cold_launches=7, warmup_ms=30.0)
    timed = time_candidates(_fake_launchers(clock, [0.007, 0.05], log), timer=timer, settings=settings)
    assert timed.method == "cold"
    assert timer.calls[:6] == [("sample", 1)] * 6  # 3 single-launch estimates per candidate
    assert timer.calls[6] == ("warm_up", 30)  # once, after the estimates, before any round
    assert timer.calls[7:] == [("cold", 7)] * 6  # 3 rounds x 2 candidates, the slow one cold too
    assert timed.samples[0] == pytest.approx([0.007, 0.007]) and timed.samples[1] == pytest.approx([0.05] * 2)


def test_longer_keys_stay_back_to_back_and_a_zero_warm_up_is_skipped() -> None:
    clock, log = FakeClock(), []
    timer = RecordingTimer(clock)
    settings = TuneSettings(rounds=1, warmup_rounds=0, sample_ms=1.0, warmup_ms=0.0)
    timed = time_candidates(_fake_launchers(clock, [0.25, 0.5], log), timer=timer, settings=settings)
    assert timed.method == "batched"
    assert timer.calls[6:] == [("sample", 4), ("sample", 2)]  # sized to ~1 ms; no warm_up


def test_a_timer_that_returns_nan_does_not_crash_the_sizing() -> None:
    class NanTimer:
        def synchronize(self) -> None:
            pass

        def sample(self, launch, launches: int) -> float:
            launch()
            return float("nan")

    clock, log = FakeClock(), []
    settings = TuneSettings(rounds=2, warmup_rounds=0)
    samples, errors, _ = time_candidates(
        _fake_launchers(clock, [1.0, 1.0], log), timer=NanTimer(), settings=settings
    )
    assert errors == [None, None] and [len(s) for s in samples] == [2, 2]
    assert log[8:] == [0, 1, 1, 0]  # one launch per sample
    # NaN samples are not timings: the candidates count as failed, the cheapest is kept.
    assert summarize("s", samples[0]).failed


def test_resource_errors_score_infinite_and_other_errors_propagate() -> None:
    class OutOfResources(Exception):
        pass

    clock, log = FakeClock(), []
    launchers = _fake_launchers(clock, [1.0, 1.0], log)

    def broken() -> None:
        raise OutOfResources("shared memory")

    settings = TuneSettings(rounds=2, warmup_rounds=0)
    samples, errors, _ = time_candidates(
        [launchers[0], broken], timer=ClockTimer(clock), settings=settings, failures=(OutOfResources,)
    )
    assert samples[1] == [] and errors[1] == "OutOfResources: shared memory"
    assert len(samples[0]) == 2
    with pytest.raises(ZeroDivisionError):
        time_candidates(
            [lambda: 1 / 0], timer=ClockTimer(clock), settings=settings, failures=(OutOfResources,)
        )


# --------------------------------------------------------------------------- hooks, as Triton's _bench


class FakeJit:
    """Stands in for a JITFunction: ``run`` records what it saw and what it launched."""

    def __init__(self, events: list, fail_on: int | None = None) -> None:
        self.events = events
        self.fail_on = fail_on

        def user_fn(x, out, n, BLOCK):  # noqa: ANN001, ANN202, N803
            pass

        self.fn = user_fn
        self.arg_names = ["x", "out", "n", "BLOCK"]

    def run(self, x, out, n, **kwargs):  # noqa: ANN001, ANN003, ANN201
        self.events.append(("run", kwargs["BLOCK"], float(out.sum()), float(x.sum())))
        if kwargs["BLOCK"] == self.fail_on:
            raise RuntimeError("kernel failed")
        out.add_(1.0)
        x.mul_(2.0)  # clobbers an input: restore_value must undo it


def _hooked_autotuner(events: list, fail_on: int | None = None) -> Autotuner:
    def config_hook(nargs):  # noqa: ANN001, ANN202
        events.append(("config_pre_hook", nargs["BLOCK"]))

    configs = [triton.Config({"BLOCK": b}, num_warps=4, pre_hook=config_hook) for b in (32, 64)]
    fn = FakeJit(events, fail_on)
    return Autotuner(
        fn,
        fn.arg_names,
        configs,
        ["n"],
        reset_to_zero=["out"],
        restore_value=["x"],
        do_bench=lambda kernel_call, quantiles=None: [1.0, 1.0, 1.0],
    )


def _args() -> tuple:
    return (torch.ones(4), torch.full((4,), 7.0), 4)


def test_launcher_runs_the_hooks_exactly_like_triton_bench() -> None:
    ours: list = []
    tuner = _hooked_autotuner(ours)
    args = _args()
    launch = make_launcher(tuner, tuner.configs[1], args, {"grid": (1,)})
    launch()
    launch()

    theirs: list = []
    stock = _hooked_autotuner(theirs)
    stock_args = _args()
    calls = []

    def do_bench(kernel_call, quantiles=None):  # noqa: ANN001, ANN202
        kernel_call()
        kernel_call()
        calls.append(1)
        return [1.0, 1.0, 1.0]

    # An instance attribute wins over 3.4+'s cached_property and replaces 3.3's plain attribute.
    stock.__dict__["do_bench"] = do_bench
    stock.nargs = dict(zip(stock.arg_names, stock_args))
    stock._bench(*stock_args, config=stock.configs[1], grid=(1,))
    assert calls and ours == theirs
    # reset_to_zero zeroed `out` before each launch; restore_value put `x` back after each.
    assert ours == [("config_pre_hook", 64), ("run", 64, 0.0, 4.0)] * 2
    assert float(args[0].sum()) == 4.0


def test_launcher_runs_post_hook_when_the_kernel_raises() -> None:
    events: list = []
    tuner = _hooked_autotuner(events, fail_on=64)
    args = _args()
    with pytest.raises(RuntimeError, match="kernel failed"):
        make_launcher(tuner, tuner.configs[1], args, {})()
    assert float(args[0].sum()) == 4.0  # restored by the post_hook despite the error


def test_launcher_refuses_conflicting_meta_parameters() -> None:
    tuner = _hooked_autotuner([])
    with pytest.raises(ValueError, match="Conflicting meta-parameters: BLOCK"):
        make_launcher(tuner, tuner.configs[0], _args(), {"BLOCK": 32})


def test_measure_times_every_candidate_and_resets_before_the_real_launch() -> None:
    events: list = []
    tuner = _hooked_autotuner(events)
    clock = FakeClock()
    cost = {32: 2.0, 64: 1.0}
    original_run = tuner.fn.run

    def timed_run(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        clock.now += cost[kw["BLOCK"]] / 1e3
        return original_run(*a, **kw)

    tuner.fn.run = timed_run
    measure = make_measure(TuneSettings(rounds=4, warmup_rounds=1), timer=ClockTimer(clock), progress=False)
    args = _args()
    args[1].fill_(5.0)
    chosen, timings = measure(tuner, list(tuner.configs), args, {"grid": (1,)}, "m:k", "n=4")
    assert chosen is tuner.configs[1]
    assert timings["winner"] == config_signature(tuner.configs[1])
    assert timings["candidates"][timings["winner"]][0] == pytest.approx(1.0)
    assert len(timings["samples"][timings["winner"]]) == 4
    assert timings["rounds"] == 4
    assert float(args[1].sum()) == 0.0  # the final reset_only pre_hook zeroed `out`
    assert set(tuner.configs_timings) == set(tuner.configs)


def test_measure_leaves_triton_shaped_configs_timings_when_a_candidate_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import megatron_tuning.tuning.tuner as tuner_module

    monkeypatch.setattr(tuner_module, "benchmark_failures", lambda: (RuntimeError,))
    tuner = _hooked_autotuner([], fail_on=64)
    measure = make_measure(TuneSettings(rounds=2, warmup_rounds=0), timer=ClockTimer(), progress=False)
    chosen, _ = measure(tuner, list(tuner.configs), _args(), {"grid": (1,)}, "m:k", "n=4")
    assert chosen is tuner.configs[0]
    inf = float("inf")
    # Triton's _bench scores a failed config [inf, inf, inf]; None here broke min(..., key=...get).
    assert tuner.configs_timings[tuner.configs[1]] == [inf, inf, inf]
    assert all(isinstance(v, float) for t in tuner.configs_timings.values() for v in t)
    assert min(tuner.configs_timings, key=tuner.configs_timings.get) is chosen


# --------------------------------------------------------------------------- progress in batch logs


def test_each_tuned_key_logs_one_line_with_its_time_on_the_progress_logger(caplog) -> None:
    tuner = _hooked_autotuner([])
    measure = make_measure(TuneSettings(rounds=2, warmup_rounds=0), timer=ClockTimer(), progress=True)
    caplog.set_level(logging.INFO, "megatron_tuning.tuning.tuner.progress")  # a batch log keeps it alone
    measure(tuner, list(tuner.configs), _args(), {"grid": (1,)}, "pkg.mod:k", "n=4 | x:torch.float32")
    lines = [r for r in caplog.records if r.name == "megatron_tuning.tuning.tuner.progress"]
    assert len(lines) == 1 and lines[0].levelname == "INFO"
    message = lines[0].getMessage()
    assert message.startswith("tuned pkg.mod:k [n=4 | x:torch.float32] in ") and "s: BLOCK=" in message


def test_the_progress_bar_names_the_shape() -> None:
    from megatron_tuning.tuning.tuner import _bar_label

    assert (
        _bar_label("pkg.mod:matmul", "M=64, N=64 | a:torch.float16")
        == "tune matmul [M=64, N=64 | a:torch.float16]"
    )
    long = _bar_label("m:k", "M=" + "9" * 100)
    assert long.startswith("tune k [M=999") and long.endswith("...]") and len(long) < 80


def test_interleave_runs_each_live_arm_in_the_given_order_and_drops_a_failing_one():
    from megatron_tuning.tuning.tuner import interleave, rotating

    calls: list[int] = []

    def sample(arm: int) -> float:
        calls.append(arm)
        if arm == 2 and len(calls) > 4:
            raise RuntimeError("out of resources")
        return float(arm)

    errors: list[str | None] = [None, None, None]
    abba = lambda r, live: [*live, *live[::-1]]
    rounds = list(interleave(sample, errors, range(3), order=abba, failures=(RuntimeError,)))
    assert calls[:6] == [0, 1, 2, 2, 1, 0]  # round 0 whole; round 1 loses arm 2 at its first block
    assert rounds[0] == (0, [(0, 0.0), (1, 1.0), (2, 2.0), (2, 2.0), (1, 1.0), (0, 0.0)])
    assert (
        rounds[1][1] == [(0, 0.0), (1, 1.0), (1, 1.0), (0, 0.0)]
        and errors[2] == "RuntimeError: out of resources"
    )
    assert rotating(1, [0, 1, 2]) == [1, 2, 0]
