"""Small autotuned kernels for the interception tests (imported with TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

# Read by triton.jit at decoration: must be set before the kernels below are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from megatron_tuning.runtime.interception import lazy_benchmarker

BENCH_CALLS: list[str] = []  # every benchmark any kernel here attempts, via its do_bench


def counting_do_bench(kernel_call, quantiles=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
    """A do_bench that never runs the kernel, so stock Triton can "autotune" on CPU."""
    BENCH_CALLS.append("bench")
    return [1.0, 1.0, 1.0]


ADD_CONFIGS = [
    triton.Config({"BLOCK_SIZE": 8}, num_warps=2),
    triton.Config({"BLOCK_SIZE": 16}, num_warps=4),
    triton.Config({"BLOCK_SIZE": 32}, num_warps=4),
    triton.Config({"BLOCK_SIZE": 64}, num_warps=8),
    triton.Config({"BLOCK_SIZE": 128}, num_warps=8),
]

PRE_HOOK_CALLS: list[int] = []


def _record_pre_hook(nargs):  # noqa: ANN001, ANN201
    PRE_HOOK_CALLS.append(int(nargs["BLOCK_SIZE"]))


def _prune_small(configs, nargs, **kwargs):  # noqa: ANN001, ANN003, ANN201
    # Keep only blocks of at least 32 elements: the choice must come from this pruned set.
    return [c for c in configs if c.kwargs["BLOCK_SIZE"] >= 32]


with lazy_benchmarker():

    @triton.autotune(configs=ADD_CONFIGS, key=["n"], do_bench=counting_do_bench)
    @triton.jit
    def scale_add(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK_SIZE: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask)
        y = tl.load(y_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, alpha * x + y, mask=mask)

    @triton.autotune(
        configs=[
            triton.Config(dict(c.kwargs), num_warps=c.num_warps, pre_hook=_record_pre_hook)
            for c in ADD_CONFIGS
        ],
        key=["n"],
        prune_configs_by={"early_config_prune": _prune_small},
        reset_to_zero=["out_ptr"],
        do_bench=counting_do_bench,
    )
    @triton.heuristics({"EVEN": lambda args: args["n"] % args["BLOCK_SIZE"] == 0})
    @triton.jit
    def copy_hooked(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr, EVEN: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        if EVEN:
            tl.store(out_ptr + offsets, tl.load(x_ptr + offsets))
        else:
            mask = offsets < n
            tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)

    @triton.heuristics({"DOUBLE": lambda args: args["flag"] == 1})
    @triton.autotune(configs=ADD_CONFIGS[:4], key=["n", "flag"], do_bench=counting_do_bench)
    @triton.jit
    def maybe_double(x_ptr, out_ptr, n, flag, BLOCK_SIZE: tl.constexpr, DOUBLE: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask)
        if DOUBLE:
            x = x * 2
        tl.store(out_ptr + offsets, x, mask=mask)

    @triton.autotune(configs=[triton.Config({"BLOCK_SIZE": 64})], key=["n"])
    @triton.jit
    def single_config_copy(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)

    # Two autotuners over one @triton.jit function, as torchao's HQQ does (18 and 218 configs):
    # they are two kernels. The lists overlap, so an entry of one could launch in the other.
    @triton.jit
    def twin_body(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 3, mask=mask)

    TWIN_SMALL_CONFIGS = ADD_CONFIGS[:3]  # BLOCK_SIZE 8, 16, 32
    TWIN_LARGE_CONFIGS = ADD_CONFIGS[1:]  # BLOCK_SIZE 16, 32, 64, 128
    twin_small = triton.autotune(configs=TWIN_SMALL_CONFIGS, key=["n"], do_bench=counting_do_bench)(twin_body)
    twin_large = triton.autotune(configs=TWIN_LARGE_CONFIGS, key=["n"], do_bench=counting_do_bench)(twin_body)


def grid(n: int):  # noqa: ANN201
    return lambda meta: (triton.cdiv(n, meta["BLOCK_SIZE"]),)


def record_block_sizes(monkeypatch, jit_functions):  # noqa: ANN001, ANN201
    """Wrap each ``fn.run`` so the ``BLOCK_SIZE`` of every launch reaching it is appended to the
    returned list (the launch still runs); ``monkeypatch`` undoes the wrapping."""
    blocks: list[int] = []
    for jit in jit_functions:
        real = jit.run

        def recording(*args, _real=real, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            blocks.append(kwargs["BLOCK_SIZE"])
            return _real(*args, **kwargs)

        monkeypatch.setattr(jit, "run", recording)
    return blocks
