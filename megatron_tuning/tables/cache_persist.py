"""Persisting ``auto``'s decisions into its cache file: ``AutoCache`` (see ``tables.cache``).

``plan_persist`` (``cache_bounds``) decides what the file should hold; this module reads and
writes the file. A persist first reads and merges without the lock: with nothing new it stops
there (no lock, no write). Otherwise it takes the lock, re-reads the file, merges again only if
another writer changed it meanwhile, encodes and replaces it. The file's digest tells whether it
still holds what this process last read or wrote; then it is not decoded again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..core.decisions import Decision
from ..core.errors import TableError
from ..core.policy import ENV_CACHE, ENV_CACHE_MAX_ENTRIES
from . import files
from .cache_bounds import CACHE_META, CacheFormatError, Plan, encode_plan, plan_persist
from .entry import Entry, entry_with
from .files import locked, read_regular_file, write_atomic
from .merge import entry_from_decision
from .search import installed_triton_version
from .table import Table, table_from_data

logger = logging.getLogger(__name__)

PERSISTED_SOURCES = ("tuned", "adopted")
DEFAULT_MAX_ENTRIES = 50_000
MAX_ENTRIES_SETTING = 1_000_000
LOCK_TIMEOUT_S = 120.0
"""How long a persist waits for other writers' locks. Measured (docs/cache.md, 2-core CPU under
load): with 10 processes writing 100 new entries each into a full cache at once, the slowest
persist took 22-31 s at the default cap and 49-72 s at the 16 MiB bound (where the old code's 60 s
timeout dropped 4-5 writers' entries). Ranks persisting keys another rank already wrote take no
lock at all."""


def max_cache_bytes() -> int:
    """The byte bound of a cache file this library writes: a quarter of the table read limit, so
    the file stays readable with room for one persist's growth and for its JSON view."""
    return files.MAX_FILE_BYTES // 4


def legacy_read_bytes() -> int:
    """How large a cache file ``open_cache`` still reads (with a warning): 4x the table read limit,
    for caches older versions let grow past that limit."""
    return files.MAX_FILE_BYTES * 4


def content_digest(data: bytes | None) -> str:
    """The digest ``AutoCache.digest`` reports for a cache file's bytes (``""``: no file)."""
    # sha256: hardware-accelerated on current x86 and Arm CPUs (measured 2.4x faster than blake2b here).
    return "" if data is None else hashlib.sha256(data).hexdigest()[:32]


class _LockProblem(Exception):
    def __init__(self, path: str, problem: str) -> None:
        super().__init__(problem)
        self.path, self.problem = path, problem


@dataclass
class _View:
    """What this process last saw in the file: its digest and a private copy of its content."""

    digest: str
    table: Table


@dataclass
class AutoCache:
    """One run's view of the cache: what was loaded, and the decisions still to persist."""

    path: str
    table: Table
    """What lookups see: the file as loaded at start-up (persists do not change it)."""
    writable: bool
    max_entries: int = DEFAULT_MAX_ENTRIES
    digest: str = ""
    """Content digest of the file as loaded at start-up (``content_digest``; ``""``: no file).
    Two ranks with equal digests looked up in equal caches."""
    lock_timeout_s: float = LOCK_TIMEOUT_S
    loaded: Table | None = None
    """The file's whole content as loaded with ``digest`` (``None``: not read): the first persist
    merges into it without decoding the file again if the file is unchanged."""
    warned_oversize: bool = False
    """Whether opening already warned that the file is over its bound (the eviction then logs at INFO)."""
    shrink_due: bool = False
    """The file as loaded is over the cap: the next persist rewrites it even with nothing new."""
    _view: _View | None = None
    _written: set[tuple[str, str, str]] = field(default_factory=set)
    _warned_cap: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.loaded is not None:
            self._view = _View(self.digest, self.loaded)
        self._warned_cap = self.warned_oversize

    def is_cache_file(self, origin: str | None) -> bool:
        """Whether a ``TableHit.origin`` / ``Decision.origin`` names this cache file."""
        return origin is not None and os.path.realpath(origin) == os.path.realpath(self.path)

    def persist(self, decisions: Iterable[Decision]) -> int:
        """Merge this run's ``tuned``/``adopted`` decisions not yet written; return how many entries
        were added to the file (not counting keys the file already held).

        Never raises: a failed write is logged naming the cache file, and the entries are kept
        for the next persist (the run's results are not at stake, only the next run's start-up).
        """
        if not self.writable:
            return 0
        decisions = list(decisions)
        with self._lock:
            pending = self._pending(decisions)
            if not pending and not self.shrink_due:
                return 0
            hashes = {(d.arch, d.kernel): d.source_hash for d in decisions if d.source_hash}
            try:
                plan = self._commit(pending, hashes)
            except _LockProblem as exc:
                logger.warning(
                    "megatron_tuning: the auto cache %s was not written: %s. %d new entr%s kept in "
                    "memory for the next persist (handle.persist() or close); if this was the last "
                    "one, they will be tuned again next run.",
                    self.path,
                    exc.problem,
                    len(pending),
                    _plural(len(pending)),
                )
                return 0
            except CacheFormatError as exc:
                self.writable = False
                logger.warning(
                    "megatron_tuning: the auto cache %s is not written by this run: %s. Set %s to "
                    "another file to keep this version's entries apart.",
                    self.path,
                    exc,
                    ENV_CACHE,
                )
                return 0
            except (OSError, TableError) as exc:
                logger.error(
                    "megatron_tuning: could not write %d tuned entr%s to the auto cache %s: %s. They "
                    "are kept for the next persist; set %s to a writable file to keep them.",
                    len(pending),
                    _plural(len(pending)),
                    self.path,
                    exc,
                    ENV_CACHE,
                )
                return 0
            self._written.update(entry.ident for entry in pending)
            self.shrink_due = False
            self._report(plan)
            return len(plan.added) - len(plan.evicted_new)

    # -- internals -----------------------------------------------------------------
    def _pending(self, decisions: list[Decision]) -> list[Entry]:
        version = installed_triton_version()
        pending: dict[tuple[str, str, str], Entry] = {}
        for decision in decisions:
            ident = (decision.arch, decision.kernel, decision.key)
            if decision.source not in PERSISTED_SOURCES or ident in self._written or ident in pending:
                continue
            entry = entry_from_decision(decision, triton_version=version)
            if entry is None:
                continue
            if decision.source == "adopted":
                entry = entry_with(
                    entry, note=f"adopted in auto mode from {decision.origin or 'another rank'}"
                )
            pending[ident] = entry
        return list(pending.values())

    def _commit(self, pending: list[Entry], hashes: dict[tuple[str, str], str]) -> Plan:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        # Without the lock first: when every entry is already there (the common case at close,
        # where the ranks of a node persist the same adopted keys), nothing is locked or written.
        data = read_cache_bytes(self.path)
        plan = self._plan(data, pending, hashes)
        if not plan.changed:
            return plan
        with locked(self.path, timeout_s=self.lock_timeout_s, error=_LockProblem, wait_level=logging.INFO):
            current = read_cache_bytes(self.path)
            if current != data:  # another writer got in first: merge into what it wrote
                plan = self._plan(current, pending, hashes)
                if not plan.changed:
                    return plan
            # Encoding happens under the lock: done outside, it would be wasted whenever
            # another writer got in first, which is exactly when CPU time is scarce.
            payload = encode_plan(plan, max_bytes=max_cache_bytes(), as_json=self.path.endswith(".json"))
            write_atomic(self.path, payload)
            self._view = _View(content_digest(payload), plan.table)
        return plan

    def _plan(self, data: bytes | None, pending: list[Entry], hashes: dict[tuple[str, str], str]) -> Plan:
        base = self._base(data)
        self._view = _View(content_digest(data), base)
        return plan_persist(
            base,
            pending,
            triton_version=installed_triton_version(),
            source_hashes=hashes,
            max_entries=self.max_entries,
            rewrite=self.shrink_due,
        )

    def _base(self, data: bytes | None) -> Table:
        if data is None:
            return Table(meta=CACHE_META)
        view = self._view
        if view is not None and view.digest == content_digest(data):
            return view.table  # the file is what we last read or wrote: no decode
        return table_from_data(data, self.path)

    def _report(self, plan: Plan) -> None:
        if plan.kept:
            old, ours = plan.kept[0]
            logger.info(
                "auto cache %s: kept %d entr%s another run persisted first (e.g. %s [%s]: cache %s, "
                "this run %s); later runs launch the cache's",
                self.path,
                len(plan.kept),
                _plural(len(plan.kept)),
                old.kernel,
                _shortened(old.key),
                _signature(old),
                _signature(ours),
            )
        if plan.stale:
            logger.info(
                "auto cache %s: evicted %d stale entr%s (%s)",
                self.path,
                len(plan.stale),
                _plural(len(plan.stale)),
                plan.stale_reasons(),
            )
        if plan.evicted:
            self._warn_cap(plan)
        if plan.payload is not None:
            logger.info(
                "auto cache: %d entr%s merged into %s (%d entries, %d bytes)",
                len(plan.added),
                _plural(len(plan.added)),
                self.path,
                len(plan.table),
                len(plan.payload),
            )

    def _warn_cap(self, plan: Plan) -> None:
        log = logger.info if self._warned_cap else logger.warning
        self._warned_cap = True
        first = plan.evicted[0]
        bound = (
            f"bound of {max_cache_bytes()} bytes (and a cap of {self.max_entries} entries)"
            if "bytes" in plan.evicted_for
            else f"cap of {self.max_entries} entries"
        )
        log(
            "megatron_tuning: the auto cache %s reached its %s, below the %d-byte read limit for "
            "tables: evicted the %d entr%s persisted longest ago (the first: %s [%s]); they are tuned "
            "again when next used. It now holds %d entries, %d bytes. To keep them: `python -m "
            "megatron_tuning export %s tuned.json`, review, `import` it and commit it as a table "
            "(MEGATRON_TUNING_TABLE), then delete the cache; or raise %s (now %d, at most %d; the "
            "byte bound holds whatever it says).",
            self.path,
            bound,
            files.MAX_FILE_BYTES,
            len(plan.evicted),
            _plural(len(plan.evicted)),
            first.kernel,
            _shortened(first.key),
            len(plan.table),
            len(plan.payload or b""),
            self.path,
            ENV_CACHE_MAX_ENTRIES,
            self.max_entries,
            MAX_ENTRIES_SETTING,
        )


def read_cache_bytes(path: str) -> bytes | None:
    """The cache file's bytes, ``None`` when there is none (a dangling symlink: written through);
    bounded by ``legacy_read_bytes()``."""
    if not os.path.exists(path):
        return None
    return read_regular_file(path, error=TableError, max_bytes=legacy_read_bytes())


def _shortened(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plural(count: int) -> str:
    return "y" if count == 1 else "ies"


def _signature(entry: Entry) -> str:
    kwargs = entry.config.get("kwargs", {})
    parts = [f"{k}={v}" for k, v in kwargs.items()]
    parts += [f"{k}={entry.config[k]}" for k in ("num_warps", "num_stages") if k in entry.config]
    return ", ".join(parts)


__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "LOCK_TIMEOUT_S",
    "MAX_ENTRIES_SETTING",
    "PERSISTED_SOURCES",
    "AutoCache",
    "content_digest",
    "legacy_read_bytes",
    "max_cache_bytes",
    "read_cache_bytes",
]
