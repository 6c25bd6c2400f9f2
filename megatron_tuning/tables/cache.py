"""``auto`` mode's cache: one table file per user and GPU arch (docs/cache.md). First persisted
wins, so overlapping jobs converge on one config per key; a persist evicts stale entries, then the
oldest past the entry cap or a byte bound. Never stops a job: each problem is one notice."""

from __future__ import annotations

import collections
import logging
import math
import operator
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..core import __version__
from ..core.decisions import Decision
from ..core.errors import TableError
from ..core.identity import config_signature
from ..core.notices import warn_once
from ..core.policy import CACHE_OFF, ENV_CACHE, ENV_CACHE_MAX_ENTRIES, TuningPolicy
from . import files
from .entry import Entry, Ident, entry_with, same_config
from .records import content_ident, entry_from_decision
from .search import installed_triton_version, staleness
from .table import Table, table_bytes, table_from_data

logger = logging.getLogger(__name__)

CACHE_FILE_NAME = "auto.msgpack"
# Bump when what an entry means changes (e.g. how keys are written): an older cache is then
# evicted whole at its next persist, and a newer one is never written.
CACHE_FORMAT = 1
CACHE_META = {"kind": "auto-cache", "cache_format": str(CACHE_FORMAT)}
PERSISTED_SOURCES = ("tuned", "adopted")
# 10 processes persisting 100 new entries each into a full 16 MiB cache at once on a loaded 2-core
# machine: the slowest took 72 s (docs/cache.md).
LOCK_TIMEOUT_S = 120.0

_Hashes = dict[tuple[str, str], str]  # (arch, kernel) -> the source hash this run used
_Offered = dict[Ident, frozenset[str]]  # (arch, kernel, key) -> the signatures its tuning timed
_provenance = operator.attrgetter("arch", "kernel", "source_hash", "triton_version")


def default_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("megatron_tuning", appauthor=False))


def cache_path(policy: TuningPolicy, arch: str | Callable[[], str]) -> str | None:
    """The policy's cache file, else the per-user one for ``arch`` (a callable is called only then)."""
    if policy.cache == CACHE_OFF:
        return None
    if policy.cache:
        return os.path.abspath(os.path.expanduser(policy.cache))
    return str(default_cache_dir() / (arch if isinstance(arch, str) else arch()) / CACHE_FILE_NAME)


def open_cache(policy: TuningPolicy, arch: str | Callable[[], str]) -> AutoCache | None:
    """The cache ``policy`` names for ``arch``, read now; ``None`` when off, a folder or unreadable."""
    path = cache_path(policy, arch)
    if path is None:
        return None
    if os.path.isdir(path):
        _notice(
            path,
            "folder",
            f"the auto cache {path} is a folder, not a table file; running without a "
            f"cache. Set {ENV_CACHE} to a file path (e.g. {os.path.join(path, CACHE_FILE_NAME)}).",
        )
        return None
    try:
        data = _read(path)
        loaded = Table(meta=CACHE_META) if data is None else table_from_data(data, path)
    except (OSError, TableError) as exc:
        _notice(
            path,
            "unreadable",
            f"ignoring the auto cache for this run, it is unreadable ({exc}). The file "
            f"is left as it is; delete or move it to start a new cache, or set {ENV_CACHE} elsewhere.",
        )
        return None
    found, order = _format(loaded)
    if order:  # its entries mean something else (e.g. keys written another way)
        what = "the next persist replaces them" if order < 0 else "this run does not write to it"
        _notice(
            path,
            "format",
            f"the auto cache {path} is in cache format {found}, this version uses "
            f"{CACHE_FORMAT}: its entries are not used, and {what}. Set {ENV_CACHE} to another file "
            "to keep versions apart.",
        )
    # Checked now: a run learns at start-up, not at its end, that nothing it tunes will persist.
    problem = files.output_folder_problem(os.path.dirname(path)) if order <= 0 else None
    if problem is None and order <= 0 and os.path.exists(path) and not os.access(path, os.W_OK):
        problem = "the file is read-only"
    if problem is not None:
        _notice(
            path,
            "unwritable",
            f"the auto cache {path} cannot be written ({problem}); decisions tuned in "
            f"this run will not persist. Set {ENV_CACHE} to a writable file, or to 'off'.",
        )
    return AutoCache(
        path=path,
        table=Table(meta=CACHE_META) if order else loaded,
        writable=order <= 0 and problem is None,
        max_entries=policy.cache_max_entries,
        _seen=None if data is None else (data, loaded),
    )


@dataclass
class AutoCache:
    """One run's cache: what lookups see, and the decisions still to persist into the file."""

    path: str
    table: Table  # what lookups see: the file as read at start-up (persists do not change it)
    writable: bool
    max_entries: int
    lock_timeout_s: float = LOCK_TIMEOUT_S
    _seen: tuple[bytes, Table] | None = None  # the file as this process last read or wrote it
    _written: set[Ident] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def persist(self, decisions: Iterable[Decision]) -> int:
        """Merge this run's ``tuned``/``adopted`` decisions not yet persisted into the file; return
        how many entries that added. Never raises: a failed write is one warning, its entries kept
        for the next persist."""
        if not self.writable:
            return 0
        decisions = list(decisions)
        with self._lock:
            version = installed_triton_version()
            pending = self._pending(decisions, version)
            if not pending:
                return 0
            hashes = {(d.arch, d.kernel): d.source_hash for d in decisions if d.source_hash}
            try:
                plan = self._write(pending, hashes, _offered(decisions), version)
            except (OSError, TableError) as exc:
                problem = exc.problem if isinstance(exc, TableError) else exc.strerror or str(exc)
                self._warn_once(
                    "write",
                    f"megatron_tuning: the auto cache {self.path} was not written ({problem}). "
                    f"{_count(len(pending), 'new entry')} kept in memory for the next persist "
                    "(handle.persist() or close); if none succeeds, they are tuned again next run. If "
                    f"this repeats, set {ENV_CACHE} to another file, or to 'off'.",
                )
                return 0
            self._written.update(entry.ident for entry in pending)
            self._report(plan)
            return sum(plan.table.get(*entry.ident) is entry for entry in plan.added)

    def on_decision(self, decision: Decision) -> None:
        """Decision-log listener: what this rank measured is persisted at once (a run killed after a
        tune keeps it); adopted keys wait for the next persist."""
        if decision.source in PERSISTED_SOURCES and decision.timings is not None:
            self.persist([decision])

    def _pending(self, decisions: list[Decision], version: str | None) -> list[Entry]:
        pending: dict[Ident, Entry] = {}
        for decision in decisions:
            ident = (decision.arch, decision.kernel, decision.key)
            if decision.source not in PERSISTED_SOURCES or ident in self._written or ident in pending:
                continue
            entry = entry_from_decision(decision, triton_version=version)
            if entry is not None:
                note = f"adopted in auto mode from {decision.origin or 'another rank'}"
                pending[ident] = entry_with(entry, note=note) if decision.source == "adopted" else entry
        return list(pending.values())

    def _write(self, pending: list[Entry], hashes: _Hashes, offered: _Offered, version: str | None) -> _Plan:
        # Without the lock first: when every key is already there (the ranks of a node persisting
        # the same adopted keys at close), nothing is locked or written.
        data = _read(self.path)
        plan = _keep_first(self._base(data), pending, hashes, offered, version, self.max_entries)
        if not plan.changed:
            return plan
        with files.locked(self.path, timeout_s=self.lock_timeout_s, wait_level=logging.INFO):
            current = _read(self.path)
            if current != data:  # another writer got in first: merge into what it wrote
                plan = _keep_first(self._base(current), pending, hashes, offered, version, self.max_entries)
                if not plan.changed:
                    return plan
            # A quarter of the read limit: the file stays readable, with room for its JSON view.
            payload = _encode(plan, files.MAX_FILE_BYTES // 4, as_json=self.path.endswith(".json"))
            files.write_atomic(self.path, payload)
        self._seen = (payload, plan.table)
        return plan

    def _base(self, data: bytes | None) -> Table:
        """The file's content, decoded only when its bytes changed; a newer format raises ``TableError``."""
        if data is None:
            return Table(meta=CACHE_META)
        if self._seen is None or self._seen[0] != data:
            self._seen = (data, table_from_data(data, self.path))
        found, order = _format(self._seen[1])
        if order > 0:
            problem = f"it is in cache format {found}, newer than this version's {CACHE_FORMAT}"
            raise TableError(self.path, problem)
        return self._seen[1]

    def _report(self, plan: _Plan) -> None:
        for pairs, what, ours_as in (
            (plan.replaced, "replaced {} whose config the kernel no longer offers", "re-tuned"),
            (plan.kept, "kept {} another run persisted first (later runs launch the cache's)", "this run"),
        ):
            if pairs:
                old, ours = pairs[0]
                done = what.format(_count(len(pairs), "entry"))
                example = f"{old.kernel} [{_shortened(old.key)}]: cache {config_signature(old.config)}"
                example += f", {ours_as} {config_signature(ours.config)}"
                logger.info(f"auto cache {self.path}: {done} (e.g. {example})")
        if plan.stale:
            reasons = sorted(collections.Counter(reason for _, reason in plan.stale).items())
            why = ", ".join(f"{count} {reason}" for reason, count in reasons)
            logger.info(f"auto cache {self.path}: evicted {_count(len(plan.stale), 'stale entry')} ({why})")
        if plan.evicted:
            bound = f"cap of {self.max_entries} entries"
            bound = f"bound of {files.MAX_FILE_BYTES // 4} bytes (and a {bound})" if plan.by_bytes else bound
            first = plan.evicted[0]
            self._warn_once(
                "cap",
                f"megatron_tuning: the auto cache {self.path} reached its {bound}, below the "
                f"{files.MAX_FILE_BYTES}-byte read limit for tables: evicted the "
                f"{_count(len(plan.evicted), 'entry')} persisted longest ago (the first: {first.kernel} "
                f"[{_shortened(first.key)}]); they are tuned again when next used. It now holds "
                f"{len(plan.table)} entries, {plan.size} bytes. To keep them: `python -m megatron_tuning "
                f"export {self.path} tuned.json`, review, `import` it and commit it as a table "
                f"(MEGATRON_TUNING_TABLE), then delete the cache; or raise {ENV_CACHE_MAX_ENTRIES} (now "
                f"{self.max_entries}; the byte bound holds whatever it says).",
            )
        if plan.size:
            logger.info(
                f"auto cache: {_count(len(plan.added), 'entry')} merged into {self.path} "
                f"({len(plan.table)} entries, {plan.size} bytes)"
            )

    def _warn_once(self, kind: str, message: str) -> None:
        # One notice per kind and policy; repeats (a persist called often) are logged at INFO.
        if not _notice(self.path, kind, message):
            logger.info("%s", message)


def _notice(path: str, kind: str, message: str) -> bool:
    # Rank-local: each node has a cache of its own, so rank 0's may be fine.
    return warn_once(("auto-cache", path, kind), message, rank_local=True)


@dataclass
class _Plan:
    """What one persist does: the table to write, and what happened to which entries."""

    table: Table
    added: list[Entry] = field(default_factory=list)
    kept: list[tuple[Entry, Entry]] = field(default_factory=list)  # (the file's, ours): another config
    stale: list[tuple[Entry, str]] = field(default_factory=list)
    replaced: list[tuple[Entry, Entry]] = field(default_factory=list)  # (the file's, ours): not launchable
    evicted: list[Entry] = field(default_factory=list)  # oldest first past a bound; may include added
    by_bytes: bool = False  # the byte bound evicted, not only the entry cap
    size: int = 0  # bytes written (0: nothing written)

    @property
    def changed(self) -> bool:
        return bool(self.added or self.stale or self.evicted)


def _keep_first(
    base: Table, pending: list[Entry], hashes: _Hashes, offered: _Offered, version: str | None, cap: int
) -> _Plan:
    """``pending`` merged into a copy of ``base``: stale entries evicted, new keys added (first
    persisted wins, unless the kernel no longer offers its config), the oldest evicted past ``cap``."""
    found, order = _format(base)
    plan = _Plan(base.copy())
    table = plan.table
    if order:
        plan.stale = [(entry, f"in cache format {found}") for entry in table.values()]
    else:
        # Staleness depends only on an entry's provenance, and a cache holds few distinct ones:
        # judge those, and walk the entries only when one is stale.
        kinds = {_provenance(entry): entry for entry in table.values()}
        reasons = {kind: staleness(entry, hashes.get(kind[:2]), version) for kind, entry in kinds.items()}
        if any(reasons.values()):
            plan.stale = [(e, why) for e in table.values() if (why := reasons[_provenance(e)])]
    for entry, _ in plan.stale:
        table.remove(*entry.ident)
    # One kernel by content under another module name (an eval pipeline's loads) holds the key too.
    twins = {content_ident(entry): entry for entry in table.values()}
    for entry in pending:
        old = table.get(*entry.ident) or twins.get(content_ident(entry))
        live = offered.get(entry.ident)
        if old is not None and live is not None and config_signature(old.config) not in live:
            table.remove(*old.ident)  # no run of this kernel can launch it: every run would re-tune
            plan.replaced.append((old, entry))
            old = None
        if old is None:
            table.add(entry)
            twins[content_ident(entry)] = entry
            plan.added.append(entry)
        elif not same_config(old.config, entry.config):
            plan.kept.append((old, entry))
    if len(table) > cap:
        plan.evicted = _evict_oldest(table, len(table) - cap)
    table.meta = {**base.meta, **CACHE_META}
    table.library_version = __version__
    return plan


def _offered(decisions: list[Decision]) -> _Offered:
    """The configs each measured decision chose among (the tuner's ``timings["candidates"]``: the
    live configs after pruning); a decision without them offers no evidence, so replaces nothing."""
    offered = {}
    for d in decisions:
        candidates = d.timings.get("candidates") if isinstance(d.timings, dict) else None
        if isinstance(candidates, dict):
            offered[(d.arch, d.kernel, d.key)] = frozenset(candidates)
    return offered


def _encode(plan: _Plan, max_bytes: int, *, as_json: bool) -> bytes:
    """``plan.table`` encoded in entry order, its oldest entries evicted until it fits."""
    table = plan.table
    while True:
        payload = table.to_json(keep_order=True).encode() if as_json else table.to_bytes(keep_order=True)
        if len(payload) <= max_bytes or not len(table):
            plan.size = len(payload)
            return payload
        # A little more than the excess, so one re-encode almost always suffices.
        drop = math.ceil((len(payload) - max_bytes) * 1.02 * len(table) / len(payload)) + 1
        plan.evicted += _evict_oldest(table, min(drop, len(table)))
        plan.by_bytes = True


def _evict_oldest(table: Table, count: int) -> list[Entry]:
    oldest = table.values()[:count]
    for entry in oldest:
        table.remove(*entry.ident)
    return oldest


def _read(path: str) -> bytes | None:
    """The cache file's bytes; ``None`` when there is none yet (a dangling symlink: written through)."""
    return table_bytes(path) if os.path.exists(path) else None


def _format(table: Table) -> tuple[str, int]:
    """The cache format a header names (none: 1), and -1, 0 or 1: older, this version's, newer."""
    found = table.meta.get("cache_format", "1")
    number = int(found) if found.isascii() and found.isdigit() else CACHE_FORMAT + 1
    return found, (number > CACHE_FORMAT) - (number < CACHE_FORMAT)


def _shortened(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _count(count: int, noun: str) -> str:
    return f"{count} {noun if count == 1 else noun[:-1] + 'ies'}"  # the nouns here end in "entry"
