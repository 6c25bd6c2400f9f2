"""torchrun worker for auto mode: ranks race to tune the same keys, in chosen orders.

Each scenario launches the "add" kernel on fresh keys (its own n values) under ``auto`` mode. The
measurement is a fake that picks a *different* config on consecutive ranks (rank % (candidates -
1)) after a short "tuning" sleep, so ranks agree only if the consensus works. The ``split_*``
scenarios give each rank a cache of its own: rank 0's holds the keys, the others' is empty,
corrupt, a folder or off. ``module_names`` loads the kernels' file under a per-rank module name,
as an eval pipeline does. Results go to ``<out>/rank<r>.json`` for
``tests_distributed/test_auto_torchrun.py`` to judge.
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
from megatron_tuning.core.decisions import decision_log, get_decisions
from megatron_tuning.core.errors import MegatronTuningError
from megatron_tuning.core.key import Key
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.tables.entry import Entry
from megatron_tuning.tables.table import Table, save_table

RANK = WORLD = 0
MEASURED: list[str] = []
TUNE_S = 0.2  # a fake tuning takes this long: long enough for ranks to overlap
SLOW_S = 5.0  # how late the last rank arrives in the slow_rank scenario

SCENARIOS = (
    "forward",
    "reverse",
    "together",
    "slow_rank",
    "table_vs_published",
    "split_empty",
    "split_corrupt",
    "split_folder",
    "split_off",
    "full_cache",
    "module_names",
)
CACHED = {"kwargs": {"BLOCK": 128}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
"""What rank 0's cache holds in the split scenarios: a config the fake measurement never picks."""


def add_key(n: int) -> Key:
    return Key({"n": n}, {"x_ptr": "torch.float32", "y_ptr": "torch.float32"})


def split_cache(scenario: str, folder: str) -> str:
    """This rank's own cache for a split scenario: rank 0's holds every key, the others' not."""
    path = os.path.join(folder, f"{scenario}-rank{RANK}.msgpack")
    if RANK == 0:
        entries = [
            Entry(
                arch="unknown",
                kernel="tests.support_kernels:add_kernel",
                key=add_key(n),
                config=CACHED,
                how="tuned",
            )
            for n in sizes(scenario)
        ]
        save_table(Table(entries, meta={"kind": "auto-cache", "cache_format": "1"}), path)
    elif scenario == "split_corrupt":
        with open(path, "wb") as handle:
            handle.write(b"not a table")
    elif scenario == "split_folder":
        os.makedirs(path)
    elif scenario == "split_off":
        return "off"
    return path


def fake_measure(autotuner, candidates, args, kwargs, kernel, key):  # noqa: ANN001, ANN201
    """The decision flow under test, without real timing."""
    MEASURED.append(key)
    time.sleep(TUNE_S)
    # Never the last config (BLOCK=128): rank 0's table pins it in table_vs_published, and with
    # 4+ ranks a publisher that picked it would agree with that table by accident.
    return candidates[RANK % (len(candidates) - 1)], {"format": "fake", "median_ms": 1.0 + RANK}


def sizes(scenario: str) -> list[int]:
    if scenario == "full_cache":
        return [1, 50_000]  # the first and the last entry of the test's 50,000
    base = 100 * (SCENARIOS.index(scenario) + 1)
    return [base + 1, base + 2, base + 3]


def delay(scenario: str) -> float:
    if scenario == "forward":
        return 0.3 * RANK
    if scenario == "reverse":
        return 0.3 * (WORLD - 1 - RANK)
    if scenario == "slow_rank" and RANK == WORLD - 1:
        return SLOW_S  # the others must not wait for this rank's tuning
    if scenario.startswith("split_") and RANK > 0:
        return 0.5  # rank 0 proposes its cache entries first; the others adopt them
    return 0.0


def run_scenario(scenario: str, cache: str, tables: tuple[str, ...]) -> dict[str, Any]:
    decision_log().clear()
    MEASURED.clear()
    result: dict[str, Any] = {"error": None}
    policy = TuningPolicy(mode="auto", cache=cache, tables=tables, use_shipped_tables=False)
    handle = None
    try:  # ranks started with other inputs (tables) are told here, at init
        handle = megatron_tuning.init_deterministic_tuning(policy, measure=fake_measure)
    except MegatronTuningError as error:
        result["error"] = type(error).__name__
        result["message"] = str(error)
    from tests.support_kernels import (
        run,  # after the interception is installed: Triton 3.3 decorates lazily then
    )

    if scenario == "module_names":  # one file, one module name per rank: one kernel to the job
        import importlib.util

        import tests.support_kernels

        spec = importlib.util.spec_from_file_location(f"candidate_{RANK}", tests.support_kernels.__file__)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        run = module.run

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
    parser.add_argument("--full-cache", default="", help="a default-size cache file (full_cache)")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    SLOW_S = args.slow_s
    results: dict[str, Any] = {}
    for scenario in args.scenarios.split(","):
        tables = (args.table,) if args.table and RANK == 0 and scenario == "table_vs_published" else ()
        cache = args.cache
        if scenario.startswith("split_"):
            cache = split_cache(scenario, args.out)
        elif scenario == "full_cache":
            cache = args.full_cache
        results[scenario] = run_scenario(scenario, cache, tables)
        with open(os.path.join(args.out, f"rank{RANK}.json"), "w") as handle:
            json.dump(results, handle, indent=1)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
