"""torchrun worker for auto mode: ranks race to tune the same keys, in chosen orders.

Each scenario launches the "add" kernel on fresh keys (its own n values) under ``auto`` mode. The
measurement is a fake that picks a *different* config on consecutive ranks (rank % (candidates -
1)) after a short "tuning" sleep, so ranks agree only if the consensus works. Results go to
``<out>/rank<r>.json`` for ``tests_distributed/test_auto_torchrun.py`` to judge.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist

import megatron_tuning
from megatron_tuning import session
from megatron_tuning.core.decisions import decision_log, get_decisions
from megatron_tuning.core.errors import MegatronTuningError
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.distributed import auto_stores

RANK = WORLD = 0
MEASURED: list[str] = []
TUNE_S = 0.2  # a fake tuning takes this long: long enough for ranks to overlap
SLOW_S = 5.0  # how late the last rank arrives in the slow_rank scenario

SCENARIOS = ("forward", "reverse", "together", "slow_rank", "table_vs_published")


def fake_measure(policy: Any) -> Any:
    def measure(autotuner, candidates, args, kwargs, kernel, key):  # noqa: ANN001, ANN202
        MEASURED.append(key)
        time.sleep(TUNE_S)
        # Never the last config (BLOCK=128): rank 0's table pins it in table_vs_published, and with
        # 4+ ranks a publisher that picked it would agree with that table by accident.
        return candidates[RANK % (len(candidates) - 1)], {"format": "fake", "median_ms": 1.0 + RANK}

    return measure


def sizes(scenario: str) -> list[int]:
    base = 100 * (SCENARIOS.index(scenario) + 1)
    return [base + 1, base + 2, base + 3]


def delay(scenario: str) -> float:
    if scenario == "forward":
        return 0.3 * RANK
    if scenario == "reverse":
        return 0.3 * (WORLD - 1 - RANK)
    if scenario == "slow_rank" and RANK == WORLD - 1:
        return SLOW_S  # the others must not wait for this rank's tuning
    return 0.0


def run_scenario(scenario: str, cache: str, tables: tuple[str, ...]) -> dict[str, Any]:
    decision_log().clear()
    MEASURED.clear()
    result: dict[str, Any] = {"error": None}
    policy = TuningPolicy(mode="auto", cache=cache, tables=tables, use_shipped_tables=False)
    handle = None
    try:  # ranks started with other inputs (tables) are told here, at init
        handle = megatron_tuning.init_deterministic_tuning(policy)
    except MegatronTuningError as error:
        result["error"] = type(error).__name__
        result["message"] = str(error)
    from _kernels import run  # after the interception is installed: Triton 3.3 decorates lazily then

    try:
        dist.barrier()
        time.sleep(delay(scenario))
        start = time.monotonic()
        try:
            if handle is not None:
                for n in sizes(scenario):
                    run("add", n)
        except MegatronTuningError as error:
            result["error"] = type(error).__name__
            result["message"] = str(error)
        result["kernel_s"] = round(time.monotonic() - start, 3)
        stores = [s for s in auto_stores._STARTED.values() if s is not None]
        # Decision requests this rank routed to each hosted store so far (None: the job's store).
        result["store_requests"] = list(stores[0].requests) if stores else None
        result["store_hosts"] = stores[0].hosts if stores else None
        result["measured"] = len(MEASURED)
        result["decisions"] = [
            {"key": d.key, "source": d.source, "signature": d.signature, "origin": d.origin}
            for d in get_decisions()
            if d.kernel.endswith(":add_kernel")
        ]
        dist.barrier()
        try:  # a collective: every rank calls it, also one whose launch already raised
            result["shared"] = megatron_tuning.verify_agreement()
        except MegatronTuningError as error:
            if result["error"] is None:
                result["error"] = type(error).__name__
                result["message"] = str(error)
    finally:
        if handle is not None:
            try:
                handle.close()
            except MegatronTuningError as error:
                if result["error"] is None:
                    result["error"] = type(error).__name__
                    result["message"] = str(error)
    return result


def main() -> int:
    global RANK, WORLD, SLOW_S
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS[:-1]))
    parser.add_argument("--table", default="", help="rank 0's own table (table_vs_published)")
    parser.add_argument("--slow-s", type=float, default=SLOW_S, help="the slow rank's delay")
    parser.add_argument("--tier", default="", help="MEGATRON_TUNING_TIER for this job (node: the node tier)")
    parser.add_argument("--stores", default="", help="MEGATRON_TUNING_AUTO_STORES for this job")
    args = parser.parse_args()
    if args.tier:
        os.environ["MEGATRON_TUNING_TIER"] = args.tier
    if args.stores:
        os.environ["MEGATRON_TUNING_AUTO_STORES"] = args.stores
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    SLOW_S = args.slow_s
    session._make_measure = fake_measure  # the decision flow under test, without real timing
    results: dict[str, Any] = {}
    for scenario in args.scenarios.split(","):
        tables = (args.table,) if args.table and RANK == 0 and scenario == "table_vs_published" else ()
        results[scenario] = run_scenario(scenario, args.cache, tables)
        with open(os.path.join(args.out, f"rank{RANK}.json"), "w") as handle:
            json.dump(results, handle, indent=1)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
