"""In-process tests of the agreement protocol: several fake ranks share one in-memory store.

Fast checks of the store claim, the shared divergence record, the deadline barrier and the
fixed-size encodings; plus contract tests for the private torch API the module relies on. The
real multi-process runs are in ``test_agreement_torchrun.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

dist = pytest.importorskip("torch.distributed")

from megatron_tuning.core.decisions import Decision, decision_log
from megatron_tuning.core.errors import AgreementTimeoutError, DivergenceError
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.distributed import agreement, verify, wire

KERNEL = "pkg.kernels:matmul"
KEY = "M=64, N=48, K=40 | a_ptr:torch.float32"
SIG_A = "BLOCK_M=64, num_warps=4, num_stages=3"
SIG_B = "BLOCK_M=128, num_warps=8, num_stages=3"


def _decision(signature: str, key: str = KEY, source: str = "table") -> Decision:
    return Decision(kernel=KERNEL, key=key, signature=signature, source=source)


def _ranks(count: int, mode: str = "store", timeout_s: float = 5.0) -> list[agreement.AgreementChecker]:
    store = dist.HashStore()
    policy = TuningPolicy(agreement=mode, agreement_timeout_s=timeout_s)
    return [
        agreement.AgreementChecker(policy, store=store, rank=r, ranks=range(count), namespace="t")
        for r in range(count)
    ]


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A real (1-rank) default process group in this process, torn down afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        for checker in [agreement.active_checker()]:
            if checker is not None:
                checker.stop()
        decision_log().clear()
        dist.destroy_process_group()


def test_store_agreeing_ranks_pass_and_late_ranks_compare() -> None:
    first, second, third = _ranks(3)
    for checker in (second, first, third):
        checker.check(_decision(SIG_A))
        checker.poll()


def test_store_mismatch_raises_the_same_message_on_every_rank() -> None:
    first, second, third = _ranks(3)
    first.check(_decision(SIG_A))
    with pytest.raises(DivergenceError) as raised_second:
        second.check(_decision(SIG_B))
    # Rank 2 also differs, but the first recorded diagnosis wins so all messages are identical.
    with pytest.raises(DivergenceError) as raised_third:
        third.check(_decision("BLOCK_M=16, num_warps=1, num_stages=3"))
    with pytest.raises(DivergenceError) as raised_first:
        first.poll()
    messages = {str(e.value) for e in (raised_first, raised_second, raised_third)}
    assert len(messages) == 1
    error = raised_first.value
    assert (error.kernel, error.key, error.signatures) == (KERNEL, KEY, {0: SIG_A, 1: SIG_B})
    assert "Rank(s) [0] ran BLOCK_M=64" in str(error) and "Rank(s) [1] ran BLOCK_M=128" in str(error)


def test_flag_reaches_a_rank_at_its_next_new_key() -> None:
    first, second = _ranks(2)
    first.check(_decision(SIG_A))
    with pytest.raises(DivergenceError):
        second.check(_decision(SIG_B))
    with pytest.raises(DivergenceError, match="ran BLOCK_M=128"):
        first.check(_decision(SIG_A, key="M=1"))


def test_failed_check_fails_again_at_the_next_launch() -> None:
    # The interception pins nothing when a listener raises, so the key comes back to the checker.
    first, second = _ranks(2)
    first.check(_decision(SIG_A))
    for _ in range(2):
        with pytest.raises(DivergenceError):
            second.check(_decision(SIG_B))


@pytest.mark.parametrize("source", ["out_of_scope", "recorded", "tuned"])
def test_unchecked_sources_make_no_traffic(source: str) -> None:
    first, second = _ranks(2)
    first.check(_decision(SIG_A, source=source))
    second.check(_decision(SIG_B, source=source))  # would diverge if compared
    second.poll()


def test_keys_differing_only_by_arch_are_not_compared() -> None:
    first, second = _ranks(2)
    first.check(Decision(kernel=KERNEL, key=KEY, signature=SIG_A, source="table", arch="sm90"))
    second.check(Decision(kernel=KERNEL, key=KEY, signature=SIG_B, source="table", arch="sm80"))


def test_capture_defers_checks_until_the_next_check(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = _ranks(2)
    first.check(_decision(SIG_A))
    monkeypatch.setattr(agreement, "is_capturing", lambda: True)
    second.check(_decision(SIG_B))  # captured: queued, no store traffic, no error yet
    second.flush()  # still capturing: stays queued
    assert len(second._pending) == 1
    monkeypatch.setattr(agreement, "is_capturing", lambda: False)
    with pytest.raises(DivergenceError):
        second.check(_decision(SIG_A, key="M=2"))


def test_arrive_names_missing_ranks_and_late_ranks_accept_the_verdict() -> None:
    store = dist.PrefixStore("arrive", dist.HashStore())
    start = time.monotonic()
    with pytest.raises(AgreementTimeoutError) as raised:
        wire.arrive(store, "t1", 0, [0, 1, 2], "kernel k", 0.3)
    assert time.monotonic() - start < 3
    assert raised.value.missing_ranks == [1, 2]
    # Rank 1 arrives after rank 0 gave up: it sees the same verdict instead of waiting alone.
    with pytest.raises(AgreementTimeoutError) as late:
        wire.arrive(store, "t1", 1, [0, 1, 2], "kernel k", 0.3)
    assert late.value.missing_ranks == [1, 2]


def test_arrive_passes_when_every_rank_comes() -> None:
    store = dist.PrefixStore("arrive", dist.HashStore())
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            wire.arrive(store, "t", r, [0, 1, 2], "k", 5.0)
        except BaseException as error:  # collected for the assertion below
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert errors == []


def test_pack_text_is_fixed_size_and_marks_truncation() -> None:
    row = wire.pack_text("k", "é" * 1000, "s")
    assert len(row) == wire.TEXT_BYTES
    kernel, key, signature = wire.unpack_text(row)
    assert (kernel, signature) == ("k", "s")
    assert key.endswith("...[truncated]") and len(key.encode()) <= wire.FIELD_BYTES[1]
    assert wire.unpack_text(wire.pack_text("a", "b", "c")) == ("a", "b", "c")


def test_digests_are_fixed_size_and_stable() -> None:
    assert len(wire.identity_digest(KERNEL, KEY, "sm90")) == wire.DIGEST_BYTES
    assert wire.signature_digest(SIG_A) == wire.signature_digest(SIG_A)
    assert wire.identity_digest("a", "b\0c", "x") != wire.identity_digest("a\0b", "c", "x")


def test_no_process_group_means_no_checks() -> None:
    assert not dist.is_initialized()
    handle = agreement.start_agreement(TuningPolicy(agreement="store"))
    assert not isinstance(handle, agreement.AgreementChecker)
    handle.stop()
    assert verify.verify_agreement() == 0


@pytest.mark.parametrize("changes", [{"agreement": "off"}, {"mode": "record"}, {"mode": "tune"}])
def test_start_is_a_no_op_when_nothing_must_agree(one_rank_group: None, changes: dict[str, Any]) -> None:
    handle = agreement.start_agreement(TuningPolicy(**changes))
    assert not isinstance(handle, agreement.AgreementChecker)
    assert agreement.active_checker() is None


def test_start_attaches_and_stop_detaches(one_rank_group: None) -> None:
    handle = agreement.start_agreement(TuningPolicy(mode="chaos", agreement="allgather"))
    assert isinstance(handle, agreement.AgreementChecker) and agreement.active_checker() is handle
    decision_log().record(_decision(SIG_A))  # one rank: trivially agrees, through a real gather
    assert verify.verify_agreement() == 0  # an entry seen by one rank only is not "shared"
    replacement = agreement.start_agreement(TuningPolicy())
    assert agreement.active_checker() is replacement and not handle._attached
    replacement.stop()
    assert agreement.active_checker() is None


# --- contracts on private torch API ------------------------------------------------------------


def test_contract_default_store_is_reachable(one_rank_group: None) -> None:
    from torch.distributed import distributed_c10d

    assert hasattr(distributed_c10d, "_get_default_store"), "torch moved _get_default_store"
    store = wire.default_store()
    for method in ("compare_set", "wait", "check", "set"):
        assert callable(getattr(store, method, None)), method


@pytest.mark.parametrize(
    "make",
    [
        lambda: dist.HashStore(),
        lambda: dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5)),
    ],
)
def test_contract_compare_set_semantics(make: Any) -> None:
    store = dist.PrefixStore("contract", make())
    # Absent key + expected "": sets and returns ours (the atomic claim).
    assert store.compare_set("k", "", "0\nA") == b"0\nA"
    # Present key + expected "": returns the first claim untouched.
    assert store.compare_set("k", "", "1\nB") == b"0\nA"
    # The flag read creates an empty value that a later record still replaces.
    assert store.compare_set("flag", "", "") == b""
    assert store.compare_set("flag", "", "record") == b"record"
    assert store.compare_set("flag", "", "") == b"record"
    with pytest.raises(wire._store_timeout_errors()):
        store.wait(["absent"], timedelta(seconds=0.05))


# --- numbered sessions (unequal init calls) ----------------------------------------------------
def _session(store: Any, rank: int, number: int, mode: str = "deterministic") -> Any:
    from megatron_tuning.distributed.sessions import SessionRegistry, policy_summary

    return SessionRegistry(store, rank, number, policy_summary(TuningPolicy(mode=mode)))


def test_a_session_number_started_with_another_policy_is_a_mismatch() -> None:
    import pickle

    from megatron_tuning.core.errors import SessionMismatchError

    store = dist.HashStore()
    assert _session(store, 0, 1).register() is None
    assert _session(store, 1, 1).register() is None  # same number, same policy: fine
    error = _session(store, 1, 2, mode="chaos").register()
    assert error is None  # the first to start #2 sets it
    error = _session(store, 0, 2).register()
    assert isinstance(error, SessionMismatchError) and sorted(error.sessions) == [0, 1]
    assert "Rank 1 is in session #2 (mode=chaos" in str(error)
    assert "Rank 0 is in session #2 (mode=deterministic" in str(error)
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_a_rank_that_moved_on_is_named_at_once_and_a_late_one_only_at_timeout() -> None:
    from megatron_tuning.core.errors import SessionMismatchError

    store = dist.HashStore()
    ahead, behind = _session(store, 0, 2), _session(store, 1, 1)
    ahead.register()
    behind.register()
    with pytest.raises(SessionMismatchError, match="Rank 0 is in session #2"):
        behind.fail_if_moved_on([0], "check #1")
    ahead.fail_if_moved_on([1], "check #1")  # rank 1 may still be on its way to session #2
    timeout = AgreementTimeoutError("check #1", [1], 1.0)
    explained = ahead.explain_timeout(timeout, "check #1")
    assert explained is not None and "Rank 1 is in session #1" in str(explained)
    assert _session(store, 1, 2).explain_timeout(AgreementTimeoutError("x", [0], 1.0), "x") is None


def test_arrive_calls_on_wait_while_a_rank_is_missing() -> None:
    store = dist.HashStore()
    seen: list[list[int]] = []

    def on_wait(missing: list[int]) -> None:
        seen.append(missing)
        raise RuntimeError("gone")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="gone"):
        wire.arrive(store, "t", 0, [0, 1], "check", 30.0, on_wait=on_wait)
    assert seen == [[1]] and time.monotonic() - start < 5
