"""A kernel that writes its own ``BLOCK`` into its output, so the launched config can be read back.

Four configs, ``key=["n"]``: issue 10's measurement kernel for ``bench_compile.py``. Under stock
autotuning every config is within noise of the others (the kernel does almost no work), so the
winner varies from process to process. Import it after ``TRITON_INTERPRET`` is settled (smoke).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_CONFIGS = [
    triton.Config({"BLOCK": 256}, num_warps=4),
    triton.Config({"BLOCK": 128}, num_warps=4),
    triton.Config({"BLOCK": 64}, num_warps=2),
    triton.Config({"BLOCK": 32}, num_warps=1),
]


@triton.autotune(configs=BLOCK_CONFIGS, key=["n"])
@triton.jit
def write_block_kernel(y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, BLOCK + 0 * offs, mask=offs < n)


def write_block(x: torch.Tensor) -> torch.Tensor:
    """``y`` of ``x``'s shape, every element set to the ``BLOCK`` of the launched config."""
    y = torch.empty_like(x)
    n = x.numel()
    write_block_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](y, n)
    return y
