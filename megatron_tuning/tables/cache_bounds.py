"""What one persist does to ``auto``'s cache table: keep, add, evict. Pure: no I/O, no clock.

``plan_persist(base, pending, ...)`` takes the file's current content and this run's new entries
and returns the table to write (``Plan.changed`` false: nothing to write), applying, in order:

1. **Stale entries are evicted**: tuned with another Triton version than the running one, or
   for another source hash of a kernel this run used (``source_hashes``); every entry of a file in
   an older cache format. Entries whose provenance is unknown (no version, no hash) are kept, as
   lookups use them.
2. **First persisted wins**: a new entry whose key the table already holds is dropped, whatever
   its config; the table keeps the entry it has (``Plan.kept`` lists those whose configs differ).
3. **The cap**: past ``max_entries`` entries, then (``encode_plan``) past ``max_bytes`` encoded
   bytes, the entries that entered the table first are evicted. Row order in the file is entry
   order (``Table`` keeps it; ``to_bytes(keep_order=True)``), so the rule is deterministic and
   needs no clock.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from .entry import Entry, same_config
from .table import Table, library_version

CACHE_FORMAT = 1
"""Bump when what a cache entry means changes (e.g. how keys are written): caches in an older
format are then evicted whole, and older versions of the library stop writing newer ones."""
CACHE_META = {"kind": "auto-cache", "cache_format": str(CACHE_FORMAT)}

_Ident = tuple[str, str, str]


class CacheFormatError(Exception):
    """The file is a cache in a newer format than this library writes: it must not be rewritten."""


@dataclass
class Plan:
    """The outcome of one persist: the table to write and what happened to which entries."""

    table: Table
    payload: bytes | None = None
    """The encoded table to write, once ``encode_plan`` made it."""
    added: list[Entry] = field(default_factory=list)
    kept: list[tuple[Entry, Entry]] = field(default_factory=list)
    """(entry in the table, this run's entry) for keys persisted first by another run, configs differing."""
    stale: list[tuple[Entry, str]] = field(default_factory=list)
    """Evicted stale entries and why."""
    evicted: list[Entry] = field(default_factory=list)
    """Entries evicted by the cap, oldest first (may include some of ``added``)."""
    evicted_for: set[str] = field(default_factory=set)
    """Which bounds evicted them: ``entries``, ``bytes``."""

    rewrite: bool = False
    """Write even if nothing was added or evicted (a file over its bounds)."""

    @property
    def changed(self) -> bool:
        """Whether the file must be written: something added or evicted, or a rewrite asked for."""
        return bool(self.added or self.stale or self.evicted or self.rewrite)

    @property
    def evicted_new(self) -> list[Entry]:
        """Entries of this persist that the cap evicted at once (a cap smaller than one run)."""
        ours = {id(entry) for entry in self.added}
        return [entry for entry in self.evicted if id(entry) in ours]

    def stale_reasons(self) -> str:
        counts = collections.Counter(reason for _, reason in self.stale)
        return ", ".join(f"{count} {reason}" for reason, count in sorted(counts.items()))


def cache_format_of(table: Table) -> int | str:
    """The cache format a table's header names; a table without one (caches written before formats
    were numbered) is format 1. A value that is not a number is returned as written."""
    raw = table.meta.get("cache_format")
    if raw is None:
        return 1
    return int(raw) if raw.isdigit() and raw.isascii() else raw


def staleness(
    entry: Entry, triton_version: str | None, source_hashes: dict[tuple[str, str], str]
) -> str | None:
    """Why ``entry`` can no longer be used by this run (``None``: it can); the rule lookups apply."""
    if triton_version is not None and entry.triton_version not in (None, triton_version):
        return f"tuned with Triton {entry.triton_version}, running {triton_version}"
    known = source_hashes.get((entry.arch, entry.kernel))
    if known is not None and entry.source_hash not in (None, known):
        return "tuned for other kernel source"
    return None


def plan_persist(
    base: Table,
    pending: list[Entry],
    *,
    triton_version: str | None,
    source_hashes: dict[tuple[str, str], str],
    max_entries: int,
    rewrite: bool = False,
) -> Plan:
    """Merge ``pending`` into a copy of ``base`` by the rules above; ``base`` is not changed.

    ``rewrite``: the table must be written even if nothing was added or evicted by count (it is
    over the byte bound, which only ``encode_plan`` can tell).

    Raises ``CacheFormatError`` when ``base`` is in a newer cache format.
    """
    found = cache_format_of(base)
    older = isinstance(found, int) and found < CACHE_FORMAT
    if found != CACHE_FORMAT and not older:
        raise CacheFormatError(
            f"it is in cache format {found!r}, newer than this version's {CACHE_FORMAT} (a newer "
            "megatron_tuning wrote it)"
        )
    table = base.copy()
    hashes = dict(source_hashes)
    for entry in pending:
        if entry.source_hash is not None:
            hashes.setdefault((entry.arch, entry.kernel), entry.source_hash)
    plan = Plan(table=table, payload=None)
    if older:
        plan.stale = [(entry, f"in cache format {found}") for entry in table.entries_in_order()]
    else:
        # Staleness depends only on (arch, kernel, source hash, Triton version), and a cache has
        # few distinct ones: judge those first and walk the entries only when one is stale.
        provenance = {(e.arch, e.kernel, e.source_hash, e.triton_version): e for e in table.values()}
        reasons = {
            combo: reason
            for combo, sample in provenance.items()
            if (reason := staleness(sample, triton_version, hashes)) is not None
        }
        if reasons:
            for entry in table.entries_in_order():
                reason = reasons.get((entry.arch, entry.kernel, entry.source_hash, entry.triton_version))
                if reason is not None:
                    plan.stale.append((entry, reason))
    for entry, _ in plan.stale:
        table.remove(*entry.ident)
    for entry in pending:
        old = table.get(*entry.ident)
        if old is None:
            table.add(entry)
            plan.added.append(entry)
        elif not same_config(old.config, entry.config):
            plan.kept.append((old, entry))
    order = table.entries_in_order()
    if len(order) > max_entries:
        plan.evicted.extend(_evict(table, order[: len(order) - max_entries]))
        plan.evicted_for.add("entries")
    plan.rewrite = rewrite
    if not plan.changed:
        return Plan(table=base, payload=None, kept=plan.kept)
    table.meta = {**base.meta, **CACHE_META}
    table.library_version = library_version()
    return plan


def encode_plan(plan: Plan, *, max_bytes: int, as_json: bool = False) -> bytes:
    """Encode ``plan.table`` (rows in entry order), evicting its oldest entries until the bytes fit
    ``max_bytes``; sets and returns ``plan.payload``. Separate from ``plan_persist`` because only a
    writer holding the lock needs it: encoding is half of a persist's cost."""
    table = plan.table
    payload = _encode(table, as_json)
    while len(payload) > max_bytes and len(table):
        order = table.entries_in_order()
        per_entry = len(payload) / len(order)
        # A little more than the excess, so one re-encode almost always suffices.
        drop = min(len(order), math.ceil((len(payload) - max_bytes) * 1.02 / per_entry) + 1)
        plan.evicted.extend(_evict(table, order[:drop]))
        plan.evicted_for.add("bytes")
        payload = _encode(table, as_json)
    plan.payload = payload
    return payload


def _evict(table: Table, entries: list[Entry]) -> list[Entry]:
    for entry in entries:
        table.remove(*entry.ident)
    return entries


def _encode(table: Table, as_json: bool) -> bytes:
    if as_json:
        return table.to_json(keep_order=True).encode("utf-8")
    return table.to_bytes(keep_order=True)


__all__ = [
    "CACHE_FORMAT",
    "CACHE_META",
    "CacheFormatError",
    "Plan",
    "cache_format_of",
    "encode_plan",
    "plan_persist",
    "staleness",
]
