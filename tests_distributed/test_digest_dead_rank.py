"""digest mode with a rank that dies: the others flush, verify nothing is waited for, and stop.

Real processes share one real TCPStore (no process group, so no collective can mask a wait):
rank 2 records its decisions and is SIGKILLed before it flushes; ranks 0 and 1 must still flush
and stop at once, and a conflict between the two live ranks is still found.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
from datetime import timedelta
from typing import Any

import pytest

dist = pytest.importorskip("torch.distributed")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(port: int, rank: int, signature_of_shared: str, queue: Any) -> None:
    from megatron_tuning.core.decisions import Decision
    from megatron_tuning.core.errors import MegatronTuningError
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.distributed.agreement import AgreementChecker

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    checker = AgreementChecker(
        TuningPolicy(agreement="digest"), store=store, rank=rank, ranks=range(3), namespace="t"
    )
    for n in range(30):
        checker.check(Decision(kernel="pkg:matmul", key=f"M={n}", signature="BLOCK=64", source="table"))
    checker.check(Decision(kernel="pkg:matmul", key="shared", signature=signature_of_shared, source="table"))
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # dies with its batch unsent
    time.sleep(0.2 * rank)  # rank 0's batch is the reference
    start = time.monotonic()
    outcome = "ok"
    try:
        checker.flush()
        if rank == 0:  # it closes after rank 1 flushed: a rank that already closed is not told
            time.sleep(1.0)
        checker.stop()
    except MegatronTuningError as error:
        outcome = f"{type(error).__name__}: {error}"
    queue.put((rank, outcome, time.monotonic() - start))


@pytest.mark.parametrize("second_rank_signature", ["BLOCK=64", "BLOCK=128"])
def test_live_ranks_neither_wait_for_a_dead_one_nor_miss_their_own_divergence(
    second_rank_signature: str,
) -> None:
    port = _port()
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    ctx = mp.get_context("fork")  # children inherit the imports: no 10 s torch import each
    queue = ctx.Queue()
    signatures = ["BLOCK=64", second_rank_signature, "BLOCK=16"]
    procs = [ctx.Process(target=_rank, args=(port, r, signatures[r], queue)) for r in range(3)]
    for p in procs:
        p.start()
    outcomes = sorted(queue.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(timeout=30)
    assert procs[2].exitcode == -signal.SIGKILL
    assert [rank for rank, _, _ in outcomes] == [0, 1]
    assert all(seconds < 6.0 for _, _, seconds in outcomes), outcomes
    if second_rank_signature == "BLOCK=64":
        assert [outcome for _, outcome, _ in outcomes] == ["ok", "ok"]
    else:
        raised = [outcome for _, outcome, _ in outcomes]
        assert all(o.startswith("DivergenceError") and "key shared" in o for o in raised), raised
    del server
