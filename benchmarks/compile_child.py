"""The child side of ``bench_compile.py``: one process, one variant and compile kind, two kernels.

``child`` installs a ``Probe`` (Triton's and Inductor's benchmark counts, the config Inductor
launches for the call in progress) before the library, then launches each kernel's first key
eagerly and compiled, its second key compiled and then eagerly, and emits the configs launched,
the benchmark counts, the decisions and the library's warnings.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import common

WB_KEYS = (1000, 2000)
MM_KEYS = ((512, 512, 512), (4096, 4096, 4096))
SMOKE_MM_KEYS = ((32, 48, 40), (64, 32, 48))
CALLS = {"static": 2, "dynamic": 2, "reduce-overhead": 4}  # compiled calls per key


def label(config: Any) -> str:
    """Short text of a launched config: ``BLOCK=32`` or ``128x256x32 g8 w8 s4``."""
    kwargs = config.kwargs
    if "BLOCK" in kwargs:
        return f"BLOCK={kwargs['BLOCK']}"
    return (
        f"{kwargs['BLOCK_SIZE_M']}x{kwargs['BLOCK_SIZE_N']}x{kwargs['BLOCK_SIZE_K']} "
        f"g{kwargs['GROUP_SIZE_M']} w{config.num_warps} s{config.num_stages}"
    )


class Probe:
    """Counts benchmarks and records which config Inductor launches for the call in progress."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.inductor_runs: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
        self.inductor_bench: collections.Counter[str] = collections.Counter()
        self.triton_bench: collections.Counter[str] = collections.Counter()

    def install(self, smoke: bool) -> None:
        # Installed before the library, which then wraps these wrappers (and restores them).
        self.triton_bench = common.count_triton_benchmarks()
        if smoke:
            return  # no Inductor on the CPU path: Dynamo runs these kernels eagerly there
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        run, benchmark_all = CachingAutotuner.run, CachingAutotuner.benchmark_all_configs

        def _run(autotuner: Any, *args: Any, **kwargs: Any) -> Any:
            result = run(autotuner, *args, **kwargs)
            if autotuner.custom_kernel and self.current is not None:
                launcher = autotuner.launchers[0]
                self.inductor_runs[self.current].append((label(launcher.config), len(autotuner.launchers)))
            return result

        def _benchmark_all(autotuner: Any, *args: Any, **kwargs: Any) -> Any:
            if autotuner.custom_kernel:
                self.inductor_bench[str(self.current).split("|")[0]] += 1
            return benchmark_all(autotuner, *args, **kwargs)

        CachingAutotuner.run = _run
        CachingAutotuner.benchmark_all_configs = _benchmark_all


def _block_of(y: Any) -> str:
    return f"BLOCK={int(y.reshape(-1)[0].item())}"


def _measure_kernel(
    name: str,
    keys: tuple[Any, ...],
    make_input: Callable[[Any], tuple[Any, ...]],
    fn: Callable[..., Any],
    eager_config: Callable[[Any], str],
    compile_options: dict[str, Any],
    calls: int,
    probe: Probe,
    smoke: bool,
) -> list[dict[str, Any]]:
    import torch

    torch._dynamo.reset()
    # CPU smoke: torch.compile cannot handle an interpreted kernel (Dynamo traces into the
    # interpreter), so the "compiled" calls are plain calls there: plumbing only.
    # tests/runtime/test_inductor.py covers the compiled path on CPU.
    compiled = fn if smoke else torch.compile(fn, **compile_options)
    rows = []
    for index, key in enumerate(keys):
        inputs = make_input(key)
        row: dict[str, Any] = {
            "kernel": name,
            "key": str(key),
            "first": "eager" if index == 0 else "compiled",
        }
        if index == 0:
            row["eager"] = eager_config(fn(*inputs))
        probe.current = f"{name}|{key}"
        launched = []
        for _ in range(calls):
            if compile_options.get("mode") == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()  # the previous output is not reused
            out = compiled(*inputs)
            common.synchronize(smoke)
            launched.append(eager_config(out) if name == "write_block" else "")
            del out
        probe.current = None
        runs = probe.inductor_runs.get(f"{name}|{key}", [])
        if name != "write_block":  # matmul: what Inductor's launcher ran (replays run the same one)
            # (smoke: no Inductor; on a GPU no record means the probe missed the launch: "?")
            fallback = runs[-1][0] if runs else (eager_config(None) if smoke else "?")
            launched = [fallback] * calls
        row["compiled"] = launched
        row["inductor_configs_compiled"] = sorted({count for _, count in runs})
        row["inductor_launched"] = sorted({config for config, _ in runs})
        if index == 1:
            row["eager"] = eager_config(fn(*inputs))
        rows.append(row)
    return rows


def child(args: argparse.Namespace) -> None:
    variant, kind = args.child.split(",")
    import torch

    from megatron_tuning import kernels as mm
    from tests import support_kernels as sk

    probe = Probe()
    probe.install(args.smoke)
    # The library's notices are TuningWarnings (warnings.warn), its diagnostics log records: keep both.
    messages = common.collect_warnings()
    if variant == "stock" and args.smoke:
        for kernel in (sk.write_block_kernel, mm.matmul_kernel):  # no GPU benchmarker on CPU
            kernel.__dict__["do_bench"] = lambda fn, quantiles=None, **kw: (
                [1.0, 1.0, 1.0] if quantiles else 1.0
            )
    elif variant in ("pinned", "bypass"):
        import megatron_tuning
        from megatron_tuning.core.policy import TuningPolicy

        policy = None
        if variant == "bypass":  # simulate a torch whose call_triton_kernel cannot be wrapped
            from megatron_tuning.runtime import inductor

            inductor._hopifier_class = lambda: (None, "simulated by bench_compile: hook not installed")
            policy = TuningPolicy.from_env(strict=True)
        megatron_tuning.init_deterministic_tuning(policy)

    device = "cpu" if args.smoke else "cuda"
    options: dict[str, Any] = {"fullgraph": True}
    if kind == "reduce-overhead":
        options.update(mode="reduce-overhead")
    else:
        options.update(dynamic=kind == "dynamic")
    calls = CALLS[kind]
    result: dict[str, Any] = {"variant": variant, "kind": kind, "rows": []}
    start = time.perf_counter()
    try:
        result["rows"] += _measure_kernel(
            "write_block",
            WB_KEYS,
            lambda n: (torch.zeros(n, device=device),),
            sk.write_block,
            _block_of,
            options,
            calls,
            probe,
            args.smoke,
        )
        if variant != "bypass":
            result["rows"] += _measure_kernel(
                "matmul",
                SMOKE_MM_KEYS if args.smoke else MM_KEYS,
                lambda shape: common.matmul_operands(shape, args.smoke)[:2],
                mm.matmul,
                lambda _: label(mm.matmul_kernel.best_config),
                options,
                calls,
                probe,
                args.smoke,
            )
    except Exception as e:  # the bypass check expects one; anything else is reported
        result["error"] = {"type": type(e).__name__, "message": str(e)}
    from megatron_tuning.core.decisions import get_decisions

    result["seconds"] = time.perf_counter() - start
    result["decisions"] = [[d.kernel, d.key, d.signature, d.source] for d in get_decisions() if d.key != "*"]
    result["inductor_bench"] = dict(probe.inductor_bench)
    result["triton_bench"] = dict(probe.triton_bench)
    result["warnings"] = [m for m in messages if "cannot be intercepted" in m or "not pinned" in m]
    common.emit(result)
