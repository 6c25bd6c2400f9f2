"""Re-tune stability: does tuning again in a fresh process pick the same config? Tuner vs Triton.

    PYTHONPATH=. python benchmarks/bench_retune.py [--processes 5] [--rounds 10] [--tie-band 0.02]
    PYTHONPATH=. python benchmarks/bench_retune.py --smoke      # CPU check of the code paths

Each fresh process first lets stock ``@triton.autotune`` pick a config for every reference matmul
shape (one noisy pass, Triton's own choice), then runs the noise-aware tuner (policy mode ``tune``)
on the same shapes, with the real arguments. Per shape it reports how many processes agreed with
the most common choice, for both. Goal: the tuner picks the same config in >= 95% of processes.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from typing import Any

import common


def child(args: argparse.Namespace) -> None:
    from megatron_tuning import kernels as mm
    from megatron_tuning.core.decisions import get_decisions
    from megatron_tuning.core.identity import config_signature
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.runtime import interception
    from megatron_tuning.tuning.stats import TuneSettings
    from megatron_tuning.tuning.tuner import ClockTimer, make_measure

    kernel = mm.matmul_kernel
    shapes = common.SMOKE_MATMUL_SHAPES if args.smoke else common.MATMUL_SHAPES
    operands = {shape: common.matmul_operands(shape, args.smoke) for shape in shapes}
    if args.smoke:
        common.allow_stock_autotune_on_cpu(kernel)
    stock = {}
    for shape, (_, _, _, kargs) in operands.items():
        kernel[mm.matmul_grid(shape[0], shape[1])](*kargs)
        stock[common.shape_name(shape)] = config_signature(kernel.best_config)
    settings = TuneSettings(rounds=args.rounds, tie_band=args.tie_band)
    interception.install(
        TuningPolicy(mode="tune", agreement="off", scope=("megatron_tuning.kernels",)),
        measure=make_measure(settings, timer=ClockTimer() if args.smoke else None, progress=False),
    )
    tuned = {}
    for shape, (_, _, _, kargs) in operands.items():
        kernel[mm.matmul_grid(shape[0], shape[1])](*kargs)
        (decision,) = [
            d for d in get_decisions() if d.key.startswith(f"M={shape[0]}, N={shape[1]}, K={shape[2]} ")
        ]
        timings = decision.timings or {}
        tuned[common.shape_name(shape)] = {
            "signature": decision.signature,
            "tied": len(timings.get("tied", [])),
            "seconds": timings.get("tune_seconds"),
            "timings": timings,
        }
    common.emit({"stock": stock, "tuned": tuned})


def parent(args: argparse.Namespace) -> int:
    processes = args.processes if args.processes is not None else (2 if args.smoke else 5)
    results = []
    with tempfile.TemporaryDirectory(prefix="mt_retune_cache_") as cache:
        env = common.child_env(args.smoke, TRITON_CACHE_DIR=cache)
        argv = ["--child", "1", "--rounds", str(args.rounds), "--tie-band", str(args.tie_band)]
        for i in range(processes):
            result = common.run_child(
                "bench_retune.py", argv + (["--smoke"] if args.smoke else []), env, timeout=args.timeout
            )
            results.append(result)
            print(
                f"process {i + 1}/{processes}: "
                + ", ".join(
                    f"{s} tuned in {t['seconds']}s ({t['tied']} tied)" for s, t in result["tuned"].items()
                ),
                flush=True,
            )
    summary = summarize(results)
    common.print_table(
        [
            "shape",
            "processes",
            "tuner same %",
            "tuner configs",
            "Triton same %",
            "Triton configs",
            "tied (median)",
            "tune s (median)",
        ],
        [
            [
                s["shape"],
                s["processes"],
                100 * s["tuned_same"],
                s["tuned_distinct"],
                100 * s["stock_same"],
                s["stock_distinct"],
                s["tied_median"],
                s["tune_seconds_median"],
            ]
            for s in summary
        ],
    )
    if args.plot:
        from megatron_tuning.commands.report import plot_into
        from megatron_tuning.core.decisions import Decision

        decisions = [
            Decision(
                kernel="megatron_tuning.kernels:matmul_kernel",
                key=f"{shape} (process 1)",
                signature=t["signature"],
                source="tuned",
                timings=t["timings"],
            )
            for shape, t in results[0]["tuned"].items()
        ]
        plot_into(decisions, args.plot, prog="bench_retune")
    for result in results:  # the per-candidate samples are in the plots; keep the JSON small
        for t in result["tuned"].values():
            t["timings"] = {k: v for k, v in t["timings"].items() if k not in ("samples", "configs")}
    common.write_results(
        args.out,
        "retune",
        processes=processes,
        rounds=args.rounds,
        tie_band=args.tie_band,
        summary=summary,
        runs=results,
    )
    return 0


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import statistics

    out = []
    for shape in results[0]["tuned"]:
        tuned = collections.Counter(r["tuned"][shape]["signature"] for r in results)
        stock = collections.Counter(r["stock"][shape] for r in results)
        seconds = [r["tuned"][shape]["seconds"] for r in results if r["tuned"][shape]["seconds"] is not None]
        out.append(
            {
                "shape": shape,
                "processes": len(results),
                "tuned_same": tuned.most_common(1)[0][1] / len(results),
                "tuned_distinct": len(tuned),
                "tuned_configs": dict(tuned.most_common()),
                "stock_same": stock.most_common(1)[0][1] / len(results),
                "stock_distinct": len(stock),
                "stock_configs": dict(stock.most_common()),
                "tied_median": statistics.median(r["tuned"][shape]["tied"] for r in results),
                "tune_seconds_median": statistics.median(seconds) if seconds else None,
            }
        )
    return out


def main() -> int:
    parser = common.script_parser(__doc__)
    parser.add_argument("--processes", type=int, default=None, help="fresh processes (default 5)")
    parser.add_argument("--rounds", type=int, default=10, help="tuner rounds")
    parser.add_argument("--tie-band", type=float, default=0.02, help="tuner tie band")
    parser.add_argument("--plot", default=None, help="draw the first process's tuning plots here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per child process")
    return common.run_parent_or_child(parser, "bench_retune", child, parent)


if __name__ == "__main__":
    sys.exit(main())
