"""Tuned quality: the pinned config's median throughput vs the best candidate's, per shape.

    PYTHONPATH=. python benchmarks/bench_quality.py [--table configs/sm90/matmul.msgpack] [--rounds 5]
    PYTHONPATH=. python benchmarks/bench_quality.py --smoke      # CPU check of the code paths

One process. For each reference matmul shape, every candidate config is launched directly
(bypassing the autotuner) and timed with ``triton.testing.do_bench`` in ``--rounds`` interleaved
rounds with a rotating start; the pinned config is the table's entry for that shape. Reports
pinned median throughput / best candidate median throughput. Goal: >= 98%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import common


def measure(args: argparse.Namespace, table_path: str | None) -> list[dict[str, Any]]:
    from megatron_tuning import kernels as mm
    from megatron_tuning import tuning_key
    from megatron_tuning.core.fallback import cheapest
    from megatron_tuning.core.identity import arch_tag, config_signature, kernel_id

    kernel = mm.matmul_kernel
    configs = list(mm.MATMUL_CONFIGS)
    signatures = [config_signature(c) for c in configs]
    tables = None
    if table_path:
        from megatron_tuning.tables.search import TableSet

        tables = TableSet([table_path], shipped_dir=None)
    rows = []
    for shape in common.SMOKE_MATMUL_SHAPES if args.smoke else common.MATMUL_SHAPES:
        _, _, _, kargs = common.matmul_operands(shape, args.smoke)
        grid = mm.matmul_grid(shape[0], shape[1])
        key = tuning_key(kernel, kargs, {})
        found = tables.lookup(kernel_id(kernel), key, arch=arch_tag()) if tables is not None else []
        pinned = config_signature(found[0].config) if found else config_signature(cheapest(configs))
        samples = common.time_configs_interleaved(
            kernel, configs, kargs, grid, rounds=args.rounds, rep_ms=args.rep_ms, smoke=args.smoke
        )
        medians = [statistics.median(s) for s in samples]
        best = min(range(len(configs)), key=lambda i: medians[i])
        p = signatures.index(pinned) if pinned in signatures else None
        pinned_ms = medians[p] if p is not None else float("nan")
        rows.append(
            {
                "shape": common.shape_name(shape),
                "key": key,
                "pinned": pinned,
                "pinned_from": "table" if found else "cheapest (no table entry)",
                "pinned_ms": pinned_ms,
                "pinned_tflops": common.tflops(shape, pinned_ms),
                "best": signatures[best],
                "best_ms": medians[best],
                "best_tflops": common.tflops(shape, medians[best]),
                "quality": medians[best] / pinned_ms if pinned_ms == pinned_ms else float("nan"),
                "candidates": {signatures[i]: samples[i] for i in range(len(configs))},
            }
        )
        print(
            f"{rows[-1]['shape']}: pinned {rows[-1]['pinned_tflops']:.4g} TF/s, "
            f"best {rows[-1]['best_tflops']:.4g} "
            f"TF/s ({100 * rows[-1]['quality']:.1f}%)",
            flush=True,
        )
    return rows


def main() -> int:
    parser = common.script_parser(__doc__)
    parser.add_argument("--table", default=None, help="pinned configs (default configs/sm90/matmul.msgpack)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds per candidate (default 5)"
    )
    parser.add_argument("--rep-ms", type=int, default=40, help="do_bench rep (ms) per sample")
    args = parser.parse_args()
    if not common.require_device(args, "bench_quality"):
        return 2
    args.rounds = args.rounds or (2 if args.smoke else 5)
    table = args.table if args.table is not None else common.default_matmul_table()
    if table is None:
        print("warning: no matmul table; comparing against the cheapest config instead", file=sys.stderr)
    rows = measure(args, table)
    common.print_table(
        ["shape", "pinned TF/s", "best TF/s", "quality %", "goal", "pinned from", "pinned == best"],
        [
            [
                r["shape"],
                r["pinned_tflops"],
                r["best_tflops"],
                100 * r["quality"],
                ">= 98%",
                r["pinned_from"],
                r["pinned"] == r["best"],
            ]
            for r in rows
        ],
    )
    common.write_results(
        args.out,
        "quality",
        table=table,
        rounds=args.rounds,
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
