"""Steady-state host cost per launch of a tiny kernel: pinned vs Triton's cache-hit path vs bare jit.

    PYTHONPATH=. python benchmarks/bench_launch_overhead.py [--launches 20000] [--trials 7]
    PYTHONPATH=. python benchmarks/bench_launch_overhead.py --smoke      # CPU check of the code paths

One process, one 1024-element add-one kernel (the GPU work is negligible, so launches/s measures
host overhead). Paths, each launched with the same callable grid:

* ``bare``: the ``@triton.jit`` twin with a fixed block size;
* ``triton_hit``: stock ``@triton.autotune`` after its first call (Triton's own cache-hit path);
* ``one_config``: a one-config ``@triton.autotune`` (no key is built at all);
* ``pinned``: the autotuned kernel under the interception (deterministic policy, a table entry
  pinning the config Triton chose), after first use.

Trials interleave the paths in rotating order; the interception is installed only around the
pinned path's trials. Goal: pinned <= 1.05x Triton's hit path per launch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import common

PATHS = ("bare", "triton_hit", "one_config", "pinned")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import triton

    from megatron_tuning.core.identity import config_data, kernel_id, tuning_key
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.kernels import tiny
    from megatron_tuning.runtime import interception

    policy = TuningPolicy(mode="deterministic", agreement="off", use_shipped_tables=False)

    n = 1024
    device = "cpu" if args.smoke else "cuda"
    x = torch.zeros(n, device=device, dtype=torch.float32)
    y = torch.empty_like(x)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)
    one = triton.autotune(configs=[tiny.ADD_ONE_CONFIGS[2]], key=["n"])(tiny.add_one_kernel.fn)
    if args.smoke:
        common.allow_stock_autotune_on_cpu(tiny.add_one_kernel)
    calls: dict[str, Callable[[], Any]] = {
        "bare": lambda: tiny.add_one_bare_kernel[grid](x, y, n, BLOCK=tiny.BARE_BLOCK),
        "triton_hit": lambda: tiny.add_one_kernel[grid](x, y, n),
        "one_config": lambda: one[grid](x, y, n),
        "pinned": lambda: tiny.add_one_kernel[grid](x, y, n),
    }
    per_launch: dict[str, list[float]] = {p: [] for p in PATHS}
    for trial in range(args.trials + 1):  # trial 0 warms every path up (compile, autotune, first use)
        order = PATHS[trial % len(PATHS) :] + PATHS[: trial % len(PATHS)]
        for path in order:
            if path == "pinned":
                # Pin what Triton's hit path launches, so both run the same config and only the
                # host-side path differs (trial 0 runs triton_hit before pinned).
                best = tiny.add_one_kernel.best_config
                key = tuning_key(tiny.add_one_kernel, (x, y, n), {})
                interception.install(policy, table={(kernel_id(tiny.add_one_kernel), key): config_data(best)})
            try:
                call = calls[path]
                for _ in range(min(100, args.launches)):
                    call()
                common.synchronize(args.smoke)
                start = time.perf_counter()
                for _ in range(args.launches):
                    call()
                common.synchronize(args.smoke)
                elapsed = time.perf_counter() - start
            finally:
                if path == "pinned":
                    interception.uninstall()
            if trial:
                per_launch[path].append(elapsed / args.launches * 1e6)
    torch.testing.assert_close(y, x + 1)
    return per_launch


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_common_arguments(parser)
    parser.add_argument("--launches", type=int, default=None, help="launches per trial (default 20000)")
    parser.add_argument("--trials", type=int, default=None, help="trials per path (default 7)")
    args = parser.parse_args()
    if not common.require_device(args, "bench_launch_overhead"):
        return 2
    args.launches = args.launches or (20 if args.smoke else 20000)
    args.trials = args.trials or (2 if args.smoke else 7)
    per_launch = measure(args)
    hit = statistics.median(per_launch["triton_hit"])
    rows, summary = [], {}
    for path in PATHS:
        us = common.spread(per_launch[path])
        summary[path] = {
            "us_per_launch": us,
            "launches_per_s": 1e6 / us["median"],
            "vs_triton_hit": us["median"] / hit,
        }
        rows.append(
            [path, us["median"], us["min"], us["max"], 1e6 / us["median"], f"{us['median'] / hit:.3f}x"]
        )
    common.print_table(["path", "us/launch (median)", "min", "max", "launches/s", "vs triton_hit"], rows)
    verdict = "met" if summary["pinned"]["vs_triton_hit"] <= 1.05 else "MISSED"
    print(f"goal pinned <= 1.05x triton_hit: {verdict} ({summary['pinned']['vs_triton_hit']:.3f}x)")
    common.write_json(
        args.out,
        {
            "benchmark": "launch_overhead",
            "environment": common.environment(),
            "launches": args.launches,
            "trials": args.trials,
            "summary": summary,
            "samples_us": per_launch,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
