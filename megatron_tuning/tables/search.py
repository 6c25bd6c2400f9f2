"""The table search path behind one ``lookup``: the policy's tables, the shipped ``configs/<arch>/``
(lazily), then ``auto``'s cache, earlier wins. A kernel id without a fresh entry of its own is
answered by one of the same code under another module name; a stale entry is warned about once per
cause, then used, skipped or raised (``stale_entries``)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..core import notices
from ..core.choice import TableHit
from ..core.errors import StaleEntryError, TableError
from ..core.fallback import nearest_keys
from ..core.identity import content_name, split_kernel_id
from ..core.key import Key
from ..core.notices import warn_once
from .entry import Entry, Ident
from .files import broken_link_problem
from .table import Table, load_table

if TYPE_CHECKING:
    from ..core.policy import TuningPolicy

logger = logging.getLogger(__name__)

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # megatron_tuning/


def shipped_tables_dir() -> Path:
    """The per-arch table folders: an install's ``_configs``, else a checkout's ``configs/``."""
    installed = _PACKAGE_DIR / "_configs"
    checkout = _PACKAGE_DIR.parent / "configs"
    if not installed.is_dir() and checkout.is_dir() and (_PACKAGE_DIR.parent / "setup.py").is_file():
        return checkout
    return installed


def installed_triton_version() -> str | None:
    """The installed Triton's version, from package metadata (no ``import triton``)."""
    try:
        return importlib.metadata.version("triton")
    except Exception:  # not installed, or broken metadata: staleness checks then skip Triton
        return None


def staleness(entry: Entry, source: str | None, triton: str | None) -> str | None:
    """Why ``entry`` is stale for the running ``source`` hash and ``triton`` version, if it is."""
    problems = []
    if entry.source_hash not in (None, source) and source is not None:
        problems.append(f"kernel source hash {entry.source_hash[:12]} in the table, {source[:12]} running")
    if entry.triton_version not in (None, triton) and triton is not None:
        problems.append(f"tuned with Triton {entry.triton_version}, running {triton}")
    return "; ".join(problems) or None


def expand_table_paths(paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Files named by ``paths`` (folders: their ``*.msgpack`` in name order), deduplicated. A missing
    path or an empty folder raises ``TableError``: a typo must not fall back to the cheapest config."""
    if isinstance(paths, (str, os.PathLike)):  # one path, not a sequence of characters
        paths = [paths]
    files: dict[str, str] = {}  # real path -> the first name given for it
    for raw in paths:
        path = os.fspath(raw)
        if not path:
            continue
        if os.path.isdir(path):
            found = sorted(str(p) for p in Path(path).glob("*.msgpack") if p.is_file())
            if not found:
                hint = " (JSON views load only by file name, or convert them with `import`)"
                hint = hint if any(Path(path).glob("*.json")) else ""
                raise TableError(path, f"folder holds no *.msgpack tables{hint}")
        elif os.path.exists(path):
            found = [path]
        elif os.path.islink(path):  # a loop or a dangling link: say so, not "no such file"
            raise TableError(path, broken_link_problem(path) or "cannot follow this symlink")
        else:
            where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
            raise TableError(path, f"no such file or folder{where}")
        for name in found:
            files.setdefault(os.path.realpath(name), name)
    return list(files.values())


class TableSet:
    """Tables searched in order, earlier wins; implements ``core.choice.ConfigTable``."""

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]] = (),
        *,
        shipped_dir: str | os.PathLike[str] | None = None,
        stale_entries: str = "use",
        triton_version: str | None = None,
        cache: tuple[str, Table] | None = None,
    ) -> None:
        # ``cache``: ``auto``'s (path, content), searched last: the tables before it are inputs every
        # rank compared, a node's cache is not, so it must not shadow them. Its stale entries miss.
        self.stale_entries = stale_entries
        self.triton_version = triton_version if triton_version is not None else installed_triton_version()
        self._shipped_dir = Path(shipped_dir) if shipped_dir is not None else None
        self._lock = threading.Lock()
        try:
            names = expand_table_paths(paths)
        except TableError as exc:
            hint = " (check the policy's tables / MEGATRON_TUNING_TABLE)"
            raise TableError(exc.path, exc.problem + hint) from None
        self._tables: list[tuple[str, Table]] = [(name, load_table(name)) for name in names]
        self.named_files = tuple(names)  # what the session's ranks compare (with ``shipped_dir``)
        self.cache_file: str | None = None  # auto's: its hits are this node's, proposed to the job
        self._cache: list[tuple[str, Table]] = []  # after every table, shipped ones loaded later too
        if cache is not None and os.path.realpath(cache[0]) not in {os.path.realpath(n) for n in names}:
            self.cache_file = cache[0]
            self._cache.append(cache)
        self._shipped_archs: set[str] = set()
        # First wins, O(1); later files' entries for an ident are scanned only when it is stale.
        self._index: dict[Ident, tuple[Entry, str]] = {}
        self._keys: dict[tuple[str, str], list[Key]] = {}  # (arch, kernel) -> keys, for nearest
        self._content: dict[tuple[str, str], list[str]] | None = None  # (arch, content name) -> ids
        for name, table in self._tables + self._cache:
            self._add_to_index(name, table)
        logger.info("Tuning tables: %s", ", ".join(self.files) or "(none)")

    @classmethod
    def from_policy(
        cls,
        policy: TuningPolicy,
        *,
        triton_version: str | None = None,
        cache: tuple[str, Table] | None = None,
    ) -> TableSet:
        return cls(
            policy.tables,
            shipped_dir=shipped_tables_dir() if policy.use_shipped_tables else None,
            stale_entries=policy.effective_stale_entries,
            triton_version=triton_version,
            cache=cache,
        )

    @property
    def shipped_dir(self) -> Path | None:
        """The folder of shipped per-arch tables this set searches, if any."""
        return self._shipped_dir

    @property
    def files(self) -> list[str]:
        """Loaded table files in search order (shipped ones appear once loaded)."""
        return [name for name, _ in self._tables + self._cache]

    def lookup(
        self,
        kernel: str,
        key: Key,
        *,
        arch: str,
        source_hash: str | None = None,
        config_list_digest: str | None = None,
        nearest: bool = False,
    ) -> list[TableHit]:
        """The kernel id's own entry, else, where that is missing or tuned for other source, one of
        the same source (and config list, where both are known) under another module name; with
        ``nearest``, usable entries of comparable keys, nearest first, then those of such twins
        (stale ones only under ``'use'``, never raised)."""
        self._load_shipped(arch)
        if nearest:
            return self._neighbours(kernel, key, arch, source_hash, config_list_digest)
        ident = (arch, kernel, key)
        # An entry of this very kernel id that may be for the running source wins over a twin.
        if source_hash is not None and not any(
            e.source_hash in (None, source_hash) for e, _ in self._all_for(ident)
        ):
            for twin in self._twins(arch, kernel):
                hit = self._twin_hit((arch, twin, key), source_hash, config_list_digest, self.stale_entries)
                if hit is not None:
                    return [TableHit(hit.config, hit.origin, key, kernel=twin, numerics=hit.numerics)]
        hit = self._resolve(ident, source_hash, self.stale_entries)
        if hit is not None:
            return [hit]
        module, qualname, digest = split_kernel_id(kernel)
        plain = (arch, f"{module}:{qualname}", key)
        if digest is None or plain not in self._index:
            return []
        # A plain-id entry that stored this kernel's own config list digest was tuned for it (its id
        # was plain where it was tuned, or on a rank that launched it before a variant existed).
        mine = config_list_digest or digest
        found = self._all_for(plain)
        ours = [(e, origin) for e, origin in found if e.config_list_digest == mine]
        hit = self._pick(plain, ours, source_hash, self.stale_entries) if ours else None
        if hit is None and any(e.config_list_digest is None for e, _ in found):  # another list's: not ours
            notices.ambiguous_entry(plain[1], kernel, key, self._index[plain][1])
        return [] if hit is None else [hit]

    def _neighbours(
        self, kernel: str, key: Key, arch: str, source_hash: str | None, digest: str | None
    ) -> list[TableHit]:
        strictness = "use" if self.stale_entries == "use" else "miss"
        hits = []
        for other_kernel in [kernel, *(self._twins(arch, kernel) if source_hash is not None else ())]:
            with self._lock:
                keys = list(self._keys.get((arch, other_kernel), ()))
            for other in nearest_keys(key, keys):
                ident = (arch, other_kernel, other)
                if other_kernel == kernel:
                    hit = self._resolve(ident, source_hash, strictness)
                else:  # a twin: only listed when source_hash is known
                    hit = self._twin_hit(ident, source_hash or "", digest, strictness)
                if hit is not None:
                    twin = None if other_kernel == kernel else other_kernel
                    hits.append(TableHit(hit.config, hit.origin, other, kernel=twin))
        return hits

    def _twin_hit(
        self, ident: Ident, source_hash: str, digest: str | None, stale_entries: str
    ) -> TableHit | None:
        # Same source, and the same config list where both are known: another list is another kernel.
        same_code = [
            (e, origin)
            for e, origin in self._all_for(ident)
            if e.source_hash == source_hash and (digest is None or e.config_list_digest in (None, digest))
        ]
        return self._pick(ident, same_code, source_hash, stale_entries)

    def _twins(self, arch: str, kernel: str) -> list[str]:
        with self._lock:
            if self._content is None:
                self._content = {}
                for entry_arch, name in self._keys:
                    self._content.setdefault((entry_arch, content_name(name)), []).append(name)
            return [other for other in self._content.get((arch, content_name(kernel)), ()) if other != kernel]

    def _resolve(self, ident: Ident, source_hash: str | None, stale_entries: str) -> TableHit | None:
        first = self._index.get(ident)
        if first is None:
            return None
        scan = stale_entries == "miss" or first[1] == self.cache_file
        return self._pick(ident, self._all_for(ident) if scan else [first], source_hash, stale_entries)

    def _pick(
        self, ident: Ident, candidates: list[tuple[Entry, str]], source_hash: str | None, stale_entries: str
    ) -> TableHit | None:
        arch, kernel, key = ident
        for entry, origin in candidates:
            detail = staleness(entry, source_hash, self.triton_version)
            if detail is not None and origin == self.cache_file:  # ours: re-tuned for the running code
                logger.debug("stale cache entry %s [%s] in %s (%s): a miss", kernel, key, origin, detail)
                continue
            if detail is not None:
                if stale_entries == "error":
                    raise StaleEntryError(kernel, key, origin, detail)
                # One warning per cause: a kernel edit or a Triton upgrade makes every key of the
                # kernel stale at once, and one line per key would bury the log.
                use = stale_entries == "use"
                message = (
                    f"Table entry for kernel {kernel} key {key} in {origin} is stale ({detail}); "
                    f"{'using it anyway' if use else 'ignoring it'} (stale_entries={stale_entries!r}). "
                    f"{'Re-tune to refresh it. ' if use else ''}Other keys of this kernel stale for the same "
                    f"reason are {'used' if use else 'ignored'} without another warning."
                )
                warn_once(("stale-entry", arch, kernel, origin, detail), message, rank_local=True)
                if not use:
                    continue
            return TableHit(MappingProxyType(entry.config), origin, entry.key, numerics=entry.numerics)
        return None

    def _all_for(self, ident: Ident) -> list[tuple[Entry, str]]:
        with self._lock:
            tables = self._tables + self._cache
        return [(entry, name) for name, table in tables if (entry := table.get(*ident)) is not None]

    def _add_to_index(self, name: str, table: Table) -> None:
        self._content = None  # rebuilt from _keys on the next content query
        for entry in table.values():
            first = self._index.get(entry.ident)
            if first is None:
                self._keys.setdefault((entry.arch, entry.kernel), []).append(entry.key)
            if first is None or (first[1] == self.cache_file and name != self.cache_file):
                self._index[entry.ident] = (entry, name)  # a shipped table loaded later beats the cache

    def _load_shipped(self, arch: str) -> None:
        if self._shipped_dir is None or arch in self._shipped_archs:
            return
        with self._lock:
            if arch in self._shipped_archs:
                return
            folder = self._shipped_dir / arch
            loaded = {os.path.realpath(name) for name, _ in self._tables + self._cache}
            for name in sorted(str(p) for p in folder.glob("*.msgpack") if p.is_file()):
                if os.path.realpath(name) not in loaded:
                    table = load_table(name)
                    self._tables.append((name, table))
                    self._add_to_index(name, table)
                    logger.info("Loaded shipped tuning table %s (%d entries)", name, len(table))
            self._shipped_archs.add(arch)
