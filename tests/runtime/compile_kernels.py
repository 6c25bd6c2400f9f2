"""Autotuned kernels for the torch.compile tests, decorated WITHOUT the Triton interpreter.

Dynamo only turns a call into its Triton kernel node for a real ``JITFunction`` (an interpreted
kernel makes it crash), so ``compile_scenarios`` imports this module in a child process whose
environment has no ``TRITON_INTERPRET``. Nothing here can run on a CPU: ``stub_launches`` replaces
each kernel's final launch (``JITFunction.run``) with a recorder of the config it was given.
"""

from __future__ import annotations

import triton
import triton.language as tl

BENCH_CALLS: list[str] = []
LAUNCHES: list[dict] = []


def counting_do_bench(kernel_call, quantiles=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
    """Any benchmark of these kernels lands here (and never runs the kernel)."""
    BENCH_CALLS.append("bench")
    return [1.0, 1.0, 1.0]


CONFIGS = [
    triton.Config({"BLOCK": 256}, num_warps=4),
    triton.Config({"BLOCK": 128}, num_warps=4),
    triton.Config({"BLOCK": 64}, num_warps=2),
    triton.Config({"BLOCK": 32}, num_warps=1),
]


@triton.autotune(configs=CONFIGS, key=["n"], do_bench=counting_do_bench)
@triton.jit
def write_block(y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, BLOCK + 0 * offs, mask=offs < n)


def _no_larger_than_n(configs, nargs, **kwargs):  # noqa: ANN001, ANN003, ANN201
    return [c for c in configs if c.kwargs["BLOCK"] <= nargs["n"]]


@triton.autotune(
    configs=CONFIGS,
    key=["n"],
    prune_configs_by={"early_config_prune": _no_larger_than_n},
    restore_value=["y_ptr"],
    do_bench=counting_do_bench,
)
@triton.heuristics({"EVEN": lambda args: args["n"] % args["BLOCK"] == 0})
@triton.jit
def add_one_even(x_ptr, y_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1)
    else:
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def _jit_function(kernel):  # noqa: ANN001, ANN202
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def stub_launches() -> None:
    """Make every launch of these kernels record its constexprs instead of running."""
    for kernel in (write_block, add_one_even):
        jit = _jit_function(kernel)
        name = jit.fn.__name__

        def run(*args, grid, warmup=False, _name=name, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            LAUNCHES.append({"kernel": _name, "BLOCK": kwargs["BLOCK"], "EVEN": kwargs.get("EVEN")})

        jit.run = run
