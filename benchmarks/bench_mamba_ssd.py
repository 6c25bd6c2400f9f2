"""A real third-party workload: megatron-core's Mamba SSD Triton kernels, stock vs pinned vs tuned.

    # one process, one mode; appends one JSON line to --out
    PYTHONPATH=.:/tmp/site python3 benchmarks/bench_mamba_ssd.py --mode stock --out runs.jsonl
    # the driver: fresh processes per mode, then a summary table
    PYTHONPATH=.:/tmp/site python3 benchmarks/bench_mamba_ssd.py --driver --processes 4 \
        --work-dir /tmp/mamba_bench --out runs.jsonl --summary-out summary.json
    # CPU check of every code path (Triton interpreter, tiny fp32 shapes; numbers meaningless)
    PYTHONPATH=.:/tmp/site python3 benchmarks/bench_mamba_ssd.py --driver --smoke
    # the kernel inventory: configs, keys, megatron's and our cheapest pick (no GPU needed)
    PYTHONPATH=.:/tmp/site python3 benchmarks/bench_mamba_ssd.py --list-kernels
    # the summary again from recorded runs (no GPU, no megatron-core)
    PYTHONPATH=. python3 benchmarks/bench_mamba_ssd.py --summarize runs.jsonl

The workload is the prefill path of megatron-core's ``MambaMixer`` in dynamic inference
(megatron-core 0.19.2, unedited): ``causal_conv1d_varlen_fn`` (optional, ``--no-conv`` drops it)
then ``mamba_chunk_scan_combined_varlen`` on one packed batch of ``--lens`` sequences (default
16384 tokens in 4 sequences of uneven length), 64 heads x head dim 64, state 128, chunk 256, bf16.
Together they launch 6 of the 7 ``@triton.autotune`` kernels in ``megatron.core.ssm.ops``
(``_chunk_state_varlen_kernel`` has no caller in 0.19.2). The SSD ops are forward only: they
have no autograd, so there is no backward to time.

Modes (each worker is ONE fresh process):

* ``stock``: plain Triton autotune of the full config lists (``MAMBA_DETERMINISTIC`` unset).
* ``mamba_deterministic``: megatron's own rule, ``MAMBA_DETERMINISTIC=1`` before the import: the
  config lists are cut to one config (cheapest by block product x stages, then warps) at
  decoration time, with ``TRITON_CACHE_AUTOTUNING`` not ``1`` (the driver sets ``0``).
* ``ours_cheapest``: ``init_deterministic_tuning(TuningPolicy(mode="deterministic",
  scope=("megatron.core",), on_miss="min_cost"))`` on the full lists (no table has these kernels).
* ``ours_default``: ``init_deterministic_tuning()`` with only ``MEGATRON_TUNING_SCOPE=megatron.core``
  in the environment (the env path; ``on_miss`` defaults to ``min_cost``, so same rule).
* ``auto``: ``TuningPolicy.from_env(mode="auto", scope=("megatron.core",))``; its cache table path
  comes from ``MEGATRON_TUNING_CACHE``, which the driver sets (empty for the first auto
  process, reused by the later ones). A library without mode ``auto`` is reported, not fatal.

Each worker: installs counters (``Autotuner._bench`` calls that reach Triton's own benchmarking,
``triton.testing.do_bench`` calls, kernel launches), imports the ops, installs the policy, builds
the inputs from a fixed seed, times the first step by wall clock (autotune + compile-cache load,
with ``cuda.synchronize``), then the steady state (CUDA events, median of ``--steps`` after
``--warmup``) and each kernel's share; records the config every autotuned kernel actually
launched (read off the launch itself, the same way for every mode), Triton's ``autotuner.cache``
and the decision log; hashes the outputs (sha256 of the bytes); checks the first ``--ref-tokens``
tokens against a sequential fp32 recurrence (written here from the SSM definition).

Import: ``--import-style stub`` (default) imports ``megatron.core.ssm.ops`` without running
``megatron/core/__init__.py`` (same files and module names, so kernel ids and the ``megatron.core``
scope are the real ones); ``plain`` does the ordinary import (``mamba_workload.import_ops``).

Driver: one shared ``TRITON_CACHE_DIR`` (``--compile-cache shared``, default) warmed by one
uncounted stock "prewarm" process that compiles every candidate (its first step is the cold-compile
number), or one per mode (``per-mode``, each warmed by its own prewarm). Triton's autotune result
cache is off (``TRITON_CACHE_AUTOTUNING=0``) in every process. Modes run round-robin,
``--processes`` rounds, so drift hits all alike; no new round starts once ``--budget-s`` would be
exceeded.

Code: this script is the command line and the driver; ``mamba_worker`` is one worker process,
``mamba_summary`` the summary of their JSON lines, ``mamba_workload`` megatron's ops and inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import mamba_workload as mw
from mamba_summary import print_summary, summarize
from mamba_worker import SCOPE, SCRUB, SCRUB_PREFIXES, fake_worker, worker

SCRIPT = "bench_mamba_ssd.py"
MODES = ("stock", "mamba_deterministic", "ours_cheapest", "ours_default", "auto")
DEFAULT_MODES = ("stock", "mamba_deterministic", "ours_cheapest", "auto")


# =========================================================================== driver (fresh processes)


def child_env(
    args: argparse.Namespace, mode: str, compile_cache: Path, tuning_cache: Path | None
) -> dict[str, str]:
    env = common.child_env(args.smoke)
    for key in list(env):
        if key in SCRUB or key.startswith(SCRUB_PREFIXES) or key.startswith("MEGATRON_TUNING_"):
            env.pop(key)
    env["TRITON_CACHE_DIR"] = str(compile_cache)
    env["TRITON_CACHE_AUTOTUNING"] = "0"
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
    if mode == "mamba_deterministic":
        env["MAMBA_DETERMINISTIC"] = "1"
    if mode == "ours_default":
        env["MEGATRON_TUNING_SCOPE"] = ",".join(SCOPE)
    if mode == "auto" and tuning_cache is not None:
        env["MEGATRON_TUNING_CACHE"] = str(tuning_cache)
    return env


def worker_argv(args: argparse.Namespace, mode: str, tag: str) -> list[str]:
    argv = ["--mode", mode, "--tag", tag, "--import-style", args.import_style]
    for name in ("steps", "warmup", "kernel_steps", "ref_tokens"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.lens:
        argv += ["--lens", *map(str, args.lens)]
    for name in mw.SHAPE_FIELDS:
        if getattr(args, name) is not None:
            argv += [f"--{name}", str(getattr(args, name))]
    flags = {"--no-conv": args.no_conv, "--smoke": args.smoke, "--fake-worker": args.fake_worker}
    return argv + [flag for flag, on in flags.items() if on]


def run_worker(
    args: argparse.Namespace, mode: str, tag: str, env: dict[str, str], round_index: int | None = None
) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        result = common.run_child(SCRIPT, worker_argv(args, mode, tag), env, timeout=args.timeout)
    except Exception as exc:  # crashed or timed out: keep going, report it
        result = {"mode": mode, "tag": tag, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
    result["wall_s"] = time.perf_counter() - started
    if round_index is not None:
        result["round"] = round_index
    if args.out:
        common.append_jsonl(args.out, result)
    status = "ok" if result.get("ok") else f"FAILED: {result.get('error', '?')[:300]}"
    print(
        f"process {tag:>10s} {mode:20s} {result['wall_s']:6.1f}s  "
        f"first step {result.get('first_step_s', float('nan')):7.3f}s  "
        f"steady {result.get('steady_ms', {}).get('median', float('nan')):8.4f} ms  "
        f"bench calls {result.get('triton_bench_calls', '-')}  "
        f"out {result.get('out', {}).get('all', '-')}  {status}",
        flush=True,
    )
    return result


def driver(args: argparse.Namespace) -> int:
    modes = list(args.modes or DEFAULT_MODES)
    processes = args.processes if args.processes is not None else (2 if args.smoke else 4)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="mamba_ssd_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    print(json.dumps(common.environment()))
    print(
        f"modes {modes}, {processes} process(es) each, work dir {work}, budget {args.budget_s:.0f}s",
        flush=True,
    )
    t_start = time.perf_counter()

    def compile_cache(mode: str) -> Path:
        return work / ("triton_cache" if args.compile_cache == "shared" else f"triton_cache_{mode}")

    auto_cache = work / "auto_cache"
    if auto_cache.exists():
        shutil.rmtree(auto_cache)
    auto_cache.mkdir()
    tuning_cache = auto_cache / "tuning_cache.msgpack"  # the library reads MEGATRON_TUNING_CACHE

    runs: list[dict[str, Any]] = []
    if args.prewarm:
        for mode in ["stock"] if args.compile_cache == "shared" else modes:
            throwaway = work / f"prewarm_tuning_cache_{mode}.msgpack"
            with contextlib.suppress(FileNotFoundError):
                throwaway.unlink()
            runs.append(
                run_worker(args, mode, "prewarm", child_env(args, mode, compile_cache(mode), throwaway))
            )

    skipped = []
    auto_unsupported = False
    round_s: list[float] = []
    for index in range(processes):
        elapsed = time.perf_counter() - t_start
        expected = max(round_s) if round_s else 0.0
        if index and elapsed + expected > args.budget_s:
            skipped.append(
                f"rounds {index + 1}..{processes} "
                f"(elapsed {elapsed:.0f}s + ~{expected:.0f}s/round > {args.budget_s:.0f}s)"
            )
            break
        t_round = time.perf_counter()
        for mode in modes if index % 2 == 0 else modes[::-1]:
            if mode == "auto" and auto_unsupported:
                continue
            env = child_env(args, mode, compile_cache(mode), tuning_cache if mode == "auto" else None)
            result = run_worker(args, mode, f"run{index + 1}", env, round_index=index + 1)
            runs.append(result)
            if mode == "auto" and result.get("unsupported"):
                auto_unsupported = True
                print(f"auto: not available in this megatron_tuning ({result.get('error')}); skipping it")
        round_s.append(time.perf_counter() - t_round)

    summary = summarize(runs, modes)
    summary["skipped"] = skipped
    summary["wall_s"] = time.perf_counter() - t_start
    print_summary(summary)
    for line in skipped:
        print(f"SKIPPED {line}")
    if args.summary_out:
        common.write_json(args.summary_out, {"environment": common.environment(), "summary": summary})
    print(f"driver done in {summary['wall_s']:.0f}s; runs appended to {args.out or '(no --out)'}")
    failed = [r for r in runs if not r.get("ok") and not (r.get("mode") == "auto" and auto_unsupported)]
    return 1 if failed else 0


# =========================================================================== main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--mode", choices=MODES, help="worker: run this mode in this process")
    add("--driver", action="store_true", help="launch fresh worker processes per mode and summarize")
    add("--list-kernels", action="store_true", help="print the autotuned kernels of megatron.core.ssm.ops")
    add("--summarize", default=None, metavar="RUNS_JSONL", help="print the summary of recorded runs and exit")
    add("--modes", nargs="+", choices=MODES, help=f"driver: modes to run (default {' '.join(DEFAULT_MODES)})")
    add("--processes", type=int, default=None, help="driver: processes per mode (default 4; smoke 2)")
    add(
        "--work-dir",
        default=None,
        help="driver: folder for the compile and tuning caches (default: a temp dir)",
    )
    add(
        "--compile-cache",
        choices=("shared", "per-mode"),
        default="shared",
        help="driver: one TRITON_CACHE_DIR for all modes (default) or one per mode",
    )
    add(
        "--no-prewarm",
        dest="prewarm",
        action="store_false",
        help="driver: skip the uncounted warm-up process(es)",
    )
    add(
        "--budget-s",
        type=float,
        default=330.0,
        help="driver: start no new round past this many seconds (330)",
    )
    add("--timeout", type=float, default=300.0, help="driver: seconds per worker process")
    add("--summary-out", default=None, help="driver: write the summary JSON here")
    add("--out", default=None, help="append one JSON line per process to this file")
    add("--tag", default="single", help=argparse.SUPPRESS)
    add(
        "--import-style",
        choices=("stub", "plain"),
        default="stub",
        help="stub: skip megatron/core/__init__.py (default); plain: ordinary import",
    )
    add(
        "--lens",
        type=int,
        nargs="+",
        default=None,
        help="sequence lengths in the batch (default 5000 3000 6000 2384)",
    )
    for name in mw.SHAPE_FIELDS:
        add(f"--{name}", type=int, default=None)
    add("--no-conv", action="store_true", help="time the SSD only (no causal_conv1d_varlen_fn)")
    add("--steps", type=int, default=None, help="timed steady-state steps (default 100; smoke 2)")
    add("--warmup", type=int, default=None, help="untimed steps before them (default 10; smoke 1)")
    add("--kernel-steps", type=int, default=20, help="steps of the per-kernel timing pass (0: skip)")
    add(
        "--ref-tokens",
        type=int,
        default=None,
        help="tokens checked against the fp32 recurrence (512; smoke 24)",
    )
    add("--smoke", action="store_true", help="CPU, Triton interpreter, tiny fp32 shapes: numbers meaningless")
    add("--fake-worker", action="store_true", help=argparse.SUPPRESS)  # driver tests without torch
    args = parser.parse_args()
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 100)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 10)
    args.ref_tokens = args.ref_tokens if args.ref_tokens is not None else (24 if args.smoke else 512)
    if not (args.mode or args.driver or args.list_kernels or args.summarize):
        parser.error("give --mode (one worker process), --driver, --list-kernels or --summarize")
    return args


def main() -> int:
    args = parse_args()
    if args.list_kernels:
        os.environ.pop("MAMBA_DETERMINISTIC", None)
        os.environ.setdefault("TRITON_INTERPRET", "1")  # decorating needs no GPU then
        headers = [
            "kernel",
            "configs",
            "key",
            "prune",
            "hooks",
            "MAMBA_DETERMINISTIC=1 pick",
            "ours min_cost",
        ]
        common.print_table(headers, mw.kernel_inventory(args.import_style))
        return 0
    if args.summarize:
        runs = [json.loads(line) for line in Path(args.summarize).read_text().splitlines() if line.strip()]
        modes = [m for m in MODES if any(r.get("mode") == m for r in runs)]
        summary = summarize(runs, list(args.modes or modes))
        print_summary(summary)
        common.write_json(args.summary_out, {"summary": summary})
        return 0
    if args.driver:
        return driver(args)
    result = fake_worker(args) if args.fake_worker else worker(args)
    if args.out:
        common.append_jsonl(args.out, result)
    common.emit(result)
    if not result.get("ok"):
        print(result.get("traceback", result.get("error")), file=sys.stderr)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
