"""Record -> merge -> pin, end to end: the table workflow exactly as a user runs it on a GPU.

    PYTHONPATH=. python benchmarks/record_merge_e2e.py [--processes 4] [--out results.json]
    PYTHONPATH=. python benchmarks/record_merge_e2e.py --smoke       # CPU check of the code paths

1. ``--processes`` fresh processes (``RANK=0..P-1``, like the ranks of one job) each run the
   reference matmul shapes under ``MEGATRON_TUNING_MODE=record``: Triton autotunes as usual and
   every winner, with its timings, goes to ``recording-rankNNNNN.msgpack`` in one folder.
2. ``python -m megatron_tuning merge`` votes the recordings into one table and reports every entry
   where the processes disagreed: stock autotune's instability, measured on this machine.
3. One more fresh process runs the same shapes pinned to the merged table with
   ``MEGATRON_TUNING_ON_MISS=error``: every launch must come from the table, and a benchmark
   attempt would raise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import common


def child(args: argparse.Namespace) -> None:
    import megatron_tuning
    from megatron_tuning import kernels as mm

    handle = megatron_tuning.init_deterministic_tuning()  # mode, table, record dir from the env
    if args.smoke and args.child == "record":
        common.allow_stock_autotune_on_cpu(mm.matmul_kernel)
    for shape in common.SMOKE_MATMUL_SHAPES if args.smoke else common.MATMUL_SHAPES:
        _, _, _, kargs = common.matmul_operands(shape, args.smoke)
        mm.matmul_kernel[mm.matmul_grid(shape[0], shape[1])](*kargs)
    common.synchronize(args.smoke)
    decisions = [
        {"key": d.key, "signature": d.signature, "source": d.source, "origin": d.origin}
        for d in megatron_tuning.get_decisions()
    ]
    handle.close()  # record mode: writes this rank's recording
    common.emit({"mode": args.child, "decisions": decisions})


def parent(args: argparse.Namespace) -> int:
    processes = args.processes if args.processes is not None else (2 if args.smoke else 4)
    smoke = ["--smoke"] if args.smoke else []
    with tempfile.TemporaryDirectory(prefix="mt_record_") as work:
        recordings = os.path.join(work, "recordings")
        merged = os.path.join(work, "merged.msgpack")
        base = common.child_env(args.smoke, TRITON_CACHE_DIR=os.path.join(work, "triton_cache"))
        recorded = []
        for rank in range(processes):
            env = dict(
                base, MEGATRON_TUNING_MODE="record", MEGATRON_TUNING_RECORD_DIR=recordings, RANK=str(rank)
            )
            result = common.run_child("record_merge_e2e.py", ["--child", "record", *smoke], env, args.timeout)
            recorded.append(result["decisions"])
            print(f"process {rank}: " + "; ".join(d["signature"] for d in result["decisions"]), flush=True)

        merge = subprocess.run(
            [sys.executable, "-m", "megatron_tuning", "merge", merged, recordings, "--json"],
            env=base,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        report = json.loads(merge.stdout)
        show = subprocess.run(
            [sys.executable, "-m", "megatron_tuning", "show", merged],
            env=base,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        print(show.stdout)

        env = dict(
            base,
            MEGATRON_TUNING_MODE="deterministic",
            MEGATRON_TUNING_TABLE=merged,
            MEGATRON_TUNING_ON_MISS="error",
            MEGATRON_TUNING_SHIPPED_TABLES="0",
        )
        pinned = common.run_child("record_merge_e2e.py", ["--child", "pinned", *smoke], env, args.timeout)

    rows = []
    disagreements = {d["key"]: d for d in report["disagreements"]}
    for position, decision in enumerate(pinned["decisions"]):
        winners = {run[position]["signature"] for run in recorded}
        split = disagreements.get(decision["key"])
        rows.append(
            {
                "key": decision["key"].split(" |")[0],
                "distinct_recorded": len(winners),
                "votes": [v["votes"] for v in split["votes"]] if split else [processes],
                "pinned_signature": decision["signature"],
                "pinned_source": decision["source"],
            }
        )
    common.print_table(
        ["key", "distinct winners recorded", "votes", "pinned source", "pinned config"],
        [
            [r["key"], r["distinct_recorded"], r["votes"], r["pinned_source"], r["pinned_signature"]]
            for r in rows
        ],
    )
    all_hits = all(r["pinned_source"] == "table" for r in rows)
    print(
        f"{len(report['disagreements'])} of {report['entries']} merged entries had disagreeing recordings; "
        f"pinned run: {'every launch a table hit' if all_hits else 'NOT every launch a table hit'}"
    )
    common.write_results(
        args.out,
        "record_merge_e2e",
        processes=processes,
        merge=report,
        recorded=recorded,
        pinned=pinned["decisions"],
        rows=rows,
    )
    return 0 if all_hits else 1


def main() -> int:
    parser = common.script_parser(__doc__)
    parser.add_argument("--processes", type=int, default=None, help="recording processes (default 4)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per child process")
    return common.run_parent_or_child(parser, "record_merge_e2e", child, parent)


if __name__ == "__main__":
    sys.exit(main())
