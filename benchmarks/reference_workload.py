"""The reference kernels on a realistic shape set: the job that ``make_sm90_tables.py`` tunes.

    PYTHONPATH=. python -m megatron_tuning tune --out t.msgpack -- \
        benchmarks/reference_workload.py --kernels matmul

Launches each reference kernel twice per shape (the first launch is where tune mode measures; the
second runs the pinned choice) and checks the result against torch, so a tuned config that
computes garbage fails the job instead of landing in a table.
"""

from __future__ import annotations

import argparse
import os
import sys

# (M, N, K) bf16 GEMMs: the four shapes, a square 4096 and a Llama-style FFN down-projection.
MATMUL_SHAPES = [
    (8192, 8192, 8192),
    (16384, 8192, 4096),
    (4096, 14336, 4096),
    (512, 512, 512),
    (4096, 4096, 4096),
    (8192, 4096, 14336),
]
# Split-K shines for small M x N with a long K (e.g. weight-gradient-like reductions).
SPLITK_SHAPES = [(256, 256, 16384), (512, 512, 8192), (1024, 1024, 4096)]
TINY_SIZES = [1024, 1 << 20, 1 << 24]

SMOKE = {"matmul": [(32, 48, 40)], "splitk": [(32, 32, 128)], "tiny": [100]}
KERNELS = ("matmul", "splitk", "tiny")


def run(kernels: list[str], smoke: bool) -> None:
    import torch

    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    if "matmul" in kernels:
        from megatron_tuning.kernels import matmul

        for m, n, k in SMOKE["matmul"] if smoke else MATMUL_SHAPES:
            a = torch.randn((m, k), device=device, dtype=dtype, generator=gen) / k**0.25
            b = torch.randn((k, n), device=device, dtype=dtype, generator=gen) / k**0.25
            expected = a.float() @ b.float()
            for _ in range(2):
                torch.testing.assert_close(matmul(a, b).float(), expected, atol=0.1, rtol=0.05)
    if "splitk" in kernels:
        from megatron_tuning.kernels import splitk_matmul

        for m, n, k in SMOKE["splitk"] if smoke else SPLITK_SHAPES:
            a = torch.randn((m, k), device=device, dtype=dtype, generator=gen) / k**0.25
            b = torch.randn((k, n), device=device, dtype=dtype, generator=gen) / k**0.25
            out = torch.empty((m, n), device=device, dtype=torch.float32)
            expected = a.float() @ b.float()
            for _ in range(2):
                torch.testing.assert_close(
                    splitk_matmul(a, b, out=out).float(), expected, atol=0.1, rtol=0.05
                )
    if "tiny" in kernels:
        from megatron_tuning.kernels import add_one

        for size in SMOKE["tiny"] if smoke else TINY_SIZES:
            x = torch.randn(size, device=device, dtype=torch.float32, generator=gen)
            for _ in range(2):
                torch.testing.assert_close(add_one(x), x + 1)
    if not smoke:
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in the Triton interpreter (CPU)")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    run(args.kernels, args.smoke)
    print(f"reference workload done: {', '.join(args.kernels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
