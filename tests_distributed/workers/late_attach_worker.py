"""torchrun worker: ``init_deterministic_tuning`` runs *before* ``init_process_group``.

The session must attach to the group at the first new key launched after it exists: in chaos the
agreement check must fire, in auto the ranks must share one decision per key (one tuned, the rest
adopted). The measurement is a fake that picks a different config on each rank, so ranks agree
only through the job's consensus. Results go to ``<out>/rank<r>.json``.

``--mode failed``: first ``auto`` past its rank cap (lowered to 1 here) must be refused at init, as
torchrun's ``WORLD_SIZE`` gives the job's size. Then rank 1's attach fails (its policy pins another
block size): its later keys and checks must raise the same error within ``TIMEOUT_S``, and no rank
may hang. The ranks' logs differ (a key launched before the group), so verify_agreement compares them.
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
from megatron_tuning.core.errors import MegatronTuningError
from megatron_tuning.distributed import store

RANK = int(os.environ.get("RANK", "0"))
SIZES = (101, 102, 103)
TIMEOUT_S = 5.0  # the failed-attach modes' agreement timeout: a hang is bounded by it


def fake_measure(autotuner, candidates, args, kwargs, kernel, key):  # noqa: ANN001, ANN201
    time.sleep(0.1)
    return candidates[RANK % len(candidates)], {"format": "fake", "median_ms": 1.0 + RANK}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("chaos", "auto", "failed"), required=True)
    parser.add_argument("--cache", default="off")
    args = parser.parse_args()
    if args.mode == "failed":
        return failed_attach(args.out)
    policy = megatron_tuning.TuningPolicy(mode=args.mode, cache=args.cache, use_shipped_tables=False)
    handle = megatron_tuning.init_deterministic_tuning(policy, measure=fake_measure)  # no group yet
    from tests.support_kernels import run

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    result: dict[str, Any] = {"error": None}
    dist.barrier()
    try:
        for n in SIZES:
            run("add", n)
    except MegatronTuningError as error:
        result["error"], result["message"] = type(error).__name__, str(error)
    result["decisions"] = [
        {"key": d.key, "source": d.source, "signature": d.signature}
        for d in megatron_tuning.get_decisions()
        if d.kernel.endswith(":add_kernel")
    ]
    dist.barrier()
    result["close"] = _attempt(handle.close)  # a recorded divergence this rank has not raised yet
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as out:
        json.dump(result, out, indent=1)
    dist.destroy_process_group()
    return 0


def _attempt(action: Any) -> dict[str, str] | None:
    """Run ``action``; the error it raised, if any."""
    try:
        action()
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error)}
    return None


def failed_attach(out: str) -> int:
    result: dict[str, Any] = {}
    policy = megatron_tuning.TuningPolicy(
        mode="auto", cache="off", agreement_timeout_s=TIMEOUT_S, use_shipped_tables=False
    )
    cap, store.AUTO_MAX_RANKS = store.AUTO_MAX_RANKS, 1
    result["auto_init"] = _attempt(lambda: megatron_tuning.init_deterministic_tuning(policy))
    store.AUTO_MAX_RANKS = cap
    blocks = (("BLOCK", 64),) if RANK == 1 else ()
    handle = megatron_tuning.init_deterministic_tuning(
        policy.replace(mode="deterministic", block_sizes=blocks)
    )
    from tests.support_kernels import run

    run("add", 100)  # no process group yet: BLOCK=16 on rank 0, 64 on rank 1
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    world = dist.get_world_size()
    for turn in range(world):  # rank 0 attaches first: rank 1's attach is the one that fails
        if turn == RANK:
            result["attach"] = _attempt(lambda: run("add", 101))
        dist.barrier()
    result["next_key"] = _attempt(lambda: run("add", 102))
    start = time.monotonic()
    result["verify"] = _attempt(lambda: megatron_tuning.verify_agreement(timeout_s=TIMEOUT_S))
    result["verify_s"] = time.monotonic() - start
    result["close"] = _attempt(handle.close)
    with open(os.path.join(out, f"rank{RANK}.json"), "w") as file:
        json.dump(result, file, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
