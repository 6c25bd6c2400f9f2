"""Where ``auto`` keeps its decisions: the job's store, or N stores that ranks of the job host.

The node tier (``tier.py``) brings a miss down to one publish-or-adopt request per node and key,
and nothing brings it lower: in a job's first step every node reaches key k before anyone
published it, and each must launch the job's winner before k + 1 without waiting for a peer's
tuning. At 10,000 ranks on 8-rank nodes and 200 new keys that is 250,000 answered requests, and
on the one server of the job's store (single-threaded, 25-35 µs each on this project's CPU
machine) 6-9 s in which every node's launch waits its turn.

So large jobs spread the decisions over ``N`` stores instead. Each (arch, kernel, key) lives in
exactly one of them, chosen by its digest, so "the first writer wins" holds per key as before
and every rank launches one config per key; each server answers ``1/N`` of the requests, on a
host of its own. The servers are ``TCPStore`` servers that ``N`` ranks start in their own
process, on a free port, and announce in the job's store. The hosts are not fixed ranks: the
first rank of a node to start a session takes tickets for its node (one ``add`` on the job's
store, shared through the tier), and the first ``N`` tickets host. So a rank that needs the
addresses waits only for ``N`` nodes to have started, never for one particular rank, which could
be blocked in a collective that waits for this one (a later pipeline stage whose session starts
at its first launch). A rank reads the ``N`` addresses at its first miss (shared by the node's
ranks through the tier), connects to a store the first time a key routes there, and never falls
back to the job's store: ranks that kept some keys elsewhere could launch two configs for one
key. A host keeps serving at exit until every rank has closed, at most ``LINGER_S``.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..core import env
from ..core.errors import AutoStoreError, PolicyError, StoreRequestError
from .storeops import decode_text, request, store_errors
from .tier import NodeTier

logger = logging.getLogger(__name__)

ENV_STORES = "MEGATRON_TUNING_AUTO_STORES"
ENV_HOST = "MEGATRON_TUNING_AUTO_STORE_HOST"
NODES_PER_STORE = 128
"""Unset ``MEGATRON_TUNING_AUTO_STORES``: one hosted store per this many nodes, above that many."""
MAX_STORES = 1024
ANNOUNCE_WAIT_S = 120.0
"""How long a rank's first miss waits for the hosts' announcements before raising."""
LINGER_S = 60.0
"""How long a host keeps serving at exit for ranks that have not closed yet."""


def store_count(world: int, local_world: int) -> int:
    """How many hosted stores ``auto`` uses (0: the job's store), from ``MEGATRON_TUNING_AUTO_STORES``
    (``auto``, ``off`` or a count), else by the number of nodes."""
    text = env.env_str(ENV_STORES)
    allowed = f"'auto', 'off' (the job's store) or a number of stores hosted by ranks, 1..{MAX_STORES}"
    if text is None or text == "" or text.lower() == "auto":
        nodes = max(1, world // max(1, local_world))
        return 0 if nodes <= NODES_PER_STORE else min(MAX_STORES, math.ceil(nodes / NODES_PER_STORE))
    if text.lower() in ("off", "0"):
        return 0
    count = env.parse_int(text)
    if count is None or not 1 <= count <= MAX_STORES:
        raise PolicyError(ENV_STORES, text, allowed)
    if count > world:
        raise PolicyError(ENV_STORES, text, f"at most one store per rank (this job has {world} ranks)")
    return count


def candidates_per_node(count: int, world: int, local_world: int) -> int:
    """How many of the ``count`` stores a node hosts at most: one, unless the job has fewer nodes
    than stores."""
    nodes = world // local_world if local_world > 0 and world % local_world == 0 else world
    return max(1, math.ceil(count / nodes))


def shard_of(name: str, count: int) -> int:
    """The store that holds decision ``name`` (a stable digest: every rank routes a key alike)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") % count


def advertised_host() -> str:
    """The address other ranks reach this rank at: ``MEGATRON_TUNING_AUTO_STORE_HOST``, else the
    address of the interface that routes to the job's store (``MASTER_ADDR``), else the host name."""
    chosen = env.env_str(ENV_HOST)
    if chosen:
        return chosen
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            family, kind, proto, _, where = socket.getaddrinfo(
                master, int(os.environ.get("MASTER_PORT") or 29500), type=socket.SOCK_DGRAM
            )[0]
            with socket.socket(family, kind, proto) as probe:
                probe.connect(where)  # a datagram socket sends nothing: this only picks the route
                return str(probe.getsockname()[0])
        except (OSError, ValueError) as exc:
            logger.debug("auto stores: no route to MASTER_ADDR=%s (%s); using the host name", master, exc)
    return socket.getfqdn()


CLIENT_TIMEOUT_S = 60.0
"""At most this long for a client to connect to a hosted store or hear back: a host announces only
once it listens, so a refused connection means it died or cannot be reached (fail, do not wait
out the job store's timeout, up to 30 minutes)."""


def _timeout(store: Any) -> timedelta:
    found = getattr(store, "timeout", None)
    limit = timedelta(seconds=CLIENT_TIMEOUT_S)
    return min(found, limit) if isinstance(found, timedelta) else limit


def connect(address: str, timeout: timedelta) -> Any:
    """A client of the store at ``host:port``."""
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    return dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timeout, use_libuv=True)


class AutoStores:
    """This rank's view of the hosted stores: which one holds a decision, and a client of each.

    ``job_store`` is where the hosts announce themselves (the consensus's prefixed job store);
    ``connect`` opens a client (tests and ``bench_scale`` count requests through it).
    """

    def __init__(
        self,
        job_store: Any,
        count: int,
        *,
        tier: NodeTier | None = None,
        connect: Callable[[str, timedelta], Any] = connect,
        announce_wait_s: float = ANNOUNCE_WAIT_S,
    ) -> None:
        if count < 1:
            raise ValueError(f"auto stores: {count} stores")
        self.job_store = job_store
        self.count = count
        self.hosts: list[int] | None = None
        """The rank hosting each store, from the announcements (read at the first miss)."""
        self.tier = tier
        self.connect = connect
        self.announce_wait_s = announce_wait_s
        self.addresses: list[str] | None = None
        self.clients: dict[int, Any] = {}
        self.requests = [0] * count
        """Decision requests routed to each store (``StoreConsensus`` counts them)."""
        self._lock = threading.Lock()

    def compare_set(self, name: str, value: str, what: str) -> Any:
        """``compare_set(name, "", value)`` on the store that holds decision ``name``, for ``what``
        (as ``storeops.request`` names it); a failure names the store's host rank and address."""
        index, store = self._client_for(name)
        host = f"rank {self.host_of(index)}"
        try:
            return request(
                what,
                lambda: store.compare_set(name, "", value),
                store=store,
                where=f"auto store {index} (hosted by {host})",
            )
        except StoreRequestError as exc:
            raise AutoStoreError(
                f"the auto store hosted by {host} at {self.address_of(index)} failed during {what}: "
                f"{exc.detail}"
            ) from exc

    def _client_for(self, name: str) -> tuple[int, Any]:
        """The index of the store that holds decision ``name``, and a client of it."""
        index = shard_of(name, self.count)
        with self._lock:
            client = self.clients.get(index)
            if client is None:
                address = self._addresses()[index]
                try:
                    client = self.connect(address, _timeout(self.job_store))
                except store_errors() as exc:
                    raise AutoStoreError(
                        f"cannot connect to the auto store hosted by rank {self.host_of(index)} at "
                        f"{address} ({type(exc).__name__}: {exc})"
                    ) from exc
                self.clients[index] = client
        self.requests[index] += 1
        return index, client

    def address_of(self, index: int) -> str:
        return self._addresses()[index]

    def host_of(self, index: int) -> int:
        self._addresses()
        assert self.hosts is not None
        return self.hosts[index]

    def _addresses(self) -> list[str]:
        if self.addresses is None:
            raw = self.tier.once("auto-stores", self._fetch) if self.tier is not None else self._fetch()
            text = decode_text(raw, "the auto stores' announcements")
            parsed = [_parse_announcement(line) for line in text.split("\n")]
            if len(parsed) != self.count or None in parsed:
                raise AutoStoreError(
                    f"the job's store holds {text[:200]!r} as the auto stores' announcements"
                )
            self.hosts = [p[0] for p in parsed if p is not None]
            self.addresses = [p[1] for p in parsed if p is not None]
        return self.addresses

    def _fetch(self) -> bytes:
        """The hosts' announcements, one per line; waits for hosts that have not announced yet."""
        keys = [_announce_key(i) for i in range(self.count)]
        try:
            self.job_store.wait(keys, timedelta(seconds=self.announce_wait_s))
        except store_errors() as exc:
            announced = sum(1 for key in keys if self.job_store.check([key]))
            raise AutoStoreError(
                f"only {announced} of the job's {self.count} auto stores were announced within "
                f"{self.announce_wait_s:.0f} s ({type(exc).__name__}). They are hosted by the first "
                "ranks of different nodes to start a tuning session; fewer nodes than that started one "
                "(every rank must call init_deterministic_tuning with mode 'auto', or launch a kernel "
                "under `python -m megatron_tuning run`)"
            ) from exc
        values = request(
            "the auto stores' addresses", lambda: self.job_store.multi_get(keys), store=self.job_store
        )
        return "\n".join(decode_text(v, "an auto store's address") for v in values).encode()


def _announce_key(index: int) -> str:
    return f"stores/{index}"


def _parse_announcement(line: str) -> tuple[int, str] | None:
    """``"<rank> <host>:<port>"`` as (rank, address), or ``None`` if it is not that."""
    rank, _, address = line.partition(" ")
    host, sep, port = address.rpartition(":")
    if not (rank.isascii() and rank.isdigit() and sep and host and port.isascii() and port.isdigit()):
        return None
    return (int(rank), address) if 0 < int(port) < 65536 else None


def announce(job_store: Any, index: int, rank: int, address: str) -> None:
    """Tell the job that rank ``rank`` serves store ``index`` at ``address`` (once it listens)."""
    request(
        f"the announcement of auto store {index}",
        lambda: job_store.set(_announce_key(index), f"{rank} {address}"),
    )


def take_tickets(job_store: Any, count: int, rank: int, per_node: int, tier: NodeTier | None) -> list[int]:
    """The stores this rank hosts: its node's share of the first ``count`` tickets, if this rank is
    the first of its node to start (it takes them for the node, through the tier; without a tier
    each rank is its own node). One ``add`` per node."""

    def take() -> bytes:
        last = request("the auto stores' host tickets", lambda: job_store.add("stores/tickets", per_node))
        return f"{rank} {int(last)}".encode()

    answer = decode_text(tier.once("auto-stores-tickets", take) if tier is not None else take(), "tickets")
    owner, _, last_text = answer.partition(" ")
    if not (owner.isascii() and owner.isdigit() and last_text.isascii() and last_text.isdigit()):
        raise AutoStoreError(f"the node's record of its auto store tickets is {answer[:80]!r}")
    if owner != str(rank):  # a node-mate started first: it hosts the node's share
        return []
    last = int(last_text)
    return [ticket - 1 for ticket in range(last - per_node + 1, last + 1) if ticket <= count]


class HostedStore:
    """The store server this rank hosts for the job, kept until every rank has closed."""

    def __init__(self, job_store: Any, index: int, world: int, rank: int) -> None:
        import torch.distributed as dist

        self.job_store = job_store
        self.index = index
        _allow_connections(world)
        # Bound on every interface (TCPStore's server does); its own client talks over loopback.
        self.server = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=_timeout(job_store),
            use_libuv=True,
        )
        self.address = f"{advertised_host()}:{self.server.port}"
        announce(job_store, index, rank, self.address)
        logger.info("auto: this rank hosts auto store %d of the job at %s", index, self.address)

    def linger(self, timeout_s: float = LINGER_S) -> bool:
        """Keep serving until every rank has closed (``close_rank``), at most ``timeout_s``."""
        start = time.monotonic()
        try:
            self.job_store.wait([_ALL_CLOSED], timedelta(seconds=timeout_s))
        except Exception:
            logger.warning(
                "megatron_tuning: auto store %d at %s: not every rank closed within %g s (a rank that died, "
                "or that never started a tuning session); stopping it",
                self.index,
                self.address,
                timeout_s,
            )
            return False
        logger.debug("auto store %d: every rank closed after %.1f s", self.index, time.monotonic() - start)
        return True


_ALL_CLOSED = "stores/all-closed"


def _allow_connections(world: int) -> None:
    """Raise this process's open-file limit so its server can hold a connection from every rank.

    Any rank may make its node's request, so a host may see one connection per rank; a soft limit
    of 1,024 (a common default) would refuse the rest, and those ranks would fail.
    """
    import resource

    needed = world + 256  # the training process's own files, sockets and NCCL's
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        logger.debug("auto stores: could not raise the open-file limit to %d: %s", target, exc)
        target = soft
    if target < needed:
        logger.warning(
            "megatron_tuning: this rank hosts an auto store for %d ranks but may open only %d files "
            "(hard limit %d); ranks past that cannot connect. Raise it (ulimit -n %d) or set "
            "MEGATRON_TUNING_AUTO_STORES to more stores.",
            world,
            target,
            hard,
            needed,
        )


def close_rank(job_store: Any, world: int) -> None:
    """Count this rank as done with the hosted stores; the last one tells the hosts."""
    try:
        if int(job_store.add("stores/closed", 1)) >= world:
            job_store.set(_ALL_CLOSED, "1")
    except store_errors() as exc:  # at exit, the job's store may be gone: the hosts stop at LINGER_S
        logger.debug("auto stores: could not count this rank as closed: %s", exc)


_STARTED: dict[str, AutoStores | None] = {}
_HOSTED: dict[str, list[HostedStore]] = {}


def start_auto_stores(
    job_store: Any,
    namespace: str,
    rank: int,
    world: int,
    local_world: int,
    tier: NodeTier | None,
) -> AutoStores | None:
    """The hosted stores for this job (once per process and namespace; ``None``: the job's store).

    The first rank of each node to start takes the node's tickets; the first ``count`` tickets
    start servers here. Every rank counts itself closed at exit, and a host serves until all have.
    """
    if namespace in _STARTED:
        return _STARTED[namespace]
    count = store_count(world, local_world)
    if count == 0:
        _STARTED[namespace] = None
        return None
    per_node = candidates_per_node(count, world, local_world) if tier is not None else 1
    hosted = [
        HostedStore(job_store, index, world, rank)
        for index in take_tickets(job_store, count, rank, per_node, tier)
    ]
    if hosted:
        _HOSTED[namespace] = hosted
    stores = AutoStores(job_store, count, tier=tier)
    _STARTED[namespace] = stores
    atexit.register(_at_exit, namespace, job_store, world)
    return stores


def _at_exit(namespace: str, job_store: Any, world: int) -> None:
    close_rank(job_store, world)
    for hosted in _HOSTED.pop(namespace, []):  # one wait: the others find every rank closed
        hosted.linger()


__all__ = [
    "ENV_HOST",
    "ENV_STORES",
    "AutoStores",
    "HostedStore",
    "advertised_host",
    "announce",
    "close_rank",
    "candidates_per_node",
    "shard_of",
    "start_auto_stores",
    "store_count",
    "take_tickets",
]
