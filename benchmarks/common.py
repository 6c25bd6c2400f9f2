"""Shared plumbing for the GPU benchmarks: child processes, timing, shapes, JSON and tables.

Every benchmark is one script that is both the parent (spawns fresh processes, aggregates,
writes JSON, prints a table) and the child (``--child ...``: does one process's measurement
and prints one ``RESULT {json}`` line). ``--smoke`` runs the same code paths on CPU in the
Triton interpreter with tiny shapes and a host-clock "benchmarker", so a script is exercised
end to end before any GPU minute is spent; smoke numbers mean nothing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# (M, N, K) of the reference GEMMs (bf16): the shapes issue 5 names.
MATMUL_SHAPES: list[tuple[int, int, int]] = [
    (8192, 8192, 8192),
    (16384, 8192, 4096),
    (4096, 14336, 4096),
    (512, 512, 512),
]
SMOKE_MATMUL_SHAPES: list[tuple[int, int, int]] = [(32, 48, 40), (64, 32, 48)]
RESULT_MARK = "RESULT "
# Contexts held for the whole process (closed at exit); a bare __enter__ would be undone at GC.
_PROCESS_CONTEXTS = contextlib.ExitStack()


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check of every code path (Triton interpreter, tiny shapes; numbers meaningless)",
    )
    parser.add_argument("--out", default=None, help="write the JSON results here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one process's part


def require_device(args: argparse.Namespace, name: str) -> bool:
    """True when the benchmark can run: a CUDA GPU, or ``--smoke``. Explains itself otherwise."""
    if args.smoke:
        use_cpu_interpreter()
        return True
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    print(
        f"{name} measures Triton kernels on a CUDA GPU and none is visible here. "
        f"Run it on a GPU machine (PYTHONPATH=. python benchmarks/{name}.py), "
        f"or add --smoke to check its code paths on CPU.",
        file=sys.stderr,
    )
    return False


def use_cpu_interpreter() -> None:
    """Run this process's kernels in the Triton interpreter (``--smoke``, CPU modes)."""
    os.environ["TRITON_INTERPRET"] = "1"
    # Triton 3.3 resolves its benchmarker when a kernel is decorated, which fails without a
    # GPU driver: keep the lazy one for this whole (short-lived) process.
    from megatron_tuning.runtime.triton_compat import lazy_benchmarker

    _PROCESS_CONTEXTS.enter_context(lazy_benchmarker())


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    """``items`` starting at position ``shift`` (mod length): interleaved rounds rotate their start
    so slow drift hits every item alike."""
    start = shift % len(items)
    return list(items[start:]) + list(items[:start])


def run_parent_or_child(
    parser: argparse.ArgumentParser,
    name: str,
    child: Callable[[argparse.Namespace], None],
    parent: Callable[[argparse.Namespace], int],
) -> int:
    """The shared ``main`` of the multi-process benchmarks: parse, check the device, dispatch."""
    args = parser.parse_args()
    if not require_device(args, name):
        return 2
    if args.child:
        child(args)
        return 0
    return parent(args)


def child_env(smoke: bool, **extra: str | None) -> dict[str, str]:
    """A clean environment for a fresh child: repo importable, no inherited tuning state."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MEGATRON_TUNING_")
        and k not in ("TRITON_CACHE_AUTOTUNING", "TRITON_PRINT_AUTOTUNING")
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    if smoke:
        env["TRITON_INTERPRET"] = "1"
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_child(
    script: str, argv: Sequence[str], env: Mapping[str, str], timeout: float = 600.0
) -> dict[str, Any]:
    """Run ``script --child ...`` in a fresh interpreter; return its ``RESULT`` JSON."""
    cmd = [sys.executable, str(Path(__file__).resolve().parent / script), *argv]
    proc = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=timeout, check=False)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])  # type: ignore[no-any-return]
    raise RuntimeError(
        f"child {' '.join(cmd)} exited {proc.returncode} without a result:\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )


def emit(result: Mapping[str, Any]) -> None:
    """The child's answer to its parent: one line, last on stdout."""
    sys.stdout.flush()
    print(RESULT_MARK + json.dumps(result, sort_keys=True), flush=True)


def environment() -> dict[str, Any]:
    """Date, machine, GPU and versions: the header of every results file."""
    info: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ"),
        "python": platform.python_version(),
        "host": platform.node(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    try:
        import torch
        import triton

        info["torch"] = torch.__version__
        info["triton"] = triton.__version__
        if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
    except ImportError:
        pass
    return info


def write_json(path: str | None, payload: Mapping[str, Any]) -> None:
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"results written to {target}")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain, aligned text table (what RESULTS.md quotes)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if n and _numeric(c) else c.ljust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def _numeric(text: str) -> bool:
    try:
        float(text.rstrip("x%"))
    except ValueError:
        return False
    return True


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and (max - min) / median of a sample (the spread RESULTS.md reports)."""
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if not finite:
        return {
            "median": float("nan"),
            "min": float("nan"),
            "max": float("nan"),
            "rel_range": float("nan"),
            "n": 0,
        }
    med = statistics.median(finite)
    return {
        "median": med,
        "min": min(finite),
        "max": max(finite),
        "rel_range": (max(finite) - min(finite)) / med if med else float("nan"),
        "n": len(finite),
    }


def append_jsonl(path: str, record: Mapping[str, Any]) -> None:
    """Append one JSON line (a process's raw result) to ``path``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")


def quantiles(samples: Sequence[float]) -> dict[str, float]:
    """Median, p20, p80 (nearest rank), min and count of a non-empty sample."""
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


def median_or_none(values: Sequence[Any]) -> Any:
    """The median of the values that are not ``None``; ``None`` when there are none."""
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def dash(value: Any, suffix: str = "") -> Any:
    """A table cell: ``-`` for a missing value, 4 significant digits (and ``suffix``) for a float."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}{suffix}"
    return value


# --------------------------------------------------------------------------- inside a child


def time_ms(fn: Callable[[], Any], smoke: bool, *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on a GPU, the host clock in smoke."""
    if smoke:
        fn()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
    import triton.testing

    # Three quantiles: do_bench returns a list for several (a bare float for exactly one).
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.2, 0.5, 0.8])[1])


def synchronize(smoke: bool) -> None:
    if not smoke:
        import torch

        torch.cuda.synchronize()


def cpu_do_bench(kernel_call: Callable[[], Any], quantiles: Any = None, **_: Any) -> list[float]:
    """Stand-in for Triton's GPU benchmarker in smoke mode, so stock autotuning runs on CPU."""
    start = time.perf_counter()
    kernel_call()
    elapsed = (time.perf_counter() - start) * 1e3
    return [elapsed, elapsed, elapsed] if quantiles else elapsed  # type: ignore[return-value]


def allow_stock_autotune_on_cpu(autotuner: Any) -> None:
    """Smoke mode only: give a stock autotuner a host-clock benchmarker (no GPU driver on CPU)."""
    autotuner.__dict__["do_bench"] = cpu_do_bench


def matmul_operands(shape: tuple[int, int, int], smoke: bool, seed: int = 0) -> tuple[Any, Any, Any, tuple]:
    """``a``, ``b``, ``c`` and the positional argument tuple of ``matmul_kernel`` for ``shape``."""
    import torch

    m, n, k = shape
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn((m, k), device=device, dtype=dtype, generator=gen)
    b = torch.randn((k, n), device=device, dtype=dtype, generator=gen)
    c = torch.empty((m, n), device=device, dtype=dtype)
    args = (a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    return a, b, c, args


def tflops(shape: tuple[int, int, int], ms: float) -> float:
    m, n, k = shape
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def shape_name(shape: tuple[int, int, int]) -> str:
    return "x".join(str(d) for d in shape)


def launch_config(autotuner: Any, config: Any, args: tuple, grid: Any) -> None:
    """Launch one specific config of an autotuned kernel, bypassing the autotuner (fixed-config timing)."""
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(autotuner.arg_names, args)), **config.all_kwargs()})
    autotuner.fn[grid](*args, **config.all_kwargs())


def time_configs_interleaved(
    autotuner: Any, configs: Sequence[Any], args: tuple, grid: Any, *, rounds: int, rep_ms: int, smoke: bool
) -> list[list[float]]:
    """Per config, ``rounds`` samples (ms) of launching exactly that config, bypassing the autotuner.

    Rounds are interleaved with a rotating start so clock drift hits every config alike; a config
    that cannot compile or run scores ``inf`` (as in Triton's autotuner).
    """
    samples: list[list[float]] = [[] for _ in configs]
    order = list(range(len(configs)))
    for r in range(rounds):
        start = r % len(configs)
        for i in order[start:] + order[:start]:

            def call(c: Any = configs[i]) -> None:
                launch_config(autotuner, c, args, grid)

            try:
                samples[i].append(time_ms(call, smoke, warmup=5, rep=rep_ms))
            except Exception as exc:  # out of resources / compile errors: this config cannot run
                samples[i].append(float("inf"))
                print(f"config {i}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return samples


class LaunchCounters:
    """Process-wide counts of Triton's benchmarking and of kernel launches (``install`` them first).

    ``bench_calls``: ``Autotuner._bench`` calls that reach Triton's own benchmarking (installed
    before ``megatron_tuning``, whose guard then wraps this wrapper); ``do_bench_calls``:
    ``triton.testing.do_bench`` calls; ``launches``: ``JITFunction.run`` (and interpreted) calls.
    While ``launch_log`` is a list, each launch appends ``(jit function, keyword arguments with
    "__positional__")``; while ``events`` is a list, each launch is timed with CUDA events and
    appends ``(function id, start, end)``.
    """

    def __init__(self) -> None:
        self.bench_calls = 0
        self.do_bench_calls = 0
        self.launches = 0
        self.launch_log: list[tuple[Any, dict[str, Any]]] | None = None
        self.events: list[tuple[str, Any, Any]] | None = None

    def install(self) -> None:
        import functools

        import triton
        import triton.testing
        from triton.runtime.autotuner import Autotuner

        original_bench = Autotuner.__dict__.get("_bench") or Autotuner._bench

        @functools.wraps(original_bench)
        def _bench(autotuner: Any, *args: Any, **kwargs: Any) -> Any:
            self.bench_calls += 1
            return original_bench(autotuner, *args, **kwargs)

        Autotuner._bench = _bench
        original_do_bench = triton.testing.do_bench

        @functools.wraps(original_do_bench)
        def do_bench(*args: Any, **kwargs: Any) -> Any:
            self.do_bench_calls += 1
            return original_do_bench(*args, **kwargs)

        triton.testing.do_bench = do_bench  # the CUDA driver's get_benchmarker() imports it at call time
        classes = [triton.runtime.jit.JITFunction]
        with contextlib.suppress(ImportError, AttributeError):
            from triton.runtime.interpreter import InterpretedFunction

            classes.append(InterpretedFunction)
        for cls in classes:
            self._wrap_run(cls)

    def _wrap_run(self, cls: Any) -> None:
        import functools

        original_run = cls.__dict__.get("run") or cls.run

        @functools.wraps(original_run)
        def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
            self.launches += 1
            if self.launch_log is not None:
                self.launch_log.append((fn, dict(kwargs, __positional__=args)))
            events = self.events
            if events is None:
                return original_run(fn, *args, **kwargs)
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = original_run(fn, *args, **kwargs)
            end.record()
            inner = getattr(fn, "fn", None)
            name = getattr(inner, "__qualname__", getattr(inner, "__name__", "?"))
            events.append((f"{getattr(inner, '__module__', '?')}:{name}", start, end))
            return result

        cls.run = run


def count_triton_benchmarks() -> collections.Counter[str]:
    """Count, per kernel name, the calls that reach Triton's own ``Autotuner._bench``.

    Install it before the library: the interception then wraps this wrapper, so a count is a
    config Triton really benchmarked (our tuner never goes through ``_bench``).
    """
    from triton.runtime.autotuner import Autotuner

    counts: collections.Counter[str] = collections.Counter()
    original = Autotuner._bench

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts[getattr(getattr(self, "base_fn", None), "__name__", "?")] += 1
        return original(self, *args, **kwargs)

    Autotuner._bench = counted
    return counts


def install_pinned(table_paths: Sequence[str]) -> Any:
    """Deterministic policy with these tables (no shipped ones): what a pinned user process does."""
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.runtime import interception
    from megatron_tuning.tables.search import TableSet

    table = TableSet([p for p in table_paths if p], shipped_dir=None) if table_paths else None
    interception.install(
        TuningPolicy(mode="deterministic", agreement="off", use_shipped_tables=False), table=table
    )
    return table


def default_matmul_table() -> str | None:
    """The sm90 matmul table in this checkout, when the tables step (or a commit) put one there."""
    path = REPO / "configs" / "sm90" / "matmul.msgpack"
    return str(path) if path.exists() else None
