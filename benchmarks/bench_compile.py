"""torch.compile launches the pinned config: eager vs compiled, stock vs pinned, fresh processes.

    PYTHONPATH=. python benchmarks/bench_compile.py --out compile.json     # H200: about 3 minutes
    PYTHONPATH=. python benchmarks/bench_compile.py --smoke                # CPU check of the code paths

Issue 10's measurement, repeated for the fix. For each compile kind (``static``: fullgraph,
``dynamic=False``; ``dynamic``: ``dynamic=True``; ``reduce-overhead``: CUDA graphs) and each
variant (``stock``: no library; ``pinned``: ``init_deterministic_tuning()`` with the default
policy), ``--processes`` fresh processes each run, for two kernels:

* ``tests/support_kernels.write_block_kernel`` (4 configs, writes its ``BLOCK`` into its output, so the
  launched config is read back from the result, CUDA-graph replays included), keys n=1000, 2000;
* the reference ``megatron_tuning.kernels`` (18 configs, bf16), keys 512^3 and 4096^3,
  both in the shipped sm90 table.

Per kernel: the first key is launched eagerly, then compiled (several calls: warm-up, capture and
replays under ``reduce-overhead``); the second key is first seen in compiled code, then launched
eagerly. Compiled matmul launches are read from Inductor's ``CachingAutotuner.run`` (the config of
its launcher). Counted: Inductor ``benchmark_all_configs`` calls for user kernels, Triton
``Autotuner._bench`` calls, decisions in the log. Each process gets a fresh Inductor cache (no FX
graph or autotune cache hits); all share one Triton compile cache made fresh for this run
(``--fresh-triton-cache`` gives each process its own, as issue 10 measured; slower). Pinned
processes time nothing, so ``--jobs`` of them run at once; stock processes run one at a time.
Triton benchmark counts are per kernel over the whole process.

Last, a ``bypass`` process simulates a torch the library cannot intercept (the hook is not
installed) under ``MEGATRON_TUNING_STRICT=1``: the compiled launch must raise
``CompiledLaunchNotPinnedError`` naming kernel and key, after ``init`` warned.

Goal (pinned): per key, 1 config across all processes, eager == compiled in every process,
0 Inductor and 0 Triton benchmark calls, 1 decision per key per process. Exit 1 if missed.

Code: this script is the parent (processes, summary, goals); ``compile_child`` is one process.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import sys
import tempfile
import time
from typing import Any

import common
from compile_child import child

KINDS = ("static", "dynamic", "reduce-overhead")
VARIANTS = ("stock", "pinned")
MM_KERNEL = "megatron_tuning.kernels:matmul_kernel"
WB_KERNEL = "tests.support_kernels:write_block_kernel"
FUNCTION = {"write_block": "write_block_kernel", "matmul": "matmul_kernel"}  # Triton bench counts' keys


def parent(args: argparse.Namespace) -> int:
    processes = args.processes if args.processes is not None else (1 if args.smoke else 3)
    kinds = [k for k in args.kinds.split(",") if k] if args.kinds else list(KINDS)
    if args.smoke:
        kinds = [k for k in kinds if k != "reduce-overhead"]  # CUDA graphs need a GPU
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        print(f"unknown kinds {unknown}; choose from {','.join(KINDS)}", file=sys.stderr)
        return 2
    jobs = [
        (variant, kind, f"{i}-{kind}-{variant}")
        for i in range(processes)
        for kind in kinds
        for variant in VARIANTS
    ]
    if not args.smoke:
        jobs.append(("bypass", "static", "bypass"))
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mt_compile_") as tmp:
        shared_triton = f"{tmp}/triton"

        def run(job: tuple[str, str, str]) -> dict[str, Any]:
            return _run(args, *job, tmp=tmp, shared_triton=shared_triton)

        # Pinned processes measure nothing, so they may share the GPU: --jobs at a time. Stock
        # processes autotune by timing, so they run one at a time, after the pinned ones.
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            runs += pool.map(run, [job for job in jobs if job[0] != "stock"])
        runs += [run(job) for job in jobs if job[0] == "stock"]
    summary = summarize(runs)
    bypass = next((r for r in runs if r["variant"] == "bypass"), None)
    goals = check_goals(summary, bypass)
    _print(summary, bypass, goals, time.perf_counter() - started)
    common.write_results(
        args.out,
        "compile",
        processes=processes,
        kinds=kinds,
        summary=summary,
        bypass=bypass,
        goals=goals,
        runs=runs,
    )
    return 0 if all(g["met"] for g in goals) or args.smoke else 1


def _run(
    args: argparse.Namespace, variant: str, kind: str, tag: str, *, tmp: str, shared_triton: str
) -> dict[str, Any]:
    env = common.child_env(
        args.smoke,
        TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor-{tag}",
        TRITON_CACHE_DIR=f"{tmp}/triton-{tag}" if args.fresh_triton_cache else shared_triton,
        # Compile in-process: no worker pool to start per process (choices do not depend on it).
        TORCHINDUCTOR_COMPILE_THREADS="1",
    )
    argv = ["--child", f"{variant},{kind}"] + (["--smoke"] if args.smoke else [])
    start = time.perf_counter()
    result = common.run_child("bench_compile.py", argv, env, timeout=args.timeout)
    result["process_s"] = time.perf_counter() - start
    launched = ", ".join(
        f"{r['kernel']} {r['key']}: {r.get('eager')} / {r['compiled'][0]}" for r in result["rows"]
    )
    print(f"process {tag}: {result['process_s']:.1f}s eager/compiled {launched}", flush=True)
    return result


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, str, str], list[tuple[dict[str, Any], dict[str, Any]]]] = (
        collections.defaultdict(list)
    )
    for run in runs:
        if run["variant"] == "bypass":
            continue
        for row in run["rows"]:
            groups[(row["kernel"], row["key"], run["variant"], run["kind"])].append((run, row))
    out = []
    for (kernel, key, variant, kind), items in sorted(groups.items()):
        eager = collections.Counter(row.get("eager") for _, row in items)
        compiled = collections.Counter(c for _, row in items for c in row["compiled"])
        match = sum(1 for _, row in items if set(row["compiled"]) == {row.get("eager")})
        kernel_id = MM_KERNEL if kernel == "matmul" else WB_KERNEL
        key_prefix = _key_prefix(kernel, key)
        decisions = [
            sum(1 for d in run["decisions"] if d[0] == kernel_id and d[1].startswith(key_prefix))
            for run, _ in items
        ]
        out.append(
            {
                "kernel": kernel,
                "key": key,
                "first_seen": items[0][1]["first"],
                "variant": variant,
                "kind": kind,
                "processes": len(items),
                "eager_configs": dict(eager.most_common()),
                "compiled_configs": dict(compiled.most_common()),
                "eager_equals_compiled": match,
                "inductor_benchmarks": sum(run["inductor_bench"].get(kernel, 0) for run, _ in items),
                "triton_benchmarks": sum(run["triton_bench"].get(FUNCTION[kernel], 0) for run, _ in items),
                "configs_compiled": sorted({n for _, row in items for n in row["inductor_configs_compiled"]}),
                "decisions_per_process": decisions,
                "sources": sorted(
                    {
                        d[3]
                        for run, _ in items
                        for d in run["decisions"]
                        if d[0] == kernel_id and d[1].startswith(key_prefix)
                    }
                ),
                "errors": [run["error"] for run, _ in items if "error" in run],
            }
        )
    return out


def _key_prefix(kernel: str, key: str) -> str:
    if kernel == "write_block":
        return f"n={key} |"
    m, n, k = (int(v) for v in key.strip("()").split(","))
    return f"M={m}, N={n}, K={k} |"


def check_goals(summary: list[dict[str, Any]], bypass: dict[str, Any] | None) -> list[dict[str, Any]]:
    goals = []
    for s in summary:
        if s["variant"] != "pinned":
            continue
        problems = []
        if len(s["compiled_configs"]) != 1 or set(s["compiled_configs"]) != set(s["eager_configs"]):
            problems.append("more than one config, or compiled != eager")
        if s["eager_equals_compiled"] != s["processes"]:
            problems.append(
                f"eager == compiled in only {s['eager_equals_compiled']}/{s['processes']} processes"
            )
        if s["inductor_benchmarks"] or s["triton_benchmarks"]:
            problems.append(
                f"benchmarks: Inductor {s['inductor_benchmarks']}, Triton {s['triton_benchmarks']}"
            )
        if any(n != 1 for n in s["decisions_per_process"]):
            problems.append(f"decisions per process {s['decisions_per_process']}")
        if s["errors"]:
            problems.append(f"errors {s['errors']}")
        goals.append(
            {
                "what": f"pinned {s['kernel']} {s['key']} {s['kind']}",
                "met": not problems,
                "problems": problems,
            }
        )
    if bypass is not None:
        error = bypass.get("error") or {}
        message = error.get("message", "")
        met = (
            (error.get("type") == "CompiledLaunchNotPinnedError" or "bypassed the pinned config" in message)
            and WB_KERNEL in message
            and "n=1000" in message
            and any("cannot be intercepted" in w for w in bypass["warnings"])
        )
        goals.append(
            {
                "what": "bypass under strict raises, after a warning",
                "met": met,
                "problems": [] if met else [error],
            }
        )
    return goals


def _print(
    summary: list[dict[str, Any]], bypass: dict[str, Any] | None, goals: list[dict[str, Any]], seconds: float
) -> None:
    common.print_table(
        [
            "kernel",
            "key",
            "first",
            "variant",
            "kind",
            "procs",
            "eager configs",
            "compiled configs",
            "eager==compiled",
            "Inductor bench",
            "Triton bench",
            "configs compiled",
            "decisions/proc",
            "sources",
        ],
        [
            [
                s["kernel"],
                s["key"],
                s["first_seen"],
                s["variant"],
                s["kind"],
                s["processes"],
                _counts(s["eager_configs"]),
                _counts(s["compiled_configs"]),
                f"{s['eager_equals_compiled']}/{s['processes']}",
                s["inductor_benchmarks"],
                s["triton_benchmarks"],
                ",".join(str(n) for n in s["configs_compiled"]) or "-",
                ",".join(str(n) for n in s["decisions_per_process"]),
                ",".join(s["sources"]) or "-",
            ]
            for s in summary
        ],
    )
    if bypass is not None:
        error = bypass.get("error") or {}
        print(f"bypass (strict, hook not installed): {error.get('type')}: {error.get('message', '')[:300]}")
        for warning in bypass["warnings"][:2]:
            print(f"  warning: {warning[:300]}")
    missed = [g for g in goals if not g["met"]]
    print(
        f"goals: {len(goals) - len(missed)}/{len(goals)} met in {seconds:.0f}s"
        + "".join(f"\n  MISSED {g['what']}: {'; '.join(str(p) for p in g['problems'])}" for g in missed)
    )


def _counts(counter: dict[str, int]) -> str:
    return " | ".join(f"{config} x{count}" for config, count in counter.items())


def main() -> int:
    parser = common.script_parser(__doc__)
    parser.add_argument(
        "--processes", type=int, default=None, help="fresh processes per variant and kind (default 3)"
    )
    parser.add_argument("--kinds", default=None, help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument(
        "--fresh-triton-cache", action="store_true", help="a fresh Triton compile cache per process (slower)"
    )
    parser.add_argument(
        "--jobs", type=int, default=3, help="pinned processes run at the same time (default 3)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per child process")
    return common.run_parent_or_child(parser, "bench_compile", child, parent)


if __name__ == "__main__":
    sys.exit(main())
