"""``auto`` mode's consensus: one tuned decision per (arch, kernel, key) for the whole job.

A rank that misses the tables looks for a decision already published in the job's c10d store
and adopts it; otherwise it tunes, then publishes with the store's atomic ``compare_set``. The
first writer wins, and a rank that loses the race launches the winner's config, not its own.

A rank never waits for another rank: a lookup is one ``compare_set(key, "", "")`` (the current
value, or an empty one it leaves for the publisher's ``compare_set(key, "", ours)``), a publish is
one ``compare_set``. So no order of ranks, no pipeline stage that never reaches a kernel, and no
peer stuck in a collective can stall a launch: one request per new key on the adopt path, two on
the tune path.

With the node tier (``tier.py``, large worlds) a miss makes **one request per node and key**: the
lookup asks only the node's folder (a node-mate may hold the job's answer already; no request),
and the publish is a publish-or-adopt ``compare_set`` made once for the node, its answer shared
with the node-mates. In a job's first step every node reaches a key before anyone published it,
so a store lookup would miss anyway. A node that is *behind* would instead tune keys that were
published long ago, so each record carries its publisher's wall time: when the winner a publish
returns was published more than ``LATE_S`` before this rank began tuning, the rank looks its next
misses up in the store first (one request per node and key, shared through the folder; a hit
needs no tuning and no publish) until a lookup misses, which means it caught up. The clock is
only a hint: skewed clocks cost tuning time or one request, never a wrong or split decision.

In large jobs the decisions live in stores that ranks host (``auto_stores.py``), each key in one
of them, so no single server answers every node's request for every key.

What crosses ranks is plain JSON text (the config's ``config_data`` and signature), never a
pickle, and what comes back is checked: a record that is not the library's JSON, or names a rank
outside the job, is a ``ConsensusError`` naming kernel, key and the value.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..core.errors import ConsensusError
from .auto_stores import AutoStores, start_auto_stores
from .job_cache import JobCacheView, reconcile
from .storeops import BadRecord, decode_record, record_field, record_rank, request
from .tier import NodeTier, local_world_size, start_tier
from .wire import default_store, identity_digest

logger = logging.getLogger(__name__)

_PREFIX = "megatron_tuning/auto/v1"
LATE_S = 2.0
"""With the node tier: a winner this much older than this rank's tuning makes it look up first."""


@dataclass(frozen=True, slots=True)
class Published:
    """A decision as the job's store holds it."""

    config: dict[str, Any]
    signature: str
    rank: int
    time: float | None = None
    """The publisher's wall clock at its publish (``None`` in records of older versions)."""


class StoreConsensus:
    """Publish and adopt ``auto`` decisions through a c10d store (the job's, by default).

    ``store`` and ``rank`` exist so tests can drive the protocol without a process group.
    """

    def __init__(
        self,
        store: Any = None,
        *,
        rank: int | None = None,
        namespace: str | None = None,
        world: int | None = None,
        tier: NodeTier | None = None,
    ) -> None:
        base = store if store is not None else default_store()
        # Elastic restarts reuse the rendezvous store: a restarted job tunes afresh, but its cache
        # table (written at exit) already holds what the previous attempt tuned.
        namespace = (
            namespace if namespace is not None else "r" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        )
        self.namespace = namespace
        self._store = dist.PrefixStore(f"{_PREFIX}/{namespace}", base)
        self.rank = dist.get_rank() if rank is None else int(rank)
        self.world = (
            world if world is not None else (dist.get_world_size() if dist.is_initialized() else None)
        )
        self.requests = 0
        self.tier = tier
        """The node tier (``tier.py``): lookups read the node's folder; a publish is made once per node."""
        self.stores: AutoStores | None = None
        """Hosted stores (``auto_stores.py``, large jobs): each decision lives in one of them."""
        self.look_first = False
        """With the tier: whether misses ask the store before tuning (this rank fell behind)."""
        self._tuning_since: dict[str, float] = {}
        self.cache_view: JobCacheView | None = None
        """Set by ``reconcile_cache``: how ``auto`` treats this rank's cache hits (``job_cache.py``)."""

    def reconcile_cache(self, path: str, table: Any) -> JobCacheView:
        """Offer this rank's auto cache to the job (once per session); see ``job_cache.reconcile``."""
        self.cache_view = reconcile(self._store, self.rank, self.world, path, table, tier=self.tier)
        return self.cache_view

    def lookup(self, kernel: str, key: str, arch: str) -> Published | None:
        """The decision published for (arch, kernel, key), or ``None``; never waits.

        One request. With the node tier: what a node-mate left in the folder, and no request,
        unless this rank fell behind (``look_first``): then one request per node.
        """
        name = _store_key(kernel, key, arch)
        if self.tier is None:
            raw = self._ask(kernel, key, "lookup", name, "")
            return None if not bytes(raw) else self._decode(raw, kernel, key)
        # A node-mate's publish answer, or its non-empty lookup answer: both are the job's winner.
        for kept in (self.tier.peek(f"publish/{name}"), self.tier.peek(f"lookup/{name}")):
            if kept:
                return self._decode(kept, kernel, key)
        if self.look_first:
            raw = self._ask(kernel, key, "lookup", name, "")
            if bytes(raw):
                return self._decode(raw, kernel, key)
            self.look_first = False  # nothing published yet: this node is among the first again
        self._tuning_since[name] = time.time()
        return None

    def publish(
        self, kernel: str, key: str, arch: str, config: Mapping[str, Any], signature: str
    ) -> Published:
        """Publish ours unless someone was first; return the decision every rank must launch."""
        name = _store_key(kernel, key, arch)
        record = {"config": dict(config), "signature": signature, "rank": self.rank, "time": time.time()}
        winner = self._ask(kernel, key, "publish", name, json.dumps(record, sort_keys=True))
        published = self._decode(winner, kernel, key)
        since = self._tuning_since.pop(name, None)
        if since is not None and published.time is not None and published.time < since - LATE_S:
            self.look_first = True  # it was published before we began tuning: look up from now on
        # Compare what was published, not who claims to have published it: a record naming this
        # rank with another config must be adopted, not mistaken for our own.
        if published.signature != signature:
            logger.info(
                "auto: rank %d published %s for %s [%s] first; launching it (ours was %s)",
                published.rank,
                published.signature,
                kernel,
                key,
                signature,
            )
        return published

    def _ask(self, kernel: str, key: str, purpose: str, name: str, value: str) -> Any:
        what = f"the auto {purpose} of kernel {kernel} with key {key}"

        def ask() -> Any:
            self.requests += 1
            if self.stores is not None:
                return self.stores.compare_set(name, value, what)
            return request(what, lambda: self._store.compare_set(name, "", value), store=self._store)

        if self.tier is None:
            return ask()
        # A publish's answer (the job's winner) is final: the node's ranks share the one request. A
        # lookup's empty answer is not, but a node-mate that reuses it only tunes, then publishes;
        # for the same reason a lookup that a node-mate claimed and never answered is a miss.
        fallback = b"" if purpose == "lookup" else None
        return self.tier.once(f"{purpose}/{name}", ask, fallback=fallback)

    def _decode(self, raw: Any, kernel: str, key: str) -> Published:
        what = f"the decision published for kernel {kernel} with key {key}"
        try:
            data = decode_record(raw, what)
            config = record_field(data, "config", dict, what)
            signature = record_field(data, "signature", str, what)
            rank = record_rank(data, what, self.world)
            stamp = data.get("time")
            if stamp is not None and type(stamp) not in (int, float):
                raise BadRecord(what, f"field 'time' = {stamp!r} (expected a number)")
        except BadRecord as bad:
            raise ConsensusError(
                kernel, key, f"{bad.problem}; was it written by another megatron_tuning version?"
            ) from None
        return Published(config=config, signature=signature, rank=rank, time=stamp)


def start_consensus() -> StoreConsensus | None:
    """The job's consensus when a process group is up (with the node tier and hosted stores in
    large worlds, see ``tier.py`` and ``auto_stores.py``); ``None`` for a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    consensus = StoreConsensus()
    consensus.tier = start_tier(consensus.namespace)
    if consensus.tier is not None:
        atexit.register(consensus.tier.close)
    consensus.stores = start_auto_stores(
        consensus._store,
        consensus.namespace,
        consensus.rank,
        dist.get_world_size(),
        max(1, local_world_size() or 1),
        consensus.tier,
    )
    return consensus


def _store_key(kernel: str, key: str, arch: str) -> str:
    return "d/" + identity_digest(kernel, key, arch).hex()


__all__ = ["Published", "StoreConsensus", "start_consensus"]
