"""auto mode on the reference matmul: pinned AND fast without a hand-made table.

    PYTHONPATH=. python benchmarks/bench_auto.py --out auto.json      # GPU, ~3 minutes on an H200
    PYTHONPATH=. python benchmarks/bench_auto.py --smoke              # CPU check of the code paths

Part ``auto`` (the four reference shapes, bf16). Each job is ``torchrun --nproc_per_node 2`` on one
GPU with gloo, so both processes share the job's store:

1. ``stock_cold``: stock ``@triton.autotune`` in both processes, fresh Triton cache A;
2. ``auto1_cold``: ``auto`` mode, no table, empty auto cache, fresh Triton cache B;
3. ``stock_warm``: stock again on cache A (compiled, autotune cache off: it benchmarks again);
4. ``auto2_warm``: ``auto`` on cache B with the auto cache ``auto1_cold`` wrote.

Per process: the first step (from just before ``init_deterministic_tuning``, or the same point
for stock, until the four shapes have each launched once and the GPU is idle), the config each
shape launched (``best_config``), calls of Triton's ``Autotuner._bench`` and our tuner's
measurements. Then one ``judge`` process times every candidate config of every shape,
interleaved, so the steady-state ratios (auto's config vs the configs stock chose) come from one
process and one run.

The nearest-shape fallback on held-out shapes is ``bench_nearest.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common

JOBS = ("stock_cold", "auto1_cold", "stock_warm", "auto2_warm")


# --------------------------------------------------------------------------- children


def _matmul_module(smoke: bool) -> Any:
    from megatron_tuning import kernels as mm

    if smoke:
        common.allow_stock_autotune_on_cpu(mm.matmul_kernel)
    return mm


def child_worker(args: argparse.Namespace) -> None:
    """One rank of a 2-process job: the first step under ``--mode``, then what it launched."""
    import torch.distributed as dist

    from megatron_tuning.core.identity import config_signature

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    bench_calls = common.count_triton_benchmarks()
    mm = _matmul_module(args.smoke)
    shapes = common.SMOKE_MATMUL_SHAPES if args.smoke else common.MATMUL_SHAPES
    operands = [common.matmul_operands(shape, args.smoke, seed=rank) for shape in shapes]
    common.synchronize(args.smoke)
    dist.barrier()
    start = time.perf_counter()
    handle = None
    if args.mode == "auto":
        import megatron_tuning

        policy = megatron_tuning.TuningPolicy.from_env(  # smoke: MEGATRON_TUNING_TUNE_ROUNDS=1
            mode="auto", cache=args.cache, use_shipped_tables=False, scope=("megatron_tuning.kernels",)
        )
        handle = megatron_tuning.init_deterministic_tuning(policy)
    launched = {}
    for shape, (_, _, _, kargs) in zip(shapes, operands):
        mm.matmul_kernel[mm.matmul_grid(shape[0], shape[1])](*kargs)
        launched[common.shape_name(shape)] = config_signature(mm.matmul_kernel.best_config)
    common.synchronize(args.smoke)
    first_step_s = time.perf_counter() - start
    sources: dict[str, str] = {}
    measured = 0
    if handle is not None:
        from megatron_tuning import get_decisions

        for d in get_decisions():
            if d.kernel.endswith(":matmul_kernel"):
                sources[d.key] = d.source
                measured += d.source == "tuned" or (d.source == "adopted" and d.timings is not None)
        handle.close()  # persists the auto cache
    result = {
        "rank": rank,
        "mode": args.mode,
        "first_step_s": first_step_s,
        "launched": launched,
        "sources": sorted(sources.values()),
        "our_measurements": measured,
        "triton_bench_calls": sum(bench_calls.values()),
    }
    Path(args.child_out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def child_judge(args: argparse.Namespace) -> None:
    """Time every candidate of every shape, interleaved: the steady state of any config chosen."""
    from megatron_tuning.core.identity import config_signature

    mm = _matmul_module(args.smoke)
    configs = list(mm.MATMUL_CONFIGS)
    rows = {}
    for shape in common.SMOKE_MATMUL_SHAPES if args.smoke else common.MATMUL_SHAPES:
        _, _, _, kargs = common.matmul_operands(shape, args.smoke)
        samples = common.time_configs_interleaved(
            mm.matmul_kernel,
            configs,
            kargs,
            mm.matmul_grid(shape[0], shape[1]),
            rounds=args.rounds,
            rep_ms=args.rep_ms,
            smoke=args.smoke,
        )
        rows[common.shape_name(shape)] = {
            config_signature(c): statistics.median(s) for c, s in zip(configs, samples)
        }
    common.emit({"medians_ms": rows})


def child(args: argparse.Namespace) -> None:
    if args.smoke:  # one timed round: interpreted candidates are slow, and smoke numbers mean nothing
        os.environ["MEGATRON_TUNING_TUNE_ROUNDS"] = "1"
    {"worker": child_worker, "judge": child_judge}[args.child](args)


# --------------------------------------------------------------------------- parent


def run_job(
    args: argparse.Namespace, name: str, mode: str, triton_cache: str, cache: str, work: Path
) -> list[dict]:
    out = work / name
    out.mkdir()
    env = common.child_env(
        args.smoke, TRITON_CACHE_DIR=triton_cache, TRITON_CACHE_AUTOTUNING="0", OMP_NUM_THREADS="1"
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(Path(__file__).resolve()),
        "--child",
        "worker",
        "--mode",
        mode,
        "--cache",
        cache,
        "--child-out",
        str(out),
    ] + (["--smoke"] if args.smoke else [])
    started = time.perf_counter()
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=args.job_timeout_s, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"job {name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    print(
        f"{name}: job {time.perf_counter() - started:.1f}s, first steps "
        + ", ".join(f"{r['first_step_s']:.2f}s" for r in ranks),
        flush=True,
    )
    return ranks


def part_auto(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    caches = {"A": str(work / "triton_A"), "B": str(work / "triton_B")}
    auto_cache = str(work / "auto_cache" / "auto.msgpack")
    jobs = {
        "stock_cold": run_job(args, "stock_cold", "stock", caches["A"], auto_cache, work),
        "auto1_cold": run_job(args, "auto1_cold", "auto", caches["B"], auto_cache, work),
        "stock_warm": run_job(args, "stock_warm", "stock", caches["A"], auto_cache, work),
        "auto2_warm": run_job(args, "auto2_warm", "auto", caches["B"], auto_cache, work),
    }
    judge = common.run_child(
        "bench_auto.py",
        ["--child", "judge", "--rounds", str(args.rounds), "--rep-ms", str(args.rep_ms)]
        + (["--smoke"] if args.smoke else []),
        common.child_env(args.smoke, TRITON_CACHE_DIR=caches["A"]),
        timeout=args.job_timeout_s,
    )["medians_ms"]
    rows = []
    for shape, medians in judge.items():
        best_ms = min(medians.values())
        stock_cfgs = [r["launched"][shape] for job in ("stock_cold", "stock_warm") for r in jobs[job]]
        auto_cfgs = [r["launched"][shape] for job in ("auto1_cold", "auto2_warm") for r in jobs[job]]
        stock_ms = statistics.mean(medians[c] for c in stock_cfgs)
        auto1 = {r["launched"][shape] for r in jobs["auto1_cold"]}
        rows.append(
            {
                "shape": shape,
                "auto_configs": sorted(set(auto_cfgs)),
                "auto1_one_config_across_processes": len(auto1) == 1,
                "auto_run2_same_config": {r["launched"][shape] for r in jobs["auto2_warm"]} == auto1,
                "stock_configs": sorted(set(stock_cfgs)),
                "auto_vs_stock": stock_ms / statistics.mean(medians[c] for c in auto_cfgs),
                "auto_vs_best": best_ms / statistics.mean(medians[c] for c in auto_cfgs),
                "stock_vs_best": best_ms / stock_ms,
            }
        )
    first = {name: statistics.median(r["first_step_s"] for r in ranks) for name, ranks in jobs.items()}
    counts = {
        name: {
            "triton_bench_calls": [r["triton_bench_calls"] for r in ranks],
            "our_measurements": [r["our_measurements"] for r in ranks],
            "sources": [r["sources"] for r in ranks],
        }
        for name, ranks in jobs.items()
    }
    return {"jobs": jobs, "rows": rows, "first_step_median_s": first, "counts": counts}


def parent(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="bench_auto_"))
    payload: dict[str, Any] = {"benchmark": "auto", "environment": common.environment()}
    result = part_auto(args, work)
    payload["auto"] = result
    common.print_table(
        ["shape", "auto/stock", "auto/best", "stock/best", "auto 1 config", "run2 same", "auto config"],
        [
            [
                r["shape"],
                r["auto_vs_stock"],
                r["auto_vs_best"],
                r["stock_vs_best"],
                r["auto1_one_config_across_processes"],
                r["auto_run2_same_config"],
                "; ".join(r["auto_configs"]),
            ]
            for r in result["rows"]
        ],
    )
    f = result["first_step_median_s"]
    c = result["counts"]
    common.print_table(
        ["job", "first step s (median of 2)", "Triton _bench calls", "our measurements"],
        [[job, f[job], c[job]["triton_bench_calls"], c[job]["our_measurements"]] for job in JOBS],
    )
    print(
        f"first step: auto run 1 / stock (cold) = {f['auto1_cold'] / f['stock_cold']:.3f}; "
        f"stock (warm) / auto run 2 = {f['stock_warm'] / f['auto2_warm']:.1f}x"
    )
    common.write_json(args.out, payload)
    return 0


def main() -> int:
    parser = common.script_parser(__doc__)
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds per candidate (default 5)"
    )
    parser.add_argument("--rep-ms", type=int, default=40, help="do_bench rep (ms) per sample")
    parser.add_argument("--job-timeout-s", type=float, default=300.0)
    parser.add_argument("--mode", choices=("stock", "auto"), default="stock", help=argparse.SUPPRESS)
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rounds = args.rounds or (2 if args.smoke else 5)
    if not common.require_device(args, "bench_auto"):
        return 2
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
