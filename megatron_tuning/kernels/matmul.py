"""Autotuned GEMM ``C = A @ B`` with fp32 accumulation, the project's main reference kernel.

The config list mirrors what H100/H200 bf16 GEMMs tune over: large 128x256 / 256x128 tiles for
big problems, mid-size tiles, and small ones for skinny or tiny shapes (and for the Triton
interpreter on CPU). Several of them are within noise of each other on real shapes, which is the
situation that makes stock autotuning pick differently from run to run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl


def _cfg(bm: int, bn: int, bk: int, group: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": group},
        num_warps=warps,
        num_stages=stages,
    )


MATMUL_CONFIGS: list[triton.Config] = [
    # Large tiles: the usual winners for big bf16 GEMMs on sm90.
    _cfg(128, 256, 64, 8, 8, 3),
    _cfg(256, 128, 64, 8, 8, 3),
    _cfg(128, 256, 32, 8, 8, 4),
    _cfg(256, 64, 64, 8, 4, 4),
    _cfg(128, 128, 128, 8, 8, 3),
    _cfg(128, 128, 64, 8, 4, 4),
    _cfg(128, 128, 64, 8, 8, 3),
    _cfg(128, 128, 32, 8, 4, 4),
    # Mid-size tiles: often tie with the large ones on medium shapes.
    _cfg(64, 256, 32, 8, 4, 4),
    _cfg(128, 64, 64, 8, 4, 4),
    _cfg(64, 128, 64, 8, 4, 4),
    _cfg(64, 128, 32, 8, 4, 5),
    _cfg(64, 64, 64, 8, 4, 4),
    _cfg(64, 64, 32, 8, 4, 5),
    # Small tiles: skinny / tiny problems.
    _cfg(64, 32, 32, 8, 2, 5),
    _cfg(32, 64, 32, 8, 2, 5),
    _cfg(32, 32, 32, 4, 2, 4),
    _cfg(16, 32, 32, 4, 1, 3),
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
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul expects (M, K) @ (K, N), got {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul expects equal dtypes, got {a.dtype} and {b.dtype}")
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)
    # Runtime arguments go positionally: Triton's pruning hooks only see positional args (nargs).
    matmul_kernel[matmul_grid(M, N)](
        a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1)
    )
    return c
