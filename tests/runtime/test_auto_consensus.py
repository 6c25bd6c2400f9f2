"""auto's consensus as one rank sees it: one-request lookups, checked records, one job cache.

Several fake ranks share one in-memory store (no process group); real kernels run in the
interpreter with a fake measurement. The torchrun races are in ``tests_distributed/``.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_tuning.core.errors import ConsensusError, StoreRecordError
from megatron_tuning.core.identity import (
    arch_tag,
    config_data,
    config_signature,
    kernel_id,
    kernel_source_hash,
)
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.distributed import consensus as consensus_module
from megatron_tuning.distributed.consensus import StoreConsensus, _store_key
from megatron_tuning.distributed.tier import NodeTier
from megatron_tuning.runtime.auto import auto_choice
from megatron_tuning.tables.entry import Entry
from megatron_tuning.tables.search import TableSet, installed_triton_version
from megatron_tuning.tables.table import Table

from .. import support_kernels as sk
from .test_auto import FakeMeasure, key

KERNEL = kernel_id(sk.scale_add)
ARCH = arch_tag()  # what the lookup uses ("unknown" in the interpreter)


class Counting:
    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.calls += 1
            return method(*args)

        return counted


def ranks(count: int, store: Any = None) -> list[StoreConsensus]:
    store = store if store is not None else dist.HashStore()
    return [StoreConsensus(store, rank=r, namespace="t", world=count) for r in range(count)]


def choose(consensus: StoreConsensus, measure: FakeMeasure, n: int = 100, table: Any = None):
    x = torch.zeros(n)
    return auto_choice(
        sk.scale_add,
        list(sk.ADD_CONFIGS),
        key(n),
        ((x, x, x, n, 0.5), {}),
        kernel=KERNEL,
        arch=ARCH,
        policy=TuningPolicy(mode="auto", use_shipped_tables=False),
        table=table,
        measure=measure,
        consensus=consensus,
    )


def block(choice: Any) -> int:
    return int(choice.config.kwargs["BLOCK_SIZE"])


def test_a_lookup_is_one_request_and_adopting_costs_one_per_key() -> None:
    first, second = ranks(2)
    choose(first, FakeMeasure(block=64))
    counting = second._store = Counting(second._store)
    choice, _ = choose(second, FakeMeasure(block=16))
    assert (choice.source, block(choice)) == ("adopted", 64)
    assert counting.calls == 1


def test_a_foreign_record_naming_this_rank_with_another_config_is_adopted_not_taken_for_ours() -> None:
    rank0, rank1 = ranks(2)
    config = config_data(next(c for c in sk.ADD_CONFIGS if c.kwargs["BLOCK_SIZE"] == 64))
    record = {"config": config, "signature": config_signature(config), "rank": 1}
    rank1._store.set(_store_key(KERNEL, key(100), ARCH), json.dumps(record))

    # Rank 1's lookup sees the record: it must launch 64 (what the store says), like rank 0 will.
    choice, _ = choose(rank1, FakeMeasure(block=16))
    assert (choice.source, block(choice)) == ("adopted", 64)
    assert "names this rank" in str(choice.origin)
    other, _ = choose(rank0, FakeMeasure(block=16))
    assert block(other) == 64


def test_publish_compares_the_published_signature_not_the_rank() -> None:
    """A foreign record naming this rank appears while it measures: it is adopted, not taken for ours."""
    (rank0,) = ranks(1)
    config = config_data(next(c for c in sk.ADD_CONFIGS if c.kwargs["BLOCK_SIZE"] == 64))
    foreign = json.dumps({"config": config, "signature": config_signature(config), "rank": 0})

    class ForeignWriter(FakeMeasure):
        def __call__(self, *args: Any) -> Any:
            rank0._store.set(_store_key(KERNEL, key(100), ARCH), foreign)
            return super().__call__(*args)

    choice, timings = choose(rank0, ForeignWriter(block=16))
    assert timings is not None  # it measured, then found the store holding another config
    assert (choice.source, block(choice)) == ("adopted", 64)


@pytest.mark.parametrize(
    "raw, shown",
    [
        (b"\xff\xfe", "not UTF-8"),
        ('{"config": {}, "signature": "s", "rank": Infinity}', "Infinity"),
        ("[" * 100 + "]" * 100, "nested"),
        ('{"config": {}, "signature": "s", "rank": 1.9}', "1.9"),
        ('{"config": {}, "signature": "s", "rank": true}', "True"),
        ('{"config": {}, "signature": "s", "rank": -7}', "-7"),
        ('{"config": {}, "signature": "s", "rank": 99}', "99"),
        ('{"config": [], "signature": "s", "rank": 0}', "config"),
        ('"just text"', "not an object"),
        ('{"config": {}, "signature": "s", "rank": 0, "time": "noon"}', "time"),
    ],
)
def test_garbage_under_a_decision_key_is_a_consensus_error_naming_kernel_key_and_value(
    raw: Any, shown: str
) -> None:
    rank0, _ = ranks(2)
    rank0._store.set(_store_key(KERNEL, key(100), ARCH), raw)
    with pytest.raises(ConsensusError) as caught:
        choose(rank0, FakeMeasure())
    assert caught.value.kernel == KERNEL and caught.value.key == key(100)
    assert shown in str(caught.value)


def cache_table(blocks: dict[int, int]) -> Table:
    """A cache holding, for each n, the config with BLOCK_SIZE=blocks[n]."""
    entries = []
    for n, size in blocks.items():
        config = next(c for c in sk.ADD_CONFIGS if c.kwargs["BLOCK_SIZE"] == size)
        entries.append(
            Entry(
                arch=ARCH,
                kernel=KERNEL,
                key=key(n),
                config=config_data(config),
                how="tuned",
                source_hash=kernel_source_hash(sk.scale_add),
                triton_version=installed_triton_version(),
            )
        )
    return Table(entries, meta={"kind": "auto-cache"})


def test_ranks_with_equal_caches_trust_their_hits_with_no_request(tmp_path: Any) -> None:
    store = dist.HashStore()
    r0, r1 = ranks(2, store)
    for rank in (r0, r1):
        view = rank.reconcile_cache(str(tmp_path / f"c{rank.rank}.msgpack"), cache_table({100: 64}))
        assert not view.differs
    counting = r1._store = Counting(r1._store)
    table = TableSet([], cache=(str(tmp_path / "c1.msgpack"), cache_table({100: 64})))
    choice, _ = choose(r1, FakeMeasure(block=16), table=table)
    assert (choice.source, block(choice), counting.calls) == ("table", 64, 0)


def test_a_rank_whose_cache_differs_launches_the_jobs_entries_and_proposes_its_own(tmp_path: Any) -> None:
    store = dist.HashStore()
    r0, r1 = ranks(2, store)
    job = cache_table({100: 64})
    mine = cache_table({100: 16, 200: 128})  # 100 disagrees with the job's cache, 200 is ours alone
    r0.reconcile_cache(str(tmp_path / "c0.msgpack"), job)
    path = str(tmp_path / "c1.msgpack")
    view = r1.reconcile_cache(path, mine)
    assert view.differs and view.local_only == {(ARCH, KERNEL, key(200))}
    table1 = TableSet([], cache=(path, mine))
    adopted, timings = choose(r1, FakeMeasure(block=8), 100, table=table1)
    assert (adopted.source, block(adopted), timings) == ("adopted", 64, None)
    assert "the job's auto cache (rank 0's)" in adopted.origin
    proposed, _ = choose(r1, FakeMeasure(block=8), 200, table=table1)
    assert (proposed.source, block(proposed)) == ("table", 128) and "proposed to the job" in proposed.origin
    # Rank 0's cache lacks 200: its miss finds rank 1's proposal, and it measures nothing.
    measure = FakeMeasure(block=8)
    table0 = TableSet([], cache=(str(tmp_path / "c0.msgpack"), job))
    follower, _ = choose(r0, measure, 200, table=table0)
    assert (follower.source, block(follower), measure.calls) == ("adopted", 128, [])


def test_an_unreadable_job_cache_upload_fails_at_start_naming_it(tmp_path: Any) -> None:
    store = dist.HashStore()
    r0, r1 = ranks(2, store)
    r0.reconcile_cache(str(tmp_path / "c0.msgpack"), cache_table({100: 64}))
    record = json.loads(bytes(r0._store.get("cache/first")).decode())
    r0._store.set(f"cache/blob/{record['digest']}", b"not a table")
    with pytest.raises(StoreRecordError, match="job's auto cache"):
        r1.reconcile_cache(str(tmp_path / "c1.msgpack"), cache_table({100: 16}))


# --- the node tier: one request per node and key (issue 15.3) --------------------------------


class LockedCounting(Counting):
    """``Counting`` for ranks in threads, with the requests it saw by method."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.lock, self.methods = threading.Lock(), []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            with self.lock:
                self.calls += 1
                self.methods.append(name)
            return method(*args)

        return counted


class Job:
    """One in-memory store for simulated nodes; ``requests`` counts what reaches it from all of them."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.requests: LockedCounting | None = None

    def node(self, folder: Any, first: int, count: int, world: int = 16) -> list[StoreConsensus]:
        """``count`` ranks from ``first`` on, sharing the node folder ``folder``."""
        folder.mkdir(mode=0o700)
        ranks = [
            StoreConsensus(
                self.store,
                rank=r,
                namespace="t",
                world=world,
                tier=NodeTier(folder, rank=r, owner=r == first),
            )
            for r in range(first, first + count)
        ]
        if self.requests is None:  # every rank's prefix store is alike: one counted copy for all
            self.requests = LockedCounting(ranks[0]._store)
        for rank in ranks:
            rank._store = self.requests
        return ranks


class SlowMeasure(FakeMeasure):
    """A fake tuning that takes a while, so node-mates that started together all miss."""

    def __init__(self, block: int, seconds: float = 0.05) -> None:
        super().__init__(block)
        self.seconds = seconds

    def __call__(self, *args: Any) -> Any:
        time.sleep(self.seconds)
        return super().__call__(*args)


def test_a_node_in_lockstep_makes_one_request_per_key_and_launches_one_config(tmp_path: Any) -> None:
    """Eight node-mates reach five new keys together: five publish-or-adopt requests, no lookup."""
    job = Job()
    mates = job.node(tmp_path / "node0", 0, 8)
    store = job.requests
    blocks = [8, 16, 32, 64, 128, 8, 16, 32]  # every rank's own tuning picks another config
    start = threading.Barrier(8)
    chosen: dict[int, list[tuple[int, str]]] = {}

    def rank(consensus: StoreConsensus) -> None:
        start.wait()
        measure = SlowMeasure(blocks[consensus.rank])
        chosen[consensus.rank] = []
        for n in (100, 200, 300, 400, 500):
            choice, _ = choose(consensus, measure, n)
            chosen[consensus.rank].append((block(choice), choice.source))

    threads = [threading.Thread(target=rank, args=(c,)) for c in mates]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (store.calls, set(store.methods)) == (5, {"compare_set"})
    for i in range(5):
        picks = [chosen[r][i] for r in range(8)]
        assert len({b for b, _ in picks}) == 1, picks  # one config per key on the whole node
        assert sorted(s for _, s in picks).count("tuned") == 1  # the node's claimer won the store


def test_publish_or_adopt_the_first_node_wins_a_later_node_tunes_then_adopts(tmp_path: Any) -> None:
    """Both outcomes of the one request; the price: the later node measures before it adopts."""
    job = Job()
    a0, a1 = job.node(tmp_path / "a", 0, 2)
    b0, b1 = job.node(tmp_path / "b", 8, 2)
    store = job.requests
    won, timings = choose(a0, FakeMeasure(block=64))
    assert (won.source, block(won), timings is not None, store.calls) == ("tuned", 64, True, 1)
    late = FakeMeasure(block=16)
    adopted, timings = choose(b0, late)
    assert (adopted.source, block(adopted), adopted.origin) == ("adopted", 64, "rank 0")
    assert timings is not None and late.calls == [key(100)]  # it tuned what node a had published
    assert store.calls == 2  # one request per node and key: no lookup before tuning
    # Node-mates arriving later find the node's answer in its folder: no request, no measurement.
    for mate in (a1, b1):
        measure = FakeMeasure(block=8)
        choice, timings = choose(mate, measure)
        assert (choice.source, block(choice), timings, measure.calls) == ("adopted", 64, None, [])
    assert store.calls == 2


def test_a_node_that_fell_behind_looks_up_first_until_a_lookup_misses(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node b starts after node a published three keys: it tunes the first (its winner is older
    than b's tuning), then looks up and adopts the next two without tuning, one request each; a
    key nobody published makes its lookup miss, and b goes back to publishing without a lookup."""
    monkeypatch.setattr(consensus_module, "LATE_S", 0.0)  # "older than b's tuning" at any age
    job = Job()
    (a0,) = job.node(tmp_path / "a", 0, 1)
    b0, b1 = job.node(tmp_path / "b", 8, 2)
    for n in (100, 200, 300):
        choose(a0, FakeMeasure(block=64), n)
    store = job.requests
    assert store is not None and store.calls == 3
    measure = FakeMeasure(block=16)
    steps = []
    for n in (100, 200, 300, 400, 500):
        before = store.calls
        choice, _ = choose(b0, measure, n)
        steps.append((n, choice.source, block(choice), store.calls - before))
    assert steps == [
        (100, "adopted", 64, 1),  # the price: tuned, then its publish-or-adopt found a's record
        (200, "adopted", 64, 1),  # looked up first: a hit, no tuning, no publish
        (300, "adopted", 64, 1),
        (400, "tuned", 16, 2),  # the lookup missed (b caught up), then b published
        (500, "tuned", 16, 1),  # publish-or-adopt only again
    ]
    assert measure.calls == [key(100), key(400), key(500)]
    # b's node-mate finds every answer in the folder (lookups' hits as well): no request, no tuning.
    mate = FakeMeasure(block=8)
    for n in (100, 200, 300, 400, 500):
        choose(b1, mate, n)
    assert mate.calls == [] and store.calls == 3 + 6


def test_a_winner_from_the_same_burst_keeps_the_node_publishing_without_lookups(tmp_path: Any) -> None:
    job = Job()
    (a0,) = job.node(tmp_path / "a", 0, 1)
    (b0,) = job.node(tmp_path / "b", 8, 1)
    choose(a0, FakeMeasure(block=64), 100)
    choice, _ = choose(b0, FakeMeasure(block=16), 100)  # a published within LATE_S of b's tuning
    assert choice.source == "adopted" and not b0.look_first


def test_a_rank_never_waits_for_a_node_mate_tuning_the_same_key(tmp_path: Any) -> None:
    """Rank 1 is stuck inside its tuning of the key (say behind a collective): rank 0 decides alone."""
    job = Job()
    r0, r1 = job.node(tmp_path / "n", 0, 2)
    store = job.requests
    release = threading.Event()

    class Stuck(FakeMeasure):
        def __call__(self, *args: Any) -> Any:
            release.wait(30)
            return super().__call__(*args)

    stuck = threading.Thread(target=choose, args=(r1, Stuck(block=16)))
    stuck.start()
    try:
        t0 = time.monotonic()
        choice, _ = choose(r0, FakeMeasure(block=64))
        assert time.monotonic() - t0 < 5.0  # the tier's bounded wait is 10 s; a wait on rank 1: 30 s
        assert (choice.source, block(choice), store.calls) == ("tuned", 64, 1)
    finally:
        release.set()
        stuck.join()
    assert store.calls == 1  # rank 1's publish found rank 0's answer in the folder


def test_garbage_in_the_store_reaches_every_node_mate_as_a_consensus_error(tmp_path: Any) -> None:
    job = Job()
    r0, r1 = job.node(tmp_path / "n", 0, 2)
    r0._store.set(_store_key(KERNEL, key(100), ARCH), b"\xff\xfe")
    for rank in (r0, r1):  # r1 decodes the answer r0's request left in the folder
        with pytest.raises(ConsensusError, match="not UTF-8") as caught:
            choose(rank, FakeMeasure())
        assert caught.value.kernel == KERNEL and caught.value.key == key(100)


def test_a_nodes_ranks_with_one_cache_offer_it_with_one_request(tmp_path: Any) -> None:
    """Reconcile through the tier: one offer per node; only the rank the job's record names uploads;
    another node whose cache differs still downloads it and launches the job's entries."""
    job = Job()
    mates = job.node(tmp_path / "a", 0, 8)
    store = job.requests
    views = [m.reconcile_cache(str(tmp_path / "cache.msgpack"), cache_table({100: 64})) for m in mates]
    assert not any(v.differs for v in views)
    assert store.methods == ["compare_set", "set"]  # the node's offer, then rank 0's upload
    (other,) = job.node(tmp_path / "b", 8, 1)
    path = str(tmp_path / "other.msgpack")
    view = other.reconcile_cache(path, cache_table({100: 16}))
    assert view.differs and view.job is not None and len(view.job) == 1
    choice, timings = choose(
        other, FakeMeasure(block=8), table=TableSet([], cache=(path, cache_table({100: 16})))
    )
    assert (choice.source, block(choice), timings) == ("adopted", 64, None)
