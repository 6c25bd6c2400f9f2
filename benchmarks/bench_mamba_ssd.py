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
* ``auto``: ``TuningPolicy(mode="auto", scope=("megatron.core",))``; the library reads its cache
  table path from ``MEGATRON_TUNING_CACHE``, which the driver sets (empty for the first auto
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
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import common
import mamba_workload as mw

SCRIPT = "bench_mamba_ssd.py"
MODES = ("stock", "mamba_deterministic", "ours_cheapest", "ours_default", "auto")
DEFAULT_MODES = ("stock", "mamba_deterministic", "ours_cheapest", "auto")
SCOPE = ("megatron.core",)
# Env variables that change what megatron's ops or Triton choose; the driver sets them explicitly.
_SCRUB_PREFIXES = ("TRITON_AUTOTUNE_BLOCK",)  # megatron's own block-size filter (determinism.py)
_SCRUB = ("MAMBA_DETERMINISTIC", "TRITON_CACHE_AUTOTUNING", "TRITON_PRINT_AUTOTUNING", "TRITON_INTERPRET")
COUNTERS = common.LaunchCounters()


# =========================================================================== worker (one process, one mode)


def install_policy(mode: str) -> dict[str, Any]:
    """Install our library for ``mode``; returns what was installed (or raises)."""
    import megatron_tuning
    from megatron_tuning import TuningPolicy

    if mode == "ours_cheapest":
        handle = megatron_tuning.init_deterministic_tuning(
            TuningPolicy(mode="deterministic", scope=SCOPE, on_miss="min_cost")
        )
    elif mode == "ours_default":
        handle = megatron_tuning.init_deterministic_tuning()  # policy from MEGATRON_TUNING_* (scope only)
    elif mode == "auto":  # cache path: MEGATRON_TUNING_CACHE (env)
        handle = megatron_tuning.init_deterministic_tuning(TuningPolicy(mode="auto", scope=SCOPE))
    else:
        raise ValueError(mode)
    policy = getattr(handle, "policy", None)
    described = policy.describe() if hasattr(policy, "describe") else repr(policy)
    return {"handle": handle, "policy": described}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    result: dict[str, Any] = {"mode": args.mode, "tag": args.tag, "pid": os.getpid(), "ok": False}
    result["smoke"] = args.smoke
    watched = _SCRUB + ("TRITON_CACHE_DIR", "MEGATRON_TUNING_CACHE", "MEGATRON_TUNING_SCOPE")
    result["env"] = {k: os.environ.get(k) for k in watched}
    try:
        _worker(args, result)
        result["ok"] = True
    except Exception as exc:  # a failed mode is a result too (e.g. a library without mode "auto")
        result["error"] = f"{type(exc).__name__}: {exc}"
        # A policy the installed megatron_tuning rejects (e.g. no mode "auto" yet): not a crash.
        result["unsupported"] = type(exc).__name__ == "PolicyError"
        result["traceback"] = traceback.format_exc()[-4000:]
    result["process_s"] = time.perf_counter() - t_start
    return result


def _worker(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.mode == "mamba_deterministic":
        os.environ["MAMBA_DETERMINISTIC"] = "1"  # read by megatron's autotune_configs at decoration
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if args.smoke:
        # The ops enter ``torch.cuda.device(t.device.index)``; on CPU the index is None. Smoke only.
        _device_ctx = torch.cuda.device
        torch.cuda.device = lambda index: contextlib.nullcontext() if index is None else _device_ctx(index)  # type: ignore[assignment]
    elif not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU visible: run on a GPU machine, or add --smoke")
    COUNTERS.install()

    t0 = time.perf_counter()
    _, ssd, conv = mw.import_ops(args.import_style)
    result["import_s"] = time.perf_counter() - t0
    result["import_style"] = args.import_style
    result["megatron_modules_loaded"] = sum(1 for k in sys.modules if k.startswith("megatron"))
    autotuners = mw.ops_autotuners()
    result["n_configs"] = {k: len(a.configs) for k, a in autotuners.items()}
    result["versions"] = _versions()
    if args.smoke:
        for autotuner in autotuners.values():
            common.allow_stock_autotune_on_cpu(autotuner)  # host-clock benchmarker for stock autotune

    handle = None
    t0 = time.perf_counter()
    if args.mode in ("ours_cheapest", "ours_default", "auto"):
        installed = install_policy(args.mode)
        handle = installed["handle"]
        result["policy"] = installed["policy"]
    result["init_s"] = time.perf_counter() - t0

    shape = dict(mw.SMOKE_SHAPE if args.smoke else mw.GPU_SHAPE)
    if args.lens:
        shape["lens"] = args.lens
    shape.update({name: getattr(args, name) for name in mw.SHAPE_FIELDS if getattr(args, name) is not None})
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    result["shape"] = {
        **shape,
        "tokens": sum(shape["lens"]),
        "dtype": str(dtype),
        "with_conv": not args.no_conv,
    }
    inp = mw.build_inputs(shape, device, dtype, mw.SEED)
    step, buffers = mw.make_step(inp, ssd, conv, with_conv=not args.no_conv)
    sync = (lambda: None) if args.smoke else torch.cuda.synchronize

    # Triton's once-per-process start-up (driver, launcher) on a bare kernel, outside the timed step.
    sync()
    t0 = time.perf_counter()
    torch.zeros(16, device=device).add_(1)
    sync()
    result["startup_s"] = time.perf_counter() - t0

    COUNTERS.launches = 0
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    result["first_step_s"] = time.perf_counter() - t0
    result["first_step_launches"] = COUNTERS.launches
    result["first_out"] = mw.digest(buffers)
    result["launched"] = _launched_configs(step, sync, autotuners)
    _time_steady_state(args, step, sync, result)

    # Outputs: a clean step into a zeroed buffer, hashed; then the reference check.
    buffers["out"].zero_()
    step()
    sync()
    result["out"] = mw.digest(buffers)
    result["first_matches_steady"] = result["first_out"]["all"] == result["out"]["all"]
    out = buffers["out"].float()
    result["out_stats"] = {"sum": float(out.sum()), "abs_sum": float(out.abs().sum())}
    result["reference"] = mw.reference_error(inp, buffers["out"], args.ref_tokens)
    _record_choices(autotuners, result)
    if handle is not None:
        with contextlib.suppress(Exception):
            handle.close()


def _launched_configs(step: Any, sync: Any, autotuners: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The config every kernel launches, read off one post-first-step launch (same for every mode)."""
    COUNTERS.launch_log = []
    step()
    sync()
    by_fn = {id(a.fn): (k, a) for k, a in autotuners.items()}
    launched: dict[str, dict[str, str]] = {}
    for fn, kwargs in COUNTERS.launch_log:
        if id(fn) in by_fn:
            kernel, autotuner = by_fn[id(fn)]
            positional = kwargs.pop("__positional__")
            key = mw.launch_key_text(autotuner, positional, kwargs)
            launched.setdefault(kernel, {})[key] = mw.launched_sig(autotuner, kwargs)
    COUNTERS.launch_log = None
    return launched


def _time_steady_state(args: argparse.Namespace, step: Any, sync: Any, result: dict[str, Any]) -> None:
    import torch

    for _ in range(args.warmup):
        step()
    sync()
    if args.smoke:
        samples = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            samples.append((time.perf_counter() - t0) * 1e3)
    else:
        pairs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(args.steps)
        ]
        for start, end in pairs:
            start.record()
            step()
            end.record()
        sync()
        samples = [s.elapsed_time(e) for s, e in pairs]
    result["steady_ms"] = common.quantiles(samples)
    result["steady_samples_ms"] = [round(s, 5) for s in samples]
    # Each kernel's share (events around each launch; a separate pass so the step timing is clean).
    if not args.smoke and args.kernel_steps:
        per_kernel: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(args.kernel_steps):
            COUNTERS.events = []
            step()
            sync()
            for kernel, start, end in COUNTERS.events:
                per_kernel[kernel].append(start.elapsed_time(end))
        COUNTERS.events = None
        result["kernel_ms"] = {k: statistics.median(v) for k, v in sorted(per_kernel.items())}


def _record_choices(autotuners: dict[str, Any], result: dict[str, Any]) -> None:
    """What each kernel chose, as Triton and as our library saw it."""
    result["triton_bench_calls"] = COUNTERS.bench_calls
    result["do_bench_calls"] = COUNTERS.do_bench_calls
    result["triton_cache"] = {
        k: {repr(key): mw.config_sig(cfg) for key, cfg in a.cache.items()}
        for k, a in autotuners.items()
        if a.cache
    }
    result["bench_time_s"] = {
        k: a.bench_time for k, a in autotuners.items() if getattr(a, "bench_time", None)
    }
    result["timings_ms"] = {
        k: dict(
            sorted(
                ((mw.config_sig(c), _first(t)) for c, t in a.configs_timings.items()), key=lambda kv: kv[1]
            )
        )
        for k, a in autotuners.items()
        if getattr(a, "configs_timings", None)
    }
    result["decisions"] = _decisions()


def _first(value: Any) -> float:
    if isinstance(value, (list, tuple)):
        value = value[0]
    return round(float(value), 6)


def _decisions() -> list[dict[str, Any]]:
    if "megatron_tuning" not in sys.modules:
        return []
    try:
        from megatron_tuning import get_decisions

        rows = []
        for d in get_decisions():
            row = d.to_json() if hasattr(d, "to_json") else dict(vars(d))
            timings = row.pop("timings", None)
            if timings:  # keep the shape of what was measured, not every sample
                kept = {
                    k: v
                    for k, v in timings.items()
                    if isinstance(v, (int, float, str)) or k in ("winner", "tied")
                }
                row["timings_summary"] = kept
                row["timings_keys"] = sorted(timings)
            rows.append(row)
        return rows
    except Exception as exc:  # the library is being restructured; never lose the run for this
        return [{"error": f"get_decisions: {type(exc).__name__}: {exc}"}]


def _versions() -> dict[str, str]:
    import torch
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__}
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        info["megatron-core"] = version("megatron-core")
    with contextlib.suppress(Exception):
        import megatron

        info["megatron_path"] = str(Path(megatron.__file__).parent)
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def fake_worker(args: argparse.Namespace) -> dict[str, Any]:
    """A synthetic result with the real shape, for checking the driver and summary without torch."""
    import random

    rng = random.Random(f"{args.mode}{args.tag}{os.getpid()}")
    stock = args.mode == "stock"
    sig = f"BLOCK_SIZE_M={rng.choice([64, 128]) if stock else 64}, num_warps=4, num_stages=3"
    if args.mode == "auto" and os.environ.get("MEGATRON_TUNING_FAKE_NO_AUTO"):
        error = "PolicyError: mode='auto' is not one of ..."
        return {"mode": args.mode, "tag": args.tag, "ok": False, "unsupported": True, "error": error}
    watched = (
        "MAMBA_DETERMINISTIC",
        "TRITON_CACHE_AUTOTUNING",
        "MEGATRON_TUNING_CACHE",
        "MEGATRON_TUNING_SCOPE",
    )
    return {
        "mode": args.mode,
        "tag": args.tag,
        "ok": True,
        "fake": True,
        "first_step_s": rng.uniform(5, 9) if stock else rng.uniform(0.1, 0.3),
        "first_step_launches": 4000 if stock else 5,
        "triton_bench_calls": 41 if stock else 0,
        "do_bench_calls": 41 if stock else 0,
        "steady_ms": {"median": rng.uniform(0.9, 1.1)},
        "kernel_ms": {"m:_k": 0.5},
        "launched": {"m:_k": {"chunk_size=256": sig}},
        "out": {"all": sig[-20:], "out": sig[-20:]},
        "first_matches_steady": True,
        "reference": {"rel_err": 0.004},
        "decisions": [],
        "env": {k: os.environ.get(k) for k in watched},
    }


# =========================================================================== driver (fresh processes)


def child_env(
    args: argparse.Namespace, mode: str, compile_cache: Path, tuning_cache: Path | None
) -> dict[str, str]:
    env = common.child_env(args.smoke)
    for key in list(env):
        if key in _SCRUB or key.startswith(_SCRUB_PREFIXES) or key.startswith("MEGATRON_TUNING_"):
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


# =========================================================================== summary


def _round(run: dict[str, Any]) -> int | None:
    """The driver's round of a run: recorded, or read from its tag (``run2``; older JSONL files)."""
    if run.get("round") is not None:
        return int(run["round"])
    tag = str(run.get("tag", ""))
    return int(tag[3:]) if tag.startswith("run") and tag[3:].isdigit() else None


def summarize(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per mode: config spread, output hashes, benchmark calls, first-step and steady-state times."""
    counted = [r for r in runs if r.get("tag") != "prewarm"]
    ok = [r for r in counted if r.get("ok")]
    median = common.median_or_none
    stock_steady = median([r["steady_ms"]["median"] for r in ok if r["mode"] == "stock"])
    per_mode: dict[str, Any] = {}
    per_kernel: dict[str, dict[str, collections.Counter[str]]] = collections.defaultdict(dict)
    for mode in modes:
        mine = [r for r in ok if r["mode"] == mode]
        failed = [r for r in counted if r["mode"] == mode and not r.get("ok")]
        configs: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        for r in mine:
            for kernel, keys in r.get("launched", {}).items():
                for key, sig in keys.items():
                    configs[(kernel, key)][sig] += 1
        for (kernel, _key), counter in configs.items():
            per_kernel[kernel][mode] = per_kernel[kernel].get(mode, collections.Counter()) + counter
        steady = [r["steady_ms"]["median"] for r in mine]
        per_mode[mode] = {
            "processes": len(mine),
            "failed": len(failed),
            "errors": sorted({str(r.get("error"))[:200] for r in failed}),
            "kernel_keys": len(configs),
            "max_distinct_configs": max((len(c) for c in configs.values()), default=0),
            "keys_with_several_configs": sum(1 for c in configs.values() if len(c) > 1),
            "distinct_output_hashes": len({r["out"]["all"] for r in mine}),
            "distinct_out_hashes_per_tensor": {
                t: len({r["out"].get(t) for r in mine})
                for t in ("out", "states", "conv_out")
                if mine and t in mine[0]["out"]
            },
            "bench_calls": median([r["triton_bench_calls"] for r in mine]),
            "do_bench_calls": median([r["do_bench_calls"] for r in mine]),
            "first_step_launches": median([r["first_step_launches"] for r in mine]),
            "first_step_s": median([r["first_step_s"] for r in mine]),
            "first_step_s_run1": next((r["first_step_s"] for r in mine if _round(r) == 1), None),
            "first_step_s_later": median([r["first_step_s"] for r in mine if (_round(r) or 1) > 1]),
            "steady_ms": median(steady),
            "steady_spread": common.spread(steady)["rel_range"] if steady else None,
            "ratio_to_stock": (median(steady) / stock_steady) if steady and stock_steady else None,
            "kernel_ms": _kernel_medians(mine),
            "ref_rel_err_max": max((r.get("reference", {}).get("rel_err", 0.0) for r in mine), default=None),
            "first_matches_steady": all(r.get("first_matches_steady") for r in mine) if mine else None,
            "decision_sources": dict(
                collections.Counter(d.get("source", "?") for r in mine for d in r.get("decisions", []))
            ),
            "import_s": median([r.get("import_s", 0.0) for r in mine]),
        }
    prewarm = [r for r in runs if r.get("tag") == "prewarm"]
    return {
        "modes": per_mode,
        "kernels": {k: {m: dict(c) for m, c in v.items()} for k, v in sorted(per_kernel.items())},
        "output_hashes": {m: sorted({r["out"]["all"] for r in ok if r["mode"] == m}) for m in modes},
        "prewarm": [{k: r.get(k) for k in ("mode", "ok", "first_step_s", "error")} for r in prewarm],
    }


def _kernel_medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    pooled: dict[str, list[float]] = collections.defaultdict(list)
    for r in runs:
        for kernel, ms in r.get("kernel_ms", {}).items():
            pooled[kernel].append(ms)
    return {k: statistics.median(v) for k, v in sorted(pooled.items())}


# (header, summary field, suffix) of the per-mode table.
MODE_COLUMNS = (
    ("procs", "processes", ""),
    ("fail", "failed", ""),
    ("keys>1cfg", "keys_with_several_configs", ""),
    ("max cfgs/key", "max_distinct_configs", ""),
    ("out hashes", "distinct_output_hashes", ""),
    ("bench calls", "bench_calls", ""),
    ("launches 1st", "first_step_launches", ""),
    ("1st step s (run1)", "first_step_s_run1", ""),
    ("1st step s (later)", "first_step_s_later", ""),
    ("steady ms", "steady_ms", ""),
    ("vs stock", "ratio_to_stock", "x"),
    ("ref rel err", "ref_rel_err_max", ""),
)


def print_summary(summary: dict[str, Any]) -> None:
    modes = summary["modes"]
    print("\n== per mode (counted processes; prewarm excluded)")
    rows = [
        [mode] + [common.dash(r[field], suffix) for _, field, suffix in MODE_COLUMNS]
        for mode, r in modes.items()
    ]
    common.print_table(["mode"] + [header for header, _, _ in MODE_COLUMNS], rows)
    for mode, r in modes.items():
        for error in r["errors"]:
            print(f"  {mode} error: {error}")
    if summary["kernels"]:
        print("\n== configs launched per kernel (count of processes)")
        rows = []
        for kernel, by_mode in summary["kernels"].items():
            for mode, counter in by_mode.items():
                ms = modes.get(mode, {}).get("kernel_ms", {}).get(kernel)
                for sig, n in sorted(counter.items(), key=lambda kv: -kv[1]):
                    rows.append([kernel.rsplit(":", 1)[-1].strip("_"), mode, n, sig, common.dash(ms)])
        common.print_table(["kernel", "mode", "procs", "config", "kernel ms (mode median)"], rows)
    for p in summary.get("prewarm", []):
        print(
            f"prewarm {p['mode']}: first step {p['first_step_s']} s (cold compile cache) "
            f"ok={p['ok']} {p['error'] or ''}"
        )


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
