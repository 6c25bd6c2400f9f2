"""A torchrun job as a user has it: no megatron_tuning anywhere (the launcher tests run it under
``python -m megatron_tuning run``). It imports its kernels, then creates its process group, as
training scripts do, launches one kernel on three sizes, and writes ``<out>/rank<r>.json`` with
the error it hit, if any, for ``tests_distributed/test_launcher_torchrun.py`` to judge. With
``--pipeline``, rank 0 launches nothing until the last rank has launched its kernels and sent it
a tensor, as a later pipeline stage waits for an earlier one. With ``--own-sizes`` each rank
launches sizes no other rank reaches (chaos cannot differ); with ``--keep-group`` the group
outlives the job's code (a check at close can run); with ``--last-rank-without-triton`` the last
rank never imports Triton (nor launches a kernel). With ``--until-killed`` each rank writes
``<out>/pids<r>`` (its pid and its parent's, torchrun's) and launches new sizes until it is killed.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

LAUNCHES = "--last-rank-without-triton" not in sys.argv or os.environ["RANK"] != str(
    int(os.environ["WORLD_SIZE"]) - 1
)
if LAUNCHES:
    from tests.support_kernels import (
        run,  # kernels first (the bootstrap arms the process at their `import triton`)
    )

SIZES = (100, 200, 300)


def main() -> int:
    out = sys.argv[1]
    pipeline = "--pipeline" in sys.argv[2:]  # rank 0 is a later stage: it waits for the last rank
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    result: dict[str, object] = {"error": None}
    dist.barrier()
    if pipeline and rank == 0:
        dist.recv(torch.zeros(1), src=last)  # no kernel launched (no tuning session) until then
    if "--until-killed" in sys.argv:
        with open(os.path.join(out, f"pids{rank}.tmp"), "w") as handle:
            handle.write(f"{os.getpid()} {os.getppid()}")
        os.rename(os.path.join(out, f"pids{rank}.tmp"), os.path.join(out, f"pids{rank}"))
        for n in itertools.count(1000):  # in auto mode: a new key to tune, and to cache, every round
            run("add", n)
    for n in SIZES if LAUNCHES else ():
        try:
            run("add", n + rank if "--own-sizes" in sys.argv else n)
        except Exception as error:  # what the user would see: kept for the test
            result["error"], result["message"] = type(error).__name__, str(error)
            break
    if pipeline and rank == last:
        dist.send(torch.ones(1), dst=0)
    dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    if "--keep-group" not in sys.argv:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
