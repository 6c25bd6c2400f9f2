"""``auto`` under torch.compile: a key first reached in compiled code is tuned once, then read back.

    PYTHONPATH=. python benchmarks/bench_compile_auto.py --out auto_compiled.json   # H200: ~3 min
    PYTHONPATH=. python benchmarks/bench_compile_auto.py --smoke                    # CPU: the plumbing

Stage ``auto-compiled`` (issue 27 item 1): ``--processes`` (3) fresh processes share one ``auto``
cache (shipped tables off, so nothing else answers). Each compiles (``fullgraph=True``) and calls:

* ``tests/support_kernels.write_block`` at n=1000: the kernel writes its ``BLOCK`` into its output, so the
  config the compiled graph launched is read back from the result;
* the reference GEMM (``megatron_tuning.kernels.matmul``, 8192^3 bf16).

Per process and kernel it reports the decision's source and config, the launched BLOCK, and the
first call's seconds. The last process also times the compiled-auto GEMM against stock compiled
(the library closed, a second function compiled, so Inductor benchmarks every config itself),
interleaved in one process: ``auto/stock`` is stock's time over auto's (>= 0.97 is the goal).
Inductor's FX graph and autotune caches are off in every process (``force_disable_caches``), so a
stock compile never reuses the library's choice and each first run really benchmarks.

Goals: run 1's sources are ``tuned``; later runs launch the same config, read from the cache
(source ``table``); the block kernel launches the decided BLOCK in every run; on a GPU,
``auto/stock >= 0.97``. Exit 1 if one is missed. ``--smoke`` (CPU, Triton interpreter, small
shapes) cannot compile (Dynamo would trace the interpreter): it checks this script's plumbing and
the cache round trip through eager launches, not Inductor (``tests/runtime/test_inductor.py`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MM = "megatron_tuning.kernels:matmul_kernel"
WB = "tests.support_kernels:write_block_kernel"


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One fresh process: compile and call both kernels under ``auto``; maybe time against stock."""
    import torch

    import megatron_tuning
    from megatron_tuning.core.decisions import get_decisions
    from megatron_tuning.kernels import matmul
    from tests.support_kernels import write_block

    device = "cpu" if args.smoke else "cuda"
    # The smoke run cannot compile: Dynamo would trace the Triton interpreter itself.
    compile_ = (lambda fn: fn) if args.smoke else (lambda fn: torch.compile(fn, fullgraph=True))
    if not args.smoke:
        torch._inductor.config.force_disable_caches = True
    policy = megatron_tuning.TuningPolicy.from_env(mode="auto", cache=args.cache, use_shipped_tables=False)
    handle = megatron_tuning.init_deterministic_tuning(policy)

    def wb_auto(x: torch.Tensor) -> torch.Tensor:
        return write_block(x)

    def mm_auto(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return matmul(a, b)

    def mm_stock(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # a code object of its own
        return matmul(a, b)

    size = 32 if args.smoke else args.size
    a = torch.randn(size, size, device=device, dtype=torch.float32 if args.smoke else torch.bfloat16)
    b = torch.randn_like(a)
    result: dict[str, Any] = {"kernels": {}}
    for name, fn, call in (
        (WB, wb_auto, (torch.zeros(1000, device=device),)),
        (MM, mm_auto, (a, b)),
    ):
        compiled = compile_(fn)
        started = time.perf_counter()
        out = compiled(*call)
        if device == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - started
        (decision,) = [d for d in get_decisions() if d.kernel == name] or [None]
        result["kernels"][name] = {
            "source": decision and decision.source,
            "config": decision and decision.signature,
            "key": decision and decision.key,
            "launched_block": int(out[0].item()) if name == WB else None,
            "first_call_s": round(first, 3),
        }
        if name == MM:
            result["mm_auto"] = compiled
    if args.stock:
        auto = result.pop("mm_auto")
        handle.close()  # stock from here on: Inductor benchmarks every config of a new compile
        stock = compile_(mm_stock)
        stock(a, b)
        result["timing"] = _interleaved(auto, stock, (a, b), device, rounds=3 if args.smoke else 7)
    result.pop("mm_auto", None)
    handle.close()
    return result


def _interleaved(auto: Any, stock: Any, call: tuple[Any, ...], device: str, rounds: int) -> dict[str, Any]:
    """Median ms per call of each, timed in alternating rounds of 10 calls (drift hits both alike)."""
    import torch

    def per_call_ms(fn: Any) -> float:
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn(*call)
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 10
        started = time.perf_counter()
        for _ in range(10):
            fn(*call)
        return (time.perf_counter() - started) * 100.0

    per_call_ms(auto), per_call_ms(stock)  # warm
    samples: dict[str, list[float]] = {"auto": [], "stock": []}
    for i in range(rounds):
        for label, fn in (
            (("auto", auto), ("stock", stock)) if i % 2 == 0 else (("stock", stock), ("auto", auto))
        ):
            samples[label].append(per_call_ms(fn))
    auto_ms, stock_ms = statistics.median(samples["auto"]), statistics.median(samples["stock"])
    return {
        "auto_ms": auto_ms,
        "stock_ms": stock_ms,
        "auto_over_stock_speed": stock_ms / auto_ms,
        "samples": samples,
    }


def parent(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="bench_compile_auto_"))
    cache = work / "auto.msgpack"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    env["TRITON_CACHE_DIR"] = str(work / "triton")  # compiled kernels shared: later runs start faster
    if args.smoke:
        env.update(TRITON_INTERPRET="1", MEGATRON_TUNING_TUNE_ROUNDS="1")
    runs = []
    for index in range(args.processes):
        env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor{index}")
        command = [sys.executable, __file__, "--child", "--cache", str(cache), "--size", str(args.size)]
        last = index == args.processes - 1
        command += ["--smoke"] if args.smoke else ["--stock"] * last  # stock timing needs a GPU
        started = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(f"run {index + 1} failed (exit {done.returncode}):\n{done.stderr[-4000:]}", file=sys.stderr)
            return 1
        run = json.loads(lines[-1][len("RESULT ") :])
        run["wall_s"] = round(time.perf_counter() - started, 1)
        runs.append(run)
    goals = check_goals(runs, smoke=args.smoke)
    _print(runs, goals)
    report = {"stage": "auto-compiled", "smoke": args.smoke, "size": args.size, "runs": runs, "goals": goals}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return 0 if all(goal["met"] for goal in goals) else 1


def check_goals(runs: list[dict[str, Any]], *, smoke: bool) -> list[dict[str, Any]]:
    goals = []
    for kernel in (WB, MM):
        seen = [run["kernels"][kernel] for run in runs]
        goals.append({"goal": f"{kernel}: run 1 tuned", "met": seen[0]["source"] == "tuned"})
        later = all(s["source"] == "table" and s["config"] == seen[0]["config"] for s in seen[1:])
        goals.append({"goal": f"{kernel}: later runs launch run 1's config from the cache", "met": later})
    blocks = {run["kernels"][WB]["launched_block"] for run in runs}
    decided = {int(run["kernels"][WB]["config"].split("BLOCK=")[1].split(",")[0]) for run in runs}
    goals.append({"goal": f"{WB}: the launched BLOCK is the decided one", "met": blocks == decided})
    if not smoke:
        ratio = runs[-1]["timing"]["auto_over_stock_speed"]
        goals.append(
            {"goal": f"GEMM compiled auto >= 0.97x stock compiled ({ratio:.3f})", "met": ratio >= 0.97}
        )
    return goals


def _print(runs: list[dict[str, Any]], goals: list[dict[str, Any]]) -> None:
    print(f"{'run':>3}  {'kernel':<38} {'source':<8} {'first call s':>12}  config (launched)")
    for index, run in enumerate(runs, 1):
        for kernel, seen in run["kernels"].items():
            launched = (
                f" (launched BLOCK={seen['launched_block']})" if seen["launched_block"] is not None else ""
            )
            row = f"{index:>3}  {kernel:<38} {seen['source']!s:<8} {seen['first_call_s']:>12}"
            print(f"{row}  {seen['config']}{launched}")
    timing = runs[-1].get("timing")
    if timing:
        print(
            f"GEMM, run {len(runs)}: compiled auto {timing['auto_ms']:.3f} ms, stock compiled "
            f"{timing['stock_ms']:.3f} ms per call: auto speed = {timing['auto_over_stock_speed']:.3f}x stock"
        )
    for goal in goals:
        print(f"[{'met' if goal['met'] else 'MISSED'}] {goal['goal']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: interpreter, small shapes, eager")
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--size", type=int, default=8192, help="GEMM M=N=K on the GPU")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per process")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stock", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
