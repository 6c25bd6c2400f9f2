"""Tiny autotuned elementwise kernels for the distributed tests (fast in the interpreter).

Imported only after ``TRITON_INTERPRET=1`` is set and the interception is installed (Triton
3.2/3.3 resolve a GPU benchmarker at decoration otherwise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CONFIGS = [
    triton.Config({"BLOCK": 16}, num_warps=1),
    triton.Config({"BLOCK": 32}, num_warps=1),
    triton.Config({"BLOCK": 64}, num_warps=2),
    triton.Config({"BLOCK": 128}, num_warps=4),
]


@triton.autotune(configs=_CONFIGS, key=["n"])
@triton.jit
def add_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


@triton.autotune(configs=_CONFIGS, key=["n"])
@triton.jit
def scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0, mask=mask)


# Two autotuners over one @triton.jit function (as torchao's HQQ has): two kernels, two ids.
@triton.jit
def _shift_body(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 3.0, mask=mask)


shift_small = triton.autotune(configs=_CONFIGS[:2], key=["n"])(_shift_body)  # cheapest: BLOCK 16
shift_large = triton.autotune(configs=_CONFIGS[1:], key=["n"])(_shift_body)  # cheapest: BLOCK 32


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
    "made_small": _make_shift(_CONFIGS[:2]),
    "made_large": _make_shift(_CONFIGS[1:]),
    "built_small": triton.autotune(configs=_CONFIGS[:2], key=["n"])(_lone_shift_body),
    "built_large": triton.autotune(configs=_CONFIGS[1:], key=["n"])(_lone_shift_body),
}


def launch(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """``y = x + 1`` ("add"), ``y = 2 x`` ("scale") or ``y = x + 3`` ("shift_*"), unchecked."""
    n = x.numel()
    kernels = {
        "add": add_kernel,
        "scale": scale_kernel,
        "shift_small": shift_small,
        "shift_large": shift_large,
        **MADE,
    }
    kernels[name][lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)


def run(name: str, n: int, device: str = "cpu") -> torch.Tensor:
    """Launch kernel ``name`` (see ``launch``) on a vector of ``n`` floats and check the result."""
    x = torch.arange(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    launch(name, x, y)
    expected = {"add": x + 1.0, "scale": x * 2.0}.get(name, x + 3.0)
    if not torch.equal(y, expected):
        raise AssertionError(f"{name} kernel computed a wrong result for n={n}")
    return y
