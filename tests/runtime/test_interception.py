"""The Triton adapter (``runtime/interception.py``): real kernels in the interpreter, no mocks of
Triton's autotuner. The second half covers the hit path (the generated instance ``run``) and every
way it could launch a stale config."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tuning.core.choice import as_config_table
from megatron_tuning.core.decisions import decision_log, get_decisions
from megatron_tuning.core.errors import BenchmarkForbiddenError, TableMissError
from megatron_tuning.core.identity import config_data, config_signature, kernel_id, tuning_key
from megatron_tuning.core.notices import reset_warnings
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.runtime import inductor, interception, pinning

from .. import support_kernels as sk
from ..support_kernels import grid


@pytest.fixture(autouse=True)
def _clean_state():
    sk.BENCH_CALLS.clear()
    sk.PRE_HOOK_CALLS.clear()
    decision_log().clear()
    reset_warnings()
    for kernel in (sk.scale_add, sk.copy_hooked, sk.maybe_double.fn, sk.single_config_copy):
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
    config = interception._pin(sk.scale_add, installation, args, {}, may_measure=False)
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


# --------------------------------------------------------------------------- the hit path
#
# Each test below watches the config a launch really hands the kernel (``fn.run`` wrapped to record
# its ``BLOCK_SIZE``) and, where it matters, which ``run`` each launch entered (``_paths``: the
# generated instance ``run`` or the class-level one), so a hit path that launched an old record,
# or that was silently never taken, shows.

F32 = "torch.float32"
KEY_40 = f"n=40 | x_ptr:{F32}, y_ptr:{F32}, out_ptr:{F32}"
BY_BLOCK = {c.kwargs["BLOCK_SIZE"]: c for c in sk.ADD_CONFIGS}


def _policy(**changes: Any) -> TuningPolicy:
    changes.setdefault("on_miss", "min_cost")  # a key without an entry gets the cheapest config (8)
    return TuningPolicy(mode="deterministic", agreement="off", use_shipped_tables=False, **changes)


def _table(*entries: tuple[str, int], kernel: Any = sk.scale_add) -> dict[tuple[str, str], Any]:
    return {(kernel_id(kernel), key): config_data(BY_BLOCK[block]) for key, block in entries}


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The BLOCK_SIZE of every launch that reaches these kernels' ``fn.run`` (the launch still runs)."""
    return sk.record_block_sizes(monkeypatch, (sk.scale_add.fn, sk.copy_hooked.fn.fn, sk.maybe_double.fn.fn))


def _scale_add(n: int = 40, kernel: Any = sk.scale_add) -> None:
    x, y, out = torch.randn(n), torch.randn(n), torch.full((n,), float("nan"))
    kernel[grid(n)](x, y, out, n, 0.5)
    torch.testing.assert_close(out, 0.5 * x + y)


def _record_only(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``scale_add``'s ``fn.run`` records its BLOCK_SIZE and runs nothing: the interpreter itself is
    not thread-safe (it swaps ``tl`` builtins globally), the launch path above it is."""
    blocks: list[int] = []
    monkeypatch.setattr(sk.scale_add.fn, "run", lambda *a, **kw: blocks.append(kw["BLOCK_SIZE"]))
    return blocks


def _paths(launch: Callable[[], Any]) -> list[str]:
    """Which ``run`` each launch in ``launch()`` entered: "instance" (generated) or "class" (ours)."""
    class_code = interception.autotuner_class().__dict__["run"].__code__
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "run" and code.co_filename.startswith("<megatron_tuning launch "):
            seen.append("instance")
        elif code is class_code:
            seen.append("class")

    sys.setprofile(profile)
    try:
        launch()
    finally:
        sys.setprofile(None)
    return seen


def _serving(kernel: Any = sk.scale_add) -> Any:
    return pinning.serving(kernel.__dict__.get("run"))


def test_the_first_pinned_launch_arms_the_instance_run_and_later_launches_take_it(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    assert _paths(_scale_add) == ["class"]  # the first launch decides, then arms
    assert _serving() is pinning.active
    assert _paths(_scale_add) == ["instance"]
    assert _paths(lambda: _scale_add(12)) == ["instance"]  # a new key: decided from the instance run
    assert launched == [64, 64, 8] and len(get_decisions()) == 2
    run = sk.scale_add.__dict__["run"]
    assert getattr(run, pinning.SERVES_ATTR) is pinning.active
    assert pinning.serving(lambda: None) is None and pinning.serving(None) is None


def test_a_notice_from_the_instance_run_points_at_the_users_line_not_the_generated_one(launched):
    interception.install(_policy(on_miss="nearest"), table=_table((KEY_40, 64)))
    _scale_add()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _paths(lambda: _scale_add(12)) == ["instance"]  # the miss is decided in the instance run
    (notice,) = caught
    assert "nearest shape" in str(notice.message) and notice.filename == __file__, notice


def test_calls_of_another_shape_take_the_class_path_and_launch_the_same_decision(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    x, y, out = torch.randn(40), torch.randn(40), torch.empty(40)
    assert _paths(lambda: sk.scale_add[grid(40)](x, y, out, n=40, alpha=0.5)) == ["instance", "class"]
    assert _paths(lambda: sk.scale_add[grid(40)](x, y, out, 40, alpha=0.5)) == ["instance", "class"]
    assert _paths(lambda: sk.scale_add.run(x, y, out, 40, 0.5, grid=grid(40), warmup=False)) == ["instance"]
    # A launch option Triton's JIT takes: not the shape it serves.
    debug = lambda: sk.scale_add.run(x, y, out, 40, 0.5, grid=grid(40), warmup=False, debug=False)  # noqa: E731
    assert _paths(debug) == ["instance", "class"]
    errors = []  # no grid: the JIT's own error (TypeError on 3.9, KeyError on 3.3), as from the class path
    for run in (sk.scale_add.run, functools.partial(interception.autotuner_class().run, sk.scale_add)):
        with pytest.raises(Exception) as raised:
            run(x, y, out, 40, 0.5, warmup=False)
        errors.append((type(raised.value), str(raised.value)))
    assert errors[0] == errors[1] and "grid" in errors[0][1]
    assert launched == [64] * 7 and len(get_decisions()) == 1


def test_an_argument_without_the_dtype_the_arming_call_had_takes_the_class_path(launched, monkeypatch):
    blocks = _record_only(monkeypatch)
    table = _table((KEY_40, 64), (f"n=40 | x_ptr:{F32}, out_ptr:{F32}", 128))
    interception.install(_policy(), table=table)
    x, out = torch.randn(40), torch.empty(40)
    sk.scale_add[grid(40)](x, x, out, 40, 1.0)  # armed with y_ptr a tensor
    # y_ptr an int now (the kernel body does not run): the generated key reads .dtype there
    assert _paths(lambda: sk.scale_add[grid(40)](x, 0, out, 40, 1.0)) == ["instance", "class"]
    assert _paths(lambda: sk.scale_add[grid(40)](x, 0, out, 40, 1.0)) == ["instance", "class"]
    assert _paths(lambda: sk.scale_add[grid(40)](x, x, out, 40, 1.0)) == ["instance"]
    assert blocks == [64, 128, 128, 64] and len(get_decisions()) == 2


def test_true_one_and_one_point_zero_keep_their_own_records_on_either_path(launched, monkeypatch):
    blocks = _record_only(monkeypatch)
    key = f"n={{}} | x_ptr:{F32}, y_ptr:{F32}, out_ptr:{F32}"
    interception.install(
        _policy(), table=_table(*[(key.format(n), b) for n, b in ((1, 8), (True, 16), (1.0, 32))])
    )
    x = torch.empty(1)
    paths = []
    for n in (1, True, 1.0, 1, True, 1.0, True):
        paths += _paths(lambda n=n: sk.scale_add[grid(1)](x, x, x, n, 0.5))
    assert blocks == [8, 16, 32, 8, 16, 32, 16] and paths[1:] == ["instance"] * 6
    # maybe_double: heuristics outside the autotuner pass their values by keyword (the class path)
    key = "n=20, flag={} | x_ptr:torch.float32, out_ptr:torch.float32"
    table = _table((key.format(1), 8), (key.format(True), 16), (key.format(1.0), 32), kernel=sk.maybe_double)
    interception.install(_policy(), table=table)
    x = torch.randn(20)
    for flag in (1, True, 1.0, 1, True, 1.0, True):
        out = torch.empty(20)
        sk.maybe_double[grid(20)](x, out, 20, flag)
        torch.testing.assert_close(out, x * 2)
    assert launched == [8, 16, 32, 8, 16, 32, 16] and "run" not in sk.maybe_double.fn.__dict__
    assert len(get_decisions()) == 6


def test_a_key_argument_passed_by_keyword_is_read_from_the_keywords(launched):
    key_41 = KEY_40.replace("n=40", "n=41")
    interception.install(_policy(), table=_table((KEY_40, 64), (key_41, 128)))
    for n, by_keyword in ((40, False), (41, True), (40, True), (41, False), (41, True)):
        x, y, out = torch.randn(n), torch.randn(n), torch.empty(n)
        if by_keyword:
            sk.scale_add[grid(n)](x, y, out, n=n, alpha=0.5)
        else:
            sk.scale_add[grid(n)](x, y, out, n, 0.5)
        torch.testing.assert_close(out, 0.5 * x + y)
    assert launched == [64, 128, 64, 128, 128]
    assert len(get_decisions()) == 2  # one decision per key, however its arguments were passed


def test_tensors_passed_by_keyword_are_keyed_by_name_not_by_position(launched):
    # Same dtypes in the same call order, on different arguments: two different tuning keys.
    half = torch.float16
    key_a = f"n=8 | x_ptr:{F32}, y_ptr:torch.float16, out_ptr:{F32}"
    key_b = f"n=8 | x_ptr:{F32}, y_ptr:{F32}, out_ptr:torch.float16"
    interception.install(_policy(), table=_table((key_a, 16), (key_b, 32)))
    x = torch.ones(8)
    for _ in range(2):
        sk.scale_add[grid(8)](x, y_ptr=torch.ones(8, dtype=half), out_ptr=torch.empty(8), n=8, alpha=1.0)
        sk.scale_add[grid(8)](x, out_ptr=torch.empty(8, dtype=half), y_ptr=torch.ones(8), n=8, alpha=1.0)
    assert launched == [16, 32, 16, 32]
    assert [d.key for d in get_decisions()] == [key_a, key_b]


_DTYPES = (torch.float32, torch.float16)
_NAMES = ("x_ptr", "y_ptr", "out_ptr", "n", "alpha")


def _calls() -> st.SearchStrategy[tuple[tuple[Any, ...], dict[str, Any]]]:
    """scale_add calls: arguments positional, by keyword or left out; tensors, None or ints where
    pointers go; key values of every type ``tuning_key`` tells apart. Mostly five positional
    arguments, the shape the generated ``run`` serves once armed."""
    tensor = st.sampled_from(_DTYPES).map(lambda dtype: torch.empty(1, dtype=dtype))
    pointer = st.one_of(tensor, tensor, st.none(), st.just(0))
    key_value = st.sampled_from([8, 9, True, 1, 1.0, 8.0, "8", None])
    values = st.tuples(pointer, pointer, pointer, key_value, st.sampled_from([0.5, 1]))

    def split(drawn: tuple[tuple[Any, ...], int, int, bool]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, count, dropped, shuffle = drawn
        passed = max(count, 5 - dropped)  # the last `dropped` arguments left out (their defaults)
        kwargs = dict(zip(_NAMES[count:passed], args[count:passed]))
        if shuffle:
            kwargs = dict(reversed(kwargs.items()))
        return tuple(args[:count]), kwargs

    count = st.one_of(st.just(5), st.just(5), st.integers(0, 5))
    return st.tuples(values, count, st.sampled_from([0, 0, 1, 2]), st.booleans()).map(split)


def _by_key_text(autotuner, candidates, args, kwargs, kernel, key):  # noqa: ANN001, ANN202
    """A "tuner" whose pick is a pure function of the key text: distinct keys, mostly distinct configs."""
    return candidates[sum(map(ord, key)) % len(candidates)], {}


@settings(max_examples=300, deadline=None)
@given(calls=st.lists(_calls(), min_size=1, max_size=8))
def test_every_launch_hands_the_kernel_its_own_keys_decision_on_either_path(calls):
    launched: list[Any] = []
    interception.install(TuningPolicy(mode="tune", agreement="off"), measure=_by_key_text)
    decision_log().clear()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sk.scale_add.fn, "run", lambda *a, **kw: launched.append(kw["BLOCK_SIZE"]))
            for args, kwargs in calls * 2:  # every key twice: after its decision, from the hit path
                sk.scale_add[(1,)](*args, **kwargs)
    finally:
        interception.uninstall()
    keys = [tuning_key(sk.scale_add, args, kwargs) for args, kwargs in calls * 2]
    expected = [_by_key_text(None, sk.ADD_CONFIGS, (), {}, "", k)[0].kwargs["BLOCK_SIZE"] for k in keys]
    assert launched == expected
    assert sorted(d.key for d in get_decisions()) == sorted(set(keys))  # one decision per key


# --------------------------------------------------------------------------- what every launch does


def test_every_launch_runs_the_config_pre_hook_with_every_argument_on_either_path(launched):
    seen: list[dict[str, Any]] = []
    originals = [c.pre_hook for c in sk.copy_hooked.configs]
    for config in sk.copy_hooked.configs:
        config.pre_hook = lambda nargs, _seen=seen: _seen.append(dict(nargs))
    try:
        interception.install(_policy())
        x = torch.randn(64)
        paths = []
        for _ in range(3):
            out = torch.empty(64)
            paths += _paths(lambda out=out: sk.copy_hooked[grid(64)](x, out, 64))
            torch.testing.assert_close(out, x)
    finally:
        for config, hook in zip(sk.copy_hooked.configs, originals):
            config.pre_hook = hook
    assert paths == ["class", "instance", "instance"] and len(get_decisions()) == 1
    assert [list(s) for s in seen[1:]] == [list(seen[0])] * 2  # the same names, in the same order
    assert all(s["x_ptr"] is x and s["n"] == 64 and s["BLOCK_SIZE"] == 32 and "num_warps" in s for s in seen)
    assert {"grid", "warmup"} <= set(seen[0])  # the launch keywords too, as on Triton's hit path


def test_fn_run_and_best_config_are_read_and_set_at_every_launch(launched, monkeypatch):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    for n, block in ((40, 64), (12, 8), (40, 64), (12, 8)):
        _scale_add(n)
        assert sk.scale_add.best_config is BY_BLOCK[block]
    replaced: list[int] = []
    real = sk.scale_add.fn.run
    monkeypatch.setattr(
        sk.scale_add.fn, "run", lambda *a, **kw: replaced.append(kw["BLOCK_SIZE"]) or real(*a, **kw)
    )
    _scale_add()
    assert replaced == [64] and launched == [64, 8, 64, 8, 64]


def test_fn_run_gets_only_the_options_that_differ_from_the_backends_defaults(launched, monkeypatch):
    assert interception.launch_option_defaults() == {}  # the interpreter: every option is passed
    defaults = {"num_warps": 4, "num_stages": BY_BLOCK[16].num_stages + 1, "num_ctas": 1}
    monkeypatch.setattr(interception, "launch_option_defaults", lambda: defaults)
    received: list[dict[str, Any]] = []
    monkeypatch.setattr(sk.scale_add.fn, "run", lambda *a, **kw: received.append(kw))
    interception.install(_policy(), table=_table((KEY_40, 16)))  # BLOCK_SIZE=16, num_warps=4
    for _ in range(3):  # the body does not run: no output to check
        x = torch.empty(40)
        sk.scale_add[grid(40)](x, x, x, 40, 0.5)
    options = BY_BLOCK[16].all_kwargs()
    trimmed = {k: v for k, v in options.items() if k not in ("num_warps", "num_ctas")}
    assert [set(kw) - {"grid", "warmup"} for kw in received] == [set(options), set(trimmed), set(trimmed)]
    assert received[-1]["num_stages"] == BY_BLOCK[16].num_stages


@pytest.mark.parametrize(
    "policy",
    [
        TuningPolicy(mode="off", use_shipped_tables=False),
        TuningPolicy(mode="deterministic", agreement="off", scope=("some_other_package",)),
        TuningPolicy(mode="record", agreement="off", use_shipped_tables=False),
    ],
    ids=["mode-off", "out-of-scope", "record"],
)
def test_off_out_of_scope_and_record_mode_are_never_armed(launched, policy):
    interception.install(policy)
    for _ in range(2):
        _scale_add()
    assert "run" not in sk.scale_add.__dict__


# --------------------------------------------------------------------------- it never goes stale


def test_a_new_table_or_policy_is_launched_at_once_and_takes_the_instance_run_away(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    _scale_add()  # the hit path
    first = _serving()
    interception.install(_policy(), table=_table((KEY_40, 128)))  # same policy, another table
    assert "run" not in sk.scale_add.__dict__
    _scale_add()
    assert _serving() is pinning.active and _serving() is not first
    assert _paths(_scale_add) == ["instance"]
    interception.install(_policy())  # no table now: the cheapest config
    _scale_add()
    _scale_add()
    interception.install(_policy(block_sizes=(("BLOCK_SIZE", 32),)))
    _scale_add()
    _scale_add()
    assert launched == [64, 64, 128, 128, 8, 8, 32, 32]
    assert [d.source for d in get_decisions()] == ["table", "table", "cheapest", "override"]


def test_uninstall_takes_states_and_instance_runs_away_and_goes_back_to_stock_triton(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    _scale_add()
    assert "run" in sk.scale_add.__dict__
    interception.uninstall()
    assert "run" not in sk.scale_add.__dict__ and pinning.STATE_ATTR not in sk.scale_add.__dict__
    _scale_add()  # stock Triton: benchmarks every config (counting do_bench), launches the first
    assert launched == [64, 64, 8] and len(sk.BENCH_CALLS) == len(sk.ADD_CONFIGS)


def test_an_instance_run_put_back_after_its_installation_ended_launches_nothing_stale(launched):
    # What pytest's monkeypatch.undo, or any saved-and-restored attribute, would do.
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    stale = sk.scale_add.__dict__["run"]
    interception.install(_policy(), table=_table((KEY_40, 128)))
    sk.scale_add.__dict__["run"] = stale
    assert _paths(_scale_add) == ["instance", "class"]  # it checks the active installation itself
    assert _serving() is pinning.active  # ... and the class path armed the current one over it
    interception.uninstall()
    sk.scale_add.__dict__["run"] = stale
    try:
        _scale_add()  # stock Triton's run, through the fallback: it benchmarks, as stock does
    finally:
        sk.scale_add.__dict__.pop("run", None)
    assert launched == [64, 128, 8]


def test_a_late_attach_that_replaces_the_installation_re_arms_for_the_new_one(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    before = pinning.active
    assert before is not None
    replaced = dataclasses.replace(before)  # what session._LateAttach returns: same decisions
    pinning.before_decision.append(lambda installation: replaced)
    try:
        _scale_add(12)  # a new key: the hook runs inside the decision and replaces the installation
    finally:
        pinning.before_decision.clear()
    assert pinning.active is replaced
    assert _paths(_scale_add) == ["instance", "class"]  # the old run serves nothing any more
    assert _serving() is replaced  # ... and the class path armed one for the replacement
    assert _paths(_scale_add) == ["instance"]
    assert launched == [64, 8, 64, 64] and len(get_decisions()) == 2  # a pinned key keeps its decision


def test_a_replacement_with_other_decisions_is_launched_not_the_old_instance_run(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    before = pinning.active
    assert before is not None
    table = as_config_table(_table((KEY_40, 128)))
    other = dataclasses.replace(before, table=table, generation=before.generation + 1000)
    pinning.before_decision.append(lambda installation: other)
    try:
        _scale_add(12)
    finally:
        pinning.before_decision.clear()
    assert pinning.active is other
    _scale_add()  # decided again under the replacement: its table's config
    assert launched == [64, 8, 128]


def test_an_installation_that_changes_while_a_launch_is_being_armed_is_never_armed_for(launched, monkeypatch):
    generate = interception._generate_run

    def generate_then_reinstall(*args: Any, **kwargs: Any) -> Any:
        run = generate(*args, **kwargs)
        monkeypatch.setattr(interception, "_generate_run", generate)
        interception.install(_policy(), table=_table((KEY_40, 128)))  # another thread, in effect
        return run

    interception.install(_policy(), table=_table((KEY_40, 64)))
    monkeypatch.setattr(interception, "_generate_run", generate_then_reinstall)
    _scale_add()  # decided and launched under the first installation, armed for nothing
    assert "run" not in sk.scale_add.__dict__
    _scale_add()
    assert launched == [64, 128]


def test_copies_for_compiled_code_launch_their_own_config_never_the_originals_records(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    twin = copy.copy(sk.scale_add)  # a shallow copy carries the state and the instance run along
    assert "run" in twin.__dict__ and pinning.STATE_ATTR in twin.__dict__
    twin.configs = [BY_BLOCK[32]]
    inductor._mark_nested_copy(twin)  # how runtime/inductor.py marks a one-config copy it launches
    assert "run" not in twin.__dict__ and pinning.STATE_ATTR not in twin.__dict__
    one = inductor._one_config_copy(sk.scale_add, BY_BLOCK[16])
    assert "run" not in one.__dict__ and one.__dict__[pinning.PINNED_ATTR] is BY_BLOCK[16]
    for kernel in (twin, twin, one, one, sk.scale_add):
        _scale_add(kernel=kernel)
    assert _serving() is pinning.active and "run" not in one.__dict__
    assert launched == [64, 32, 32, 16, 16, 64]


def test_torch_dynamo_reset_keeps_the_pin_and_a_new_installation_replaces_it(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    torch._dynamo.reset()
    assert _paths(_scale_add) == ["instance"]
    interception.install(_policy(), table=_table((KEY_40, 128)))
    torch._dynamo.reset()
    _scale_add()
    _scale_add()
    assert launched == [64, 64, 128, 128]


def test_an_instance_run_of_the_users_own_is_never_replaced_or_removed(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    calls: list[int] = []
    cls_run = interception.autotuner_class().run

    def users_run(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return cls_run(sk.scale_add, *args, **kwargs)

    sk.scale_add.run = users_run
    try:
        for _ in range(2):
            _scale_add()
        assert sk.scale_add.__dict__["run"] is users_run
        interception.install(_policy(), table=_table((KEY_40, 128)))
        _scale_add()
        assert sk.scale_add.__dict__["run"] is users_run
    finally:
        del sk.scale_add.run
    assert calls == [1, 1, 1] and launched == [64, 64, 128]


def test_a_subclass_that_overrides_run_is_never_armed(launched):
    calls: list[int] = []

    class Counting(interception.autotuner_class()):  # type: ignore[misc]
        def run(self, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return super().run(*args, **kwargs)

    twin = copy.copy(sk.scale_add)
    twin.__class__ = Counting
    twin.cache = {}
    interception.install(_policy(), table=_table((KEY_40, 64)))
    for _ in range(3):
        _scale_add(kernel=twin)
    assert "run" not in twin.__dict__ and calls == [1, 1, 1] and launched == [64, 64, 64]


# --------------------------------------------------------------------------- threads


def _launch_only(n: int = 40) -> None:
    x = torch.empty(n)
    sk.scale_add[grid(n)](x, x, x, n, 0.5)


def _in_threads(count: int, work: Callable[[], None]) -> None:
    start = threading.Barrier(count)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            start.wait()
            work()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors


def test_threads_launching_after_each_install_launch_that_installations_config(launched, monkeypatch):
    blocks = _record_only(monkeypatch)
    rounds = (64, 128, 32, 16, 64, 128)
    per_round: list[list[int]] = []
    for block in rounds:
        interception.install(_policy(), table=_table((KEY_40, block)))
        before = len(blocks)
        _in_threads(4, lambda: [_launch_only() for _ in range(50)])
        assert len(blocks) - before == 200
        per_round.append(sorted(set(blocks[before:])))
    assert per_round == [[b] for b in rounds]
    assert len(get_decisions()) == len(rounds)  # one decision per key and installation, across threads


def test_threads_launching_while_another_installs_end_on_the_last_installation(launched, monkeypatch):
    blocks = _record_only(monkeypatch)
    interception.install(_policy(), table=_table((KEY_40, 64)))
    stop = threading.Event()
    errors: list[BaseException] = []

    def launcher() -> None:
        try:
            while not stop.is_set():
                _launch_only()
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=launcher) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(60):  # installs racing with decisions, arming and instance-run launches
            interception.install(_policy(), table=_table((KEY_40, (128, 64)[i % 2])))
        interception.install(_policy(), table=_table((KEY_40, 32)))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert set(blocks) <= {64, 128, 32} and len(blocks) > 0
    assert {d.signature.split(",")[0] for d in get_decisions()} <= {f"BLOCK_SIZE={b}" for b in (64, 128, 32)}
    before = len(blocks)
    _in_threads(3, lambda: [_launch_only() for _ in range(5)])  # all after the last install returned
    assert blocks[before:] == [32] * 15
    assert _serving() is pinning.active
