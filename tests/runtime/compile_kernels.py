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


def first_run(kernel, arg_names, configs, slow_unless=None, mutated=None):  # noqa: ANN001, ANN201
    """Inductor's ``CachingAutotuner`` of a user kernel at its graph's first run, built without a GPU:
    one launcher per config of ``configs`` (rebuilt from plain values, as generated code does) that
    launches the kernel through ``JITFunction.run``; every launcher but BLOCK ``slow_unless`` sleeps
    1 ms. The kernel writes ``mutated`` (default: its first argument)."""
    import inspect
    import time
    import types

    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    jit = kernel.fn
    while hasattr(jit, "fn") and not inspect.isfunction(jit.fn):  # heuristics wrappers
        jit = jit.fn
    # The generated copy's identity: its source (Inductor's JITFunction.src), name and arguments.
    fn = types.SimpleNamespace(
        src=inspect.getsource(jit.fn), fn=jit.fn, __name__=jit.fn.__name__, arg_names=list(arg_names)
    )

    def launcher_of(config):  # noqa: ANN001, ANN202
        def launcher(*args, stream):  # noqa: ANN002, ANN202
            if slow_unless is not None and launcher.config.kwargs["BLOCK"] != slow_unless:
                time.sleep(0.001)
            jit.run(*args, grid=(1,), warmup=False, **launcher.config.all_kwargs())

        launcher.config = triton.Config(
            dict(config.kwargs), num_warps=config.num_warps, num_stages=config.num_stages
        )
        launcher.def_args, launcher.cache_hash = list(arg_names), None
        launcher.n_regs = launcher.n_spills = launcher.shared = 0
        return launcher

    class FirstRun(CachingAutotuner):
        def __init__(self) -> None:  # none of Inductor's compiling: only what its first run reads
            self.fn, self.custom_kernel, self.launchers = fn, True, [launcher_of(c) for c in configs]
            self.mutated_arg_names = list(mutated or arg_names[:1])
            self.reset_to_zero_arg_names = []
            self.inductor_meta, self.save_cache_hook, self.compile_results = {}, None, []
            self.precompile_time_taken_ns, self.benchmark_failure_reasons = 0, {}

        def get_device_interface(self):  # noqa: ANN202
            return types.SimpleNamespace(current_device=lambda: 0, get_raw_stream=lambda index: 0)

    return FirstRun()
