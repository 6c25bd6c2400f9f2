"""In-process tests of the ``digest`` agreement: fake ranks share one in-memory store.

Covers the flush protocol (dedup of identical batches, the per-flush reference, the log reader,
the last closer), the request counts the mode promises, the hot-path flush trigger, and bad
records under the library's keys. Multi-process runs are in ``test_agreement_torchrun.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

dist = pytest.importorskip("torch.distributed")

from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.errors import DivergenceError, StoreRecordError
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.distributed import agreement
from megatron_tuning.runtime import pinning

KERNEL = "pkg.kernels:matmul"
SIG_A = "BLOCK_M=64, num_warps=4, num_stages=3"
SIG_B = "BLOCK_M=128, num_warps=8, num_stages=3"


class Counter:
    """Counts every request the checkers send (with a reply or not), through a proxy per checker."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def wrap(self, store: Any) -> Any:
        counter = self

        class _Counting:
            def __getattr__(self, name: str) -> Any:
                method = getattr(store, name)

                def counted(*args: Any, **kwargs: Any) -> Any:
                    counter.calls[name] = counter.calls.get(name, 0) + 1
                    return method(*args, **kwargs)

                return counted

        return _Counting()

    def total(self) -> int:
        return sum(self.calls.values())


def _ranks(count: int, counter: Counter | None = None) -> list[agreement.AgreementChecker]:
    store = dist.HashStore()
    policy = TuningPolicy(agreement="digest")
    checkers = [
        agreement.AgreementChecker(policy, store=store, rank=r, ranks=range(count), namespace="t")
        for r in range(count)
    ]
    if counter is not None:
        for checker in checkers:
            checker._store = counter.wrap(checker._store)
            assert checker.ledger is not None
            checker.ledger.store = checker._store
    return checkers


def _d(key: str, signature: str = SIG_A, kernel: str = KERNEL) -> Decision:
    return Decision(kernel=kernel, key=key, signature=signature, source="table")


def _decide(checker: agreement.AgreementChecker, keys: list[str], signature: str = SIG_A) -> None:
    for key in keys:
        checker.check(_d(key, signature))


def _claim_key(flush: int, keys: list[str]) -> str:
    """The claim key a batch of ``keys`` goes to at ``flush`` (its bucket: the smallest identity)."""
    from megatron_tuning.distributed.digest import bucket_of, row_of

    return f"ref/{flush}/{bucket_of(sorted(row_of(_d(k)) for k in keys))}"


@pytest.fixture(autouse=True)
def _no_leftover_flush() -> Any:
    yield
    pinning.run_pending_flush.__globals__["_flush_callbacks"].clear()
    pinning.flush_pending = False


def test_first_use_sends_nothing_and_a_flush_sends_one_batch() -> None:
    store = Counter()
    (checker,) = _ranks(1, store)
    before = store.total()
    _decide(checker, [f"M={n}" for n in range(50)])
    assert store.total() == before  # the launch path makes no store request
    assert pinning.flush_pending
    checker.flush()
    assert checker.ledger is not None and checker.ledger.flushes == 1


def test_identical_batches_are_sent_once_and_agree() -> None:
    store = Counter()
    ranks = _ranks(4, store)
    keys = [f"M={n}" for n in range(200)]
    for checker in ranks:
        _decide(checker, keys)
    counts = []
    for checker in ranks:
        before = store.total()
        checker.flush()
        counts.append(store.total() - before)
    # The first sender claims the reference (one compare_set), sets its rows and its ready key,
    # appends its record (rows and texts) and reads the log (it is the group's first rank); the
    # others send only the claim, whose reply names the reference's digest. Nobody polls the flag.
    assert counts[1:] == [1, 1, 1]
    assert counts[0] == 5
    # What the peers got back is the claim and its summary (an IBLT of 52 cells), not 6,400 bytes.
    assert len(bytes(ranks[0]._store.compare_set(_claim_key(1, keys), "", ""))) == 30 + 52 * 44
    closes = []
    for checker in ranks:
        before = store.total()
        checker.stop()
        closes.append(store.total() - before)
    # Close: one add each (its reply says no divergence was recorded), the first rank's log read,
    # and the last closer's read of the whole log.
    assert closes == [2, 1, 1, 2]


def test_requests_per_rank_do_not_grow_with_keys() -> None:
    def per_rank(keys: int) -> int:
        store = Counter()
        ranks = _ranks(2, store)
        for checker in ranks:
            _decide(checker, [f"M={n}" for n in range(keys)])
        before = store.total()
        for checker in ranks:
            checker.flush()
        return store.total() - before

    assert per_rank(100) <= 1.5 * per_rank(10)


def test_a_rank_that_differs_from_the_reference_raises_at_its_flush_and_the_others_at_theirs() -> None:
    first, second, third = _ranks(3)
    keys = ["M=1", "M=2", "M=3"]
    _decide(first, keys)
    _decide(second, keys[:2])
    second.check(_d("M=3", SIG_B))
    _decide(third, keys)
    first.flush()  # rank 0's batch is the reference of flush #1
    with pytest.raises(DivergenceError) as raised:
        second.flush()
    error = raised.value
    assert (error.kernel, error.key) == (KERNEL, "M=3")
    assert error.signatures == {0: SIG_A, 1: SIG_B}
    assert "digest check" in str(error)
    with pytest.raises(DivergenceError) as at_third:
        third.flush()  # identical to rank 0's batch: the alarm in its claim reply tells it
    with pytest.raises(DivergenceError) as at_first:
        first.poll()
    assert str(at_third.value) == str(at_first.value) == str(error)


def test_pipeline_stages_with_disjoint_keys_agree() -> None:
    ranks = _ranks(8)
    for checker in ranks:
        stage = checker.rank % 4
        _decide(checker, [f"stage={stage}, M={n}" for n in range(30)], f"BLOCK={stage}")
    for checker in ranks:
        checker.flush()
    for checker in ranks:
        checker.stop()


def test_rows_only_some_ranks_share_are_compared() -> None:
    """Varlen-like: shared keys plus own keys; two ranks share an own key with different configs."""
    ranks = _ranks(4)
    shared = [f"M={n}" for n in range(40)]
    for checker in ranks:
        _decide(checker, shared)
        _decide(checker, [f"own={checker.rank}, n={n}" for n in range(5)])
    ranks[2].check(_d("seq=777", SIG_A))
    ranks[3].check(_d("seq=777", SIG_B))
    errors = []
    for checker in reversed(ranks):  # rank 0 reads the log, after everyone sent
        try:
            checker.flush()
        except DivergenceError as error:
            errors.append(error)
    if not errors:  # neither the reference nor the reader's log read had both rows
        for checker in ranks:
            try:
                checker.stop()
            except DivergenceError as error:
                errors.append(error)
    assert errors, "the shared own key with two configs was never noticed"
    assert errors[0].key == "seq=777"
    assert set(errors[0].signatures.values()) == {SIG_A, SIG_B}


def test_the_last_rank_to_close_reads_the_whole_log() -> None:
    first, second = _ranks(2)
    # Neither row is in the other's reference (different flush numbers) and rank 0 read the log
    # before rank 1's second row was in it: the conflict is found when rank 1 closes last.
    first.check(_d("M=1"))
    first.flush()
    second.check(_d("other"))
    second.flush()
    second.check(_d("M=1", SIG_B))
    first.stop()
    with pytest.raises(DivergenceError) as raised:
        second.stop()
    assert raised.value.key == "M=1"


def test_a_repeated_launch_runs_the_pending_flush() -> None:
    (checker,) = _ranks(1)
    calls = []
    original = checker.flush
    checker.flush = lambda: calls.append(1) or original()  # type: ignore[method-assign]
    checker.check(_d("M=1"))
    assert pinning.flush_pending
    pinning.run_pending_flush()
    assert not pinning.flush_pending
    assert checker.ledger is not None and checker.ledger.flushes == 1


def test_a_full_batch_flushes_without_waiting_for_a_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_tuning.distributed import digest

    monkeypatch.setattr(digest, "MAX_BATCH", 8)
    (checker,) = _ranks(1)
    _decide(checker, [f"M={n}" for n in range(8)])
    assert checker.ledger is not None and checker.ledger.flushes == 1


def test_garbage_in_the_flag_is_a_store_record_error() -> None:
    (checker,) = _ranks(1)
    prefixed = checker._store
    prefixed.set("divergence", b"\xff\xfe not text")
    with pytest.raises(StoreRecordError, match="not UTF-8"):
        checker.poll()
    prefixed.set("divergence", '{"kernel": "k", "key": "y", "detail": "", "signatures": {"1": 5}}')
    with pytest.raises(StoreRecordError, match="signature 5"):
        checker.poll()
    prefixed.set("divergence", "[" * 5000 + "]" * 5000)
    with pytest.raises(StoreRecordError, match="nested"):
        checker.poll()


@pytest.mark.parametrize("claim", ["1.9\nBLOCK=1", "true\nx", "-7\nx", "99\nx", "\xff"])
def test_garbage_claims_in_store_mode_name_kernel_key_and_value(claim: str) -> None:
    store = dist.HashStore()
    policy = TuningPolicy(agreement="store")
    checker = agreement.AgreementChecker(policy, store=store, rank=0, ranks=range(2), namespace="t")
    from megatron_tuning.distributed.wire import identity_digest

    checker._store.set("k/" + identity_digest(KERNEL, "M=1", "unknown").hex(), claim)
    with pytest.raises(DivergenceError) as raised:
        checker.check(_d("M=1"))
    assert raised.value.key == "M=1" and KERNEL in str(raised.value)
    assert "unreadable" in str(raised.value)


def test_unset_agreement_means_store_for_small_worlds() -> None:
    assert agreement.resolve_mode(TuningPolicy()) == "store"  # no process group here
    assert agreement.resolve_mode(TuningPolicy(agreement="digest")) == "digest"


def test_ranks_with_other_tables_fail_at_session_start_naming_the_difference(tmp_path: Any) -> None:
    from megatron_tuning.core.errors import InputMismatchError
    from megatron_tuning.distributed.inputs import describe_inputs

    store = dist.HashStore()
    policy = TuningPolicy(agreement="digest")
    checkers = [
        agreement.AgreementChecker(policy, store=store, rank=r, ranks=range(2), namespace="t")
        for r in range(2)
    ]
    same = describe_inputs(policy)
    checkers[0].start_session("job", 1, policy, same)
    other = dict(same, tables="big.msgpack@0123456789ab")
    with pytest.raises(InputMismatchError) as raised:
        checkers[1].start_session("job", 1, policy, other)
    message = str(raised.value)
    assert "tables" in message and "big.msgpack@0123456789ab" in message and "rank 0" in message
    with pytest.raises(InputMismatchError):
        checkers[0].poll()  # the first rank learns it at its next check
    third = agreement.AgreementChecker(policy, store=store, rank=0, ranks=range(2), namespace="u")
    third.start_session("job", 2, policy, same)  # a new session number compares afresh


def test_inputs_compare_table_files_by_content(tmp_path: Any) -> None:
    from megatron_tuning.distributed.inputs import describe_inputs

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "t.msgpack").write_bytes(b"same bytes")
    (b / "t.msgpack").write_bytes(b"same bytes")
    first = describe_inputs(TuningPolicy(tables=(str(a / "t.msgpack"),)))
    second = describe_inputs(TuningPolicy(tables=(str(b / "t.msgpack"),)))
    assert first == second  # another path on another node, same content
    (b / "t.msgpack").write_bytes(b"other bytes")
    assert describe_inputs(TuningPolicy(tables=(str(b / "t.msgpack"),)))["tables"] != first["tables"]


def test_a_slow_store_request_is_told_once_per_kind_with_the_fix_its_caller_knows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import warnings

    from megatron_tuning.core import warn
    from megatron_tuning.distributed import storeops

    def told(calls: Any) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            calls()
        return [str(w.message) for w in caught if issubclass(w.category, warn.TuningWarning)]

    warn.reset_warnings()
    monkeypatch.setattr(storeops, "SLOW_REQUEST_S", -1.0)  # every request counts as slow

    def three() -> None:
        storeops.request("the digest flush #1 of rank 3 (5 new decisions)", lambda: 1)
        storeops.request("the digest flush #2 of rank 3 (1 new decisions)", lambda: 1)  # same kind
        storeops.request("the store check of kernel k with key n=1", lambda: 1, hint="use agreement 'digest'")

    first = told(three)
    assert len(first) == 2, first
    assert "digest flush #1 of rank 3" in first[0] and "'digest'" not in first[0]
    assert "kernel k with key n=1" in first[1] and "; use agreement 'digest'" in first[1]
    warn.reset_warnings()
    monkeypatch.setattr(storeops, "SLOW_REQUEST_S", 60.0)
    assert told(lambda: storeops.request("the digest flush #3 of rank 3", lambda: 1)) == []


# -- the log, the reference claim and the close count (the varlen-cheap protocol) ---------------


def _log_records(checker: agreement.AgreementChecker) -> list[tuple[int, int, int]]:
    from megatron_tuning.distributed.digest import unpack_records

    blob = bytes(checker._store.compare_set("log", "", ""))
    return [(rank, flush, len(rows)) for rank, flush, rows, _ in unpack_records(blob, "the log")]


def test_a_rank_with_keys_of_its_own_sends_only_those_in_one_append() -> None:
    store = Counter()
    ranks = _ranks(4, store)
    shared = [f"M={n}" for n in range(300)]
    for checker in ranks:
        _decide(checker, shared + [f"own={checker.rank}, n={n}" for n in range(7)])
    ranks[0].flush()  # the reference: its whole batch goes to the log
    for checker in ranks[1:]:
        before = dict(store.calls)
        checker.flush()
        sent = {name: store.calls[name] - before.get(name, 0) for name in store.calls}
        # The claim, whose summary says which 7 rows are new (no reference rows fetched, no dedup
        # add), and one append of those rows with their texts; no flag poll, no texts key.
        assert {k: v for k, v in sent.items() if v} == {"compare_set": 1, "append": 1}, sent
    assert _log_records(ranks[0]) == [(0, 1, 307), (1, 1, 7), (2, 1, 7), (3, 1, 7)]


def test_pipeline_stage_peers_upload_their_long_residual_once() -> None:
    ranks = _ranks(8)
    for checker in ranks:
        _decide(checker, [f"stage={checker.rank % 4}, M={n}" for n in range(300)])
    for checker in ranks:
        checker.flush()
    # Stage 0 is the reference; stages 1-3 differ from it entirely, and their 300-row residuals
    # (over DEDUP_ABOVE_ROWS) are deduplicated: one record per stage, not one per rank.
    assert sorted(rank for rank, _, _ in _log_records(ranks[0])) == [0, 1, 2, 3]


@pytest.mark.parametrize(("slow", "then"), [("set", "launch"), ("set", "close"), ("append", "launch")])
def test_a_rank_that_gets_only_the_claim_compares_later_and_names_the_owners_config(
    slow: str, then: str
) -> None:
    """The owner is slow after its claim, to publish its rows (``set``) or its texts (``append``).

    The other rank's batch differs in every row (chaos-like), too much for the claim's summary,
    so it needs the rows. It does not wait at its flush: it compares at the next launch (a
    re-requested flush), or waits at close.
    """
    import threading
    import time

    store = Counter()
    first, second = _ranks(2, store)
    assert first.ledger is not None
    owner_store = first.ledger.store
    released = threading.Event()

    class _Slow:
        def __getattr__(self, name: str) -> Any:
            method = getattr(owner_store, name)
            if name != slow:
                return method
            return lambda *args: (released.wait(5), method(*args))[1]

    keys = [f"M={n}" for n in range(200)]
    first.ledger.store = _Slow()
    _decide(first, keys)
    _decide(second, keys, SIG_B)
    owner = threading.Thread(target=first.flush)
    owner.start()
    while not bytes(first._store.compare_set(_claim_key(1, keys), "", "")):
        time.sleep(0.01)  # the claim is in; the reference or the texts are not
    if slow == "set":
        before = store.total()
        second.flush()  # only the claim came back: no wait, no flag poll, a flush at the next launch
        assert store.total() - before == 3 and pinning.flush_pending  # claim, dedup add, rows (absent)
        assert second.ledger is not None and list(second.ledger.deferred) == [1]
    threading.Timer(0.2, released.set).start()
    with pytest.raises(DivergenceError) as raised:
        if then == "close":
            second.stop()
        elif slow == "set":
            time.sleep(0.3)  # the owner published; the next launch runs the re-requested flush
            second.flush()
        else:
            second.flush()  # the rows are there: compared now; the message waits for the texts
    owner.join()
    assert raised.value.key in keys and raised.value.signatures == {0: SIG_A, 1: SIG_B}


def test_a_claim_whose_owner_never_publishes_is_named_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_tuning.distributed import digest

    monkeypatch.setattr(digest, "REFERENCE_WAIT_S", 0.3)
    first, second = _ranks(2)
    keys = [f"M={n}" for n in range(200)]
    rows = sorted(digest.row_of(_d(k, SIG_B)) for k in keys)
    kind, summary = digest.summarize(rows)
    claim = digest._CLAIM.pack(b"C", 0, 1, len(rows), digest.batch_digest(rows)) + kind + summary
    first._store.compare_set(_claim_key(1, keys), "", claim)  # then it died
    _decide(second, keys)  # differs in every row: the summary cannot tell how, the rows are needed
    second.flush()  # deferred to the next launch: a flush never waits
    with pytest.raises(StoreRecordError, match=r"no reference for flush #1 after 0.3 s"):
        second.stop()  # close does, for a bounded time


def test_a_closing_rank_learns_of_a_divergence_from_its_close_count() -> None:
    first, second, third = _ranks(3)
    _decide(first, ["M=1"])
    second.check(_d("M=1", SIG_B))
    _decide(third, ["M=1"])
    first.flush()
    third.flush()  # the reference's own batch: nothing to compare, and no divergence yet
    with pytest.raises(DivergenceError):
        second.flush()
    with pytest.raises(DivergenceError) as raised:
        third.stop()  # nothing pending: the close count's reply carries the divergence mark
    assert raised.value.key == "M=1" and raised.value.signatures == {0: SIG_A, 1: SIG_B}


def test_a_divergence_mark_without_a_record_is_a_store_record_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_tuning.distributed import digest

    monkeypatch.setattr(agreement, "REFERENCE_WAIT_S", 0.3)
    (checker,) = _ranks(1)
    checker._store.add("closed", digest.DIVERGED)  # its recorder died before writing the record
    with pytest.raises(StoreRecordError, match="a divergence mark but no divergence record"):
        checker.stop()


def test_the_log_reader_is_the_groups_first_rank() -> None:
    store = dist.HashStore()
    policy = TuningPolicy(agreement="digest")
    ranks = [
        agreement.AgreementChecker(policy, store=store, rank=r, ranks=range(4, 8), namespace="g")
        for r in range(4, 8)
    ]
    for checker in ranks:
        _decide(checker, [f"M={n}" for n in range(5)])
    ranks[1].check(_d("seq=9", SIG_A))
    ranks[2].check(_d("seq=9", SIG_B))
    for checker in (ranks[3], ranks[1], ranks[2]):  # rank 7's batch is the reference
        checker.flush()
    with pytest.raises(DivergenceError) as raised:
        ranks[0].flush()  # global rank 4 reads the log at its flush
    assert raised.value.key == "seq=9" and raised.value.signatures == {5: SIG_A, 6: SIG_B}


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("log", b"\x01\x00", "truncated record header"),
        ("log", b"\x01\x00\x00\x00\x01\x00\x00\x00\x09\x00\x00\x00\x00\x00\x00\x00", "a record of 9 rows"),
        ("ref", b"hello, not a claim", "not a reference claim"),
    ],
)
def test_garbage_under_the_digest_keys_is_a_store_record_error(key: str, value: bytes, problem: str) -> None:
    first, second = _ranks(2)
    second._store.set(_claim_key(1, ["M=1"]) if key == "ref" else key, value)
    if key == "ref":  # a flush with rows reads the reference; rank 0 reads the log anyway
        first.check(_d("M=1"))
    with pytest.raises(StoreRecordError, match=problem):
        first.flush()


def test_garbage_texts_in_the_log_are_a_store_record_error() -> None:
    from megatron_tuning.distributed.digest import decode_texts, texts_blob

    assert decode_texts(texts_blob([_d("M=1")]), 1, "t") == [(KERNEL, "M=1", SIG_A)]
    with pytest.raises(ValueError, match="not zlib data"):
        decode_texts(b"plain", 1, "t")
    with pytest.raises(ValueError, match="texts for 1 rows, not 2"):
        decode_texts(texts_blob([_d("M=1")]), 2, "t")
    import zlib

    with pytest.raises(ValueError, match="nested deeper"):
        decode_texts(zlib.compress(b"[[[[1]]]]"), 1, "t")
    with pytest.raises(ValueError, match="expected three strings"):
        decode_texts(zlib.compress(b'[["a", 2, "c"]]'), 1, "t")


# -- the alarm (no flag poll per flush), summaries and buckets -------------------------------


def test_flushes_and_closes_without_a_divergence_never_read_the_flag() -> None:
    ranks = _ranks(4)
    shared = [f"M={n}" for n in range(50)]
    for checker in ranks:
        _decide(checker, shared + [f"own={checker.rank}"])
    for checker in ranks:
        checker.flush()
    for checker in ranks:
        checker.stop()
    # Reading the flag is compare_set(flag, "", ""), which would leave the key behind.
    assert not ranks[0]._store.check(["divergence"])


def test_ranks_behind_and_ahead_of_the_finder_learn_from_the_alarm_at_their_next_flush() -> None:
    ahead, finder, behind = _ranks(3)
    for n in range(3):  # rank 0 is three flushes ahead; its flush #1 is the reference
        ahead.check(_d(f"M={n}"))
        ahead.flush()
    finder.check(_d("M=0", SIG_B))
    with pytest.raises(DivergenceError) as found:
        finder.flush()  # differs from the reference of flush #1: recorded, alarm sounded
    behind.check(_d("M=0"))
    with pytest.raises(DivergenceError) as at_behind:
        behind.flush()  # flush #1: the claim key carries the alarm
    ahead.check(_d("M=9"))
    with pytest.raises(DivergenceError) as at_ahead:
        ahead.flush()  # flush #4, never claimed: the alarm alone is there
    assert str(at_behind.value) == str(at_ahead.value) == str(found.value)
    assert found.value.signatures == {0: SIG_A, 1: SIG_B}


def test_a_rank_further_ahead_than_the_alarm_learns_at_close(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_tuning.distributed import digest

    monkeypatch.setattr(digest, "ALARM_AHEAD", 1)
    ahead, finder = _ranks(2)
    for n in range(4):
        ahead.check(_d(f"M={n}"))
        ahead.flush()
    finder.check(_d("M=0", SIG_B))
    with pytest.raises(DivergenceError):
        finder.flush()  # marks flushes #1 and #2 only
    ahead.check(_d("M=9"))
    ahead.flush()  # flush #5: unmarked, and a flush reads no flag
    with pytest.raises(DivergenceError) as at_close:
        ahead.stop()  # the close count's reply carries the mark
    assert at_close.value.key == "M=0"


@pytest.mark.parametrize("summaries", ["decoded", "never decoded"])
@pytest.mark.parametrize("buckets", [1, 64])
def test_summaries_and_buckets_only_save_requests_never_change_what_is_compared(
    monkeypatch: pytest.MonkeyPatch, summaries: str, buckets: int
) -> None:
    """Decoded from the claim or fetched, one bucket or many: the same divergence reaches every rank."""
    from megatron_tuning.distributed import digest

    monkeypatch.setattr(digest, "BUCKETS", buckets)
    if summaries == "never decoded":
        monkeypatch.setattr(digest, "difference", lambda *args: None)
    ranks = _ranks(4)
    ranks[1].check(_d("M=5", SIG_B))  # the reference has M=5 with SIG_A
    for checker in ranks:
        _decide(checker, [f"M={n}" for n in range(20)] + [f"own={checker.rank}"])
    ranks[2].check(_d("M=3x", SIG_A))
    ranks[3].check(_d("M=3x", SIG_B))  # only ranks 2 and 3 have it: in the log (found later)
    errors = []
    for checker in ranks:
        try:
            checker.flush()
        except DivergenceError as error:
            errors.append(error)
    for checker in ranks:
        try:
            checker.stop()
        except DivergenceError as error:
            errors.append(error)
    assert len(errors) >= 4  # every rank raised, at its flush or at close
    # The first divergence recorded wins: every rank names the same one, whichever was found first.
    named = {(e.key, tuple(sorted(e.signatures.values()))) for e in errors}
    assert len(named) == 1
    assert named <= {("M=5", (SIG_B, SIG_A)), ("M=3x", (SIG_B, SIG_A))}


def test_batches_that_share_most_rows_meet_in_one_bucket_and_pipeline_stages_do_not() -> None:
    from megatron_tuning.distributed.digest import BUCKETS, bucket_of, row_of

    def bucket(keys: list[str]) -> int:
        return bucket_of(sorted(row_of(_d(k)) for k in keys))

    # The benchmark's workloads (benchmarks/bench_scale.py): 2,000 keys, 100 of a rank's own.
    shared = [f"M={n}, N=4096, K=4096" for n in range(1900)]
    varlen = [bucket(shared + [f"seqlen={rank * 100 + n}" for n in range(100)]) for rank in range(200)]
    majority = max(set(varlen), key=varlen.count)
    assert varlen.count(majority) >= 0.9 * len(varlen)  # a rank's own rows hold the minimum 5% of the time
    stages = {bucket([f"stage={s}, M={n}" for n in range(2000)]) for s in range(4)}
    assert len(stages) == 4 and BUCKETS == 64


def test_a_pipeline_stage_in_a_bucket_of_its_own_costs_its_ranks_one_request() -> None:
    from megatron_tuning.distributed.digest import bucket_of, row_of

    stage_keys = {s: [f"stage={s}, M={n}" for n in range(300)] for s in range(4)}
    buckets = {bucket_of(sorted(row_of(_d(k)) for k in keys)) for keys in stage_keys.values()}
    assert len(buckets) == 4  # these four stages land in four buckets
    store = Counter()
    ranks = _ranks(8, store)
    for checker in ranks:
        _decide(checker, stage_keys[checker.rank % 4])
    for checker in ranks[:4]:
        checker.flush()  # each is the first of its stage, so its bucket's reference
    before = store.calls.get("compare_set", 0), store.calls.get("add", 0)
    for checker in ranks[4:]:
        checker.flush()
    # One claim each, whose reply is their own stage's reference: no dedup add, no rows fetched.
    assert (store.calls["compare_set"] - before[0], store.calls.get("add", 0) - before[1]) == (4, 0)
    assert sorted(rank for rank, _, _ in _log_records(ranks[0])) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (
            b"C" + bytes(8) + b"\x05\0\0\0" + bytes(16) + b"R" + bytes(8),
            "a claim of 5 rows with 8 summary bytes",
        ),
        (b"C" + bytes(8) + b"\x01\0\0\0" + bytes(16) + b"R" + bytes(32) + b"!?", "summary bytes"),
        (b"C" + bytes(8) + b"\x01\0\0\0" + bytes(16) + b"X" + bytes(32), "a summary of kind b'X'"),
        (b"C" + bytes(8) + b"\0\0\0\0" + bytes(16) + b"R", "a claim of 0 rows"),
        (b"C" + bytes(8) + b"\xff\xff\0\0" + bytes(16) + b"I" + bytes(64), "a claim of 65535 rows"),
    ],
)
def test_a_claim_with_a_torn_summary_is_a_store_record_error(value: bytes, problem: str) -> None:
    first, second = _ranks(2)
    second._store.set(_claim_key(1, ["M=1"]), value)
    first.check(_d("M=1"))
    with pytest.raises(StoreRecordError, match=problem):
        first.flush()


def test_a_summary_that_does_not_decode_falls_back_to_the_reference_rows() -> None:
    """A forged table (all zeros): the rank fetches the rows instead, and still finds the divergence."""
    from megatron_tuning.distributed import digest

    keys = [f"M={n}" for n in range(200)]
    first, second = _ranks(2)
    _decide(first, keys)
    first.flush()
    claim_key = _claim_key(1, keys)
    claim = bytes(first._store.compare_set(claim_key, "", ""))
    forged = claim[:30] + bytes(len(claim) - 30)  # an all-zero table: nothing to peel
    first._store.set(claim_key, forged)
    second.check(_d("M=7", SIG_B))
    _decide(second, keys)
    with pytest.raises(DivergenceError) as raised:
        second.flush()
    assert raised.value.key == "M=7" and raised.value.signatures == {0: SIG_A, 1: SIG_B}
    assert digest.parse_claim(forged, "t").count == 200
