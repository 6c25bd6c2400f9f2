"""Contract tests: every private Triton attribute the interception relies on.

When a Triton upgrade moves one of these, this file fails with one clear message instead of
many confusing failures elsewhere.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
import triton
from triton.runtime.autotuner import Autotuner, Heuristics

from megatron_tuning.core.errors import CONFIG_HOOKS
from megatron_tuning.core.identity import CONFIG_FIELDS
from megatron_tuning.core.key import tuning_key
from megatron_tuning.runtime import interception

from .. import support_kernels as sk
from ..support_kernels import grid


def test_supported_version():
    interception.check_triton_contract()
    assert tuple(int(part) for part in triton.__version__.split(".")[:2]) >= interception.MIN_TRITON


def test_the_errors_the_tuner_scores_as_failures_are_those_triton_bench_catches():
    from megatron_tuning.tuning.tuner import benchmark_failures

    source = inspect.getsource(Autotuner._bench)
    assert all(error.__name__ in source for error in benchmark_failures())


def test_autotuner_class_attributes():
    for name in ("run", "_bench", "prune_configs", "warmup"):
        assert callable(Autotuner.__dict__.get(name)), name
    assert list(inspect.signature(Autotuner.__dict__["run"]).parameters) == ["self", "args", "kwargs"]
    bench = inspect.signature(Autotuner.__dict__["_bench"]).parameters
    assert list(bench)[:2] == ["self", "args"] and bench["config"].kind is inspect.Parameter.KEYWORD_ONLY
    init = inspect.signature(Autotuner.__init__).parameters
    for name in (
        "fn",
        "arg_names",
        "configs",
        "key",
        "reset_to_zero",
        "restore_value",
        "prune_configs_by",
        "do_bench",
    ):
        assert name in init, name


def test_benchmarker_is_lazy_or_patchable():
    lazy = isinstance(inspect.getattr_static(Autotuner, "do_bench", None), functools.cached_property)
    assert lazy or "do_bench" in inspect.signature(Autotuner.__init__).parameters


def test_autotuner_instance_attributes():
    tuner = sk.scale_add
    assert tuner.arg_names == ["x_ptr", "y_ptr", "out_ptr", "n", "alpha", "BLOCK_SIZE"]
    assert tuner.keys == ["n"]
    assert isinstance(tuner.cache, dict)
    assert tuner.configs is sk.ADD_CONFIGS or list(tuner.configs) == sk.ADD_CONFIGS
    assert inspect.isfunction(tuner.base_fn)
    assert isinstance(sk.copy_hooked.fn, Heuristics) and sk.copy_hooked.fn.fn is not None
    assert isinstance(sk.maybe_double, Heuristics) and isinstance(sk.maybe_double.fn, Autotuner)


def test_prune_configs_reads_nargs_and_applies_early_prune():
    tuner = sk.copy_hooked
    x = torch.zeros(8)
    tuner.nargs = {"x_ptr": x, "out_ptr": x, "n": 8}
    try:
        pruned = tuner.prune_configs({})
    finally:
        tuner.nargs = None
    assert [c.kwargs["BLOCK_SIZE"] for c in pruned] == [32, 64, 128]


def test_config_fields_and_all_kwargs():
    config = triton.Config({"B": 4}, num_warps=2, num_stages=1, pre_hook=None)
    for name in ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg", "pre_hook"):
        assert hasattr(config, name), name
    merged = config.all_kwargs()
    assert merged["B"] == 4 and merged["num_warps"] == 2 and merged["num_stages"] == 1
    # Each field a signature holds, or a hook that config_list_digest compares: a new field (a
    # per-config post_hook, say) must be placed in one of them before configs differing in it pass.
    assert set(vars(config)) <= {*CONFIG_FIELDS, *CONFIG_HOOKS}, set(vars(config)) - {*CONFIG_FIELDS}


_MULTIPLE = "got multiple values for keyword argument '{}'"


@pytest.mark.parametrize(
    ("name", "value", "on_miss", "miss_text"),
    [
        ("num_warps", 8, TypeError, _MULTIPLE),
        ("num_stages", 1, TypeError, _MULTIPLE),
        ("BLOCK_SIZE", 16, ValueError, "Conflicting meta-parameters: {}"),  # _bench refuses it first
    ],
)
def test_stock_run_refuses_a_call_keyword_its_config_also_sets(name, value, on_miss, miss_text):
    # What LaunchOptionError stands in for: Triton's launch passes the call's keywords and the
    # config's together.
    interception.uninstall()
    sk.scale_add.cache.clear()
    x = torch.zeros(16)
    try:
        with pytest.raises(on_miss, match=miss_text.format(name)):
            sk.scale_add[grid(16)](x, x, x, 16, 1.0, **{name: value})
        sk.scale_add[grid(16)](x, x, x, 16, 1.0)
        with pytest.raises(TypeError, match=_MULTIPLE.format(name)):  # a hit
            sk.scale_add[grid(16)](x, x, x, 16, 1.0, **{name: value})
    finally:
        sk.scale_add.cache.clear()
        sk.BENCH_CALLS.clear()


def test_stock_run_sets_best_config_and_timings():
    # Record mode reads best_config, configs_timings and bench_time after Triton's own run.
    interception.uninstall()
    sk.scale_add.cache.clear()
    x = torch.zeros(16)
    try:
        sk.scale_add[grid(16)](x, x, x, 16, 1.0)
        assert sk.scale_add.best_config in sk.ADD_CONFIGS
        assert set(sk.scale_add.configs_timings) == set(sk.ADD_CONFIGS)
        assert isinstance(sk.scale_add.bench_time, float)
    finally:  # other tests count benchmark calls on these kernels
        sk.scale_add.cache.clear()
        sk.BENCH_CALLS.clear()


def test_triton_files_a_launch_under_the_key_the_interception_writes():
    # After a pinned launch the interception stores the config in kernel.cache under the call
    # key's triton_key; Triton's own run must file the same call under the same key.
    interception.uninstall()
    sk.scale_add.cache.clear()
    x, y16 = torch.zeros(16), torch.zeros(16, dtype=torch.float16)
    try:
        sk.scale_add[grid(16)](x, out_ptr=x, y_ptr=y16, n=16, alpha=1.0)
        kwargs = {"out_ptr": x, "y_ptr": y16, "n": 16, "alpha": 1.0}
        expected = tuning_key(sk.scale_add, (x,), kwargs).triton_key(["x_ptr", *kwargs])
        assert (
            list(sk.scale_add.cache)
            == [expected]
            == [(16, "torch.float32", "torch.float32", "torch.float16")]
        )
        assert sk.scale_add.cache[expected] is sk.scale_add.best_config
    finally:
        sk.scale_add.cache.clear()
        sk.BENCH_CALLS.clear()
