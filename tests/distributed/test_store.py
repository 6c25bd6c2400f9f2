"""The job's store in one process (fake ranks share one in-memory store): the claim primitive, the
barrier, the digests, and chaos through the real store protocol.

For chaos, each fake rank picks through ``distributed.store.StoreChaos`` and checks through the real
``AgreementChecker`` (store mode), both over one ``HashStore``, for a matrix of layouts, config
counts (duplicates included) and arrival orders: in every group of two or more ranks chaos must be
caught, i.e. every rank of it raises ``DivergenceError`` (at its first use or at its next poll).
"""

from __future__ import annotations

import random
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

dist = pytest.importorskip("torch.distributed")

import triton

from megatron_tuning.core.chaos import choose_chaos
from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.errors import AgreementTimeoutError, DivergenceError, StoreError
from megatron_tuning.core.identity import config_signature
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.distributed import agreement, store
from megatron_tuning.distributed.store import StoreChaos, identity_digest, scope_id

KERNEL = "pkg.kernels:matmul"
KEY = "M=6 | a:torch.int8"


def _configs(distinct: int, duplicated: bool) -> list[triton.Config]:
    base = [triton.Config({"BLOCK": 16 << i}, num_warps=4) for i in range(distinct)]
    return base + base[:2] if duplicated else base


def _layouts(world: int) -> Iterator[tuple[str, list[list[int]]]]:
    ranks = list(range(world))
    yield "world", [ranks]
    if world > 2:
        yield "pairs", [ranks[i : i + 2] for i in range(0, world, 2)]
    for stages in range(2, 9):
        if stages < world:
            yield f"stage=rank%{stages}", [[r for r in ranks if r % stages == s] for s in range(stages)]


def _run_group(group: list[int], order: list[int], configs: list[triton.Config]) -> dict[int, str]:
    """Every rank of ``group`` reaches (KERNEL, KEY) in ``order``; return what each rank raised."""
    store = dist.HashStore()
    policy = TuningPolicy(mode="chaos", agreement="store")
    checkers = {r: agreement.AgreementChecker(policy, store=store, rank=r, ranks=group) for r in group}
    raised: dict[int, str] = {}
    for rank in order:
        coordinator = StoreChaos(store=store, rank=rank, ranks=group, namespace="t")
        choice = choose_chaos(KERNEL, KEY, configs, rank=rank, coordinator=coordinator)
        decision = Decision(
            kernel=KERNEL, key=KEY, signature=config_signature(choice.config), source="chaos", rank=rank
        )
        try:
            checkers[rank].check(decision)
        except DivergenceError as error:
            raised[rank] = str(error)
    for rank in group:  # the first claimer learns at its next check (here: a poll)
        if rank not in raised:
            try:
                checkers[rank].poll()
            except DivergenceError as error:
                raised[rank] = str(error)
    return raised


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 16])
def test_chaos_is_caught_on_every_rank_of_every_group(world: int) -> None:
    for distinct in (2, 3, 4, 5):
        for duplicated in (False, True):
            configs = _configs(distinct, duplicated)
            for name, groups in _layouts(world):
                for group in groups:
                    if len(group) < 2:
                        continue
                    shuffled = list(group)
                    random.Random(zlib.crc32(f"{world}/{name}/{group}".encode())).shuffle(shuffled)
                    for order in (group, list(reversed(group)), shuffled):
                        raised = _run_group(group, order, configs)
                        assert sorted(raised) == group, (name, distinct, duplicated, order, raised)
                        assert len(set(raised.values())) == 1  # one diagnosis, the same everywhere


def test_without_the_coordinator_the_strided_layout_is_blind() -> None:
    """The control: the rank formula alone lets ranks 0 and 4 (stage 0 of rank % 4) agree on 4 configs."""
    configs = _configs(4, False)
    picks = {r: config_signature(choose_chaos(KERNEL, KEY, configs, rank=r).config) for r in (0, 4)}
    assert picks[0] == picks[4]
    assert sorted(_run_group([0, 4], [4, 0], configs)) == [0, 4]


def test_claims_are_scoped_by_namespace_and_group() -> None:
    store = dist.HashStore()
    first = StoreChaos(store=store, rank=0, ranks=[0, 1], namespace="a")
    assert first.claim(KERNEL, KEY, "sm90", "S0") == first.claim(KERNEL, KEY, "sm90", "S9")
    other_session = StoreChaos(store=store, rank=1, ranks=[0, 1], namespace="b")
    # A group object (any, with its ranks given) scopes the claims to that group.
    other_group = StoreChaos(object(), store=store, rank=1, ranks=[1, 2], namespace="a")
    other_arch = StoreChaos(store=store, rank=1, ranks=[0, 1], namespace="a")
    for coordinator in (other_session, other_group):
        claim = coordinator.claim(KERNEL, KEY, "sm90", "S1")
        assert claim is not None and (claim.rank, claim.signature) == (1, "S1")
    claim = other_arch.claim(KERNEL, KEY, "sm80", "S1")
    assert claim is not None and claim.rank == 1
    claim = other_arch.claim(KERNEL, KEY, "sm90", "S1")
    assert claim is not None and (claim.rank, claim.signature) == (0, "S0")


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff\xfe\n1",
        b"x\nS",
        b'{"rank": -1, "signature": "S"}',
        b'{"rank": 0}',
        b'{"rank": 1.5, "signature": "S"}',
    ],
)
def test_an_unreadable_claim_is_a_store_error_naming_kernel_and_key(garbage: bytes) -> None:
    store = dist.HashStore()
    coordinator = StoreChaos(store=store, rank=0, ranks=[0, 1], namespace="g")
    # What a foreign writer might leave under the claim key (PrefixStore nests with "/").
    raw = dist.PrefixStore(f"megatron_tuning/v2/chaos/g/{scope_id(None, [0, 1])}", store)
    raw.set("c/" + identity_digest(KERNEL, KEY, "unknown").hex(), garbage)
    with pytest.raises(StoreError, match="chaos claim of kernel") as raised:
        coordinator.claim(KERNEL, KEY, "unknown", "S0")
    assert KERNEL in str(raised.value) and KEY in str(raised.value)


def test_without_a_process_group_the_coordinator_stands_aside() -> None:
    assert not dist.is_initialized()
    coordinator = StoreChaos()
    assert coordinator.claim(KERNEL, KEY, "unknown", "S0") is None
    choice = choose_chaos(KERNEL, KEY, _configs(3, False), rank=0, coordinator=coordinator)
    assert choice.chaos == "rank_formula"


def test_a_coordinator_made_before_init_process_group_attaches_once_one_exists() -> None:
    coordinator = StoreChaos()
    assert coordinator.claim(KERNEL, KEY, "unknown", "S0") is None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        claim = coordinator.claim(KERNEL, KEY, "unknown", "S0")
        assert claim is not None and (claim.rank, claim.signature) == (0, "S0")
    finally:
        dist.destroy_process_group()


def test_recall_answers_the_last_claim_of_any_session_without_the_store() -> None:
    store = dist.HashStore()
    warm_up = StoreChaos(store=store, rank=1, ranks=[0, 1], namespace="warm")
    StoreChaos(store=store, rank=0, ranks=[0, 1], namespace="warm").claim(
        KERNEL, "recall key", "unknown", "S0"
    )
    assert warm_up.claim(KERNEL, "recall key", "unknown", "S1") == warm_up.recall(
        KERNEL, "recall key", "unknown"
    )

    class NoStore:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"store.{name} called during a capture")

    later = StoreChaos(store=NoStore(), rank=1, ranks=[0, 1], namespace="later")
    claim = later.recall(KERNEL, "recall key", "unknown")
    assert claim is not None and (claim.rank, claim.signature) == (0, "S0")
    assert later.recall(KERNEL, "never claimed", "unknown") is None


# --- the claim primitive ------------------------------------------------------------------------


def test_claim_keeps_the_first_record_and_returns_it_to_everyone() -> None:
    shared = dist.HashStore()
    assert store.claim(shared, "k", {"rank": 0, "v": "a"}, "test") == {"rank": 0, "v": "a"}
    assert store.claim(shared, "k", {"rank": 1, "v": "b"}, "test") == {"rank": 0, "v": "a"}
    assert store.peek(shared, "absent", "test") is None
    assert store.claim(shared, "absent", {"rank": 2}, "test") == {"rank": 2}  # a peek does not block it


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xfe",
        b"not json",
        b"[1, 2]",
        b"NaN",
        b"[" * 5000 + b"]" * 5000,
        b"x" * (store.MAX_RECORD_BYTES + 1),
    ],
)
def test_a_record_the_library_did_not_write_is_a_store_error_naming_it(raw: bytes) -> None:
    shared = dist.HashStore()
    shared.set("k", raw)
    with pytest.raises(StoreError, match="the test record"):
        store.claim(shared, "k", {"rank": 0}, "the test record")


def test_a_record_naming_a_rank_outside_the_job_is_refused() -> None:
    for rank in (-1, 4, True, 1.5, "1"):
        with pytest.raises(StoreError, match="rank"):
            store.rank_of({"rank": rank}, "a claim", 4)


# --- the barrier --------------------------------------------------------------------------------


def test_arrive_names_missing_ranks_and_late_ranks_accept_the_verdict() -> None:
    shared = dist.PrefixStore("arrive", dist.HashStore())
    start = time.monotonic()
    with pytest.raises(AgreementTimeoutError) as raised:
        store.arrive(shared, "t1", 0, [0, 1, 2], "kernel k", 0.3)
    assert time.monotonic() - start < 3
    assert raised.value.missing_ranks == [1, 2]
    # Rank 1 arrives after rank 0 gave up: it sees the same verdict instead of waiting alone.
    with pytest.raises(AgreementTimeoutError) as late:
        store.arrive(shared, "t1", 1, [0, 1, 2], "kernel k", 0.3)
    assert late.value.missing_ranks == [1, 2]


def test_arrive_passes_when_every_rank_comes() -> None:
    shared = dist.PrefixStore("arrive", dist.HashStore())
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            store.arrive(shared, "t", r, [0, 1, 2], "k", 5.0)
        except BaseException as error:  # collected for the assertion below
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert errors == []


# --- digests ------------------------------------------------------------------------------------


def test_digests_are_fixed_size_and_stable() -> None:
    assert len(store.identity_digest(KERNEL, KEY, "sm90")) == 32
    assert store.signature_digest("BLOCK=64") == store.signature_digest("BLOCK=64")
    assert store.identity_digest("a", "b\0c", "x") != store.identity_digest("a\0b", "c", "x")
