"""Launch records (``runtime/launches.py``) on the pinned hit path, and every way one could go stale.

Each test here watches the config a launch really hands the kernel (``fn.run`` is wrapped to
record its ``BLOCK_SIZE``), not only ``best_config``, so a fast path that launched an old record
would show. Real kernels in the interpreter; no mocks of Triton's autotuner.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tuning.core.decisions import decision_log, get_decisions
from megatron_tuning.core.identity import config_data, kernel_id, tuning_key
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.runtime import interception, pinning
from megatron_tuning.runtime.launches import (
    Launch,
    compile_run,
    launch_key,
    make_launch,
    raw_key,
    specialize_find,
)
from megatron_tuning.runtime.pinning import STATE_ATTR
from megatron_tuning.runtime.triton_compat import launch_option_defaults

from .. import support_kernels as sk
from ..support_kernels import grid

F32 = "torch.float32"
KEY_40 = f"n=40 | x_ptr:{F32}, y_ptr:{F32}, out_ptr:{F32}"
BY_BLOCK = {c.kwargs["BLOCK_SIZE"]: c for c in sk.ADD_CONFIGS}


def _policy(**changes: Any) -> TuningPolicy:
    changes.setdefault("on_miss", "min_cost")  # a key without an entry gets its own config (8)
    return TuningPolicy(mode="deterministic", agreement="off", use_shipped_tables=False, **changes)


def _table(*entries: tuple[str, int], kernel: Any = sk.scale_add) -> dict[tuple[str, str], Any]:
    return {(kernel_id(kernel), key): config_data(BY_BLOCK[block]) for key, block in entries}


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The BLOCK_SIZE of every launch that reaches the kernels' ``fn.run`` (also stock Triton's)."""
    blocks = sk.record_block_sizes(monkeypatch, (sk.scale_add.fn, sk.maybe_double.fn.fn))
    sk.BENCH_CALLS.clear()
    sk.PRE_HOOK_CALLS.clear()
    for kernel in (sk.scale_add, sk.maybe_double.fn, sk.copy_hooked):
        kernel.cache.clear()
    decision_log().clear()
    yield blocks
    interception.uninstall()


def _scale_add(n: int = 40, **kwargs: Any) -> None:
    x = torch.randn(n)
    y = torch.randn(n)
    out = torch.full((n,), float("nan"))
    sk.scale_add[grid(n)](x, y, out, n, 0.5, **kwargs)
    torch.testing.assert_close(out, 0.5 * x + y)


# --------------------------------------------------------------------------- stale records


def test_a_new_table_is_launched_at_once_not_the_old_record(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    _scale_add()  # the hit path
    interception.install(_policy(), table=_table((KEY_40, 128)))  # same policy, another table
    _scale_add()
    _scale_add()
    assert launched == [64, 64, 128, 128]
    assert [d.signature.split(",")[0] for d in get_decisions()] == ["BLOCK_SIZE=64", "BLOCK_SIZE=128"]


def test_a_replaced_policy_is_launched_at_once(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    _scale_add()
    interception.install(_policy())  # no table now: the cheapest config
    _scale_add()
    _scale_add()
    interception.install(_policy(block_sizes=(("BLOCK_SIZE", 32),)))
    _scale_add()
    _scale_add()
    assert launched == [64, 64, 8, 8, 32, 32]
    assert [d.source for d in get_decisions()] == ["table", "cheapest", "override"]


def test_uninstall_goes_back_to_stock_triton_even_for_a_key_on_the_hit_path(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    _scale_add()
    state = sk.scale_add.__dict__[STATE_ATTR]
    interception.uninstall()
    assert STATE_ATTR not in sk.scale_add.__dict__ and state.live is not pinning.active
    _scale_add()
    assert launched == [64, 64, 8] and len(sk.BENCH_CALLS) == len(sk.ADD_CONFIGS)


def test_bool_int_and_float_key_values_keep_their_own_records(launched):
    key = "n=20, flag={} | x_ptr:torch.float32, out_ptr:torch.float32"
    table = _table((key.format(1), 8), (key.format(True), 16), (key.format(1.0), 32), kernel=sk.maybe_double)
    interception.install(_policy(), table=table)
    x = torch.randn(20)
    for flag in (1, True, 1.0, 1, True, 1.0, True):
        out = torch.empty(20)
        sk.maybe_double[grid(20)](x, out, 20, flag)
        torch.testing.assert_close(out, x * 2)
    assert launched == [8, 16, 32, 8, 16, 32, 16]
    assert len(get_decisions()) == 3


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


# --------------------------------------------------------------------------- what every launch still does


def test_every_hit_path_launch_runs_the_config_pre_hook_with_every_argument(launched):
    seen: list[dict[str, Any]] = []
    hooked = [c for c in sk.copy_hooked.configs]
    originals = [c.pre_hook for c in hooked]
    for config in hooked:
        config.pre_hook = lambda nargs, _seen=seen: _seen.append(dict(nargs))
    try:
        interception.install(_policy())
        x = torch.randn(64)
        for _ in range(3):
            out = torch.empty(64)
            sk.copy_hooked[grid(64)](x, out, 64)
            torch.testing.assert_close(out, x)
    finally:
        for config, hook in zip(hooked, originals):
            config.pre_hook = hook
    assert len(seen) == 3 and len(get_decisions()) == 1
    assert all(s["x_ptr"] is x and s["n"] == 64 and s["BLOCK_SIZE"] == 32 and "num_warps" in s for s in seen)
    assert {"grid", "warmup"} <= set(seen[0])  # the launch keywords too, as on Triton's hit path


def test_best_config_follows_every_launch(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    for n, block in ((40, 64), (12, 8), (40, 64), (12, 8)):
        _scale_add(n)
        assert sk.scale_add.best_config is BY_BLOCK[block]
    assert launched == [64, 8, 64, 8]


def test_the_hit_path_reads_no_records_past_its_limit(launched, monkeypatch):
    monkeypatch.setattr(pinning, "MAX_LAUNCHES", 1)
    interception.install(_policy(), table=_table((KEY_40, 64)))
    for n in (40, 12, 40, 12, 12):
        _scale_add(n)
    assert launched == [64, 8, 64, 8, 8]
    assert len(sk.scale_add.__dict__[STATE_ATTR].launches) == 1 and len(get_decisions()) == 2


# --------------------------------------------------------------------------- the keys themselves

_DTYPES = (torch.float32, torch.float16)


def _calls() -> st.SearchStrategy[tuple[tuple[Any, ...], dict[str, Any]]]:
    """scale_add-like calls: arguments positional, by keyword or left out; tensors, None or ints
    where pointers go; key values of every type ``tuning_key`` tells apart. Mostly all-positional
    calls, the ones the compiled launch key serves."""
    names = ("x_ptr", "y_ptr", "out_ptr", "n", "alpha")
    tensor = st.sampled_from(_DTYPES).map(lambda dtype: torch.empty(1, dtype=dtype))
    pointer = st.one_of(tensor, tensor, st.none(), st.just(0))
    key_value = st.sampled_from([8, 9, True, 1, 1.0, 8.0, "8", None])
    values = st.tuples(pointer, pointer, pointer, key_value, st.sampled_from([0.5, 1]))
    positional = st.one_of(st.just(5), st.just(5), st.integers(0, 5))

    def split(drawn: tuple[tuple[Any, ...], int, int, bool]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, count, dropped, shuffle = drawn
        passed = max(count, 5 - dropped)  # the last `dropped` arguments left out (their defaults)
        kwargs = dict(zip(names[count:passed], args[count:passed]))
        if shuffle:
            kwargs = dict(reversed(kwargs.items()))
        kwargs.update(grid=(1,), warmup=False)
        return tuple(args[:count]), kwargs

    return st.tuples(values, positional, st.sampled_from([0, 0, 1, 2]), st.booleans()).map(split)


def _scale_add_state() -> pinning.AutotunerState:
    """A fresh state keyed like ``scale_add`` (``n``, its 4th argument), with no records yet."""
    return pinning.AutotunerState(
        generation=0,
        in_scope=True,
        kernel="k",
        key_index=(("n", 3),),
        arg_names=tuple(sk.scale_add.arg_names),
    )


@settings(max_examples=300, deadline=None)
@given(first=_calls(), calls=st.lists(_calls(), min_size=2, max_size=6))
def test_launch_keys_are_exact_and_the_compiled_lookup_agrees_with_the_generic_one(first, calls):
    state = _scale_add_state()
    specialize_find(state, first[0])
    for args, kwargs in [first, *calls[:-1]]:  # a record each (the last call may find none)
        state.launches.setdefault(launch_key(state, args, kwargs), Launch(object(), {}, {}))
    for args, kwargs in [first, *calls]:
        assert state.find(args, kwargs) is state.launches.get(launch_key(state, args, kwargs))
    for (args_a, kw_a), (args_b, kw_b) in itertools.combinations([first, *calls], 2):
        same_raw = raw_key(state, args_a, kw_a) == raw_key(state, args_b, kw_b)
        same_text = tuning_key(sk.scale_add, args_a, kw_a) == tuning_key(sk.scale_add, args_b, kw_b)
        if launch_key(state, args_a, kw_a) == launch_key(state, args_b, kw_b):
            assert same_raw  # a launch record is only ever shared by calls of one decision
        # One decision per tuning key: for these value types the two keys tell the same calls apart.
        assert same_raw == same_text


@settings(max_examples=200, deadline=None)
@given(first=_calls(), calls=st.lists(_calls(), min_size=2, max_size=6))
def test_the_compiled_instance_run_launches_exactly_the_record_launch_key_finds(first, calls):
    state = _scale_add_state()
    for i, (args, kwargs) in enumerate([first, *calls[:-1]]):
        options = {"BLOCK_SIZE": i, "num_warps": 4}
        record = Launch(types.SimpleNamespace(pre_hook=None), options, {"BLOCK_SIZE": i})
        state.launches.setdefault(launch_key(state, args, kwargs), record)
    launched: list[tuple[Any, ...]] = []
    autotuner = types.SimpleNamespace(best_config=None)
    autotuner.fn = types.SimpleNamespace(run=lambda *a, **kw: launched.append(("fast", a, kw)))
    serves = object()
    flags = types.SimpleNamespace(active=serves)
    run = compile_run(
        state,
        autotuner,
        first[0],
        serves=serves,
        flags=flags,
        slow=lambda k, *a, **kw: launched.append(("slow", a, kw)),
    )
    for args, kwargs in [first, *calls]:
        launched.clear()
        run(*args, **kwargs)
        ((path, got_args, got_kwargs),) = launched
        record = state.launches.get(launch_key(state, args, kwargs))
        assert got_args == args
        if path == "fast":  # only ever the record the class path would find, with its options
            assert record is not None and autotuner.best_config is record.config
            assert got_kwargs == {**kwargs, **record.run_options}
        else:  # everything else reaches the class path unchanged, grid and warmup first as
            # kernel[grid](...) passes them (the order the generated function cannot see)
            assert got_kwargs == kwargs
            assert list(got_kwargs) == ["grid", "warmup"] + [k for k in kwargs if k not in ("grid", "warmup")]
    args, kwargs = first
    if len(args) == len(first[0]) and kwargs.keys() == {"grid", "warmup"}:
        launched.clear()
        run(*args, **kwargs)
        assert launched[0][0] == "fast"  # the call it was compiled for is served
        flags.active = object()  # another installation is active: nothing is served any more
        launched.clear()
        run(*args, **kwargs)
        assert launched[0][0] == "slow"


def test_a_launch_record_leaves_out_only_compile_options_equal_to_the_backends_defaults():
    config = triton.Config({"BLOCK_SIZE": 64}, num_warps=4, num_stages=2)
    launch = make_launch(config, {"num_warps": 4, "num_stages": 3, "num_ctas": 1})
    assert launch.options == config.all_kwargs()  # what Config.pre_hook sees: everything
    # num_warps and num_ctas are what fn.run compiles with when they are left out; num_stages is not
    assert launch.run_options == {
        k: v for k, v in config.all_kwargs().items() if k not in ("num_warps", "num_ctas")
    }
    assert make_launch(config, {}).run_options == config.all_kwargs()  # defaults unknown: pass all


def test_launch_option_defaults_are_none_without_a_gpu_driver():
    assert launch_option_defaults() == {}  # the interpreter: every option is passed, as Triton does


def test_the_compiled_run_gives_pre_hook_every_option_and_fn_run_the_trimmed_ones():
    hooked: list[dict[str, Any]] = []
    config = types.SimpleNamespace(pre_hook=hooked.append)
    state = _scale_add_state()
    args = (torch.zeros(4), torch.zeros(4), torch.zeros(4), 4, 1.0)
    state.launches[launch_key(state, args, {"grid": 1, "warmup": False})] = Launch(
        config, {"BLOCK_SIZE": 8, "num_warps": 4}, {"BLOCK_SIZE": 8}
    )
    launched: list[dict[str, Any]] = []
    autotuner = types.SimpleNamespace(best_config=None)
    autotuner.fn = types.SimpleNamespace(run=lambda *a, **kw: launched.append(kw))
    serves = object()
    flags = types.SimpleNamespace(active=serves)
    run = compile_run(state, autotuner, args, serves=serves, flags=flags, slow=None)
    run(*args, grid=1, warmup=False)
    assert launched == [{"grid": 1, "warmup": False, "BLOCK_SIZE": 8}]
    assert hooked[0]["num_warps"] == 4 and hooked[0]["BLOCK_SIZE"] == 8 and hooked[0]["n"] == 4
