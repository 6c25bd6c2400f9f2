"""The reference GEMM workload: its shapes, operands, throughput, and the pinned tables for it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harness.processes import REPO

# (M, N, K) of the reference GEMMs (bf16): the shapes issue 5 names.
MATMUL_SHAPES: list[tuple[int, int, int]] = [
    (8192, 8192, 8192),
    (16384, 8192, 4096),
    (4096, 14336, 4096),
    (512, 512, 512),
]
SMOKE_MATMUL_SHAPES: list[tuple[int, int, int]] = [(32, 48, 40), (64, 32, 48)]


def matmul_operands(shape: tuple[int, int, int], smoke: bool, seed: int = 0) -> tuple[Any, Any, Any, tuple]:
    """``a``, ``b``, ``c`` and the positional argument tuple of ``matmul_kernel`` for ``shape``."""
    import torch

    m, n, k = shape
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn((m, k), device=device, dtype=dtype, generator=gen)
    b = torch.randn((k, n), device=device, dtype=dtype, generator=gen)
    c = torch.empty((m, n), device=device, dtype=dtype)
    args = (a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    return a, b, c, args


def tflops(shape: tuple[int, int, int], ms: float) -> float:
    m, n, k = shape
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def shape_name(shape: tuple[int, int, int]) -> str:
    return "x".join(str(d) for d in shape)


def install_pinned(table_paths: Sequence[str]) -> Any:
    """Deterministic policy with these tables (no shipped ones): what a pinned user process does."""
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.runtime import interception
    from megatron_tuning.tables.search import TableSet

    table = TableSet([p for p in table_paths if p], shipped_dir=None) if table_paths else None
    interception.install(
        TuningPolicy(mode="deterministic", agreement="off", use_shipped_tables=False), table=table
    )
    return table


def default_matmul_table() -> str | None:
    """The sm90 matmul table in this checkout, when the tables step (or a commit) put one there."""
    path = REPO / "configs" / "sm90" / "matmul.msgpack"
    return str(path) if path.exists() else None
