"""The Triton adapter (``runtime/interception.py``): real kernels in the interpreter, no mocks of
Triton's autotuner. The generated hit path has its own tests (``test_fastpath.py``)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import triton

from megatron_tuning.core.decisions import decision_log, get_decisions
from megatron_tuning.core.errors import (
    AmbiguousConfigError,
    BenchmarkForbiddenError,
    LaunchOptionError,
    TableMissError,
)
from megatron_tuning.core.identity import config_signature, kernel_id
from megatron_tuning.core.notices import reset_warnings
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.runtime import fastpath, interception, pinning

from .. import support_kernels as sk
from ..support_kernels import grid


@pytest.fixture(autouse=True)
def _clean_state():
    sk.BENCH_CALLS.clear()
    sk.PRE_HOOK_CALLS.clear()
    decision_log().clear()
    reset_warnings()
    for kernel in (sk.scale_add, sk.copy_hooked, sk.maybe_double.fn, sk.single_config_copy, sk.activate):
        kernel.cache.clear()
    yield
    interception.uninstall()
    decision_log().clear()


def _run_scale_add(n: int, dtype=torch.float32):
    x = torch.randn(n).to(dtype)
    y = torch.randn(n).to(dtype)
    out = torch.full((n,), float("nan"), dtype=dtype)
    sk.scale_add[grid(n)](x, y, out, n, 0.5)
    torch.testing.assert_close(out, 0.5 * x + y)
    return out


def test_deterministic_launch_is_correct_and_never_benchmarks():
    interception.install(TuningPolicy(mode="deterministic"))
    for n in (7, 100, 257):
        _run_scale_add(n)
    _run_scale_add(33, torch.float16)
    assert sk.BENCH_CALLS == []
    decisions = [d for d in get_decisions() if d.kernel == kernel_id(sk.scale_add)]
    assert [d.source for d in decisions] == ["cheapest"] * 4
    assert len({d.key for d in decisions}) == 4  # dtype is part of the key
    assert all(
        d.signature == "BLOCK_SIZE=8, num_warps=2, num_stages=" + str(sk.ADD_CONFIGS[0].num_stages)
        for d in decisions
    )
    # Triton's own cache holds each decision under Triton's key, as after its hit path.
    assert sk.scale_add.cache[(257, "torch.float32", "torch.float32", "torch.float32")] is sk.ADD_CONFIGS[0]
    assert sk.scale_add.cache[(33, "torch.float16", "torch.float16", "torch.float16")] is sk.ADD_CONFIGS[0]
    assert len(sk.scale_add.cache) == 4


def test_one_decision_per_key_not_per_launch():
    interception.install(TuningPolicy(mode="deterministic"))
    for _ in range(3):
        _run_scale_add(50)
    assert len(get_decisions()) == 1


def test_benchmark_guard_raises_for_in_scope_kernels():
    interception.install(TuningPolicy(mode="deterministic"))
    x = torch.zeros(8)
    with pytest.raises(BenchmarkForbiddenError, match="scale_add"):
        sk.scale_add._bench(x, x, x, 8, 1.0, config=sk.ADD_CONFIGS[0], grid=(1,))
    assert sk.BENCH_CALLS == []


def test_table_entry_pins_the_config():
    key = "n=40 | x_ptr:torch.float32, y_ptr:torch.float32, out_ptr:torch.float32"
    table = {(kernel_id(sk.scale_add), key): sk.ADD_CONFIGS[3]}
    interception.install(TuningPolicy(mode="deterministic"), table=table)
    _run_scale_add(40)
    (decision,) = get_decisions()
    assert (decision.key, decision.source, decision.origin) == (key, "table", "<memory>")
    assert decision.signature == config_signature(sk.ADD_CONFIGS[3])
    assert sk.scale_add.best_config is sk.ADD_CONFIGS[3]  # matched back to the live object


def test_a_table_entry_pins_a_config_that_differs_from_another_only_in_a_function():
    negate, double = sk.ACT_CONFIGS
    key = "n=8 | x_ptr:torch.float32, out_ptr:torch.float32"
    interception.install(TuningPolicy(mode="deterministic"), table={(kernel_id(sk.activate), key): double})
    x, out = torch.arange(8, dtype=torch.float32), torch.full((8,), float("nan"))
    sk.activate[grid(8)](x, out, 8)
    torch.testing.assert_close(out, x * 2)  # the entry's ``double``, not ``negate``
    assert sk.activate.best_config is double
    assert get_decisions()[0].signature == config_signature(double) != config_signature(negate)


def test_configs_that_sign_alike_but_launch_differently_stop_an_in_scope_kernel_only():
    with interception.lazy_benchmarker():
        configs = [triton.Config({"BLOCK_SIZE": 16, "ACT": act}) for act in (lambda x: -x, lambda x: x * 2)]
        ambiguous = triton.autotune(configs=configs, key=["n"], do_bench=sk.counting_do_bench)(sk.activate.fn)
    x, out = torch.arange(8, dtype=torch.float32), torch.full((8,), float("nan"))
    interception.install(TuningPolicy(mode="deterministic"))
    with pytest.raises(AmbiguousConfigError, match=f"Kernel {sk.__name__}:activate has two configs"):
        ambiguous[grid(8)](x, out, 8)
    assert get_decisions() == [] and sk.BENCH_CALLS == []
    interception.install(TuningPolicy(mode="deterministic", scope=("some.other.package",)))
    ambiguous[grid(8)](x, out, 8)  # out of scope: Triton times and picks, as without the library
    torch.testing.assert_close(out, -x)
    assert len(sk.BENCH_CALLS) == 2


def test_on_miss_error_names_kernel_and_key():
    interception.install(TuningPolicy(mode="deterministic", on_miss="error"))
    with pytest.raises(TableMissError) as info:
        _run_scale_add(12)
    message = str(info.value)
    assert "scale_add" in message and "n=12" in message
    assert sk.BENCH_CALLS == []


def test_pruning_heuristics_and_config_pre_hook_are_honoured():
    interception.install(TuningPolicy(mode="deterministic"))
    for n in (64, 70):  # EVEN heuristic true for 64 with block 32, false for 70
        x = torch.randn(n)
        out = torch.full((n,), float("nan"))
        sk.copy_hooked[grid(n)](x, out, n)
        torch.testing.assert_close(out, x)
    decisions = get_decisions()
    # early_config_prune keeps blocks >= 32; cheapest of those is 32.
    assert {d.config["kwargs"]["BLOCK_SIZE"] for d in decisions} == {32}
    assert sk.PRE_HOOK_CALLS == [32, 32]  # Config.pre_hook runs at every launch
    assert sk.BENCH_CALLS == []


def test_heuristics_outside_the_autotuner():
    interception.install(TuningPolicy(mode="deterministic"))
    for flag in (0, 1):
        x = torch.randn(20)
        out = torch.empty(20)
        sk.maybe_double[grid(20)](x, out, 20, flag)
        torch.testing.assert_close(out, x * (2 if flag else 1))
    assert [d.key.split(" |")[0] for d in get_decisions()] == ["n=20, flag=0", "n=20, flag=1"]


def test_bool_and_int_key_values_are_separate_decisions():
    interception.install(TuningPolicy(mode="deterministic"))
    x = torch.randn(20)
    for flag in (1, True, 1.0):
        out = torch.empty(20)
        sk.maybe_double[grid(20)](x, out, 20, flag)
        torch.testing.assert_close(out, x * 2)
    keys = [d.key.split(" |")[0] for d in get_decisions()]
    assert keys == ["n=20, flag=1", "n=20, flag=True", "n=20, flag=1.0"]


def test_single_config_kernel_is_recorded_as_single():
    interception.install(TuningPolicy(mode="deterministic", on_miss="error"))
    x = torch.randn(10)
    out = torch.empty(10)
    sk.single_config_copy[grid(10)](x, out, 10)
    torch.testing.assert_close(out, x)
    assert [d.source for d in get_decisions()] == ["single"]


def test_out_of_scope_kernel_goes_through_stock_triton():
    interception.install(TuningPolicy(mode="deterministic", scope=("some.other.package",)))
    _run_scale_add(30)
    # Stock Triton benchmarked every config through the kernel's own do_bench and cached a winner.
    assert len(sk.BENCH_CALLS) == len(sk.ADD_CONFIGS)
    assert len(sk.scale_add.cache) == 1
    assert [(d.source, d.key) for d in get_decisions()] == [("out_of_scope", "*")]


def test_scope_prefix_matches_module():
    interception.install(TuningPolicy(mode="deterministic", scope=(sk.__name__.rsplit(".", 1)[0],)))
    _run_scale_add(30)
    assert sk.BENCH_CALLS == []
    assert get_decisions()[0].source == "cheapest"


def test_mode_off_is_stock_triton():
    interception.install(TuningPolicy(mode="off"))
    _run_scale_add(30)
    assert len(sk.BENCH_CALLS) == len(sk.ADD_CONFIGS)
    assert get_decisions() == []


def test_uninstall_restores_triton_exactly():
    from triton.runtime.autotuner import Autotuner

    before = {name: Autotuner.__dict__[name] for name in ("run", "_bench", "__init__")}
    interception.install(TuningPolicy(mode="deterministic"))
    interception.install(TuningPolicy(mode="chaos"))  # idempotent: patched once
    assert Autotuner.run.__wrapped__ is before["run"]
    _run_scale_add(9)
    interception.uninstall()
    interception.uninstall()
    assert {name: Autotuner.__dict__[name] for name in before} == before
    assert "_megatron_tuning_state" not in sk.scale_add.__dict__
    _run_scale_add(9)  # stock Triton again: benchmarks through do_bench
    assert len(sk.BENCH_CALLS) == len(sk.ADD_CONFIGS)


def test_reinstall_with_new_policy_takes_effect():
    interception.install(TuningPolicy(mode="deterministic"))
    _run_scale_add(11)
    interception.install(TuningPolicy(mode="chaos"))
    _run_scale_add(11)
    assert [d.source for d in get_decisions()] == ["cheapest", "chaos"]


def test_concurrent_first_use_records_one_decision(monkeypatch):
    # The interpreter itself is not thread-safe (it swaps tl builtins globally), so serialise
    # only the kernel body; the decision path above it stays concurrent.
    interpret_lock = threading.Lock()
    jit_run = sk.scale_add.fn.run

    def serialised_run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with interpret_lock:
            return jit_run(*args, **kwargs)

    monkeypatch.setattr(sk.scale_add.fn, "run", serialised_run)
    interception.install(TuningPolicy(mode="deterministic"))
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def worker() -> None:
        try:
            barrier.wait()
            _run_scale_add(45)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert len(get_decisions()) == 1


def test_listener_exception_stops_the_launch_and_pins_nothing():
    def refuse(decision):  # noqa: ANN001, ANN202
        raise RuntimeError(f"refused {decision.key}")

    interception.install(TuningPolicy(mode="deterministic"))
    decision_log().add_listener(refuse)
    try:
        x = torch.zeros(5)
        out = torch.full((5,), 7.0)
        with pytest.raises(RuntimeError, match="refused n=5"):
            sk.scale_add[grid(5)](x, x, out, 5, 1.0)
        assert torch.equal(out, torch.full((5,), 7.0))  # nothing launched
    finally:
        decision_log().remove_listener(refuse)
    _run_scale_add(5)  # decided again, now without the listener
    assert len(get_decisions()) == 2


def test_record_mode_records_tritons_winner_with_timings():
    interception.install(TuningPolicy(mode="record"))
    _run_scale_add(21)
    _run_scale_add(21)
    assert len(sk.BENCH_CALLS) == len(sk.ADD_CONFIGS)
    (decision,) = get_decisions()
    assert decision.source == "recorded"
    assert decision.signature == config_signature(sk.scale_add.best_config)
    assert set(decision.timings["candidates"]) == {config_signature(c) for c in sk.ADD_CONFIGS}


def test_tune_mode_uses_the_measure_function():
    calls = []

    def measure(autotuner, candidates, args, kwargs, kernel, key):  # noqa: ANN001, ANN202
        calls.append((kernel, key, len(candidates)))
        return candidates[-1], {"median_ms": {config_signature(c): 1.0 for c in candidates}}

    with pytest.raises(ValueError, match="measure"):
        interception.install(TuningPolicy(mode="tune"))
    interception.install(TuningPolicy(mode="tune"), measure=measure)
    _run_scale_add(17)
    assert calls == [(kernel_id(sk.scale_add), get_decisions()[0].key, len(sk.ADD_CONFIGS))]
    assert get_decisions()[0].source == "tuned"
    assert get_decisions()[0].config["kwargs"] == {"BLOCK_SIZE": 128}


def test_pinned_launch_leaves_tritons_cache_and_best_config_as_its_hit_path_does():
    key = "n=40 | x_ptr:torch.float32, y_ptr:torch.float32, out_ptr:torch.float32"
    interception.install(
        TuningPolicy(mode="deterministic"), table={(kernel_id(sk.scale_add), key): sk.ADD_CONFIGS[3]}
    )
    _run_scale_add(40)
    assert sk.scale_add.best_config is sk.ADD_CONFIGS[3]
    assert sk.scale_add.cache == {(40, "torch.float32", "torch.float32", "torch.float32"): sk.ADD_CONFIGS[3]}
    _run_scale_add(40)  # the key is in Triton's cache now; the pinned launch still never benchmarks
    assert sk.BENCH_CALLS == [] and len(get_decisions()) == 1


@pytest.mark.parametrize("fast_path", [True, False], ids=["generated", "class"])
def test_a_call_passing_an_option_its_config_sets_raises_as_stock_triton_does(monkeypatch, fast_path):
    # A GPU backend's defaults (the interpreter has none): the pinned launch leaves num_warps=4 and
    # num_stages=3 out, so a caller's num_warps=8 used to reach the kernel in their place, silently.
    config = sk.ADD_CONFIGS[2]  # BLOCK_SIZE=32, num_warps=4
    defaults = {"num_warps": 4, "num_stages": config.num_stages, "num_ctas": 1, "maxnreg": None}
    monkeypatch.setattr(fastpath, "_launch_option_defaults", lambda: defaults)
    launched = sk.record_block_sizes(monkeypatch, (sk.scale_add.fn,))
    key = "n=40 | x_ptr:torch.float32, y_ptr:torch.float32, out_ptr:torch.float32"
    table = {(kernel_id(sk.scale_add), key): config}
    interception.install(TuningPolicy(mode="deterministic"), table=table, fast_path=fast_path)
    x = torch.zeros(40)
    sk.scale_add[grid(40)](x, x, x, 40, 0.5)
    sk.scale_add[grid(40)](x, x, x, 40, 0.5)  # served by the generated run where it is on
    for options in ({"num_warps": 8, "num_stages": 1}, {"BLOCK_SIZE": 16}):
        with pytest.raises(TypeError) as info:
            sk.scale_add[grid(40)](x, x, x, 40, 0.5, **options)
        error, names = info.value, ", ".join(f"{k}={v}" for k, v in options.items())
        assert isinstance(error, LaunchOptionError)
        assert error.options == {k: str(v) for k, v in options.items()}
        message = str(error)
        assert f"Kernel {sk.__name__}:scale_add was called with {names}, which its config" in message
        assert config_signature(sk.ADD_CONFIGS[0]) in message and "triton.Config" in message  # sets it first
        assert "refuses this call too (ValueError for a meta-parameter, TypeError for a" in message
        assert str(pickle.loads(pickle.dumps(error))) == message
    assert launched == [32, 32]  # nothing else reached the kernel
    sk.scale_add[grid(40)](x, x, x, 40, 0.5, maxnreg=128)  # an option the config leaves unset: as stock
    assert launched == [32, 32, 32] and len(get_decisions()) == 1


@pytest.mark.parametrize("options", [{"num_warps": 8}, {"BLOCK_SIZE": 16}], ids=["launch", "meta"])
@pytest.mark.parametrize("mode", ["auto", "tune"])
def test_a_clashing_keyword_is_refused_before_anything_is_measured_logged_or_cached(
    mode, options, tmp_path: Path
):
    measured: list[str] = []

    def measure(autotuner, candidates, *rest):
        measured.append(rest[-1])
        return candidates[0], {}

    cache = tmp_path / "auto.msgpack"
    policy = TuningPolicy(mode=mode, cache=str(cache), use_shipped_tables=False)
    interception.install(policy, measure=measure)
    x = torch.zeros(40)
    with pytest.raises(LaunchOptionError) as info:  # not the tuner's ValueError, for a meta-parameter
        sk.scale_add[grid(40)](x, x, x, 40, 0.5, **options)
    assert info.value.options == {k: str(v) for k, v in options.items()}
    assert measured == [] and sk.BENCH_CALLS == [] and get_decisions() == []
    assert sk.scale_add.cache == {}
    interception.uninstall()
    assert not cache.exists()


def test_keyword_arguments_follow_tritons_key_order():
    interception.install(TuningPolicy(mode="deterministic"))
    x, y, out = torch.zeros(6), torch.zeros(6, dtype=torch.float16), torch.zeros(6)
    sk.scale_add[grid(6)](x, out_ptr=out, y_ptr=y, n=6, alpha=1.0)
    # Triton: key values, then dtypes of positional args, then keyword args in call order.
    assert list(sk.scale_add.cache) == [(6, "torch.float32", "torch.float32", "torch.float16")]


def test_uninstall_and_reinstall_forget_the_entries_they_wrote_in_tritons_cache():
    interception.install(TuningPolicy(mode="deterministic"))
    _run_scale_add(12)
    interception.install(TuningPolicy(mode="chaos"))
    _run_scale_add(13)  # a new installation: the old entry for n=12 goes at the kernel's next decision
    assert list(sk.scale_add.cache) == [(13, "torch.float32", "torch.float32", "torch.float32")]
    interception.uninstall()
    assert sk.scale_add.cache == {}
    _run_scale_add(13)  # stock Triton autotunes the key again instead of reusing our pin
    assert len(sk.BENCH_CALLS) == len(sk.ADD_CONFIGS)


def test_decide_without_measuring_uses_the_deterministic_choice_in_tune_mode(notices):
    def measure(*args):  # noqa: ANN002, ANN202
        raise AssertionError("measured where nothing may be measured")

    interception.install(TuningPolicy(mode="tune"), measure=measure)
    installation = pinning.active
    x = torch.zeros(20)
    args = (x, x, x, 20, 1.0)
    config, _ = interception._pin(sk.scale_add, installation, args, {}, may_measure=False)
    assert config is sk.ADD_CONFIGS[0]
    assert [d.source for d in get_decisions()] == ["cheapest"]
    (message,) = notices.matching("first seen where nothing can be measured")
    assert "scale_add" in message and "Launch this key once eagerly" in message
    _run_scale_add(20)  # eager reuses the pin: still nothing measured
    assert len(get_decisions()) == 1


def test_a_lazy_benchmarker_left_open_until_exit_exits_quietly():
    # The benchmark harness keeps one open for its whole process: restoring Triton at exit must
    # not import anything (the import machinery is gone by then).
    code = (  # held by another module, as by the harness: finalized late in the shutdown
        "import contextlib, logging; from megatron_tuning.runtime.interception import lazy_benchmarker; "
        "logging.STACK = contextlib.ExitStack(); logging.STACK.enter_context(lazy_benchmarker())"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")


# --------------------------------------------------------------------------- notices and the arch


def test_every_new_policy_reports_the_fallback_again_and_its_end_counts_the_keys(notices):
    interception.install(TuningPolicy(mode="deterministic"))
    for n in (7, 100, 257):
        _run_scale_add(n)
    assert len(notices.matching("has no tuned config")) == 1  # once per kernel, not per key
    interception.install(TuningPolicy(mode="deterministic"))  # a new policy: the old one ends
    assert "3 keys of 1 kernel(s) launched the cheapest config" in notices.text
    _run_scale_add(7)
    assert len(notices.matching("has no tuned config")) == 2  # and the new one reports again
    interception.uninstall()
    assert len(notices.matching("keys of")) == 1  # one key under the second policy: nothing to add


def test_install_does_not_touch_the_cuda_device(monkeypatch):
    def no_device() -> int:
        raise AssertionError("install touched torch.cuda.current_device()")

    monkeypatch.delenv("TRITON_INTERPRET")  # arch_tag() returns "unknown" early under the interpreter
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", no_device)
    interception.install(TuningPolicy(mode="deterministic"))
    interception.install(TuningPolicy(mode="chaos"))
    assert interception.installed()


def test_the_arch_is_read_at_the_first_launch_of_each_key_on_the_launching_device(monkeypatch):
    device = {"index": 1}
    capability = {0: (8, 0), 1: (9, 0)}
    interception.install(TuningPolicy(mode="deterministic"))  # before "set_device": nothing read
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device["index"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability[index])
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    _run_scale_add(7)
    _run_scale_add(7)  # the hit path reads nothing
    device["index"] = 0
    _run_scale_add(100)
    assert [(d.key.split(" ")[0], d.arch) for d in get_decisions()] == [("n=7", "sm90"), ("n=100", "sm80")]
