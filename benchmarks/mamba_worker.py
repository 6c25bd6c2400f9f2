"""One process, one mode of ``bench_mamba_ssd.py``: install the mode, time a step, record choices.

``worker`` installs the counters (``Autotuner._bench`` calls that reach Triton's own
benchmarking, ``triton.testing.do_bench`` calls, kernel launches), imports the ops, installs the
policy, builds the inputs from a fixed seed, times the first step by wall clock and the steady
state by CUDA events, records the config every autotuned kernel launched, Triton's
``autotuner.cache`` and the decision log, hashes the outputs and checks them against the fp32
recurrence (``mamba_workload``). A failed mode is a result too. ``fake_worker`` returns a
synthetic result of the same shape, for checking the driver and summary without torch.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import common
import mamba_workload as mw

SCOPE = ("megatron.core",)
# Env variables that change what megatron's ops or Triton choose; the driver sets them explicitly.
SCRUB_PREFIXES = ("TRITON_AUTOTUNE_BLOCK",)  # megatron's own block-size filter (determinism.py)
SCRUB = ("MAMBA_DETERMINISTIC", "TRITON_CACHE_AUTOTUNING", "TRITON_PRINT_AUTOTUNING", "TRITON_INTERPRET")
COUNTERS = common.LaunchCounters()


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
        handle = megatron_tuning.init_deterministic_tuning(TuningPolicy.from_env(mode="auto", scope=SCOPE))
    else:
        raise ValueError(mode)
    policy = getattr(handle, "policy", None)
    described = policy.describe() if hasattr(policy, "describe") else repr(policy)
    return {"handle": handle, "policy": described}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    result: dict[str, Any] = {"mode": args.mode, "tag": args.tag, "pid": os.getpid(), "ok": False}
    result["smoke"] = args.smoke
    watched = SCRUB + ("TRITON_CACHE_DIR", "MEGATRON_TUNING_CACHE", "MEGATRON_TUNING_SCOPE")
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
