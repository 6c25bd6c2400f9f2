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
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.decisions import chaos_can_differ

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
    from ..kernels import matmul, splitk, tiny

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


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _run_phase(
    mode: str, policy: Any, device: torch.device, shapes: Sequence[Shape], dtype: torch.dtype, world: int
) -> tuple[list[Any], list[str], Exception | None, int]:
    """One pass of the workload under ``mode``; returns (decisions, failures, error, shared entries)."""
    from ..core.decisions import decision_log, get_decisions
    from ..core.errors import MegatronTuningError
    from ..distributed.verify import verify_agreement
    from ..session import init_deterministic_tuning

    decision_log().clear()
    failures: list[str] = []
    error: Exception | None = None
    shared = 0
    with init_deterministic_tuning(policy.replace(mode=mode)):
        try:
            failures = _run_workload(device, shapes, dtype)
        except MegatronTuningError as exc:  # the first-use check fired on this rank
            error = exc
        if world > 1:
            # Every rank reaches this collective, whether or not its own launches raised, so a
            # rank that stopped early never leaves the others waiting; all get the same verdict.
            try:
                shared = verify_agreement()
            except MegatronTuningError as exc:
                error = error or exc
    return [d for d in get_decisions() if d.source != "out_of_scope"], failures, error, shared


def chaos_verdict(
    decisions: Sequence[Any], error: Exception | None, rank: int, world: int
) -> tuple[int, list[str]]:
    """Judge one rank's chaos phase: (exit status, lines to print). Only a divergence is proof.

    A key with one distinct config cannot differ between ranks (``Decision.chaos ==
    "no_other_config"``), so a run without such proof is inconclusive, not a pass.
    """
    if error is not None:
        return 0, [f"chaos mode: the agreement check fired, as it must ({type(error).__name__}):", str(error)]
    if world <= 1:
        return 0, ["chaos mode in one process: nothing to compare (run under torchrun with 2+ ranks)"]
    if not any(chaos_can_differ(d) for d in decisions):
        return 4, [
            f"rank {rank}: chaos could not make ranks differ (no key had two distinct configs): "
            "this run proves nothing about the agreement check"
        ]
    return 4, [f"rank {rank}: chaos ran and no divergence was detected: the agreement check is blind"]


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
        "--phases",
        default="deterministic,chaos",
        help="comma-separated modes to run in order (default: deterministic,chaos)",
    )
    parser.add_argument(
        "--all-ranks", action="store_true", help="print every rank's output, not only rank 0's"
    )
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or any(p not in ("deterministic", "chaos") for p in phases):
        parser.error(f"--phases takes deterministic and/or chaos, not {args.phases!r}")

    on_gpu = _prepare_backend()
    rank, world = _init_process_group(on_gpu)
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    shapes = _GPU_SHAPES if on_gpu else _CPU_SHAPES
    show = rank == 0 or args.all_ranks

    from ..core.policy import TuningPolicy

    policy = TuningPolicy.from_env(default_mode="deterministic")
    backend = "GPU" if on_gpu else "Triton interpreter (CPU)"
    status = 0
    for mode in phases:
        start = time.perf_counter()
        decisions, failures, error, shared = _run_phase(mode, policy, device, shapes, dtype, world)
        if show:
            out(
                f"== {mode}: rank {rank}/{world}, {policy.replace(mode=mode).describe()}, "
                f"{backend}, {dtype}, {time.perf_counter() - start:.1f}s"
            )
            rows = [("kernel", "key", "config", "source")]
            rows += [
                (
                    d.kernel.split(":")[-1],
                    d.key,
                    d.signature,
                    d.source + (f" ({d.origin})" if d.origin else ""),
                )
                for d in decisions
            ]
            out(_table(rows))
        if failures:
            out(f"rank {rank}: WRONG RESULTS: " + "; ".join(failures))
            status = status or 1
        if mode == "deterministic":
            if error is not None:
                out(f"rank {rank}: unexpected {type(error).__name__}: {error}")
                status = status or 2
            elif show:
                agreed = (
                    f"agreement check passed: {shared} shared kernel/shape entries agree on all {world} ranks"
                )
                out(
                    agreed
                    if world > 1
                    else f"all {len(decisions)} kernel/shape results match torch (one process)"
                )
        else:
            code, lines = chaos_verdict(decisions, error, rank, world)
            status = status or code
            for line in lines if (show or code) else ():
                out(line)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
