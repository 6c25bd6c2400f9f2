"""auto's hosted stores: each decision lives in one of N stores that ranks host, found and reached by
every rank alike, with clear errors when a host cannot be found or reached.

Real ``TCPStore`` servers in this process stand for the hosts; fake ranks are ``StoreConsensus``
objects (no process group). The torchrun job with hosted stores is in ``test_auto_torchrun.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tuning.core.errors import AutoStoreError, PolicyError
from megatron_tuning.distributed import auto_stores
from megatron_tuning.distributed.auto_stores import (
    ENV_HOST,
    ENV_STORES,
    AutoStores,
    HostedStore,
    advertised_host,
    announce,
    candidates_per_node,
    close_rank,
    shard_of,
    store_count,
    take_tickets,
)
from megatron_tuning.distributed.consensus import StoreConsensus, _store_key
from megatron_tuning.distributed.tier import NodeTier, node_folder

CONFIG = {"kwargs": {"BLOCK": 64}, "num_warps": 4}


class Counting:
    """Counts requests on a store, per method."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.calls.append(name)
            return method(*args)

        return counted


def _job_store() -> Any:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    return server, dist.PrefixStore("megatron_tuning/auto/v1/t", server)


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(ENV_HOST, "127.0.0.1")
    server, prefixed = _job_store()
    yield prefixed
    del server


def _ranks(job_store: Any, count: int, world: int, **kwargs: Any) -> list[StoreConsensus]:
    ranks = []
    for r in range(world):
        consensus = StoreConsensus(job_store, rank=r, namespace="t", world=world)
        consensus._store = job_store  # the fixture's store is prefixed already
        consensus.stores = AutoStores(consensus._store, count, **kwargs)
        ranks.append(consensus)
    return ranks


# -- how many stores, and who hosts them -------------------------------------------------------


def test_the_count_follows_the_number_of_nodes_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_STORES, raising=False)
    assert store_count(1024, 8) == 0  # 128 nodes: the job's store alone
    assert store_count(10_000, 8) == 10  # 1,250 nodes
    assert store_count(10_000, 1) == 79  # one rank per node: 10,000 nodes
    for text, count in (("off", 0), ("0", 0), ("auto", 10), (" 3 ", 3), ("", 10)):
        monkeypatch.setenv(ENV_STORES, text)
        assert store_count(10_000, 8) == count, text


@pytest.mark.parametrize("text", ["x", "-1", "2.5", "1025", "９", "yes"])
def test_a_bad_count_names_the_variable_and_what_it_takes(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(ENV_STORES, text)
    with pytest.raises(PolicyError, match=ENV_STORES) as raised:
        store_count(10_000, 8)
    assert "'auto', 'off'" in str(raised.value)


def test_more_stores_than_ranks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_STORES, "5")
    with pytest.raises(PolicyError, match="one store per rank"):
        store_count(4, 4)


def test_one_candidate_per_node_unless_there_are_fewer_nodes_than_stores() -> None:
    assert candidates_per_node(10, 10_000, 8) == 1
    assert candidates_per_node(2, 4, 4) == 2  # one node, two stores: its first two ranks
    assert candidates_per_node(3, 16, 8) == 2


@given(
    st.integers(1, 64).flatmap(
        lambda local: st.tuples(st.just(local), st.integers(1, 200).map(lambda n: n * local))
    ),
    st.integers(1, 1024),
)
@settings(max_examples=300, deadline=None)
def test_there_are_always_enough_candidates(shape: tuple[int, int], count: int) -> None:
    local, world = shape
    count = min(count, world)
    per_node = candidates_per_node(count, world, local)
    assert per_node <= local and per_node * (world // local) >= count


def test_the_first_ranks_to_start_host_whoever_they_are(job: Any) -> None:
    order = [5, 2, 7, 0]  # without a tier each rank is its own node; sessions start in this order
    hosted = {rank: take_tickets(job, 2, rank, 1, None) for rank in order}
    assert hosted == {5: [0], 2: [1], 7: [], 0: []}


def test_a_nodes_first_rank_to_start_takes_the_nodes_tickets(
    job: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(os, "access", lambda path, mode: path != "/dev/shm")
    node_a, node_b = node_folder("tickets-a"), node_folder("tickets-b")
    assert node_a is not None and node_b is not None
    counting = Counting(job)
    # 3 stores over 2 nodes of 4 ranks: each node hosts up to 2, in whichever rank starts first.
    got = {}
    for rank, folder in ((6, node_b), (3, node_a), (4, node_b), (0, node_a), (7, node_b)):
        got[rank] = take_tickets(counting, 3, rank, 2, NodeTier(folder, rank=rank))
    assert got == {6: [0, 1], 3: [2], 4: [], 0: [], 7: []}
    assert counting.calls == ["add", "add"]  # one request per node


def test_every_process_routes_a_key_to_the_same_store() -> None:
    names = [_store_key("k:matmul", f"M={m}", "sm90") for m in range(2000)]
    here = [shard_of(n, 10) for n in names]
    code = (
        "import json, sys; from megatron_tuning.distributed.auto_stores import shard_of; "
        "print(json.dumps([shard_of(n, 10) for n in json.load(sys.stdin)]))"
    )
    for seed in ("1", "2"):  # Python's salted hash() would differ between these
        done = subprocess.run(
            [sys.executable, "-c", code],
            input=json.dumps(names),
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
        )
        assert json.loads(done.stdout) == here
    counts = [here.count(i) for i in range(10)]
    assert min(counts) > 150 and max(counts) < 250, counts  # spread: 200 each on average


# -- deciding through hosted stores ----------------------------------------------------------------


def test_ranks_adopt_one_winner_per_key_and_each_key_lives_in_one_hosted_store(job: Any) -> None:
    hosted = [HostedStore(job, i, world=4, rank=2 * i) for i in range(2)]
    ranks = _ranks(job, 2, 4)
    keys = [f"M={m}" for m in range(40)]
    winners: dict[str, set[str]] = {k: set() for k in keys}
    lock = threading.Lock()

    def run(consensus: StoreConsensus) -> None:
        for k in keys:
            mine = f"BLOCK={consensus.rank}"  # every rank tuned something else
            won = consensus.publish("k:matmul", k, "sm90", CONFIG, mine)
            with lock:
                winners[k].add(won.signature)

    threads = [threading.Thread(target=run, args=(c,)) for c in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(found) == 1 for found in winners.values()), winners
    servers = [dist.TCPStore("127.0.0.1", h.server.port, is_master=False, use_libuv=True) for h in hosted]
    for k in keys:
        name = _store_key("k:matmul", k, "sm90")
        holders = [i for i, s in enumerate(servers) if s.check([name])]
        assert holders == [shard_of(name, 2)], (k, holders)
        assert not job.check([name])  # never in the job's store
    for consensus in ranks:
        assert consensus.stores is not None and min(consensus.stores.requests) > 0
        assert sum(consensus.stores.requests) == len(keys)


def test_node_mates_read_the_addresses_once_through_the_tier(
    job: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(os, "access", lambda path, mode: path != "/dev/shm")
    folder = node_folder("stores-job")
    assert folder is not None
    hosted = [HostedStore(job, i, world=4, rank=2 * i) for i in range(2)]
    counting = Counting(job)
    ranks = []
    for r in range(4):
        consensus = StoreConsensus(job, rank=r, namespace="t", world=4)
        consensus._store = job
        tier = NodeTier(folder, rank=r, owner=r == 0)
        consensus.stores = AutoStores(counting, 2, tier=tier)
        ranks.append(consensus)
    for consensus in ranks:
        consensus.publish("k:matmul", "M=1", "sm90", CONFIG, f"BLOCK={consensus.rank}")
    assert counting.calls == ["wait", "multi_get"]  # one node: the addresses asked for once
    for c in ranks:
        assert c.stores is not None
        assert c.stores.addresses == [h.address for h in hosted] and c.stores.hosts == [0, 2]


def test_stores_nobody_announced_are_counted_with_the_reason(job: Any) -> None:
    HostedStore(job, 0, world=4, rank=0)  # store 1's host never started a session
    (rank,) = _ranks(job, 2, 1, announce_wait_s=0.5)
    with pytest.raises(AutoStoreError, match=r"only 1 of the job's 2 auto stores were announced") as raised:
        rank.publish("k:matmul", "M=1", "sm90", CONFIG, "BLOCK=0")
    assert "first ranks of different nodes to start" in str(raised.value)
    assert "MEGATRON_TUNING_AUTO_STORES=off" in str(raised.value)


def test_a_corrupt_announcement_is_named(job: Any) -> None:
    announce(job, 0, 0, "127.0.0.1:1")
    announce(job, 1, 2, "not an address")
    (rank,) = _ranks(job, 2, 1)
    with pytest.raises(AutoStoreError, match="not an address"):
        rank.publish("k:matmul", "M=1", "sm90", CONFIG, "BLOCK=0")


def test_a_host_nobody_can_reach_is_named_with_the_fix(job: Any) -> None:
    with dist_port() as port:  # a port nothing listens on
        announce(job, 0, 3, f"127.0.0.1:{port}")
        (rank,) = _ranks(job, 1, 1, connect=_quick_connect)
        with pytest.raises(AutoStoreError, match=rf"hosted by rank 3 at 127\.0\.0\.1:{port}") as raised:
            rank.publish("k:matmul", "M=1", "sm90", CONFIG, "BLOCK=0")
    assert ENV_HOST in str(raised.value)


def test_a_host_that_went_away_is_named(job: Any) -> None:
    hosted = HostedStore(job, 0, world=2, rank=1)
    (rank,) = _ranks(job, 1, 1, connect=_quick_connect)
    rank.publish("k:matmul", "M=1", "sm90", CONFIG, "BLOCK=0")
    del hosted.server  # the host's process is gone
    with pytest.raises(AutoStoreError, match=r"auto store hosted by rank 1 at 127\.0\.0\.1:\d+ failed"):
        rank.publish("k:matmul", "M=2", "sm90", CONFIG, "BLOCK=0")


def test_a_host_serves_until_every_rank_closed(job: Any) -> None:
    hosted = HostedStore(job, 0, world=3, rank=0)
    server = job.underlying_store
    others = dist.PrefixStore(  # the other ranks' own connections
        "megatron_tuning/auto/v1/t", dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True)
    )
    close_rank(job, 3)  # the host itself, at exit
    close_rank(others, 3)
    assert hosted.linger(timeout_s=0.3) is False  # one rank still open: it waited, then gave up
    done: list[bool] = []
    waiter = threading.Thread(target=lambda: done.append(hosted.linger(timeout_s=10)))
    waiter.start()
    close_rank(others, 3)
    waiter.join()
    assert done == [True]


def test_the_advertised_address_is_the_route_to_the_job_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_HOST, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert advertised_host() == "127.0.0.1"
    monkeypatch.setenv(ENV_HOST, "node17.cluster")
    assert advertised_host() == "node17.cluster"


def test_start_hosts_once_per_process_and_namespace(job: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_STORES, "1")
    monkeypatch.setattr(auto_stores, "_STARTED", {})
    monkeypatch.setattr(auto_stores, "_HOSTED", {})
    monkeypatch.setattr(auto_stores.atexit, "register", lambda *a: None)
    start = auto_stores.start_auto_stores
    first = start(job, "ns", rank=0, world=2, local_world=1, tier=None)
    again = start(job, "ns", rank=0, world=2, local_world=1, tier=None)
    assert first is again and first is not None and list(auto_stores._HOSTED) == ["ns"]
    monkeypatch.setenv(ENV_STORES, "off")
    assert start(job, "other", rank=0, world=2, local_world=1, tier=None) is None


# -- helpers ---------------------------------------------------------------------------------------


def _quick_connect(address: str, timeout: timedelta) -> Any:
    return auto_stores.connect(address, timedelta(seconds=2))


class dist_port:
    """A free local port, held by a bound socket that does not listen."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def test_a_host_raises_its_open_file_limit_to_hold_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    limits = {"now": (1024, 65536)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limits.update(now=value))
    auto_stores._allow_connections(10_000)
    assert limits["now"] == (10_256, 65536)


def test_a_hard_limit_too_low_for_the_job_is_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import resource

    limits = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limits.update(now=value))
    auto_stores._allow_connections(10_000)
    assert limits["now"] == (4096, 4096)
    assert "may open only 4096 files" in caplog.text and "ulimit -n 10256" in caplog.text


def test_a_slow_hosted_store_is_named_as_such(job: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_tuning.core.warn import TuningWarning, reset_warnings
    from megatron_tuning.distributed import storeops

    host = HostedStore(job, 0, world=2, rank=1)
    (rank,) = _ranks(job, 1, 1)
    reset_warnings()
    monkeypatch.setattr(storeops, "SLOW_REQUEST_S", -1.0)  # every request counts as slow
    with pytest.warns(
        TuningWarning, match=r"a request to auto store 0 \(hosted by rank 1\) \(127\.0\.0\.1:\d+\)"
    ):
        rank.publish("k:matmul", "M=1", "sm90", CONFIG, "BLOCK=0")
    assert host.server.port  # the host served until here (an unreferenced server is gone)


def test_a_garbled_ticket_record_is_named(job: Any) -> None:
    class Garbled:
        def once(self, name: str, ask: Any, **kwargs: Any) -> bytes:
            return b"node-mate wrote this"

    with pytest.raises(AutoStoreError, match="record of its auto store tickets is 'node-mate wrote this'"):
        take_tickets(job, 2, 0, 1, Garbled())  # type: ignore[arg-type]
