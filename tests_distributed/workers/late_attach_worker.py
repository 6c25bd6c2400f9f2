"""torchrun worker: ``init_deterministic_tuning`` runs *before* ``init_process_group``.

The session must attach to the group at the first new key launched after it exists: in chaos the
agreement check must fire, in auto the ranks must share one decision per key (one tuned, the rest
adopted). The measurement is a fake that picks a different config on each rank, so ranks agree
only through the job's consensus. Results go to ``<out>/rank<r>.json``.
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
from megatron_tuning.core.errors import MegatronTuningError

RANK = int(os.environ.get("RANK", "0"))
SIZES = (101, 102, 103)


def fake_measure(policy: Any) -> Any:
    def measure(autotuner, candidates, args, kwargs, kernel, key):  # noqa: ANN001, ANN202
        time.sleep(0.1)
        return candidates[RANK % len(candidates)], {"format": "fake", "median_ms": 1.0 + RANK}

    return measure


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("chaos", "auto"), required=True)
    parser.add_argument("--cache", default="off")
    args = parser.parse_args()
    session._make_measure = fake_measure
    policy = megatron_tuning.TuningPolicy(mode=args.mode, cache=args.cache, use_shipped_tables=False)
    handle = megatron_tuning.init_deterministic_tuning(policy)  # no process group yet
    from _kernels import run

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
    handle.close()
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as out:
        json.dump(result, out, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
