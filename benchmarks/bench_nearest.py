"""Nearest-shape fallback on held-out shapes: how close to the best does a miss launch?

    PYTHONPATH=. python benchmarks/bench_nearest.py --out nearest.json      # GPU, ~2-3 minutes
    PYTHONPATH=. python benchmarks/bench_nearest.py --smoke                 # plumbing check

One fresh process tunes the reference matmul (bf16) at M in {1024, ..., 16384} (N = K = 4096) with
``auto`` into a fresh cache, then, for M in {1536, 3072, 6144, 12288} (no entries), reports the
throughput of the miss rule's config (``choose``, ``on_miss='nearest'``: the nearest entry, or the
lower of two bracketing entries that disagree), of the single nearest entry's (the rule before the bracketing
refinement) and of the cheapest config, as fractions of the best candidate's. Every candidate is
timed with ``triton.testing.do_bench`` in ``--rounds`` interleaved rounds in that process.
Goal: >= 95% of the best (RESULTS section 9: 90.7% at M=1536 with the single nearest entry).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import common

TUNED_M = [1024, 2048, 4096, 8192, 16384]
QUERY_M = [1536, 3072, 6144, 12288]
NK = (4096, 4096)
SMOKE_TUNED_M = [16, 64]
SMOKE_QUERY_M = [24, 48]
SMOKE_NK = (32, 40)
GOAL = 0.95


def child(args: argparse.Namespace) -> None:
    """Tune the M sweep with auto, then judge the miss rule vs the cheapest on the M values in between."""
    import megatron_tuning
    from megatron_tuning import kernels as mm
    from megatron_tuning.core.choice import choose, match_live
    from megatron_tuning.core.fallback import cheapest
    from megatron_tuning.core.identity import arch_tag, config_signature, kernel_id, kernel_source_hash
    from megatron_tuning.core.key import tuning_key
    from megatron_tuning.tables.search import TableSet

    if args.smoke:  # one timed round: interpreted candidates are slow, and smoke numbers mean nothing
        os.environ["MEGATRON_TUNING_TUNE_ROUNDS"] = "1"
        common.allow_stock_autotune_on_cpu(mm.matmul_kernel)
    tuned_m, query_m = (SMOKE_TUNED_M, SMOKE_QUERY_M) if args.smoke else (TUNED_M, QUERY_M)
    n, k = SMOKE_NK if args.smoke else NK
    policy = megatron_tuning.TuningPolicy.from_env(  # smoke: MEGATRON_TUNING_TUNE_ROUNDS=1
        mode="auto",
        cache=args.cache,
        use_shipped_tables=False,
        scope=("megatron_tuning.kernels",),
        agreement="off",
    )
    with megatron_tuning.init_deterministic_tuning(policy):
        for m in tuned_m:
            _, _, _, kargs = common.matmul_operands((m, n, k), args.smoke)
            mm.matmul_kernel[mm.matmul_grid(m, n)](*kargs)
    common.synchronize(args.smoke)
    table = TableSet([args.cache], shipped_dir=None)
    configs = list(mm.MATMUL_CONFIGS)
    entries = _entries(args.cache)
    rows = []
    for m in query_m:
        shape = (m, n, k)
        _, _, _, kargs = common.matmul_operands(shape, args.smoke)
        key = tuning_key(mm.matmul_kernel, kargs, {})
        nearest = choose(mm.matmul_kernel, configs, key, table=table, on_miss="nearest")
        # The rule before the bracketing refinement: the nearest usable entry, whatever lies below.
        hits = table.lookup(
            kernel_id(mm.matmul_kernel),
            key,
            arch=arch_tag(),
            source_hash=kernel_source_hash(mm.matmul_kernel),
            nearest=True,
        )
        single = next(hit for hit in hits if match_live(hit.config, configs) is not None)
        single_config = match_live(single.config, configs)
        cheap = cheapest(configs)
        samples = common.time_configs_interleaved(
            mm.matmul_kernel,
            configs,
            kargs,
            mm.matmul_grid(m, n),
            rounds=args.rounds,
            rep_ms=args.rep_ms,
            smoke=args.smoke,
        )
        medians = {config_signature(c): statistics.median(s) for c, s in zip(configs, samples)}
        best_ms = min(medians.values())
        # What any rule that launches some entry's config could reach here: the best of them.
        held = {sig for sig in entries.values() if sig in medians}
        best_held = min(held, key=medians.__getitem__)
        rows.append(
            {
                "shape": common.shape_name(shape),
                "nearest_source": nearest.source,
                "nearest_entry": nearest.nearest_key,
                "nearest": config_signature(nearest.config),
                "nearest_ratio": best_ms / medians[config_signature(nearest.config)],
                "single_nearest_entry": single.key,
                "single_nearest": config_signature(single_config),
                "single_nearest_ratio": best_ms / medians[config_signature(single_config)],
                "cheapest": config_signature(cheap),
                "cheapest_ratio": best_ms / medians[config_signature(cheap)],
                "best": min(medians, key=medians.__getitem__),
                "best_tflops": common.tflops(shape, best_ms),
                "best_entry_config": best_held,
                "best_entry_config_ratio": best_ms / medians[best_held],
                "ratios": {sig: best_ms / ms for sig, ms in sorted(medians.items())},
            }
        )
    common.emit({"rows": rows, "entries": entries})


def _entries(path: str) -> dict[str, str]:
    """The tuned table's entries, key -> config signature (the table every rule chooses from)."""
    from megatron_tuning.core.identity import config_signature
    from megatron_tuning.tables.table import load_table

    return {e.key: config_signature(e.config) for e in load_table(path).values()}


def main() -> int:
    parser = common.script_parser(__doc__)
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds per candidate (default 5)"
    )
    parser.add_argument("--rep-ms", type=int, default=40, help="do_bench rep (ms) per sample")
    parser.add_argument("--timeout-s", type=float, default=400.0, help="limit for the measuring process")
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)  # the child's auto cache
    args = parser.parse_args()
    args.rounds = args.rounds or (2 if args.smoke else 5)
    if not common.require_device(args, "bench_nearest"):
        return 2
    if args.child:
        child(args)
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench_nearest_"))
    argv = ["--child", "nearest", "--cache", str(work / "auto.msgpack"), "--rounds", str(args.rounds)]
    argv += ["--rep-ms", str(args.rep_ms)] + (["--smoke"] if args.smoke else [])
    env = common.child_env(args.smoke, TRITON_CACHE_DIR=str(work / "triton_cache"))
    result = common.run_child("bench_nearest.py", argv, env, timeout=args.timeout_s)
    rows = result["rows"]
    common.print_table(
        [
            "shape",
            "rule % of best",
            "entry used",
            "single nearest %",
            "its entry",
            "cheapest %",
            "best entry config %",
            "best TF/s",
        ],
        [
            [
                r["shape"],
                100 * r["nearest_ratio"],
                (r["nearest_entry"] or r["nearest_source"]).split(",")[0],
                100 * r["single_nearest_ratio"],
                r["single_nearest_entry"].split(",")[0],
                100 * r["cheapest_ratio"],
                100 * r["best_entry_config_ratio"],
                r["best_tflops"],
            ]
            for r in rows
        ],
    )
    for key, signature in sorted(result["entries"].items()):
        print(f"entry {key.split(' | ')[0]}: {signature}")
    met = all(r["nearest_ratio"] >= GOAL for r in rows)
    print(f"goal rule >= {100 * GOAL:.0f}% of the best on every held-out shape: {'met' if met else 'MISSED'}")
    payload = {"benchmark": "nearest", "environment": common.environment(), "rounds": args.rounds}
    common.write_json(
        args.out,
        {
            **payload,
            "goal": {"ratio_min": GOAL, "met": met},
            "nearest": {"rows": rows, "entries": result["entries"]},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
