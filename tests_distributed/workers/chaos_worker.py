"""torchrun worker: chaos in a pipeline-like layout, and two autotuners over one function.

Usage: ``torchrun --standalone --nproc_per_node N chaos_worker.py --out DIR --stages S``. Scenarios
run in order, each through ``init_deterministic_tuning`` with real (interpreted) launches, and end
with ``verify_agreement`` on every rank; one JSON result file per rank.

* ``stage_chaos`` / ``stage_deterministic``: rank r is in pipeline stage ``r % S``, and each stage
  launches its own shape (its own key), so only the ranks of one stage meet at a key.
* ``late_chaos``: one key on every rank, but rank 0 launches and goes straight to
  ``verify_agreement`` while the others start a second later (the store check fires on them first).
* ``twins_deterministic``: two autotuners over one ``@triton.jit`` function with different config
  lists, launched in opposite orders on even and odd ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is decorated

import torch.distributed as dist

from megatron_tuning.core.decisions import decision_log
from megatron_tuning.core.errors import MegatronTuningError
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.distributed import agreement


def _keep(result: dict[str, Any], error: MegatronTuningError) -> None:
    if result.get("error") is None:
        result["error"] = type(error).__name__
        result["message"] = str(error)
        result["kernel"] = getattr(error, "kernel", "")
        result["key"] = getattr(error, "key", "")


def _session(mode: str, result: dict[str, Any], plan: list[tuple[str, int]], late: bool = False) -> None:
    import megatron_tuning

    policy = TuningPolicy(
        mode=mode,
        scope=("tests.support_kernels",),
        agreement="store",
        agreement_timeout_s=60.0,
        use_shipped_tables=False,
    )
    handle = megatron_tuning.init_deterministic_tuning(policy)
    from tests import support_kernels as _kernels

    try:
        if late and dist.get_rank() != 0:
            time.sleep(1.0)
        for name, n in plan:
            try:
                _kernels.run(name, n)
            except MegatronTuningError as error:
                _keep(result, error)
        if not late:
            dist.barrier()
            checker = agreement.active_checker()
            try:
                if checker is not None:
                    checker.poll()
            except MegatronTuningError as error:
                _keep(result, error)
        try:  # every rank calls it (a collective), errors or not
            result["shared"] = agreement.verify_agreement()
        except MegatronTuningError as error:
            _keep(result, error)
    finally:
        handle.close()
    result["decisions"] = [
        {"kernel": d.kernel, "key": d.key, "signature": d.signature, "source": d.source, "chaos": d.chaos}
        for d in decision_log().decisions()
        if d.source != "out_of_scope"
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", type=int, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    rank = dist.get_rank()
    stage = rank % args.stages
    stage_plan = [("add", 40 + stage)]  # one key per stage: only a stage's ranks meet there
    twins = [("twin_small", 48), ("twin_large", 48)]
    scenarios = {
        "stage_chaos": ("chaos", stage_plan),
        "stage_deterministic": ("deterministic", stage_plan),
        "late_chaos": ("chaos", [("add", 64)]),
        "twins_deterministic": ("deterministic", twins if rank % 2 == 0 else twins[::-1]),
    }
    results: dict[str, Any] = {}
    for name, (mode, plan) in scenarios.items():
        decision_log().clear()
        result: dict[str, Any] = {"error": None, "stage": stage}
        start = time.monotonic()
        _session(mode, result, plan, late=name == "late_chaos")
        result["wall_s"] = round(time.monotonic() - start, 3)
        results[name] = result
        dist.barrier()
    path = os.path.join(args.out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(results, handle, indent=1)
    os.replace(path + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
