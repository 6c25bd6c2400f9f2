"""The test kernels, one copy of each, shared by the tests, the torchrun workers
(tests_distributed/workers) and the benchmarks.

Small autotuned kernels for the interception tests (whose ``do_bench`` never runs them, so stock
Triton can "autotune" on a CPU), the workers' kernels (``launch``/``run`` by name), and the
benchmarks' ``write_block`` (it writes its own ``BLOCK``: the launched config reads back) and bare
add-one. Import it once ``TRITON_INTERPRET`` is settled: Triton reads it at decoration (the tests'
conftest sets it, a worker's launcher passes it on, a GPU benchmark leaves it unset).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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

    # A constexpr that is a jit function (an activation), as kernels take one: the two configs differ
    # in nothing else, so only the function's name tells them apart.
    @triton.jit
    def negate(x):
        return -x

    @triton.jit
    def double(x):
        return x * 2

    ACT_CONFIGS = [
        triton.Config({"BLOCK_SIZE": 16, "ACT": negate}, num_warps=1),
        triton.Config({"BLOCK_SIZE": 16, "ACT": double}, num_warps=1),
    ]

    @triton.autotune(configs=ACT_CONFIGS, key=["n"], do_bench=counting_do_bench)
    @triton.jit
    def activate(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr, ACT: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n
        tl.store(out_ptr + offsets, ACT(tl.load(x_ptr + offsets, mask=mask)), mask=mask)

    # Its one config only: nothing is measured or stored for it, so every mode but record launches it.
    @triton.autotune(configs=ACT_CONFIGS[:1], key=["n"], do_bench=counting_do_bench)
    @triton.jit
    def activate_one(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr, ACT: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n
        tl.store(out_ptr + offsets, ACT(tl.load(x_ptr + offsets, mask=mask)), mask=mask)

    # The torchrun workers' kernels: y = x + 1 ("add"), y = 2x ("scale"), y = x + 3 (factory-made).
    BLOCK_CONFIGS = [
        triton.Config({"BLOCK": 16}, num_warps=1),
        triton.Config({"BLOCK": 32}, num_warps=1),
        triton.Config({"BLOCK": 64}, num_warps=2),
        triton.Config({"BLOCK": 128}, num_warps=4),
    ]

    @triton.autotune(configs=BLOCK_CONFIGS, key=["n"])
    @triton.jit
    def add_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)

    @triton.autotune(configs=BLOCK_CONFIGS, key=["n"])
    @triton.jit
    def scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0, mask=mask)

    def _make_shift(configs: list[triton.Config]) -> object:
        """A kernel factory: one code location, one autotuner (with its own config list) per call."""

        @triton.autotune(configs=configs, key=["n"])
        @triton.jit
        def made_shift(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 3.0, mask=mask)

        return made_shift

    @triton.jit
    def _lone_shift_body(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 3.0, mask=mask)

    # Factory-made kernels, and two autotuners over one jit function that its module holds none of.
    MADE = {
        "made_small": _make_shift(BLOCK_CONFIGS[:2]),
        "made_large": _make_shift(BLOCK_CONFIGS[1:]),
        "built_small": triton.autotune(configs=BLOCK_CONFIGS[:2], key=["n"])(_lone_shift_body),
        "built_large": triton.autotune(configs=BLOCK_CONFIGS[1:], key=["n"])(_lone_shift_body),
    }

    # The benchmarks' kernel whose output is its own BLOCK (bench_compile, bench_compile_auto): four
    # configs, each within noise of the others, so stock autotuning's winner varies by process.
    WRITE_BLOCK_CONFIGS = [
        triton.Config({"BLOCK": 256}, num_warps=4),
        triton.Config({"BLOCK": 128}, num_warps=4),
        triton.Config({"BLOCK": 64}, num_warps=2),
        triton.Config({"BLOCK": 32}, num_warps=1),
    ]

    @triton.autotune(configs=WRITE_BLOCK_CONFIGS, key=["n"])
    @triton.jit
    def write_block_kernel(y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, BLOCK + 0 * offs, mask=offs < n)


# The launch-overhead baseline: megatron_tuning.kernels.add_one_kernel's body as a bare @triton.jit,
# a separate def so it keeps an identity of its own.
BARE_BLOCK = 256


@triton.jit
def add_one_bare_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


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


_WORKER_KERNELS = {
    "add": add_kernel,
    "scale": scale_kernel,
    "twin_small": twin_small,
    "twin_large": twin_large,
}


def launch(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """A worker kernel by name: ``y = x + 1`` ("add"), ``2 x`` ("scale"), ``3 x`` ("twin_*"),
    ``x + 3`` (``MADE``); unchecked."""
    n = x.numel()
    kernel = {**_WORKER_KERNELS, **MADE}[name]
    kernel[lambda meta: (triton.cdiv(n, meta.get("BLOCK", meta.get("BLOCK_SIZE"))),)](x, y, n)


def run(name: str, n: int, device: str = "cpu") -> torch.Tensor:
    """Launch kernel ``name`` (see ``launch``) on a vector of ``n`` floats and check the result."""
    x = torch.arange(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    launch(name, x, y)
    expected = {"add": x + 1.0, "scale": x * 2.0, "twin_small": x * 3, "twin_large": x * 3}.get(name, x + 3.0)
    if not torch.equal(y, expected):
        raise AssertionError(f"{name} kernel computed a wrong result for n={n}")
    return y


def write_block(x: torch.Tensor) -> torch.Tensor:
    """``y`` of ``x``'s shape, every element set to the ``BLOCK`` of the launched config."""
    y = torch.empty_like(x)
    n = x.numel()
    write_block_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](y, n)
    return y


def add_one_bare(x: torch.Tensor) -> torch.Tensor:
    """Return ``x + 1`` through the bare twin with a fixed block size."""
    y = torch.empty_like(x)
    n = x.numel()
    add_one_bare_kernel[(triton.cdiv(n, BARE_BLOCK),)](x, y, n, BLOCK=BARE_BLOCK)
    return y
