"""torchrun worker for tests_distributed: runs agreement scenarios in order, one result file per rank.

Usage (from the tests): ``torchrun --standalone --nproc_per_node N agreement_worker.py --out DIR
--scenarios a,b,...``. Each scenario starts from an empty decision log and a fresh checker, and
ends at a barrier so the ranks stay in step. A scenario's result is ``{"error": type name or
None, "message": str, ...}``; the tests assert on these files, never on log text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is decorated

import torch.distributed as dist

from megatron_tuning.core.decisions import Decision, decision_log
from megatron_tuning.core.errors import AgreementTimeoutError, InputMismatchError, MegatronTuningError
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.distributed import agreement, verify

RANK = 0
WORLD = 1
DEVICE = "cpu"  # "cuda:<local rank>" with --backend nccl
MATMUL = "synthetic.kernels:matmul"
KEY = "M=64, N=48, K=40 | a_ptr:torch.float32, b_ptr:torch.float32"
SIG = "BLOCK_K=32, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3"
SESSION_TIMEOUT_S = 4.0  # session_extra_allgather's agreement timeout


def _record(kernel: str, key: str, signature: str) -> None:
    decision_log().record(Decision(kernel=kernel, key=key, signature=signature, source="table", rank=RANK))


def _chaos_signature() -> str:
    return f"BLOCK_K=32, BLOCK_M={16 << RANK}, BLOCK_N=64, num_warps=4, num_stages=3"


def _policy(mode: str, timeout_s: float = 30.0, **extra: Any) -> TuningPolicy:
    return TuningPolicy(mode="deterministic", agreement=mode, agreement_timeout_s=timeout_s, **extra)


def _guarded(result: dict[str, Any], action: Callable[[], Any]) -> None:
    """Run ``action`` unless this rank already failed; keep its error for the test."""
    if result.get("error") is None:
        try:
            action()
        except MegatronTuningError as error:
            _store_error(result, error)


def _then_poll(handle: Any, result: dict[str, Any]) -> None:
    """Let every rank reach its next check after all others recorded theirs (store mode)."""
    dist.barrier()
    if isinstance(handle, agreement.AgreementChecker):
        _guarded(result, handle.poll)


# --- synthetic decisions (the checker alone) ---------------------------------------------------


def store_agree(result: dict[str, Any]) -> None:
    handle = agreement.start_agreement(_policy("store"))
    time.sleep(0.02 * (WORLD - RANK))  # vary who claims first
    for n in (64, 96, 128):
        _record(MATMUL, KEY.replace("64", str(n), 1), SIG)
    _then_poll(handle, result)


def store_chaos(result: dict[str, Any]) -> None:
    handle = agreement.start_agreement(_policy("store"))
    time.sleep(0.02 * (WORLD - RANK))
    _guarded(result, lambda: _record(MATMUL, KEY, SIG))
    _guarded(result, lambda: _record(MATMUL, KEY.replace("64", "96", 1), _chaos_signature()))
    _then_poll(handle, result)


def allgather_agree(result: dict[str, Any]) -> None:
    agreement.start_agreement(_policy("allgather"))
    for n in (64, 96, 128):
        _record(MATMUL, KEY.replace("64", str(n), 1), SIG)


def allgather_chaos(result: dict[str, Any]) -> None:
    agreement.start_agreement(_policy("allgather"))
    _record(MATMUL, KEY, SIG)
    _record(MATMUL, KEY.replace("64", "96", 1), _chaos_signature())


def allgather_order(result: dict[str, Any]) -> None:
    """Ranks reach different kernels at the same check: named as such, on every rank."""
    agreement.start_agreement(_policy("allgather"))
    _record(f"synthetic.kernels:kernel_{RANK % 2}", KEY, SIG)


def verify_agree(result: dict[str, Any]) -> None:
    for n in (64, 96, 128):
        _record(MATMUL, KEY.replace("64", str(n), 1), SIG)
    result["shared"] = agreement.verify_agreement()


def verify_chaos(result: dict[str, Any]) -> None:
    _record(MATMUL, KEY.replace("64", "96", 1), SIG)
    _record(MATMUL, KEY, _chaos_signature())
    for n in range(12):  # more differing entries than verify_agreement names
        _record(f"synthetic.kernels:many_{n:02d}", KEY, _chaos_signature())
    result["shared"] = agreement.verify_agreement()


def _asymmetric_plan() -> list[tuple[str, str, str]]:
    plan = [("synthetic.kernels:shared", "n=128", SIG)]
    # Per-rank shapes: the same kernel under different keys is never compared.
    plan.append(("synthetic.kernels:per_rank_shape", f"n={64 * (RANK + 1)}", _chaos_signature()))
    # Pipeline-stage-like split: even ranks run stage_0, odd ranks stage_1.
    plan.append((f"synthetic.kernels:stage_{RANK % 2}", "n=64", f"BLOCK={32 * (RANK % 2 + 1)}"))
    if RANK == 0:
        plan.reverse()
    return plan


def asymmetric_store(result: dict[str, Any]) -> None:
    handle = agreement.start_agreement(_policy("store"))
    if RANK == WORLD - 1:
        time.sleep(0.3)  # a slow rank: the others must neither wait for it nor misread it
    for kernel, key, signature in _asymmetric_plan():
        _guarded(result, lambda k=kernel, y=key, s=signature: _record(k, y, s))
    _then_poll(handle, result)
    result["shared"] = agreement.verify_agreement()


def asymmetric_verify(result: dict[str, Any]) -> None:
    for kernel, key, signature in _asymmetric_plan():
        _record(kernel, key, signature)
    result["shared"] = agreement.verify_agreement()


def allgather_missing(result: dict[str, Any]) -> None:
    """The last rank never launches the kernel: the others must name it within the timeout."""
    agreement.start_agreement(_policy("allgather", timeout_s=2.0))
    if RANK != WORLD - 1:
        start = time.monotonic()
        try:
            _record(MATMUL, KEY, SIG)
        finally:
            result["elapsed_s"] = time.monotonic() - start


def capture_deferred(result: dict[str, Any]) -> None:
    """During a (simulated) CUDA graph capture nothing touches the store; verify runs it later."""
    handle = agreement.start_agreement(_policy("store"))
    assert isinstance(handle, agreement.AgreementChecker)
    calls: list[str] = []
    real_store = handle._store

    class _Counting:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(real_store, name)

    handle._store = _Counting()
    original = agreement.is_capturing
    agreement.is_capturing = lambda: True
    try:
        _record(MATMUL, KEY, _chaos_signature())
    finally:
        agreement.is_capturing = original
    result["store_calls_during_capture"] = len(calls)
    result["pending"] = len(handle._pending)
    dist.barrier()
    result["shared"] = agreement.verify_agreement()


# --- verify mode (large worlds): nothing per key, verify_agreement at step boundaries and close ---


def _plan(layout: str) -> list[tuple[str, str, str]]:
    """(kernel, key, signature) per rank for a TP-, PP- or varlen-like job."""
    if layout == "tp":
        return [(MATMUL, f"M={n}", SIG) for n in range(40)]
    if layout == "pp":  # stage = rank % 2: each stage its own keys, plus one kernel all stages run
        stage = RANK % 2
        return [(MATMUL, "shared", SIG)] + [
            (f"synthetic.kernels:stage_{stage}", f"n={n}", SIG) for n in range(20)
        ]
    # varlen: shared keys, keys of the rank's own, and keys each rank shares with one neighbour
    shared = [(MATMUL, f"M={n}", SIG) for n in range(20)]
    own = [(MATMUL, f"seqlen={1000 + 10 * RANK + n}", SIG) for n in range(3)]
    pair = [(MATMUL, f"seqlen=pair{RANK // 2}", SIG)]
    return shared + own + pair


class _CountingStore:
    """Counts what a checker sends to the job's store."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str) -> Any:
        self.calls += 1
        return getattr(self.store, name)


def _verify_run(result: dict[str, Any], layout: str, differ: Callable[[str], str] | None = None) -> None:
    handle = agreement.start_agreement(_policy("verify"))
    assert isinstance(handle, agreement.AgreementChecker) and handle.mode == "verify"
    counting = handle._store = _CountingStore(handle._store)
    for kernel, key, signature in _plan(layout):
        _guarded(result, lambda k=kernel, y=key, s=signature: _record(k, y, differ(y) if differ else s))
    result["requests_per_key"] = counting.calls
    dist.barrier()
    with _counting_collectives(result):
        _verify_into(result)


def _counting_collectives(result: dict[str, Any]) -> Any:
    """Count the bytes verify_agreement sends through its collectives (result["verify_bytes"])."""
    import contextlib

    @contextlib.contextmanager
    def counting() -> Any:
        originals = {name: getattr(verify, name) for name in ("all_gather_bytes", "all_to_all_bytes")}
        result["verify_bytes"] = 0

        def gather(data: bytes, group: Any) -> list[bytes]:
            result["verify_bytes"] += len(data)
            return originals["all_gather_bytes"](data, group)

        def to_all(chunks: Any, group: Any) -> list[bytes]:
            result["verify_bytes"] += sum(len(c) for c in chunks)
            return originals["all_to_all_bytes"](chunks, group)

        verify.all_gather_bytes, verify.all_to_all_bytes = gather, to_all  # type: ignore[assignment]
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(verify, name, original)

    return counting()


def verify_tp(result: dict[str, Any]) -> None:
    _verify_run(result, "tp")


def verify_pp(result: dict[str, Any]) -> None:
    _verify_run(result, "pp")


def verify_varlen(result: dict[str, Any]) -> None:
    _verify_run(result, "varlen")


def verify_chaos_tp(result: dict[str, Any]) -> None:
    """Every rank launches its own config for one shared key: every rank must raise."""
    _verify_run(result, "tp", lambda key: _chaos_signature() if key == "M=7" else SIG)


def verify_chaos_strided(result: dict[str, Any]) -> None:
    """Ranks two apart share keys (stage = rank % 2) and differ: caught with no consecutive pair."""
    _verify_run(result, "pp", lambda key: f"BLOCK={RANK // 2}" if key.startswith("n=") else SIG)


def verify_chaos_pair(result: dict[str, Any]) -> None:
    """Two neighbours share a varlen key only they have, with different configs."""
    _verify_run(result, "varlen", lambda key: _chaos_signature() if key.startswith("seqlen=pair") else SIG)


def verify_close_chaos(result: dict[str, Any]) -> None:
    """No verify_agreement call in the job: the check at close catches chaos on every rank."""
    handle = agreement.start_agreement(_policy("verify"))
    for kernel, key, _ in _plan("tp"):
        _record(kernel, key, _chaos_signature() if key == "M=3" else SIG)
    dist.barrier()
    start = time.monotonic()
    try:
        _guarded(result, handle.stop)
    finally:
        result["close_s"] = time.monotonic() - start


# --- unequal init calls: numbered sessions ------------------------------------------------------


def _fresh_sessions(name: str) -> None:
    """Each session scenario starts at session 0 in its own store namespace, as after a restart."""
    os.environ["TORCHELASTIC_RESTART_COUNT"] = f"sessions-{name}"
    verify._sessions = 0
    verify._verify_calls.clear()  # and every rank's checks are paired afresh


def _verify_into(result: dict[str, Any]) -> None:
    """Every rank calls verify_agreement (a collective), errors or not; keep what it raised."""
    try:
        result["shared"] = agreement.verify_agreement(timeout_s=30.0)
    except MegatronTuningError as error:
        result["verify_error"] = type(error).__name__
        result["verify_message"] = str(error)


def session_extra_other_policy(result: dict[str, Any]) -> None:
    """Rank 0 calls init once more first, with another mode: rank 1's session #1 disagrees at start."""
    _fresh_sessions("other_policy")
    if RANK == 0:
        agreement.start_agreement(_policy("store").replace(mode="deterministic"))
    dist.barrier()
    _guarded(result, lambda: agreement.start_agreement(_policy("store").replace(mode="chaos")))
    if RANK == 0:
        _guarded(result, lambda: _record(MATMUL, KEY, _chaos_signature()))
    dist.barrier()
    _verify_into(result)


def session_extra_same_policy(result: dict[str, Any]) -> None:
    """Rank 0 calls init twice with the same policy: first-use checks meet nobody; verify names it."""
    _fresh_sessions("same_policy")
    chaos = _policy("store").replace(mode="chaos")
    if RANK == 0:
        agreement.start_agreement(chaos)
    _guarded(result, lambda: agreement.start_agreement(chaos))
    _guarded(result, lambda: _record(MATMUL, KEY, _chaos_signature()))
    dist.barrier()
    _verify_into(result)


def session_extra_allgather(result: dict[str, Any]) -> None:
    """Allgather: the rank left behind fails within a second, the other at its timeout, both named."""
    _fresh_sessions("allgather")
    policy = _policy("allgather", timeout_s=SESSION_TIMEOUT_S)
    if RANK == 0:
        agreement.start_agreement(policy)
    agreement.start_agreement(policy)
    dist.barrier()  # every rank has published its session before anyone checks
    start = time.monotonic()
    try:
        _guarded(result, lambda: _record(MATMUL, KEY, SIG))
    finally:
        result["elapsed_s"] = time.monotonic() - start


def session_extra_store_close(result: dict[str, Any]) -> None:
    """Rank 0 calls init once more, with another policy, and nobody calls verify_agreement: its keys
    are claimed in session #2, where nobody meets them. The check at close names the counts."""
    _fresh_sessions("store_close")
    if RANK == 0:
        agreement.start_agreement(_policy("store"))
    blocks = {"BLOCK_M": 64} if RANK == 0 else {}
    _guarded(result, lambda: agreement.start_agreement(_policy("store", block_sizes=blocks)))
    _guarded(result, lambda: _record(MATMUL, KEY, _chaos_signature()))  # the worker's stop: the close


def inputs_agreement_off(result: dict[str, Any]) -> None:
    """Rank 1's own environment turns its checks off (and pins another block size). It claims its
    inputs first: rank 0 raises at its start, rank 1 (which checks no key) at its close."""
    _fresh_sessions("agreement_off")
    policy = _policy("off", block_sizes={"BLOCK_M": 64}) if RANK == 1 else _policy("store")
    for turn in (1, 0):
        if turn == RANK:
            _guarded(result, lambda: agreement.start_agreement(policy))
        dist.barrier()
    _guarded(result, lambda: _record(MATMUL, KEY, _chaos_signature()))


def session_lagging_allgather(result: dict[str, Any]) -> None:
    """Quiet control: a rank that starts its next session late is waited for, not blamed."""
    _fresh_sessions("lagging")
    policy = _policy("allgather", timeout_s=30.0)
    agreement.start_agreement(policy)
    _guarded(result, lambda: _record(MATMUL, KEY, SIG))
    dist.barrier()
    if RANK == WORLD - 1:
        time.sleep(1.5)  # the others are already waiting in session #2
    agreement.start_agreement(policy)
    _guarded(result, lambda: _record(MATMUL, KEY.replace("64", "96", 1), SIG))
    _verify_into(result)


def session_equal_store(result: dict[str, Any]) -> None:
    """Quiet control: equal calls with changing policies, the same on every rank."""
    _fresh_sessions("equal")
    for scope in (("synthetic",), ("synthetic.kernels",)):
        agreement.start_agreement(_policy("store", scope=scope))
        _guarded(result, lambda: _record(MATMUL, KEY, SIG))
        dist.barrier()
    _verify_into(result)


def session_reinit_verify(result: dict[str, Any]) -> None:
    """Rank 0 calls init_deterministic_tuning once more (verify mode, chaos): its re-init must not
    run a check that pairs with rank 1's verify_agreement. Every rank raises; none says "ok"."""
    _fresh_sessions("reinit_verify")
    import megatron_tuning
    from tests import support_kernels as _kernels

    policy = TuningPolicy(
        mode="chaos",
        scope=("tests.support_kernels",),
        agreement="verify",
        agreement_timeout_s=SESSION_TIMEOUT_S,
        use_shipped_tables=False,
    )
    handle = megatron_tuning.init_deterministic_tuning(policy)
    if RANK == 0:
        handle = megatron_tuning.init_deterministic_tuning(policy)
    _kernels.run("add", 64, DEVICE)  # chaos: ranks launch different BLOCKs
    _verify_into(result)
    start = time.monotonic()
    try:
        _guarded(result, handle.close)  # the check at close
    finally:
        result["close_s"] = time.monotonic() - start


def verify_extra_call(result: dict[str, Any]) -> None:
    """Rank 0 calls verify_agreement once more than rank 1: its extra call meets rank 1's check at
    close, and both must raise instead of passing (the header says which call each rank is at)."""
    _fresh_sessions("extra_call")
    handle = agreement.start_agreement(_policy("verify", timeout_s=SESSION_TIMEOUT_S))
    _record(MATMUL, KEY, SIG)
    for _ in range(2 if RANK == 0 else 1):
        _verify_into(result)
    start = time.monotonic()
    try:
        _guarded(result, handle.stop)  # the check at close
    finally:
        result["close_s"] = time.monotonic() - start


# --- real kernel launches through init_deterministic_tuning --------------------------------------


def _kernel_run(result: dict[str, Any], mode: str, agreement_mode: str) -> None:
    import megatron_tuning

    policy = TuningPolicy(
        mode=mode,
        scope=("tests.support_kernels",),
        agreement=agreement_mode,
        agreement_timeout_s=30.0,
        use_shipped_tables=False,
    )
    handle = megatron_tuning.init_deterministic_tuning(policy)
    # init_deterministic_tuning itself starts the check; agreement off claims the inputs only.
    checker = agreement.active_checker()
    assert checker is not None and checker.mode == ("inputs" if agreement_mode == "off" else agreement_mode)
    from tests import support_kernels as _kernels

    try:
        for name, n in (("add", 64), ("scale", 64), ("add", 100)):
            _guarded(result, lambda k=name, size=n: _kernels.run(k, size, DEVICE))
            dist.barrier()  # same number of barriers on every rank, errors or not
        if agreement_mode == "off" and result.get("error") is None:
            result["shared"] = agreement.verify_agreement()
    finally:
        _guarded(result, handle.close)


def _kernels_session() -> Any:
    """A deterministic session over the shared test kernels, store checks on."""
    import megatron_tuning

    policy = TuningPolicy(
        mode="deterministic",
        scope=("tests.support_kernels",),
        agreement="store",
        agreement_timeout_s=30.0,
        use_shipped_tables=False,
    )
    return megatron_tuning.init_deterministic_tuning(policy)


def kernels_asymmetric(result: dict[str, Any]) -> None:
    """Real launches, rank-dependent kernels and shapes, store checks plus a final verify."""
    handle = _kernels_session()
    assert agreement.active_checker() is not None
    from tests import support_kernels as _kernels

    try:
        if RANK == WORLD - 1:
            time.sleep(0.3)
        plan = [("add", 64), ("scale" if RANK % 2 else "add", 32 * (RANK + 1))]
        for name, n in plan if RANK else reversed(plan):
            _guarded(result, lambda k=name, size=n: _kernels.run(k, size, DEVICE))
        dist.barrier()
        checker = agreement.active_checker()
        if checker is not None:
            _guarded(result, checker.poll)
        result["shared"] = agreement.verify_agreement()
    finally:
        handle.close()


def kernels_factory(result: dict[str, Any]) -> None:
    """Factory-made kernels and autotuners built over one jit function, in opposite orders per rank."""
    handle = _kernels_session()
    from tests import support_kernels as _kernels

    try:
        names = sorted(_kernels.MADE)
        for name in names if RANK % 2 else reversed(names):
            _guarded(result, lambda k=name: _kernels.run(k, 64, DEVICE))
        dist.barrier()
        result["shared"] = agreement.verify_agreement()
        result["launched"] = {d.kernel: d.signature for d in decision_log().decisions()}
    finally:
        handle.close()


def _config_list_run(result: dict[str, Any], mode: str, agreement_mode: str) -> None:
    """``write_block_kernel`` offers BLOCK=256 on rank 0 only, as a config list built from the node's
    device, an environment variable or a package version would: every check must name the lists."""
    import torch

    import megatron_tuning
    from tests import support_kernels as _kernels

    kernel, full = _kernels.write_block_kernel, _kernels.write_block_kernel.configs
    kernel.configs = full if RANK == 0 else full[1:]
    policy = TuningPolicy(
        mode=mode,
        scope=("tests.support_kernels",),
        agreement=agreement_mode,
        agreement_timeout_s=30.0,
        use_shipped_tables=False,
        cache="off",
    )
    handle = megatron_tuning.init_deterministic_tuning(policy)
    try:
        _guarded(result, lambda: _kernels.write_block(torch.zeros(64, device=DEVICE)))
        dist.barrier()
        _verify_into(result)  # the store check's first rank, and verify, raise here
    finally:
        kernel.configs = full
        _guarded(result, handle.close)


def _cuda_graph_run(result: dict[str, Any], mode: str) -> None:
    """A kernel's first use inside a real CUDA graph capture: checked after it, never during."""
    import torch

    import megatron_tuning

    policy = TuningPolicy(
        mode=mode,
        scope=("tests.support_kernels",),
        agreement="store",
        agreement_timeout_s=30.0,
        use_shipped_tables=False,
    )
    x = torch.arange(48, dtype=torch.float32, device=DEVICE)
    y = torch.empty_like(x)
    # Warm-up session without checks: compiles the config this rank picks, outside the capture.
    megatron_tuning.init_deterministic_tuning(policy.replace(agreement="off"))
    from tests import support_kernels as _kernels

    _kernels.launch("scale", x, y)
    torch.cuda.synchronize()
    decision_log().clear()
    handle = megatron_tuning.init_deterministic_tuning(policy)  # fresh pins: the next launch decides again
    try:
        checker = agreement.active_checker()
        assert isinstance(checker, agreement.AgreementChecker)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _guarded(result, lambda: _kernels.launch("scale", x, y))
        result["pending"] = len(checker._pending)
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        result["replay_ok"] = bool(torch.equal(y, x * 2))
        dist.barrier()
        result["shared"] = agreement.verify_agreement()
    finally:
        handle.close()


def _kernel_scenario(mode: str, agreement_mode: str) -> Callable[[dict[str, Any]], None]:
    return lambda result: _kernel_run(result, mode, agreement_mode)


SCENARIOS: dict[str, Callable[[dict[str, Any]], None]] = {
    "store_agree": store_agree,
    "store_chaos": store_chaos,
    "allgather_agree": allgather_agree,
    "allgather_chaos": allgather_chaos,
    "allgather_order": allgather_order,
    "verify_agree": verify_agree,
    "verify_chaos": verify_chaos,
    "asymmetric_store": asymmetric_store,
    "asymmetric_verify": asymmetric_verify,
    "allgather_missing": allgather_missing,
    "capture_deferred": capture_deferred,
    "kernels_asymmetric": kernels_asymmetric,
    "kernels_factory": kernels_factory,
    "session_extra_other_policy": session_extra_other_policy,
    "session_extra_same_policy": session_extra_same_policy,
    "session_extra_allgather": session_extra_allgather,
    "session_lagging_allgather": session_lagging_allgather,
    "session_extra_store_close": session_extra_store_close,
    "inputs_agreement_off": inputs_agreement_off,
    "session_equal_store": session_equal_store,
    "session_reinit_verify": session_reinit_verify,
    "verify_extra_call": verify_extra_call,
    "verify_tp": verify_tp,
    "verify_pp": verify_pp,
    "verify_varlen": verify_varlen,
    "verify_chaos_tp": verify_chaos_tp,
    "verify_chaos_strided": verify_chaos_strided,
    "verify_chaos_pair": verify_chaos_pair,
    "verify_close_chaos": verify_close_chaos,
}
SCENARIOS["cuda_graph_agree"] = lambda result: _cuda_graph_run(result, "deterministic")
SCENARIOS["cuda_graph_chaos"] = lambda result: _cuda_graph_run(result, "chaos")
for _mode, _agreement_mode in (
    ("deterministic", "store"),
    ("deterministic", "allgather"),
    ("deterministic", "verify"),
    ("chaos", "store"),
    ("auto", "store"),
):
    SCENARIOS[f"config_list_{_agreement_mode}_{_mode}"] = lambda result, m=_mode, a=_agreement_mode: (
        _config_list_run(result, m, a)
    )
for _agreement_mode in ("store", "allgather", "verify", "off"):
    for _mode in ("deterministic", "chaos"):
        SCENARIOS[f"kernels_{_agreement_mode}_{_mode}"] = _kernel_scenario(_mode, _agreement_mode)


def _store_error(result: dict[str, Any], error: BaseException) -> None:
    result["error"] = type(error).__name__
    result["message"] = str(error)
    if isinstance(error, AgreementTimeoutError):
        result["missing_ranks"] = error.missing_ranks
    if isinstance(error, InputMismatchError):
        result["mismatch_ranks"] = error.ranks
    for field in ("kernel", "key"):
        if hasattr(error, field):
            result[field] = getattr(error, field)
    if hasattr(error, "signatures"):
        result["ranks"] = sorted(error.signatures)
    if not isinstance(error, MegatronTuningError):
        result["traceback"] = traceback.format_exc()


def main() -> int:
    global RANK, WORLD, DEVICE
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", required=True)
    parser.add_argument(
        "--backend", default="gloo", help="nccl: one GPU per rank, CUDA tensors in the collectives"
    )
    args = parser.parse_args()
    if args.backend == "nccl":
        import torch

        DEVICE = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=60))
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {}
    path = os.path.join(args.out, f"rank{RANK}.json")
    for name in args.scenarios.split(","):
        decision_log().clear()
        result: dict[str, Any] = {"error": None}
        start = time.monotonic()
        try:
            SCENARIOS[name](result)
        except Exception as error:  # recorded for the test to judge; keep the ranks in step
            if result.get("error") is None:
                _store_error(result, error)
        finally:
            checker = agreement.active_checker()
            if checker is not None:
                try:
                    checker.stop()  # a verify session's check at close may still find a divergence
                except MegatronTuningError as error:
                    if result.get("error") is None:
                        _store_error(result, error)
        result["wall_s"] = round(time.monotonic() - start, 3)
        results[name] = result
        with open(path + ".tmp", "w") as handle:
            json.dump(results, handle, indent=1)
        os.replace(path + ".tmp", path)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
