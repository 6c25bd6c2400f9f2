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

Import: ``import megatron.core.ssm.ops`` runs ``megatron/core/__init__.py``, which imports most
of megatron-core (parallel_state, distributed, optimizer, inference, transformer; optional
apex/transformer_engine/... are tried and skipped), seconds of import and dozens of unrelated
modules. ``--import-style stub`` (default) registers ``megatron.core`` and ``megatron.core.ssm``
as empty packages whose ``__path__`` is the installed folder (``importlib.util.module_from_spec``
without executing them), then imports ``megatron.core.ssm.ops`` normally: same files, same module
names (so ``module:qualname`` kernel ids and the ``megatron.core`` scope are the real ones), only
the parents' ``__init__`` is skipped. The ops need only torch, triton and packaging.
``--import-style plain`` does the ordinary import.

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
import hashlib
import importlib
import importlib.util
import inspect
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

SCRIPT = "bench_mamba_ssd.py"
MODES = ("stock", "mamba_deterministic", "ours_cheapest", "ours_default", "auto")
DEFAULT_MODES = ("stock", "mamba_deterministic", "ours_cheapest", "auto")
OPS_PACKAGE = "megatron.core.ssm.ops"
SCOPE = ("megatron.core",)
SEED = 1234
# Env variables that change what megatron's ops or Triton choose; the driver sets them explicitly.
_SCRUB_PREFIXES = ("TRITON_AUTOTUNE_BLOCK",)  # megatron's own block-size filter (determinism.py)
_SCRUB = ("MAMBA_DETERMINISTIC", "TRITON_CACHE_AUTOTUNING", "TRITON_PRINT_AUTOTUNING", "TRITON_INTERPRET")

GPU_SHAPE = {
    "lens": [5000, 3000, 6000, 2384],
    "nheads": 64,
    "headdim": 64,
    "dstate": 128,
    "ngroups": 1,
    "chunk": 256,
}
SMOKE_SHAPE = {"lens": [40, 24], "nheads": 4, "headdim": 16, "dstate": 16, "ngroups": 2, "chunk": 16}


# =========================================================================== worker: counters


class _Counters:
    """Process-wide counters, installed on Triton's classes before anything else patches them."""

    def __init__(self) -> None:
        self.bench_calls = 0  # Autotuner._bench calls reaching Triton's own (configs timed by Triton)
        self.do_bench_calls = 0  # triton.testing.do_bench calls (Triton's benchmarker)
        self.launches = 0  # kernel launches (JITFunction.run / InterpretedFunction.run)
        self.launch_log: list[tuple[Any, dict[str, Any]]] | None = (
            None  # (jit fn, bound args) while recording
        )
        self.events: list[tuple[str, Any, Any]] | None = None  # (kernel, start, end) while profiling


COUNTERS = _Counters()


def install_counters() -> None:
    """Wrap Triton's benchmark entry points and kernel launch before the kernels or our library load.

    ``megatron_tuning`` saves ``Autotuner.__dict__["_bench"]`` when it installs and wraps it, so
    a call counted here is one that got past our guard into Triton's benchmarking.
    """
    import functools

    import triton
    import triton.testing
    from triton.runtime.autotuner import Autotuner

    original_bench = Autotuner.__dict__.get("_bench") or Autotuner._bench

    @functools.wraps(original_bench)
    def _bench(self: Any, *args: Any, **kwargs: Any) -> Any:
        COUNTERS.bench_calls += 1
        return original_bench(self, *args, **kwargs)

    Autotuner._bench = _bench

    original_do_bench = triton.testing.do_bench

    @functools.wraps(original_do_bench)
    def do_bench(*args: Any, **kwargs: Any) -> Any:
        COUNTERS.do_bench_calls += 1
        return original_do_bench(*args, **kwargs)

    triton.testing.do_bench = do_bench  # the CUDA driver's get_benchmarker() imports it at call time

    classes = [triton.runtime.jit.JITFunction]
    with contextlib.suppress(ImportError, AttributeError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    for cls in classes:
        _wrap_run(cls)


def _wrap_run(cls: Any) -> None:
    import functools

    original_run = cls.__dict__.get("run") or cls.run

    @functools.wraps(original_run)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        COUNTERS.launches += 1
        if COUNTERS.launch_log is not None:
            COUNTERS.launch_log.append((self, dict(kwargs, __positional__=args)))
        events = COUNTERS.events
        if events is None:
            return original_run(self, *args, **kwargs)
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = original_run(self, *args, **kwargs)
        end.record()
        events.append((_fn_id(getattr(self, "fn", None)), start, end))
        return result

    cls.run = run


def _fn_id(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"


# =========================================================================== worker: import


def import_ops(style: str) -> Any:
    """Import ``megatron.core.ssm.ops``, skipping (``stub``) or running (``plain``) megatron-core's init."""
    if style == "stub" and "megatron.core" not in sys.modules:
        import megatron  # noqa: F401  (its __init__ is a comment)

        for name in ("megatron.core", "megatron.core.ssm"):
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.submodule_search_locations:
                raise ImportError(f"{name} not found: install megatron-core (see the module docstring)")
            module = importlib.util.module_from_spec(spec)  # __path__ set, __init__ NOT executed
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            setattr(sys.modules[parent], child, module)
    ops = importlib.import_module(OPS_PACKAGE)
    from megatron.core.ssm.ops.causal_conv1d_varlen import causal_conv1d_varlen_fn
    from megatron.core.ssm.ops.ssd_combined import mamba_chunk_scan_combined_varlen

    return ops, mamba_chunk_scan_combined_varlen, causal_conv1d_varlen_fn


def ops_autotuners() -> dict[str, Any]:
    """``module:qualname`` -> Autotuner for every autotuned kernel in the ops package."""
    from triton.runtime.autotuner import Autotuner

    found: dict[str, Any] = {}
    for name, module in sorted(sys.modules.items()):
        if module is None or not (name == OPS_PACKAGE or name.startswith(OPS_PACKAGE + ".")):
            continue
        for value in vars(module).values():
            if isinstance(value, Autotuner):
                fn = value.fn
                while not inspect.isfunction(fn) and hasattr(fn, "fn"):  # JITFunction (or heuristics)
                    fn = fn.fn
                found[_fn_id(fn)] = value
    return dict(sorted(found.items()))


def config_sig(config: Any) -> str:
    """``BLOCK_SIZE_M=64, ..., num_warps=4, num_stages=3`` for a triton.Config."""
    parts = [f"{k}={v}" for k, v in sorted(config.kwargs.items())]
    parts += [f"num_warps={config.num_warps}", f"num_stages={config.num_stages}"]
    return ", ".join(parts)


def _config_names(autotuner: Any) -> list[str]:
    names = sorted({k for c in autotuner.configs for k in c.kwargs})
    return names + ["num_warps", "num_stages"]


def _launched_sig(autotuner: Any, kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{n}={kwargs.get(n, '?')}" for n in _config_names(autotuner))


def _launch_key(autotuner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    bound = {**dict(zip(autotuner.arg_names, args)), **kwargs}
    return ", ".join(f"{k}={bound.get(k, '?')}" for k in autotuner.keys)


# =========================================================================== worker: workload


def build_inputs(shape: dict[str, Any], device: str, dtype: Any, seed: int) -> dict[str, Any]:
    """Packed varlen prefill inputs, chunk metadata built the way ``MambaMixer`` builds it."""
    import torch

    lens, nheads, headdim = shape["lens"], shape["nheads"], shape["headdim"]
    dstate, ngroups, chunk = shape["dstate"], shape["ngroups"], shape["chunk"]
    total = sum(lens)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> Any:
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dtype)

    # Chunks start at each sequence's start; the last chunk of a sequence may be short.
    bounds, last, seq_idx, cu = [0], [], [], [0]
    start = 0
    for i, n in enumerate(lens):
        end = start + n
        pos = start + chunk
        while pos < end:
            bounds.append(pos)
            seq_idx.append(i)
            pos += chunk
        bounds.append(end)
        seq_idx.append(i)
        last.append(len(bounds) - 2)
        cu.append(end)
        start = end
    i32 = {"device": device, "dtype": torch.int32}
    dt_init = torch.empty(nheads).uniform_(0.001, 0.1, generator=gen)
    conv_dim = nheads * headdim + 2 * ngroups * dstate
    return {
        "x": randn(total, nheads, headdim),
        "dt": randn(total, nheads, scale=0.5),
        "A": (-torch.empty(nheads).uniform_(1.0, 16.0, generator=gen)).to(device),
        "B": randn(total, ngroups, dstate),
        "C": randn(total, ngroups, dstate),
        "D": torch.randn(nheads, generator=gen).to(device),
        "dt_bias": torch.log(torch.expm1(dt_init)).to(device),  # softplus(dt_bias) = dt_init
        "cu_chunk_seqlens": torch.tensor(bounds, **i32),
        "last_chunk_indices": torch.tensor(last, **i32),
        "seq_idx": torch.tensor(seq_idx, **i32),
        "cu_seqlens": torch.tensor(cu, **i32),
        # Per-token request id and request start, precomputed as the mixer does (no host sync).
        "conv_seq_idx": torch.tensor([i for i, n in enumerate(lens) for _ in range(n)], **i32),
        "conv_seq_start": torch.tensor([cu[i] for i, n in enumerate(lens) for _ in range(n)], **i32),
        "xBC": randn(total, conv_dim),
        "conv_weight": randn(conv_dim, 4, scale=0.5).contiguous(),
        "conv_bias": randn(conv_dim, scale=0.1),
        "chunk": chunk,
    }


def make_step(inp: dict[str, Any], ssd: Any, conv: Any, with_conv: bool) -> tuple[Any, dict[str, Any]]:
    import torch

    buffers = {"out": torch.empty_like(inp["x"])}

    def step() -> None:
        if with_conv:
            buffers["conv_out"] = conv(
                inp["xBC"],
                inp["conv_weight"],
                inp["conv_bias"],
                inp["cu_seqlens"],
                precomputed_seq_idx=inp["conv_seq_idx"],
                precomputed_seq_start=inp["conv_seq_start"],
            )
        buffers["states"] = ssd(
            x=inp["x"],
            dt=inp["dt"],
            A=inp["A"],
            B=inp["B"],
            C=inp["C"],
            chunk_size=inp["chunk"],
            cu_chunk_seqlens=inp["cu_chunk_seqlens"],
            last_chunk_indices=inp["last_chunk_indices"],
            seq_idx=inp["seq_idx"],
            out=buffers["out"],
            D=inp["D"],
            dt_bias=inp["dt_bias"],
            dt_softplus=True,
        )

    return step, buffers


def digest(buffers: dict[str, Any]) -> dict[str, str]:
    """sha256 of each output's bytes, and of all of them together."""
    import torch

    hashes: dict[str, str] = {}
    total = hashlib.sha256()
    for name in ("out", "states", "conv_out"):
        tensor = buffers.get(name)
        if tensor is None:
            continue
        data = tensor.detach().contiguous().cpu().reshape(-1).view(dtype=torch.uint8).numpy().tobytes()
        hashes[name] = hashlib.sha256(data).hexdigest()[:16]
        total.update(name.encode() + data)
    hashes["all"] = total.hexdigest()[:16]
    return hashes


def reference_error(inp: dict[str, Any], out: Any, ntokens: int) -> dict[str, float]:
    """Max |kernel - reference| over the first ``ntokens`` tokens of sequence 0.

    Reference: the SSM recurrence in fp32, one token at a time:
    ``dt = softplus(dt_raw + dt_bias)``, ``h = exp(dt*A) h + dt * x B^T``, ``y = h C + D x``.
    """
    import torch
    import torch.nn.functional as F

    n = min(ntokens, int(inp["cu_seqlens"][1]))
    if n <= 0:
        return {}
    x, B, C = (inp[k][:n].float() for k in ("x", "B", "C"))
    dt = F.softplus(inp["dt"][:n].float() + inp["dt_bias"].float())
    A, D = inp["A"].float(), inp["D"].float()
    nheads, headdim = x.shape[1], x.shape[2]
    group = torch.arange(nheads, device=x.device) // (nheads // B.shape[1])
    h = torch.zeros(nheads, headdim, B.shape[2], device=x.device)
    ref = torch.empty_like(x)
    for t in range(n):
        h = (
            torch.exp(dt[t] * A)[:, None, None] * h
            + (dt[t][:, None] * x[t])[:, :, None] * B[t, group][:, None, :]
        )
        ref[t] = (h * C[t, group][:, None, :]).sum(-1) + D[:, None] * x[t]
    err = (out[:n].float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    return {
        "tokens": n,
        "max_abs_err": err,
        "max_abs_ref": scale,
        "rel_err": err / scale if scale else float("nan"),
    }


# =========================================================================== worker: main


def install_policy(mode: str) -> dict[str, Any]:
    """Install our library for ``mode``; returns what was installed (or raises)."""
    import megatron_tuning
    from megatron_tuning import TuningPolicy

    if mode == "ours_cheapest":
        policy = TuningPolicy(mode="deterministic", scope=SCOPE, on_miss="min_cost")
        handle = megatron_tuning.init_deterministic_tuning(policy)
    elif mode == "ours_default":
        handle = megatron_tuning.init_deterministic_tuning()  # policy from MEGATRON_TUNING_* (scope only)
    elif mode == "auto":
        policy = TuningPolicy(mode="auto", scope=SCOPE)  # cache path: MEGATRON_TUNING_CACHE (env)
        handle = megatron_tuning.init_deterministic_tuning(policy)
    else:
        raise ValueError(mode)
    policy = getattr(handle, "policy", None)
    described = policy.describe() if hasattr(policy, "describe") else repr(policy)
    return {"handle": handle, "policy": described}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "mode": args.mode,
        "tag": args.tag,
        "pid": os.getpid(),
        "ok": False,
        "smoke": args.smoke,
    }
    result["env"] = {
        k: os.environ.get(k)
        for k in _SCRUB + ("TRITON_CACHE_DIR", "MEGATRON_TUNING_CACHE", "MEGATRON_TUNING_SCOPE")
    }
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
    install_counters()

    t0 = time.perf_counter()
    _, ssd, conv = import_ops(args.import_style)
    result["import_s"] = time.perf_counter() - t0
    result["import_style"] = args.import_style
    result["megatron_modules_loaded"] = sum(1 for k in sys.modules if k.startswith("megatron"))
    autotuners = ops_autotuners()
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

    shape = dict(SMOKE_SHAPE if args.smoke else GPU_SHAPE)
    if args.lens:
        shape["lens"] = args.lens
    for name in ("nheads", "headdim", "dstate", "ngroups", "chunk"):
        if getattr(args, name) is not None:
            shape[name] = getattr(args, name)
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    result["shape"] = {
        **shape,
        "tokens": sum(shape["lens"]),
        "dtype": str(dtype),
        "with_conv": not args.no_conv,
    }
    inp = build_inputs(shape, device, dtype, SEED)
    step, buffers = make_step(inp, ssd, conv, with_conv=not args.no_conv)
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
    result["first_out"] = digest(buffers)

    # The config every kernel launches, read off one post-first-step launch (same for every mode).
    COUNTERS.launch_log = []
    step()
    sync()
    by_fn = {id(a.fn): (k, a) for k, a in autotuners.items()}
    launched: dict[str, dict[str, str]] = {}
    for fn, kwargs in COUNTERS.launch_log:
        if id(fn) in by_fn:
            kernel, autotuner = by_fn[id(fn)]
            positional = kwargs.pop("__positional__")
            launched.setdefault(kernel, {})[_launch_key(autotuner, positional, kwargs)] = _launched_sig(
                autotuner, kwargs
            )
    COUNTERS.launch_log = None
    result["launched"] = launched

    # Steady state.
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
    result["steady_ms"] = _quantiles(samples)
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

    # Outputs: a clean step into a zeroed buffer, hashed; then the reference check.
    buffers["out"].zero_()
    step()
    sync()
    result["out"] = digest(buffers)
    result["first_matches_steady"] = result["first_out"]["all"] == result["out"]["all"]
    result["out_stats"] = {
        "sum": float(buffers["out"].float().sum()),
        "abs_sum": float(buffers["out"].float().abs().sum()),
    }
    result["reference"] = reference_error(inp, buffers["out"], args.ref_tokens)

    # What each chose, as Triton and as our library saw it.
    result["triton_bench_calls"] = COUNTERS.bench_calls
    result["do_bench_calls"] = COUNTERS.do_bench_calls
    result["triton_cache"] = {
        k: {repr(key): config_sig(cfg) for key, cfg in a.cache.items()}
        for k, a in autotuners.items()
        if a.cache
    }
    result["bench_time_s"] = {
        k: a.bench_time for k, a in autotuners.items() if getattr(a, "bench_time", None)
    }
    result["timings_ms"] = {
        k: dict(
            sorted(((config_sig(c), _first(t)) for c, t in a.configs_timings.items()), key=lambda kv: kv[1])
        )
        for k, a in autotuners.items()
        if getattr(a, "configs_timings", None)
    }
    result["decisions"] = _decisions()
    if handle is not None:
        with contextlib.suppress(Exception):
            handle.close()


def _first(value: Any) -> float:
    if isinstance(value, (list, tuple)):
        value = value[0]
    return round(float(value), 6)


def _quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    return {
        "median": statistics.median(ordered),
        "p20": q(0.2),
        "p80": q(0.8),
        "min": ordered[0],
        "n": len(ordered),
    }


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
                row["timings_summary"] = {
                    k: v
                    for k, v in timings.items()
                    if isinstance(v, (int, float, str)) or k in ("winner", "tied")
                }
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


# =========================================================================== kernel inventory


def list_kernels(args: argparse.Namespace) -> int:
    """Print every autotuned kernel: configs, key, megatron's deterministic pick, our cheapest pick."""
    os.environ.pop("MAMBA_DETERMINISTIC", None)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # decorating needs no GPU then
    import_ops(args.import_style)
    from megatron.core.ssm.ops import determinism

    try:
        from megatron_tuning import cheapest as ours_cheapest
    except ImportError:
        ours_cheapest = None
    rows = []
    for kernel, a in ops_autotuners().items():
        hooks = [n for n in ("reset_to_zero", "restore_value") if getattr(a, n, None)]
        prune = bool(getattr(a, "early_config_prune", None) or getattr(a, "perf_model", None))
        theirs = config_sig(min(a.configs, key=determinism._estimate_config_cost))
        ours = config_sig(ours_cheapest(a.configs)) if ours_cheapest else "(megatron_tuning.cheapest n/a)"
        rows.append(
            [
                kernel,
                len(a.configs),
                ",".join(a.keys),
                "prune" if prune else "-",
                ",".join(hooks) or "-",
                theirs,
                ours if ours != theirs else "same",
            ]
        )
    common.print_table(
        ["kernel", "configs", "key", "prune", "hooks", "MAMBA_DETERMINISTIC=1 pick", "ours min_cost"], rows
    )
    return 0


# =========================================================================== driver


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
    argv = [
        "--mode",
        mode,
        "--tag",
        tag,
        "--import-style",
        args.import_style,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--kernel-steps",
        str(args.kernel_steps),
        "--ref-tokens",
        str(args.ref_tokens),
    ]
    if args.lens:
        argv += ["--lens", *map(str, args.lens)]
    for name in ("nheads", "headdim", "dstate", "ngroups", "chunk"):
        if getattr(args, name) is not None:
            argv += [f"--{name}", str(getattr(args, name))]
    if args.no_conv:
        argv.append("--no-conv")
    if args.smoke:
        argv.append("--smoke")
    if args.fake_worker:
        argv.append("--fake-worker")
    return argv


def run_worker(args: argparse.Namespace, mode: str, tag: str, env: dict[str, str]) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        result = common.run_child(SCRIPT, worker_argv(args, mode, tag), env, timeout=args.timeout)
    except Exception as exc:  # crashed or timed out: keep going, report it
        result = {"mode": mode, "tag": tag, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
    result["wall_s"] = time.perf_counter() - started
    if args.out:
        append_jsonl(args.out, result)
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


def append_jsonl(path: str, record: dict[str, Any]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")


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
    prewarm_modes = ["stock"] if args.compile_cache == "shared" else modes
    if args.prewarm:
        for mode in prewarm_modes:
            throwaway = work / f"prewarm_tuning_cache_{mode}.msgpack"
            with contextlib.suppress(FileNotFoundError):
                throwaway.unlink()
            result = run_worker(args, mode, "prewarm", child_env(args, mode, compile_cache(mode), throwaway))
            runs.append(result)

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
        order = modes if index % 2 == 0 else modes[::-1]
        for mode in order:
            if mode == "auto" and auto_unsupported:
                continue
            tag = f"run{index + 1}"
            result = run_worker(
                args,
                mode,
                tag,
                child_env(args, mode, compile_cache(mode), tuning_cache if mode == "auto" else None),
            )
            result["round"] = index + 1
            runs.append(result)
            if mode == "auto" and result.get("unsupported"):
                auto_unsupported = True
                print(
                    f"auto: not available in this megatron_tuning ({result.get('error')}); "
                    "skipping its later runs"
                )
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


def summarize(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per mode: config spread, output hashes, benchmark calls, first-step and steady-state times."""
    counted = [r for r in runs if r.get("tag") != "prewarm"]
    ok = [r for r in counted if r.get("ok")]
    stock_steady = _median([r["steady_ms"]["median"] for r in ok if r["mode"] == "stock"])
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
        first = [r["first_step_s"] for r in mine]
        row: dict[str, Any] = {
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
            "bench_calls": _median([r["triton_bench_calls"] for r in mine]),
            "do_bench_calls": _median([r["do_bench_calls"] for r in mine]),
            "first_step_launches": _median([r["first_step_launches"] for r in mine]),
            "first_step_s": _median(first),
            "first_step_s_run1": next((r["first_step_s"] for r in mine if r.get("round") == 1), None),
            "first_step_s_later": _median([r["first_step_s"] for r in mine if r.get("round", 1) > 1]),
            "steady_ms": _median(steady),
            "steady_spread": common.spread(steady)["rel_range"] if steady else None,
            "ratio_to_stock": (_median(steady) / stock_steady) if steady and stock_steady else None,
            "kernel_ms": _kernel_medians(mine),
            "ref_rel_err_max": max((r.get("reference", {}).get("rel_err", 0.0) for r in mine), default=None),
            "first_matches_steady": all(r.get("first_matches_steady") for r in mine) if mine else None,
            "decision_sources": dict(
                collections.Counter(d.get("source", "?") for r in mine for d in r.get("decisions", []))
            ),
            "import_s": _median([r.get("import_s", 0.0) for r in mine]),
        }
        per_mode[mode] = row
    prewarm = [r for r in runs if r.get("tag") == "prewarm"]
    hashes = {m: sorted({r["out"]["all"] for r in ok if r["mode"] == m}) for m in modes}
    return {
        "modes": per_mode,
        "kernels": {k: {m: dict(c) for m, c in v.items()} for k, v in sorted(per_kernel.items())},
        "output_hashes": hashes,
        "prewarm": [
            {
                "mode": r["mode"],
                "ok": r.get("ok"),
                "first_step_s": r.get("first_step_s"),
                "error": r.get("error"),
            }
            for r in prewarm
        ],
    }


def _median(values: list[Any]) -> Any:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _kernel_medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    pooled: dict[str, list[float]] = collections.defaultdict(list)
    for r in runs:
        for kernel, ms in r.get("kernel_ms", {}).items():
            pooled[kernel].append(ms)
    return {k: statistics.median(v) for k, v in sorted(pooled.items())}


def _short(kernel: str) -> str:
    return kernel.rsplit(":", 1)[-1].strip("_")


def print_summary(summary: dict[str, Any]) -> None:
    modes = summary["modes"]
    print("\n== per mode (counted processes; prewarm excluded)")
    rows = []
    for mode, r in modes.items():
        rows.append(
            [
                mode,
                r["processes"],
                r["failed"],
                r["keys_with_several_configs"],
                r["max_distinct_configs"],
                r["distinct_output_hashes"],
                _na(r["bench_calls"]),
                _na(r["first_step_launches"]),
                _na(r["first_step_s_run1"]),
                _na(r["first_step_s_later"]),
                _na(r["steady_ms"]),
                _na(r["ratio_to_stock"], "x"),
                _na(r["ref_rel_err_max"]),
            ]
        )
    common.print_table(
        [
            "mode",
            "procs",
            "fail",
            "keys>1cfg",
            "max cfgs/key",
            "out hashes",
            "bench calls",
            "launches 1st",
            "1st step s (run1)",
            "1st step s (later)",
            "steady ms",
            "vs stock",
            "ref rel err",
        ],
        rows,
    )
    for mode, r in modes.items():
        for error in r["errors"]:
            print(f"  {mode} error: {error}")
    kernels = summary["kernels"]
    if kernels:
        print("\n== configs launched per kernel (count of processes)")
        rows = []
        for kernel, by_mode in kernels.items():
            for mode, counter in by_mode.items():
                for sig, n in sorted(counter.items(), key=lambda kv: -kv[1]):
                    ms = modes.get(mode, {}).get("kernel_ms", {}).get(kernel)
                    rows.append([_short(kernel), mode, n, sig, _na(ms)])
        common.print_table(["kernel", "mode", "procs", "config", "kernel ms (mode median)"], rows)
    for p in summary.get("prewarm", []):
        print(
            f"prewarm {p['mode']}: first step {p['first_step_s']} s (cold compile cache) "
            f"ok={p['ok']} {p['error'] or ''}"
        )


def _na(value: Any, suffix: str = "") -> Any:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}{suffix}"
    return value


# =========================================================================== fake worker (driver tests)


def fake_worker(args: argparse.Namespace) -> dict[str, Any]:
    """A synthetic result with the real shape, for checking the driver and summary without torch."""
    import random

    rng = random.Random(f"{args.mode}{args.tag}{os.getpid()}")
    stock = args.mode == "stock"
    sig = f"BLOCK_SIZE_M={rng.choice([64, 128]) if stock else 64}, num_warps=4, num_stages=3"
    if args.mode == "auto" and os.environ.get("MEGATRON_TUNING_FAKE_NO_AUTO"):
        return {
            "mode": args.mode,
            "tag": args.tag,
            "ok": False,
            "unsupported": True,
            "error": "PolicyError: mode='auto' is not one of ...",
        }
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
        "env": {
            k: os.environ.get(k)
            for k in (
                "MAMBA_DETERMINISTIC",
                "TRITON_CACHE_AUTOTUNING",
                "MEGATRON_TUNING_CACHE",
                "MEGATRON_TUNING_SCOPE",
            )
        },
    }


# =========================================================================== main


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=MODES, help="worker: run this mode in this process")
    parser.add_argument(
        "--driver", action="store_true", help="launch fresh worker processes per mode and summarize"
    )
    parser.add_argument(
        "--list-kernels", action="store_true", help="print the autotuned kernels of megatron.core.ssm.ops"
    )
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, help=f"driver: modes to run (default {' '.join(DEFAULT_MODES)})"
    )
    parser.add_argument(
        "--processes", type=int, default=None, help="driver: processes per mode (default 4; smoke 2)"
    )
    parser.add_argument(
        "--work-dir",
        default=None,
        help="driver: folder for the compile and tuning caches (default: a temp dir)",
    )
    parser.add_argument(
        "--compile-cache",
        choices=("shared", "per-mode"),
        default="shared",
        help="driver: one TRITON_CACHE_DIR for all modes (default) or one per mode",
    )
    parser.add_argument(
        "--no-prewarm",
        dest="prewarm",
        action="store_false",
        help="driver: skip the uncounted compile-cache warm-up process(es)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=330.0,
        help="driver: start no new round past this many seconds (default 330)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="driver: seconds per worker process")
    parser.add_argument("--summary-out", default=None, help="driver: write the summary JSON here")
    parser.add_argument("--out", default=None, help="append one JSON line per process to this file")
    parser.add_argument("--tag", default="single", help=argparse.SUPPRESS)
    parser.add_argument(
        "--import-style",
        choices=("stub", "plain"),
        default="stub",
        help="stub: skip megatron/core/__init__.py (default); plain: ordinary import",
    )
    parser.add_argument(
        "--lens",
        type=int,
        nargs="+",
        default=None,
        help="sequence lengths packed in the batch (default 5000 3000 6000 2384)",
    )
    parser.add_argument("--nheads", type=int, default=None)
    parser.add_argument("--headdim", type=int, default=None)
    parser.add_argument("--dstate", type=int, default=None)
    parser.add_argument("--ngroups", type=int, default=None)
    parser.add_argument("--chunk", type=int, default=None)
    parser.add_argument(
        "--no-conv", action="store_true", help="time the SSD only (no causal_conv1d_varlen_fn)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steady-state steps (default 100; smoke 2)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps before them (default 10; smoke 1)"
    )
    parser.add_argument(
        "--kernel-steps", type=int, default=20, help="steps of the per-kernel timing pass (0: skip)"
    )
    parser.add_argument(
        "--ref-tokens",
        type=int,
        default=None,
        help="tokens checked against the fp32 recurrence (default 512; smoke 24)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, Triton interpreter, tiny fp32 shapes: a plumbing check, numbers meaningless",
    )
    parser.add_argument(
        "--fake-worker", action="store_true", help=argparse.SUPPRESS
    )  # driver tests without torch
    args = parser.parse_args()
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 100)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 10)
    args.ref_tokens = args.ref_tokens if args.ref_tokens is not None else (24 if args.smoke else 512)

    if args.list_kernels:
        return list_kernels(args)
    if args.driver:
        return driver(args)
    if not args.mode:
        parser.error("give --mode (one worker process), --driver or --list-kernels")
    result = fake_worker(args) if args.fake_worker else worker(args)
    if args.out:
        append_jsonl(args.out, result)
    common.emit(result)
    if not result.get("ok"):
        print(result.get("traceback", result.get("error")), file=sys.stderr)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
