"""Reference Triton kernels of the demo, the selftest and the shipped tables: ``matmul`` (18 configs,
several within noise of each other), ``splitk_matmul`` (``reset_to_zero``, ``Config.pre_hook``,
``prune_configs_by``, ``triton.heuristics``; atomics) and ``add_one`` (launch overhead only).

Import it after ``TRITON_INTERPRET`` is settled and, on Triton 3.3 without a GPU, after
``init_deterministic_tuning`` or inside ``lazy_benchmarker()`` (importing decorates the kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl


def _matmul_cfg(bm: int, bn: int, bk: int, group: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": group},
        num_warps=warps,
        num_stages=stages,
    )


MATMUL_CONFIGS: list[triton.Config] = [
    # Large tiles: the usual winners for big bf16 GEMMs on sm90.
    _matmul_cfg(128, 256, 64, 8, 8, 3),
    _matmul_cfg(256, 128, 64, 8, 8, 3),
    _matmul_cfg(128, 256, 32, 8, 8, 4),
    _matmul_cfg(256, 64, 64, 8, 4, 4),
    _matmul_cfg(128, 128, 128, 8, 8, 3),
    _matmul_cfg(128, 128, 64, 8, 4, 4),
    _matmul_cfg(128, 128, 64, 8, 8, 3),
    _matmul_cfg(128, 128, 32, 8, 4, 4),
    # Mid-size tiles: often tie with the large ones on medium shapes.
    _matmul_cfg(64, 256, 32, 8, 4, 4),
    _matmul_cfg(128, 64, 64, 8, 4, 4),
    _matmul_cfg(64, 128, 64, 8, 4, 4),
    _matmul_cfg(64, 128, 32, 8, 4, 5),
    _matmul_cfg(64, 64, 64, 8, 4, 4),
    _matmul_cfg(64, 64, 32, 8, 4, 5),
    # Small tiles: skinny / tiny problems.
    _matmul_cfg(64, 32, 32, 8, 2, 5),
    _matmul_cfg(32, 64, 32, 8, 2, 5),
    _matmul_cfg(32, 32, 32, 4, 2, 4),
    _matmul_cfg(16, 32, 32, 4, 1, 3),
]


@triton.autotune(configs=MATMUL_CONFIGS, key=["M", "N", "K"])
@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    # Grouped ordering: GROUP_SIZE_M row-blocks share the same column-blocks of B while they are
    # hot in L2, instead of sweeping all of B for every row-block.
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_left = K - k * BLOCK_SIZE_K
        # Masks make every M, N, K legal; out-of-range elements contribute zeros.
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    c = acc.to(c_ptr.dtype.element_ty)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, c, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def matmul_grid(M: int, N: int) -> Callable[[dict[str, Any]], tuple[int]]:
    """Launch grid for ``matmul_kernel``: one program per output tile."""
    return lambda meta: (triton.cdiv(M, meta["BLOCK_SIZE_M"]) * triton.cdiv(N, meta["BLOCK_SIZE_N"]),)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Return ``a @ b`` computed by the autotuned kernel; output dtype is the input dtype."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)
    # Runtime arguments go positionally: Triton's pruning hooks only see positional args (nargs).
    matmul_kernel[matmul_grid(M, N)](
        a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1)
    )
    return c


# SMs of an H100/H200 SXM; the perf model only needs a plausible wave size.
_NUM_SMS = 132


def _zero_output(nargs: dict[str, Any]) -> None:
    # Atomic accumulation needs a zeroed output at every launch, whatever the caller passed in.
    nargs["c_ptr"].zero_()


def _splitk_cfg(bm: int, bn: int, bk: int, split_k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split_k},
        num_warps=warps,
        num_stages=stages,
        pre_hook=_zero_output,
    )


SPLITK_CONFIGS: list[triton.Config] = [
    _splitk_cfg(128, 128, 64, 4, 8, 3),
    _splitk_cfg(128, 128, 32, 8, 4, 4),
    _splitk_cfg(128, 64, 64, 4, 4, 4),
    _splitk_cfg(64, 128, 64, 4, 4, 4),
    _splitk_cfg(64, 64, 64, 8, 4, 4),
    _splitk_cfg(64, 64, 32, 2, 4, 4),
    _splitk_cfg(64, 32, 32, 4, 2, 4),
    _splitk_cfg(32, 64, 32, 4, 2, 4),
    _splitk_cfg(32, 32, 64, 2, 2, 3),
    _splitk_cfg(32, 32, 32, 2, 2, 3),
    _splitk_cfg(16, 16, 16, 2, 1, 2),
]


def _tile_limit(n: int) -> int:
    # A tile wider than the next power of two of the dimension only computes masked-out zeros.
    return max(16, triton.next_power_of_2(n))


def early_config_prune(
    configs: list[triton.Config], nargs: dict[str, Any], **kwargs: Any
) -> list[triton.Config]:
    """Drop configs whose tiles exceed the problem; always keep at least the smallest tile."""
    M, N, K = nargs["M"], nargs["N"], nargs["K"]
    kept = [
        c
        for c in configs
        if c.kwargs["BLOCK_M"] <= _tile_limit(M)
        and c.kwargs["BLOCK_N"] <= _tile_limit(N)
        and c.kwargs["BLOCK_K"] * c.kwargs["SPLIT_K"] <= _tile_limit(K)
    ]
    if kept:
        return kept
    # Deterministic fallback: the smallest tile area, first in list order on ties.
    return [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])]


def perf_model(
    M: int, N: int, K: int, BLOCK_M: int, BLOCK_N: int, BLOCK_K: int, SPLIT_K: int, **_: Any
) -> float:
    """Static estimate (arbitrary units): waves of programs times the work of one program; pure and
    cheap on purpose, since a pruning model must give every rank the same order."""
    programs = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N) * SPLIT_K
    waves = triton.cdiv(programs, _NUM_SMS)
    k_steps = triton.cdiv(K, BLOCK_K * SPLIT_K)
    per_program = BLOCK_M * BLOCK_N * BLOCK_K * k_steps
    # Each extra split adds one atomic read-modify-write of the output tile.
    atomics = BLOCK_M * BLOCK_N * SPLIT_K * 4
    return float(waves * per_program + atomics)


SPLITK_TOP_K = 4


@triton.autotune(
    configs=SPLITK_CONFIGS,
    key=["M", "N", "K"],
    reset_to_zero=["c_ptr"],
    prune_configs_by={
        "early_config_prune": early_config_prune,
        "perf_model": perf_model,
        "top_k": SPLITK_TOP_K,
    },
)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % (args["BLOCK_K"] * args["SPLIT_K"]) == 0})
@triton.jit
def splitk_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    pid_k = tl.program_id(axis=1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Program pid_k owns K-slices pid_k, pid_k + SPLIT_K, ... (interleaved for balance).
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    mask_m = offs_m[:, None] < M
    mask_n = offs_n[None, :] < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K * SPLIT_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m, other=0.0)
            b = tl.load(b_ptrs, mask=mask_n, other=0.0)
        else:
            k_left = K - (k * SPLIT_K + pid_k) * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m & (tl.arange(0, BLOCK_K)[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(tl.arange(0, BLOCK_K)[:, None] < k_left) & mask_n, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * SPLIT_K * stride_ak
        b_ptrs += BLOCK_K * SPLIT_K * stride_bk

    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    # The partial sums of the SPLIT_K programs meet here; order of arrival is not fixed, so the
    # fp32 result can differ in the last bits between runs even with a pinned config.
    tl.atomic_add(c_ptrs, acc, mask=mask_m & mask_n)


def splitk_grid(M: int, N: int) -> Callable[[dict[str, Any]], tuple[int, int]]:
    """Launch grid for ``splitk_matmul_kernel``: output tiles x K-splits."""
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])


def splitk_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``a @ b`` in ``a.dtype``, accumulated by split-K atomics into an fp32 buffer; ``out``
    (fp32, (M, N)) reuses a buffer, whatever it holds (each config's pre_hook zeroes it)."""
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty((M, N), device=a.device, dtype=torch.float32)
    # Runtime arguments go positionally: early_config_prune and perf_model only see positional args.
    splitk_matmul_kernel[splitk_grid(M, N)](
        a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1)
    )
    return out if a.dtype == torch.float32 else out.to(a.dtype)


ADD_ONE_CONFIGS: list[triton.Config] = [
    triton.Config({"BLOCK": 64}, num_warps=1),
    triton.Config({"BLOCK": 128}, num_warps=2),
    triton.Config({"BLOCK": 256}, num_warps=4),
    triton.Config({"BLOCK": 512}, num_warps=4),
    triton.Config({"BLOCK": 1024}, num_warps=8),
]


@triton.autotune(configs=ADD_ONE_CONFIGS, key=["n"])
@triton.jit
def add_one_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


def add_one(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``x + 1`` through the autotuned kernel (``out`` lets benchmarks skip allocation)."""
    y = torch.empty_like(x) if out is None else out
    n = x.numel()
    add_one_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
    return y
