"""Time to first launch: a table hit vs stock ``@triton.autotune`` over 16 configs, warm and cold cache.

    PYTHONPATH=. python benchmarks/bench_first_launch.py [--repeats 3] [--shape 8192 8192 8192]
    PYTHONPATH=. python benchmarks/bench_first_launch.py --smoke      # CPU check of the code paths

A primer process autotunes a 16-config matmul once in a shared Triton cache folder (making that
folder "warm": every config compiled) and reports the tuning key and its winner; a table pinning
that winner is written. Then fresh processes time the first ``kernel[grid](...)`` call (to the
end of the GPU work), stock vs pinned, with the warm folder or a fresh empty one each ("cold": the
pinned path compiles one config, stock compiles all 16). Each process also counts calls to the
autotuner's benchmark (``Autotuner._bench``): a table hit must make none. "warm+prewarmed" is
the warm case after one bare ``@triton.jit`` launch in the same process, which takes Triton's
once-per-process start-up out of the timed launch (reported as ``prewarm_startup_s``).
Goal: >= 20x faster warm, >= 5x cold; 0 benchmark calls on a hit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common

CONFIG_COUNT = 16


def child(args: argparse.Namespace) -> None:
    import triton

    from megatron_tuning import kernels as mm
    from megatron_tuning import tuning_key
    from megatron_tuning.core.decisions import get_decisions
    from megatron_tuning.core.identity import arch_tag, config_data, config_signature

    bench_calls = common.count_triton_benchmarks()  # under the interception's guard, if any
    kernel = triton.autotune(configs=mm.MATMUL_CONFIGS[:CONFIG_COUNT], key=["M", "N", "K"])(
        mm.matmul_kernel.fn
    )
    if args.smoke:
        common.allow_stock_autotune_on_cpu(kernel)
    if args.child == "pinned":
        common.install_pinned([args.table])
    shape = tuple(args.shape)
    _, _, _, kargs = common.matmul_operands(shape, args.smoke)  # type: ignore[arg-type]
    grid = mm.matmul_grid(shape[0], shape[1])
    startup_s = None
    if args.prewarm:
        # Pay Triton's once-per-process start-up (driver, launcher, first module load) on an
        # unrelated bare kernel, so the timed launch measures only this key's first launch.
        from tests.support_kernels import add_one_bare

        common.synchronize(args.smoke)
        t0 = time.perf_counter()
        add_one_bare(kargs[0].new_zeros(16, dtype=kargs[0].dtype).float())
        common.synchronize(args.smoke)
        startup_s = time.perf_counter() - t0
    common.synchronize(args.smoke)
    start = time.perf_counter()
    kernel[grid](*kargs)
    common.synchronize(args.smoke)
    elapsed = time.perf_counter() - start
    sources = [d.source for d in get_decisions()]
    common.emit(
        {
            "mode": args.child,
            "first_launch_s": elapsed,
            "prewarm_startup_s": startup_s,
            "bench_calls": sum(bench_calls.values()),
            "signature": config_signature(kernel.best_config),
            "config": config_data(kernel.best_config),
            "key": tuning_key(kernel, kargs, {}).to_data(),  # its stored form: an entry is built from it
            "arch": arch_tag(),
            "source": sources[0] if sources else "stock",
        }
    )


def write_table(path: Path, primer: dict[str, Any]) -> None:
    from megatron_tuning.tables.entry import Entry
    from megatron_tuning.tables.table import add_entries

    add_entries(
        path,
        [
            Entry(
                arch=primer["arch"],
                kernel="megatron_tuning.kernels:matmul_kernel",
                key=primer["key"],
                config=primer["config"],
                how="hand",
                note="bench_first_launch: the primer process's stock autotune winner",
            )
        ],
    )


def parent(args: argparse.Namespace) -> int:
    repeats = args.repeats if args.repeats is not None else (1 if args.smoke else 3)
    if args.smoke:
        args.shape = [32, 48, 40]
    flags = ["--shape", *map(str, args.shape)] + (["--smoke"] if args.smoke else [])
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="mt_first_launch_") as tmp:
        warm, table = Path(tmp) / "warm_cache", Path(tmp) / "table.msgpack"
        primer = common.run_child(
            "bench_first_launch.py",
            ["--child", "stock", *flags],
            common.child_env(args.smoke, TRITON_CACHE_DIR=str(warm)),
            timeout=args.timeout,
        )
        write_table(table, primer)
        print(f"primer: key {primer['key']} -> {primer['signature']} ({primer['first_launch_s']:.2f}s, cold)")
        for rep in range(repeats):
            for cache in ("cold", "warm", "warm+prewarmed"):
                for mode in ("stock", "pinned") if rep % 2 == 0 else ("pinned", "stock"):
                    folder = warm if cache.startswith("warm") else Path(tmp) / f"cold_{rep}_{mode}"
                    env = common.child_env(args.smoke, TRITON_CACHE_DIR=str(folder))
                    prewarm = ["--prewarm"] if cache == "warm+prewarmed" else []
                    result = common.run_child(
                        "bench_first_launch.py",
                        ["--child", mode, "--table", str(table), *flags, *prewarm],
                        env,
                        timeout=args.timeout,
                    )
                    runs.setdefault(f"{mode}/{cache}", []).append(result)
                    print(
                        f"repeat {rep + 1}/{repeats} {mode:6s} {cache}: {result['first_launch_s']:.3f}s, "
                        f"{result['bench_calls']} benchmark calls, source {result['source']}",
                        flush=True,
                    )
    summary = summarize(runs)
    common.print_table(
        [
            "cache",
            "stock s (median)",
            "pinned s (median)",
            "speedup",
            "goal",
            "bench calls on hit",
            "pinned sources",
        ],
        [
            [
                c["cache"],
                c["stock_s"]["median"],
                c["pinned_s"]["median"],
                f"{c['speedup']:.1f}x",
                f">= {c['goal']}x",
                c["pinned_bench_calls"],
                ",".join(c["pinned_sources"]),
            ]
            for c in summary
        ],
    )
    common.write_results(
        args.out,
        "first_launch",
        shape=args.shape,
        configs=CONFIG_COUNT,
        repeats=repeats,
        primer=primer,
        summary=summary,
        runs=runs,
    )
    return 0


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for cache, goal in (("warm", 20), ("warm+prewarmed", 20), ("cold", 5)):
        stock = common.spread([r["first_launch_s"] for r in runs[f"stock/{cache}"]])
        pinned = common.spread([r["first_launch_s"] for r in runs[f"pinned/{cache}"]])
        out.append(
            {
                "cache": cache,
                "stock_s": stock,
                "pinned_s": pinned,
                "goal": goal,
                "speedup": stock["median"] / pinned["median"] if pinned["median"] else float("nan"),
                "pinned_bench_calls": sum(r["bench_calls"] for r in runs[f"pinned/{cache}"]),
                "stock_bench_calls_median": statistics.median(
                    r["bench_calls"] for r in runs[f"stock/{cache}"]
                ),
                "pinned_sources": sorted({r["source"] for r in runs[f"pinned/{cache}"]}),
            }
        )
    return out


def main() -> int:
    parser = common.script_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=None, help="processes per (mode, cache) (default 3)")
    parser.add_argument("--shape", type=int, nargs=3, default=[8192, 8192, 8192], metavar=("M", "N", "K"))
    parser.add_argument("--table", default=None, help=argparse.SUPPRESS)  # the child's table
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per child process")
    parser.add_argument(
        "--prewarm",
        action="store_true",
        help=argparse.SUPPRESS,  # child: launch a bare kernel first (Triton's per-process start-up)
    )
    return common.run_parent_or_child(parser, "bench_first_launch", child, parent)


if __name__ == "__main__":
    sys.exit(main())
