"""Add-one on a vector: a kernel so small that a launch costs only host overhead.

``add_one_kernel`` is autotuned over several block sizes; ``add_one_bare_kernel`` is the same body
under a bare ``@triton.jit``. Launch-overhead benchmarks compare the two to show what the
autotuner (stock, or pinned by the interception) adds on the host per launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


# Deliberately a separate def (not the same function jitted twice): each kernel keeps its own
# identity (module:qualname), so the bare twin can never be mistaken for the autotuned one.
@triton.jit
def add_one_bare_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


BARE_BLOCK = 256
"""Block size the bare twin launches with."""


def add_one(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``x + 1`` through the autotuned kernel (``out`` lets benchmarks skip allocation)."""
    y = torch.empty_like(x) if out is None else out
    n = x.numel()
    add_one_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
    return y


def add_one_bare(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``x + 1`` through the bare ``@triton.jit`` twin with a fixed block size."""
    y = torch.empty_like(x) if out is None else out
    n = x.numel()
    add_one_bare_kernel[(triton.cdiv(n, BARE_BLOCK),)](x, y, n, BLOCK=BARE_BLOCK)
    return y
