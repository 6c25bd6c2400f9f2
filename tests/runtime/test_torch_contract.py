"""Contract tests: every private torch attribute the torch.compile adapter relies on.

``runtime/inductor.py`` wraps ``TritonHOPifier.call_triton_kernel`` (trace time) and
``CachingAutotuner.benchmark_all_configs`` (run time). When a torch upgrade moves one of these,
this file fails with one clear message; at run time the same change makes
``init_deterministic_tuning`` warn that compiled code is not pinned (``inductor._hopifier_class``).
"""

from __future__ import annotations

import inspect

import torch
from torch._dynamo.variables.base import VariableTracker
from torch._dynamo.variables.functions import DynamoTritonHOPifier, TritonKernelVariable
from torch._dynamo.variables.lazy import LazyVariableTracker
from torch._higher_order_ops import triton_kernel_wrap as tkw
from torch._inductor import ir
from torch._inductor.runtime import triton_heuristics

from megatron_tuning.runtime import inductor


def _parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_the_hook_point_is_one_method_shared_by_dynamo_and_wrap_triton():
    method = tkw.TritonHOPifier.__dict__["call_triton_kernel"]
    assert _parameters(method) == inductor.HOOK_PARAMETERS == ["self", "variable", "args", "kwargs", "tx"]
    # Both tracers inherit it; an override would bypass the hook.
    assert "call_triton_kernel" not in DynamoTritonHOPifier.__dict__
    assert "call_triton_kernel" not in tkw.TracingTritonHOPifier.__dict__
    assert issubclass(DynamoTritonHOPifier, tkw.TritonHOPifier)
    assert issubclass(tkw.TracingTritonHOPifier, tkw.TritonHOPifier)
    # The adapter's own check agrees: on this torch the hook can be installed.
    hopifier, reason = inductor._hopifier_class()
    assert hopifier is tkw.TritonHOPifier, reason


def test_the_hopifier_api_the_hook_calls():
    for hopifier in (DynamoTritonHOPifier, tkw.TracingTritonHOPifier):
        assert _parameters(hopifier.raise_unsupported) == ["self", "msg"]
    # Key arguments are made constants (with a guard) by the variable's own specialize_symbolic.
    for variable in (TritonKernelVariable, tkw.TraceableTritonKernelWrapper):
        assert _parameters(variable.specialize_symbolic) == ["self", "arg"]
    assert _parameters(tkw.TraceableTritonKernelWrapper.__init__)[:4] == [
        "self",
        "kernel",
        "kernel_idx",
        "grid",
    ]
    assert _parameters(TritonKernelVariable.__init__)[:4] == ["self", "kernel", "kernel_idx", "grid"]
    recreate = getattr(tkw.TritonHOPifier, "recreate_variable", None)  # torch >= 2.12; else the constructor
    if recreate is not None:
        params = inspect.signature(recreate).parameters
        assert [p for p in params if params[p].kind is inspect.Parameter.KEYWORD_ONLY] == [
            "kernel",
            "kernel_idx",
            "grid",
        ]


def test_dynamo_variables_expose_constants_and_example_values():
    for name in ("is_python_constant", "as_python_constant", "as_proxy", "realize"):
        assert callable(getattr(VariableTracker, name, None)), name
    assert callable(LazyVariableTracker.realize)
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        pass


def test_the_kernel_node_points_at_a_side_table_kernel_whose_configs_inductor_compiles():
    table = tkw.kernel_side_table
    assert isinstance(table.id_to_kernel, dict)
    assert _parameters(table.add_kernel) == ["kernel"] and _parameters(table.get_kernel) == ["idx"]
    assert isinstance(tkw.triton_kernel_wrapper_mutation, torch._ops.HigherOrderOperator)
    assert isinstance(tkw.triton_kernel_wrapper_functional, torch._ops.HigherOrderOperator)
    # Lowering reads configs (and restore_value/reset_to_zero) from the side-table kernel.
    source = inspect.getsource(ir.UserDefinedTritonKernel.get_kernel_and_metadata)
    for attribute in (
        "kernel_side_table.get_kernel",
        "kernel.configs",
        "kernel.restore_value",
        "kernel.reset_to_zero",
    ):
        assert attribute in source, attribute


def test_inductor_benchmarks_user_kernels_in_benchmark_all_configs():
    caching = triton_heuristics.CachingAutotuner
    assert callable(caching.__dict__.get("benchmark_all_configs"))
    assert _parameters(caching.benchmark_all_configs)[:1] == ["self"]
    assert "custom_kernel" in inspect.signature(caching.__init__).parameters
    assert _parameters(triton_heuristics.user_autotune) == [
        "configs",
        "triton_meta",
        "filename",
        "inductor_meta",
        "custom_kernel",
    ]
    # It is the one place a multi-config user kernel is timed (autotune_to_one_config calls it).
    assert "self.benchmark_all_configs(" in inspect.getsource(caching.autotune_to_one_config)


def test_tests_can_force_dynamo_to_treat_kernels_as_triton():
    # compile_scenarios forces this on CPU; builder.py reads it at call time.
    import torch.utils._triton

    assert callable(torch.utils._triton.has_triton)
    source = inspect.getsource(torch._dynamo.variables.builder)
    assert "has_triton()" in source
