"""auto's consensus as one rank sees it: one-request lookups, checked records, proposed cache hits.

Several fake ranks share one in-memory store (no process group); real kernels run in the
interpreter with a fake measurement. The torchrun races are in ``tests_distributed/``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_tuning.core.errors import ConsensusError, PolicyError
from megatron_tuning.core.identity import (
    arch_tag,
    config_data,
    config_signature,
    kernel_id,
    kernel_source_hash,
)
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.distributed import store as kv
from megatron_tuning.distributed.store import StoreConsensus
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


def ranks(count: int, store: Any = None, caches: dict[int, str] | None = None) -> list[StoreConsensus]:
    store = store if store is not None else dist.HashStore()
    caches = caches or {}
    return [StoreConsensus(store=store, rank=r, world=count, local_cache=caches.get(r)) for r in range(count)]


def _store_key(kernel: str, key: str, arch: str) -> str:
    return "d/" + kv.identity_digest(kernel, key, arch).hex()


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
        (b"\xff\xfe", "not the library's JSON"),
        ('{"config": {}, "signature": "s", "rank": Infinity}', "Infinity"),
        ("[" * 5000 + "]" * 5000, "not the library's JSON"),
        ('{"config": {}, "signature": "s", "rank": 1.9}', "1.9"),
        ('{"config": {}, "signature": "s", "rank": true}', "True"),
        ('{"config": {}, "signature": "s", "rank": -7}', "-7"),
        ('{"config": {}, "signature": "s", "rank": 99}', "99"),
        ('{"config": [], "signature": "s", "rank": 0}', "config"),
        ('"just text"', "not a JSON object"),
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


def cached(tmp_path: Any, rank: int, blocks: dict[int, int]) -> tuple[str, TableSet]:
    """Rank ``rank``'s cache file holding ``blocks``, and the search path that reads it."""
    path = str(tmp_path / f"cache{rank}.msgpack")
    return path, TableSet([], cache=(path, cache_table(blocks)))


def test_a_cache_hit_in_a_job_is_proposed_with_one_request_and_the_others_adopt_it(tmp_path: Any) -> None:
    path, table = cached(tmp_path, 0, {100: 64})
    r0, r1 = ranks(2, caches={0: path})
    counting = r0._store = Counting(r0._store)
    hit, timings = choose(r0, FakeMeasure(block=16), table=table)
    assert (hit.source, block(hit), timings, counting.calls) == ("table", 64, None, 1)
    measure = FakeMeasure(block=16)  # rank 1's cache is empty: it adopts the proposal, measures nothing
    follower, _ = choose(r1, measure)
    assert (follower.source, block(follower), measure.calls) == ("adopted", 64, [])


@pytest.mark.parametrize("second_has", ["empty", "other config", "tuned first"])
def test_ranks_with_different_caches_launch_one_config_per_key(tmp_path: Any, second_has: str) -> None:
    path0, table0 = cached(tmp_path, 0, {100: 64})
    path1, table1 = cached(tmp_path, 1, {100: 16} if second_has == "other config" else {})
    r0, r1 = ranks(2, caches={0: path0, 1: path1})
    if second_has == "tuned first":  # rank 1 (no cache entry) tunes and publishes before rank 0 proposes
        first = choose(r1, FakeMeasure(block=128), table=table1)[0]
        second = choose(r0, FakeMeasure(block=8), table=table0)[0]
        assert (second.source, second.origin) == ("adopted", "rank 1")
    else:
        first = choose(r0, FakeMeasure(block=8), table=table0)[0]
        second = choose(r1, FakeMeasure(block=8), table=table1)[0]
    assert block(first) == block(second)


def test_an_explicit_table_hit_is_an_input_every_rank_shares_and_is_not_proposed(tmp_path: Any) -> None:
    explicit = tmp_path / "explicit.msgpack"
    from megatron_tuning.tables.table import save_table

    save_table(cache_table({100: 64}), explicit)
    (r0,) = ranks(1, caches={0: str(tmp_path / "cache0.msgpack")})
    counting = r0._store = Counting(r0._store)
    choice, _ = choose(r0, FakeMeasure(block=16), table=TableSet([explicit]))
    assert (choice.source, block(choice), counting.calls) == ("table", 64, 0)


def test_auto_refuses_a_job_above_its_cap_naming_the_flow(monkeypatch: Any) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: kv.AUTO_MAX_RANKS + 1)
    with pytest.raises(PolicyError) as raised:
        kv.start_consensus(None)
    message = str(raised.value)
    for part in (
        "megatron_tuning tune",
        "show",
        "MEGATRON_TUNING_MODE=deterministic",
        str(kv.AUTO_MAX_RANKS),
    ):
        assert part in message
