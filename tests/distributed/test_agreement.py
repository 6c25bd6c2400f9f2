"""In-process tests of the agreement check: fake ranks share one store.

Fast checks of the store check, the shared divergence flag, the inputs check, starting and stopping,
and the fixed-size text rows; plus contract tests for the private torch API relied on. The real
multi-process runs are in ``tests_distributed/test_agreement_torchrun.py``.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

dist = pytest.importorskip("torch.distributed")

from megatron_tuning.core.decisions import Decision, decision_log
from megatron_tuning.core.errors import (
    CONFIG_LIST_KEY,
    FIX_A_CONFIG_LIST,
    DivergenceError,
    InputMismatchError,
)
from megatron_tuning.core.identity import config_signature
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.distributed import agreement, store, verify
from megatron_tuning.runtime import pinning

from .. import support_kernels as sk

KERNEL = "pkg.kernels:matmul"
KEY = "M=64, N=48, K=40 | a_ptr:torch.float32"
SIG_A = "BLOCK_M=64, num_warps=4, num_stages=3"
SIG_B = "BLOCK_M=128, num_warps=8, num_stages=3"
INPUTS = {"policy": "mode=deterministic", "tables": "(none)", "triton": "3.9.0"}


def _decision(signature: str, key: str = KEY, source: str = "table") -> Decision:
    return Decision(kernel=KERNEL, key=key, signature=signature, source=source)


def _ranks(count: int, mode: str = "store", timeout_s: float = 5.0, shared: Any = None) -> list[Any]:
    shared = shared if shared is not None else dist.HashStore()
    policy = TuningPolicy(agreement=mode, agreement_timeout_s=timeout_s)
    return [
        agreement.AgreementChecker(policy, store=shared, rank=r, ranks=range(count), mode=mode)
        for r in range(count)
    ]


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A real (1-rank) default process group in this process, torn down afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        checker = agreement.active_checker()
        if checker is not None:
            checker.stop(final_check=False)
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
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


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


def test_auto_compares_tuned_decisions() -> None:
    assert "tuned" not in verify.unchecked_sources("auto")
    assert "tuned" in verify.unchecked_sources("deterministic")


def test_a_kernel_named_plain_on_one_rank_and_digest_on_another_is_compared() -> None:
    """Whether a kernel id gets ``@digest`` depends on the module's autotuners at its first launch,
    which can differ by rank: the check compares module, qualname and config list digest."""
    first, second = _ranks(2)
    digest = "0123456789ab"
    first.check(Decision(KERNEL, KEY, SIG_A, "table", config_list_digest=digest))
    with pytest.raises(DivergenceError) as raised:
        second.check(Decision(f"{KERNEL}@{digest}", KEY, SIG_B, "cheapest", config_list_digest=digest))
    assert raised.value.signatures == {0: SIG_A, 1: SIG_B}
    # Another config list over the same function is another kernel: not compared.
    first, second = _ranks(2)
    first.check(Decision(KERNEL, KEY, SIG_A, "table", config_list_digest=digest))
    second.check(
        Decision(f"{KERNEL}@ba9876543210", KEY, SIG_B, "cheapest", config_list_digest="ba9876543210")
    )
    second.poll()


def test_ranks_offering_other_config_lists_for_a_kernel_raise_at_its_first_key() -> None:
    """Each rank's records of a kernel carry its own list's digest, so they never pair: the store
    check compares the kernel's list once, under its plain name, and names both."""
    first, second = _ranks(2)
    first.check(Decision(KERNEL, KEY, SIG_A, "table", config_list_digest="0123456789ab"))
    with pytest.raises(DivergenceError) as raised:
        second.check(Decision(KERNEL, KEY, SIG_B, "cheapest", config_list_digest="ba9876543210"))
    error = raised.value
    assert (error.kernel, error.key, error.planted) == (KERNEL, CONFIG_LIST_KEY, False)
    assert error.signatures == {0: "0123456789ab", 1: "ba9876543210"}
    assert f"Ranks offer different config lists for kernel {KERNEL}" in str(error)
    assert FIX_A_CONFIG_LIST in str(error)
    with pytest.raises(DivergenceError) as raised_first:  # the first rank, at its next check
        first.poll()
    assert str(raised_first.value) == str(error)


def test_the_config_list_is_named_by_its_configs() -> None:
    """A list the process met carries its configs' signatures: the error says what only one offers
    (here the lists of the twins over ``twin_body``, as if each rank held one under the plain name)."""
    installation = pinning.Installation(TuningPolicy(scope=("tests.support_kernels",)), None, None, 0)
    digests = [pinning.state_for(k, installation).config_list_digest for k in (sk.twin_large, sk.twin_small)]
    first, second = _ranks(2)
    kernel = "tests.support_kernels:twin_body"
    first.check(Decision(kernel, KEY, SIG_A, "table", config_list_digest=digests[0]))
    with pytest.raises(DivergenceError) as raised:
        second.check(Decision(kernel, KEY, SIG_A, "table", config_list_digest=digests[1]))
    large = "; ".join(sorted(config_signature(c) for c in sk.TWIN_LARGE_CONFIGS))
    assert f"Rank(s) [0] offer {digests[0]}: {large}" in str(raised.value)
    only = "BLOCK_SIZE=128, num_warps=8, num_stages=3; BLOCK_SIZE=64, num_warps=8, num_stages=3"
    assert f"diff: only rank(s) [0]: {only} | only rank(s) [1]: BLOCK_SIZE=8, num_warps=2" in str(
        raised.value
    )


def test_kernels_told_apart_by_their_list_never_compare_lists() -> None:
    """A factory's kernels and twins over one function carry ``@digest`` ids: each list is another
    kernel, so ranks holding other lists of them (or launching them in other orders) are not wrong."""
    for kernel in (f"{KERNEL}@", "pkg.kernels:make.<locals>.matmul@"):
        first, second = _ranks(2)
        first.check(Decision(kernel + "0123456789ab", KEY, SIG_A, "table", config_list_digest="0123456789ab"))
        second.check(
            Decision(kernel + "ba9876543210", KEY, SIG_B, "table", config_list_digest="ba9876543210")
        )
        second.poll()
        first.poll()


def test_keys_differing_only_by_arch_are_not_compared() -> None:
    first, second = _ranks(2)
    first.check(Decision(kernel=KERNEL, key=KEY, signature=SIG_A, source="table", arch="sm90"))
    second.check(Decision(kernel=KERNEL, key=KEY, signature=SIG_B, source="table", arch="sm80"))


def test_verify_mode_sends_nothing_per_key() -> None:
    class NoTraffic(dist.HashStore):  # type: ignore[misc]
        def compare_set(self, *args: Any) -> Any:
            raise AssertionError("verify mode made a per-key store request")

    first, second = _ranks(2, mode="verify", shared=NoTraffic())
    first.check(_decision(SIG_A))
    second.check(_decision(SIG_B))  # differs: only verify_agreement (or the close check) can tell


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


def test_inputs_that_differ_are_named_on_both_ranks() -> None:
    first, second = _ranks(2)
    first.compare_inputs(INPUTS)
    other = dict(INPUTS, tables="t.msgpack@1234abcd")
    with pytest.raises(InputMismatchError) as raised:
        second.compare_inputs(other)
    error = raised.value
    assert error.ranks == [0, 1] and error.differences == {"tables": {0: "(none)", 1: "t.msgpack@1234abcd"}}
    assert "rank 0: (none); rank 1: t.msgpack@1234abcd" in str(error)
    with pytest.raises(InputMismatchError) as seen_by_first:  # the first rank learns at its next check
        first.check(_decision(SIG_A))
    assert str(seen_by_first.value) == str(error)
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_equal_inputs_pass() -> None:
    for checker in _ranks(3):
        checker.compare_inputs(INPUTS)


def test_describe_inputs_compares_table_contents_not_paths(tmp_path: Any) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder in ("a", "b"):
        (tmp_path / folder / "t.msgpack").write_bytes(b"same bytes")
    a = agreement.describe_inputs(TuningPolicy(tables=[str(tmp_path / "a" / "t.msgpack")]))
    b = agreement.describe_inputs(TuningPolicy(tables=[str(tmp_path / "b" / "t.msgpack")]))
    assert a == b
    (tmp_path / "b" / "t.msgpack").write_bytes(b"other bytes")
    c = agreement.describe_inputs(TuningPolicy(tables=[str(tmp_path / "b" / "t.msgpack")]))
    assert c["tables"] != a["tables"] and c["policy.on_miss"] == a["policy.on_miss"]
    d = agreement.describe_inputs(TuningPolicy(tables=[str(tmp_path / "a" / "t.msgpack")], on_miss="error"))
    assert {name for name in d if d[name] != a[name]} == {"policy.on_miss"}  # named field by field


def test_pack_text_is_fixed_size_and_marks_truncation() -> None:
    row = verify.pack_text("k", "é" * 1000, "s")
    assert len(row) == verify.TEXT_BYTES
    kernel, key, signature = verify.unpack_text(row)
    assert (kernel, signature) == ("k", "s")
    assert key.endswith("...[truncated]") and len(key.encode()) <= verify.FIELD_BYTES[1]
    assert verify.unpack_text(verify.pack_text("a", "b", "c")) == ("a", "b", "c")


# --- starting and stopping ----------------------------------------------------------------------


def test_no_process_group_means_no_checks() -> None:
    assert not dist.is_initialized()
    assert agreement.start_agreement(TuningPolicy(agreement="store")) is None
    assert agreement.verify_agreement() == 0


@pytest.mark.parametrize(
    "changes", [{"agreement": "off"}, {"mode": "record"}, {"mode": "tune"}, {"mode": "off"}]
)
def test_a_session_that_checks_no_key_still_claims_its_inputs(
    one_rank_group: None, changes: dict[str, Any]
) -> None:
    """Before, such a session claimed nothing: a rank whose own environment turned checks off was
    compared with nobody, and the other ranks compared with nobody either."""
    claims = dist.HashStore()
    checker = agreement.start_agreement(TuningPolicy(**changes))
    assert isinstance(checker, agreement.AgreementChecker) and checker.mode == "inputs"
    assert agreement.active_checker() is checker and checker.check not in decision_log()._listeners
    first = agreement.AgreementChecker(TuningPolicy(), store=claims, rank=0, ranks=[0, 1])
    first.compare_inputs(agreement.describe_inputs(TuningPolicy()))
    unchecked = agreement.AgreementChecker(
        TuningPolicy(**changes), store=claims, rank=1, ranks=[0, 1], mode="inputs"
    )
    with pytest.raises(InputMismatchError) as raised:
        unchecked.compare_inputs(agreement.describe_inputs(TuningPolicy(**changes)))
    (field, value), *_ = changes.items()
    assert raised.value.differences[f"policy.{field}"][1] == value  # named field by field
    assert f"policy.{field}: rank 0: " in str(raised.value)
    with pytest.raises(InputMismatchError):  # the checked rank learns at its next check
        first.poll()


def _inputs_only_rank_claiming_first() -> agreement.AgreementChecker:
    """Rank 0 with agreement off (an inputs-only session) claims its inputs first; rank 1, checked,
    finds the mismatch at its own claim. Returns rank 0's session, which has raised nothing yet."""
    claims = dist.HashStore()
    off = TuningPolicy(agreement="off")
    unchecked = agreement.AgreementChecker(off, store=claims, rank=0, ranks=[0, 1], mode="inputs")
    unchecked.compare_inputs(agreement.describe_inputs(off))
    checked = agreement.AgreementChecker(TuningPolicy(), store=claims, rank=1, ranks=[0, 1])
    with pytest.raises(InputMismatchError, match="policy.agreement: rank 0: off; rank 1: None"):
        checked.compare_inputs(agreement.describe_inputs(TuningPolicy()))
    return unchecked


def test_an_unchecked_rank_that_claimed_first_learns_of_the_mismatch_at_close() -> None:
    unchecked = _inputs_only_rank_claiming_first()
    unchecked.check(_decision(SIG_A))  # no per-key check, no traffic
    with pytest.raises(InputMismatchError, match="policy.agreement: rank 0: off; rank 1: None"):
        unchecked.stop()


def test_start_attaches_and_stop_detaches(one_rank_group: None) -> None:
    handle = agreement.start_agreement(TuningPolicy(mode="chaos", agreement="allgather"))
    assert isinstance(handle, agreement.AgreementChecker) and agreement.active_checker() is handle
    decision_log().record(_decision(SIG_A))  # one rank: trivially agrees, through a real gather
    assert agreement.verify_agreement() == 0  # an entry seen by one rank only is not "shared"
    replacement = agreement.start_agreement(TuningPolicy())
    assert agreement.active_checker() is replacement and handle.check not in decision_log()._listeners
    replacement.stop()
    assert agreement.active_checker() is None


def _recording_compare_logs(monkeypatch: Any) -> list[tuple[float | None, bool, bool]]:
    calls: list[tuple[float | None, bool, bool]] = []
    monkeypatch.setattr(
        verify,
        "compare_logs",
        lambda group, timeout_s, checker, *, at_close, compare_rows: calls.append(
            (timeout_s, at_close, compare_rows)
        ),
    )
    return calls


def test_a_verify_session_checks_once_more_at_close(one_rank_group: None, monkeypatch: Any) -> None:
    calls = _recording_compare_logs(monkeypatch)
    handle = agreement.start_agreement(TuningPolicy(agreement="verify", agreement_timeout_s=500))
    handle.stop()
    assert calls == [(verify.CLOSE_TIMEOUT_S, True, True)]  # bounded even when the policy allows longer


def test_a_store_session_meets_at_close_to_pair_sessions_but_compares_no_rows(
    one_rank_group: None, monkeypatch: Any
) -> None:
    """Its keys were compared at first use: the meeting at close exchanges headers only."""
    calls = _recording_compare_logs(monkeypatch)
    handle = agreement.start_agreement(TuningPolicy(agreement="store", agreement_timeout_s=500))
    handle.stop()
    assert calls == [(verify.CLOSE_TIMEOUT_S, True, False)]


def test_close_does_not_raise_again_what_a_check_raised_but_raises_what_this_rank_never_did(
    one_rank_group: None, monkeypatch: Any
) -> None:
    """Before, every store rank's close raised the divergence again, after the caller (a chaos run, a
    harness) had caught it: the job died at close. A rank that recorded the flag spares the meeting."""
    calls = _recording_compare_logs(monkeypatch)
    first, second = _ranks(2)
    first.check(_decision(SIG_A))  # claims first and never polls: it has raised nothing
    with pytest.raises(DivergenceError) as raised:
        second.check(_decision(SIG_B))
    second.stop()  # raised at its launch: not again
    with pytest.raises(DivergenceError) as at_close:
        first.stop()
    assert str(at_close.value) == str(raised.value)
    assert calls == []  # the flag is recorded: no rank waits for a meeting


def test_an_inputs_session_and_a_failed_attach_raise_at_close_only_what_they_did_not_raise() -> None:
    unchecked = _inputs_only_rank_claiming_first()
    with pytest.raises(InputMismatchError):
        unchecked.poll()  # what verify_agreement() reads
    unchecked.stop()
    error = InputMismatchError("tuning session #1", [0, 1], {"tables": {0: "a", 1: "b"}})
    for raised_before in (True, False):
        failed = agreement.FailedAgreement(error, TuningPolicy())
        if raised_before:
            with pytest.raises(InputMismatchError):
                failed.check()  # its next new key
            failed.stop()
        else:
            with pytest.raises(InputMismatchError):
                failed.stop()  # attached at close: raised there first


def test_the_close_check_says_so_when_the_group_is_gone() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verify.verify_at_close(None, 5.0)
    text = "\n".join(str(w.message) for w in caught)
    assert "the final agreement check did not run" in text and "destroy_process_group" in text


def test_unset_agreement_is_store_in_small_worlds_and_verify_above(monkeypatch: Any) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(store, "group_ranks", lambda group: list(range(agreement.STORE_UP_TO_RANKS)))
    assert agreement.resolve_mode(TuningPolicy()) == "store"
    monkeypatch.setattr(store, "group_ranks", lambda group: list(range(agreement.STORE_UP_TO_RANKS + 1)))
    assert agreement.resolve_mode(TuningPolicy()) == "verify"
    assert agreement.resolve_mode(TuningPolicy(agreement="store")) == "store"


# --- contracts on private torch API ------------------------------------------------------------


def test_contract_default_store_is_reachable(one_rank_group: None) -> None:
    from torch.distributed import distributed_c10d

    assert hasattr(distributed_c10d, "_get_default_store"), "torch moved _get_default_store"
    default = store.default_store()
    for method in ("compare_set", "wait", "check", "set", "add", "append", "delete_key"):
        assert callable(getattr(default, method, None)), method


@pytest.mark.parametrize(
    "make",
    [
        lambda: dist.HashStore(),
        lambda: dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5)),
    ],
)
def test_contract_compare_set_semantics(make: Any) -> None:
    shared = dist.PrefixStore("contract", make())
    # Absent key + expected "": sets and returns ours (the atomic claim).
    assert shared.compare_set("k", "", "0\nA") == b"0\nA"
    # Present key + expected "": returns the first claim untouched.
    assert shared.compare_set("k", "", "1\nB") == b"0\nA"
    # A peek creates an empty value that a later record still replaces.
    assert shared.compare_set("flag", "", "") == b""
    assert shared.compare_set("flag", "", "record") == b"record"
    assert shared.compare_set("flag", "", "") == b"record"
    with pytest.raises((getattr(dist, "DistStoreError", RuntimeError), RuntimeError)):
        shared.wait(["absent"], timedelta(seconds=0.05))
