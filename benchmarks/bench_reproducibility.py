"""Reproducibility: which config each fresh process launches, stock ``@triton.autotune`` vs pinned.

    PYTHONPATH=. python benchmarks/bench_reproducibility.py [--processes 10] \
        [--table configs/sm90/matmul.msgpack]
    PYTHONPATH=. python benchmarks/bench_reproducibility.py --smoke      # CPU check of the code paths

Starts ``--processes`` fresh processes per mode, alternating stock and pinned so clock and thermal
drift hit both alike. Each runs the reference matmul on the issue's bf16 shapes and reports, per
shape, the config it launched, its throughput, and the throughput of one fixed config launched
directly (the noise floor of timing a config that never changes). The fixed config is the table's
config for the shape (what pinned processes launch; ``MATMUL_CONFIGS[0]`` without a table entry),
so in pinned processes both numbers time the same kernel: the autotuned call and the direct
launch alternate over ``ROUNDS`` rounds and each reports its median, so drift hits both alike. All
processes share one Triton compile cache (warm after the first); Triton's autotune result cache
stays off, as by default.

Goal: pinned = 1 config per shape in 100% of processes; pinned throughput spread no larger than
the fixed config's.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from typing import Any

import common

FIXED_CONFIG_INDEX = 0  # MATMUL_CONFIGS[0]: the fixed config where the table has no entry
ROUNDS = 3  # interleaved (autotuned call, direct launch) timing rounds per shape


def child(args: argparse.Namespace) -> None:
    from megatron_tuning import kernels as mm
    from megatron_tuning.core.decisions import get_decisions
    from megatron_tuning.core.identity import config_signature
    from megatron_tuning.tables.table import load_table

    kernel = mm.matmul_kernel
    if args.child == "pinned":
        common.install_pinned([args.table] if args.table else [])
    elif args.smoke:
        common.allow_stock_autotune_on_cpu(kernel)
    table = load_table(args.table) if args.table else None
    rows = []
    for shape in _shapes(args):
        _, _, _, kargs = common.matmul_operands(shape, args.smoke)
        grid = mm.matmul_grid(shape[0], shape[1])
        common.synchronize(args.smoke)
        start = time.perf_counter()
        kernel[grid](*kargs)
        common.synchronize(args.smoke)
        first_s = time.perf_counter() - start
        signature = config_signature(kernel.best_config)
        fixed = _table_config(table, kernel, kargs) or mm.MATMUL_CONFIGS[FIXED_CONFIG_INDEX]
        timed: dict[str, list[float]] = {"call": [], "fixed": []}
        for round_index in range(ROUNDS):
            # The lambdas run inside this iteration (time_ms calls them at once): late binding is fine.
            steps = [
                ("call", lambda: kernel[grid](*kargs)),  # noqa: B023
                ("fixed", lambda: common.launch_config(kernel, fixed, kargs, grid)),  # noqa: B023
            ]
            for name, fn in steps if round_index % 2 == 0 else steps[::-1]:
                timed[name].append(common.time_ms(fn, args.smoke, warmup=10, rep=50))
        ms, fixed_ms = statistics.median(timed["call"]), statistics.median(timed["fixed"])
        sources = [d.source for d in get_decisions() if d.signature == signature]
        rows.append(
            {
                "shape": common.shape_name(shape),
                "signature": signature,
                "ms": ms,
                "tflops": common.tflops(shape, ms),
                "fixed_ms": fixed_ms,
                "fixed_signature": config_signature(fixed),
                "fixed_tflops": common.tflops(shape, fixed_ms),
                "first_launch_s": first_s,
                "source": sources[-1] if sources else "stock",
            }
        )
    common.emit({"mode": args.child, "rows": rows})


def _table_config(table: Any, kernel: Any, kargs: tuple) -> Any:
    """The live config the table pins for this call, or None."""
    from megatron_tuning import tuning_key
    from megatron_tuning.core.identity import arch_tag, config_signature, kernel_id

    entry = table.get(arch_tag(), kernel_id(kernel), tuning_key(kernel, kargs, {})) if table else None
    if entry is None:
        return None
    wanted = config_signature(entry.config)
    return next((c for c in kernel.configs if config_signature(c) == wanted), None)


def _shapes(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    return common.SMOKE_MATMUL_SHAPES if args.smoke else common.MATMUL_SHAPES


def parent(args: argparse.Namespace) -> int:
    processes = args.processes if args.processes is not None else (2 if args.smoke else 10)
    table = args.table if args.table is not None else common.default_matmul_table()
    if table is None:
        print(
            "warning: no matmul table (configs/sm90/matmul.msgpack); pinned processes fall back to the "
            "cheapest config (still pinned, but slow). Run make_sm90_tables.py first.",
            file=sys.stderr,
        )
    runs: dict[str, list[dict[str, Any]]] = {"stock": [], "pinned": []}
    with tempfile.TemporaryDirectory(prefix="mt_repro_cache_") as cache:
        env = common.child_env(args.smoke, TRITON_CACHE_DIR=cache)
        for i in range(processes):
            order = ("stock", "pinned") if i % 2 == 0 else ("pinned", "stock")
            for mode in order:
                argv = (
                    ["--child", mode]
                    + (["--smoke"] if args.smoke else [])
                    + (["--table", table] if table else [])
                )
                result = common.run_child("bench_reproducibility.py", argv, env, timeout=args.timeout)
                runs[mode].append(result)
                print(
                    f"process {i + 1}/{processes} {mode}: "
                    + ", ".join(f"{r['shape']} {r['tflops']:.4g} TF/s" for r in result["rows"]),
                    flush=True,
                )
    summary = summarize(runs)
    common.print_table(
        [
            "shape",
            "mode",
            "processes",
            "distinct configs",
            "TF/s median",
            "min",
            "max",
            "spread %",
            "fixed-config spread %",
            "sources",
        ],
        [
            [
                s["shape"],
                s["mode"],
                s["processes"],
                s["distinct_configs"],
                s["tflops"]["median"],
                s["tflops"]["min"],
                s["tflops"]["max"],
                100 * s["tflops"]["rel_range"],
                100 * s["fixed_tflops"]["rel_range"],
                ",".join(sorted(s["sources"])),
            ]
            for s in summary
        ],
    )
    common.write_results(
        args.out,
        "reproducibility",
        processes=processes,
        table=table,
        summary=summary,
        runs=runs,
    )
    return 0


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for mode, results in runs.items():
        by_shape: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for result in results:
            for row in result["rows"]:
                by_shape[row["shape"]].append(row)
        for shape, rows in by_shape.items():
            counts = collections.Counter(r["signature"] for r in rows)
            out.append(
                {
                    "shape": shape,
                    "mode": mode,
                    "processes": len(rows),
                    "distinct_configs": len(counts),
                    "configs": dict(counts.most_common()),
                    "sources": sorted({r["source"] for r in rows}),
                    "tflops": common.spread([r["tflops"] for r in rows]),
                    "fixed_tflops": common.spread([r["fixed_tflops"] for r in rows]),
                    "first_launch_s": common.spread([r["first_launch_s"] for r in rows]),
                }
            )
    return sorted(out, key=lambda s: (s["shape"], s["mode"]))


def main() -> int:
    parser = common.script_parser(__doc__)
    parser.add_argument("--processes", type=int, default=None, help="fresh processes per mode (default 10)")
    parser.add_argument(
        "--table", default=None, help="table for the pinned mode (default configs/sm90/matmul.msgpack)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per child process")
    return common.run_parent_or_child(parser, "bench_reproducibility", child, parent)


if __name__ == "__main__":
    sys.exit(main())
