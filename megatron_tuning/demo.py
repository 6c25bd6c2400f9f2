"""``python -m megatron_tuning.demo``: the reference kernels under the deterministic policy.

Launches each reference kernel on a few shapes, checks every result against torch, and prints per
kernel and shape the config that was launched and where it came from (table, override, cheapest).
Started by ``scripts/demo.sh`` under ``torchrun`` with two ranks: each rank chooses on its own,
then the ranks compare fixed-size digests of their choices to show they launched the same configs.
Without a GPU it uses Triton's interpreter and gloo. The policy comes from ``MEGATRON_TUNING_*``
(default mode ``deterministic``), so e.g. ``MEGATRON_TUNING_MODE=chaos`` shows ranks diverging.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

Shape = tuple[int, int, int]

# Interpreted launches cost ~0.1-0.3 s each on CPU: keep the CPU shapes small and odd.
_CPU_SHAPES: tuple[Shape, ...] = ((37, 29, 45), (64, 48, 40))
_GPU_SHAPES: tuple[Shape, ...] = ((4096, 4096, 4096), (8192, 1024, 4096), (1, 4096, 4096))


def _prepare_backend() -> bool:
    """Return whether a GPU is used; otherwise switch Triton to its interpreter.

    Must run before any kernel module is imported: Triton reads ``TRITON_INTERPRET`` at decoration.
    """
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return True
    os.environ["TRITON_INTERPRET"] = "1"
    return False


def _init_process_group(on_gpu: bool) -> tuple[int, int]:
    """Join the torchrun job if there is one; return (rank, world_size)."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _run_workload(device: torch.device, shapes: Sequence[Shape], dtype: torch.dtype) -> list[str]:
    """Launch every reference kernel on every shape; return the result checks that failed."""
    from .kernels import matmul, splitk, tiny

    gen = torch.Generator().manual_seed(0)  # same inputs on every rank
    failures: list[str] = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
        if not torch.allclose(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol):
            err = (got.float() - want.float()).abs().max().item()
            failures.append(f"{name}: max abs error {err:.3g}")

    tol = 1e-3 if dtype == torch.float32 else 3e-2
    for m, n, k in shapes:
        a = torch.randn((m, k), generator=gen).to(device=device, dtype=dtype)
        b = torch.randn((k, n), generator=gen).to(device=device, dtype=dtype)
        want = a.float() @ b.float()
        check(f"matmul {m}x{n}x{k}", matmul.matmul(a, b), want, tol * max(1.0, k**0.5))
        check(f"splitk_matmul {m}x{n}x{k}", splitk.splitk_matmul(a, b), want, tol * max(1.0, k**0.5))
        x = torch.randn(m * n, generator=gen).to(device=device, dtype=dtype)
        check(f"add_one n={m * n}", tiny.add_one(x), x + 1, tol)
    return failures


def _digest(lines: Sequence[str]) -> torch.Tensor:
    """A fixed-size digest of this rank's choices (never pickled objects across ranks)."""
    raw = hashlib.sha256("\n".join(sorted(lines)).encode()).digest()
    return torch.tensor(list(raw), dtype=torch.uint8)


def _compare_ranks(lines: Sequence[str], world: int, device: torch.device) -> list[int]:
    """Return the ranks whose choices differ from rank 0's."""
    import torch.distributed as dist

    mine = _digest(lines).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return [r for r, d in enumerate(gathered) if not torch.equal(d, gathered[0])]


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def main(argv: Sequence[str] | None = None, out: Callable[[str], Any] = print) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_tuning.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help="input dtype (default: bfloat16 on GPU, float32 in the interpreter)",
    )
    parser.add_argument(
        "--all-ranks", action="store_true", help="print every rank's table, not only rank 0's"
    )
    args = parser.parse_args(argv)

    on_gpu = _prepare_backend()
    rank, world = _init_process_group(on_gpu)
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))

    from . import init_deterministic_tuning
    from .decisions import get_decisions
    from .errors import MegatronTuningError
    from .policy import TuningPolicy

    policy = TuningPolicy.from_env(default_mode="deterministic")
    start = time.perf_counter()
    error: MegatronTuningError | None = None
    failures: list[str] = []
    try:
        with init_deterministic_tuning(policy):
            failures = _run_workload(device, _GPU_SHAPES if on_gpu else _CPU_SHAPES, dtype)
    except MegatronTuningError as e:
        # e.g. a DivergenceError under MEGATRON_TUNING_MODE=chaos: report it, still meet the other
        # ranks below so that none of them waits forever for this one.
        error = e
    elapsed = time.perf_counter() - start

    decisions = [d for d in get_decisions() if d.key != "*"]
    lines = [f"{d.kernel} | {d.key} | {d.signature}" for d in decisions]
    if error is not None:
        lines.append(f"error: {type(error).__name__}")
    if rank == 0 or args.all_ranks:
        backend = "GPU" if on_gpu else "Triton interpreter (CPU)"
        out(f"rank {rank}/{world}: {policy.describe()} on {backend}, {dtype}, {elapsed:.1f}s")
        rows = [("kernel", "key", "config", "source")]
        rows += [
            (d.kernel.split(":")[-1], d.key, d.signature, d.source + (f" ({d.origin})" if d.origin else ""))
            for d in decisions
        ]
        out(_table(rows))
    status = 0
    if error is not None:
        out(f"rank {rank}: {type(error).__name__}: {error}")
        status = 3
    if failures:
        out(f"rank {rank}: WRONG RESULTS: " + "; ".join(failures))
        status = status or 1
    if world > 1:
        differing = _compare_ranks(lines, world, device)
        if rank == 0:
            if differing:
                out(f"ranks {differing} launched different configs than rank 0 ({len(lines)} entries)")
            else:
                out(f"all {world} ranks launched identical configs for all {len(lines)} kernel/shape entries")
        status = status or (2 if differing else 0)
        import torch.distributed as dist

        dist.destroy_process_group()
    elif status == 0:
        out(f"all {len(lines)} kernel/shape results match torch")
    return status


if __name__ == "__main__":
    sys.exit(main())
