"""The launch-overhead baseline: add-one as a bare ``@triton.jit`` kernel, the twin of
``megatron_tuning.kernels.add_one_kernel`` without the autotuner.

A separate def (not the same function jitted twice), so the twin keeps its own identity and can
never be mistaken for the autotuned kernel. Import it after ``TRITON_INTERPRET`` is settled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BARE_BLOCK = 256
"""Block size the bare twin launches with."""


@triton.jit
def add_one_bare_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


def add_one_bare(x: torch.Tensor) -> torch.Tensor:
    """Return ``x + 1`` through the bare twin with a fixed block size."""
    y = torch.empty_like(x)
    n = x.numel()
    add_one_bare_kernel[(triton.cdiv(n, BARE_BLOCK),)](x, y, n, BLOCK=BARE_BLOCK)
    return y
