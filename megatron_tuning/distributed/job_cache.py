"""``auto`` mode's per-node caches made one job cache: a hit is the job's decision, not a private fact.

Each node keeps its own cache (``~/.cache/...``), so in a multi-node job the caches can differ (a
new node, re-placed pipeline stages). Launching a local cache hit would then split the ranks. At
session start each rank therefore offers the digest of its cache to the job's store with one
``compare_set``; the first rank's cache becomes *the job's cache* and is uploaded once.

* A rank whose cache has that digest (the usual case: one shared home, or nodes that ran the same
  job) trusts its own hits: zero consensus requests per hit.
* A rank whose cache differs downloads the job's cache once and launches the job's entry for every
  key the job's cache has (reported as ``adopted`` from it, and persisted into its own cache for
  the next run). Keys only its own cache has are *proposals*: published through the same
  first-writer-wins ``compare_set`` as a tuned result, so every rank launches one config. It says
  so once, with counts.

With the node tier (``tier.py``) the offer is made once per node for the ranks whose caches have
one digest (one node's ranks usually share a home folder): the first of them makes the request,
the others read its answer, and only the rank named in the job's record uploads.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..core.errors import StoreRecordError, TableError
from ..core.warn import warn_once
from ..tables.cache_persist import content_digest
from ..tables.table import Entry, Table
from .storeops import BadRecord, decode_record, record_field, record_rank, request, store_errors
from .tier import NodeTier

logger = logging.getLogger(__name__)

BLOB_WAIT_S = 60.0
"""How long a rank waits for the first rank's upload, which is that rank's very next request."""


@dataclass
class JobCacheView:
    """How this rank must treat its cache table in ``auto`` mode."""

    local_path: str
    """The local cache file (the origin of its hits in ``TableSet``)."""
    differs: bool = False
    """Whether this rank's cache differs from the job's (then its hits are not trusted as they are)."""
    origin: str = ""
    """How decisions taken from the job's cache name it."""
    job: Table | None = None
    local_only: set[tuple[str, str, str]] = field(default_factory=set)
    """Entries only this rank's cache has: proposed to the job when first used."""

    def job_entry(self, arch: str, kernel: str, key: str) -> Entry | None:
        return self.job.get(arch, kernel, key) if self.job is not None else None


def cache_digest(table: Table) -> tuple[str, bytes]:
    """The canonical bytes of a cache table and their digest (same content, same digest)."""
    data = table.to_bytes()
    return content_digest(data), data


def reconcile(
    store: Any, rank: int, world: int | None, path: str, table: Table, *, tier: NodeTier | None = None
) -> JobCacheView:
    """Offer this rank's cache to the job; return how to treat it (see the module docstring).

    ``tier``: shares the offer among node-mates whose caches have the same digest.
    """
    digest, data = cache_digest(table)
    what = "the job's auto cache record"
    mine = json.dumps({"rank": rank, "digest": digest, "entries": len(table)}, sort_keys=True)

    def offer() -> Any:
        return request(what, lambda: store.compare_set("cache/first", "", mine), store=store)

    # The job's first record never changes, so a node-mate's answer is this rank's answer too.
    raw = offer() if tier is None else tier.once(f"cache/first/{digest}", offer)
    try:
        record = decode_record(raw, what)
        first_rank = record_rank(record, what, world)
        first_digest = record_field(record, "digest", str, what)
    except BadRecord as bad:
        raise StoreRecordError(bad.what, bad.problem) from None
    if first_digest == digest:
        if first_rank == rank:  # ours is the job's cache: upload it for ranks whose cache differs
            request(
                "the job's auto cache upload", lambda: store.set(f"cache/blob/{digest}", data), store=store
            )
        return JobCacheView(local_path=path)
    job = _download(store, first_rank, first_digest)
    view = JobCacheView(
        local_path=path,
        differs=True,
        origin=f"the job's auto cache (rank {first_rank}'s)",
        job=job,
        local_only={e.ident for e in table.values() if e.ident not in job},
    )
    changed = sum(
        1 for e in table.values() if (other := job.get(*e.ident)) is not None and other.config != e.config
    )
    warn_once(
        ("job-cache", path, first_digest),
        "megatron_tuning: this rank's auto cache %s (%d entries) differs from the job's, rank %d's "
        "(%d entries). This rank launches the job's entry for every key the job's cache has (%d of "
        "its own entries name another config), and proposes its %d entries the job's cache lacks "
        "through the job's store, so all ranks launch one config per key. Ranks that share one cache "
        "(one home folder, or MEGATRON_TUNING_CACHE on a shared file system) skip this.",
        path,
        len(table),
        first_rank,
        len(job),
        changed,
        len(view.local_only),
    )
    return view


def _download(store: Any, first_rank: int, digest: str) -> Table:
    name = f"cache/blob/{digest}"
    what = f"the job's auto cache (rank {first_rank}'s upload)"
    try:
        store.wait([name], timedelta(seconds=BLOB_WAIT_S))
    except store_errors() as exc:
        raise StoreRecordError(
            what, f"no upload within {BLOB_WAIT_S:g} s ({type(exc).__name__}); did rank {first_rank} die?"
        ) from exc
    blob = bytes(request(what, lambda: store.get(name), store=store))
    try:
        return Table.from_bytes(blob, path=what)
    except TableError as exc:
        raise StoreRecordError(what, f"a table the library cannot read ({exc.problem})") from None


__all__ = ["JobCacheView", "cache_digest", "reconcile"]
