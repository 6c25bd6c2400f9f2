"""The table search path: several table files behind one ``lookup`` (``core.choice.ConfigTable``).

Order, earlier wins: the policy's explicit ``tables`` → ``MEGATRON_TUNING_TABLE``
(colon-separated) → ``auto`` mode's cache table → the shipped tables ``configs/<arch>/*.msgpack``.
``neighbours`` serves the nearest-shape rule from the same entries, in the same order of trust.
A path may name a file or a folder (its ``*.msgpack`` files, in name order). Explicit and environment
tables load when the set is built, so a bad file fails at startup, not mid-training;
a path that does not exist, or a folder with no ``*.msgpack`` table, fails the same way
(``TableError`` naming it) instead of silently pinning nothing;
shipped tables load lazily, per arch, on the first lookup for that arch. They live in the
repository's top-level ``configs/``; a regular ``pip install .`` copies that folder into the
package as ``megatron_tuning/_configs`` (``setup.py``), a checkout or ``pip install -e .`` leaves
it where it is, and ``shipped_tables_dir`` finds either.

Content matches: the same code loaded under another module name (an eval pipeline's
``spec_from_file_location("candidate", path)``) finds the entries tuned under the first name.
When no entry for the kernel id itself is fresh for the running source, an entry of another
kernel id with the same qualname (and config-list digest, ``core.identity.kernel_id``) and the
*same* source hash answers, and the hit names that id (``TableHit.kernel``). A qualname alone
never matches: an entry without a source hash, or with another one, is never a content match.
Twins are tried in search order (first file, then first entry), so the answer is a pure
function of the tables.

Validators on use: an entry for another arch never applies (arch is part of the key);
an entry whose kernel source hash or Triton version differs from the running one is
*stale*: warned about once per (kernel, file, reason), then used, skipped (a miss, so a
later file may still answer), or raised as ``StaleEntryError``, per ``stale_entries``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..core.choice import TableHit
from ..core.errors import StaleEntryError, TableError
from ..core.identity import content_name
from ..core.nearest import nearest_keys
from ..core.policy import ENV_TABLE, read_knob
from ..core.warn import warn_once
from .files import broken_link_problem
from .table import Entry, Table, load_table

if TYPE_CHECKING:
    from ..core.policy import TuningPolicy

logger = logging.getLogger(__name__)

STALE_CHOICES = ("use", "miss", "error")

_Ident = tuple[str, str, str]
_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # megatron_tuning/


def shipped_tables_dir() -> Path:
    """Return the folder that holds the per-arch table folders (``sm90/`` and so on).

    The installed copy wins over the checkout so that an installed wheel never picks up a
    stray ``configs/`` folder next to ``site-packages``. The returned folder may not exist
    when no table was shipped; callers treat that as "no shipped tables".
    """
    installed = _PACKAGE_DIR / "_configs"
    if installed.is_dir():
        return installed
    checkout = _PACKAGE_DIR.parent / "configs"
    # Only trust a sibling configs/ folder inside a source tree (setup.py next to it), never
    # an unrelated folder of that name in site-packages.
    if checkout.is_dir() and (_PACKAGE_DIR.parent / "setup.py").is_file():
        return checkout
    return installed


def installed_triton_version() -> str | None:
    """The installed Triton's version, read from package metadata (no ``import triton``)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("triton")
        except PackageNotFoundError:
            return None
    except Exception:  # metadata can be broken in odd installs; staleness checks then skip Triton
        return None


def expand_table_paths(
    paths: Iterable[str | os.PathLike[str]], *, allow_empty_folders: bool = False
) -> list[str]:
    """Files named by ``paths`` (folders expand to their ``*.msgpack`` in name order), deduplicated.

    A path that does not exist, or a folder without any ``*.msgpack`` table (unless
    ``allow_empty_folders``), raises ``TableError``: a typo in a table path must not
    silently fall back to the cheapest config. A single ``str``/``PathLike`` is one path.
    """
    if isinstance(paths, (str, os.PathLike)):  # one path, not a sequence of characters
        paths = [paths]
    files: list[str] = []
    seen: set[str] = set()
    for raw in paths:
        path = os.fspath(raw)
        if not path:
            continue
        if os.path.isdir(path):
            found = sorted(str(p) for p in Path(path).glob("*.msgpack") if p.is_file())
            if not found and not allow_empty_folders:
                views = any(Path(path).glob("*.json"))
                raise TableError(
                    path,
                    "folder holds no *.msgpack tables"
                    + (
                        " (JSON views load only by file name, or convert them with `import`)" if views else ""
                    ),
                )
        elif os.path.exists(path):
            found = [path]
        elif os.path.islink(path):  # a loop or a dangling link: say so, not "no such file"
            raise TableError(path, broken_link_problem(path) or "cannot follow this symlink")
        else:
            where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
            raise TableError(path, f"no such file or folder{where}")
        for name in found:
            real = os.path.realpath(name)
            if real not in seen:
                seen.add(real)
                files.append(name)
    return files


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
        """``paths``: files or folders, searched first. ``shipped_dir``: a folder of
        ``<arch>/`` subfolders searched last (``None``: no shipped tables).
        ``triton_version``: the running version to check entries against (default: installed).
        ``cache``: ``auto`` mode's cache table (its path and loaded content), searched after
        ``paths`` and before the shipped tables; a stale cache entry is always a miss."""
        if stale_entries not in STALE_CHOICES:
            raise ValueError(f"stale_entries={stale_entries!r}: expected one of {STALE_CHOICES}")
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
        self._cache_file: str | None = None
        if cache is not None and os.path.realpath(cache[0]) not in {os.path.realpath(n) for n in names}:
            self._cache_file = cache[0]
            self._tables.append(cache)
        self._shipped_archs: set[str] = set()
        # First-wins index over all loaded files: O(1) lookups. Later files' entries for
        # the same ident are found by scanning only when the first one is skipped as stale.
        self._index: dict[_Ident, tuple[Entry, str]] = {}
        # (arch, kernel) -> keys with an entry, for the nearest-shape rule.
        self._keys: dict[tuple[str, str], list[str]] = {}
        # (arch, content name) -> kernel ids in search order; built on the first content query.
        self._content: dict[tuple[str, str], list[str]] | None = None
        for name, table in self._tables:
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
        """The search path a policy asks for: ``policy.tables`` → ``MEGATRON_TUNING_TABLE`` →
        ``cache`` (``auto`` mode's, loaded by ``tables.cache``) → shipped."""
        env_paths = read_knob(ENV_TABLE)
        return cls(
            tuple(policy.tables) + tuple(env_paths),
            shipped_dir=shipped_tables_dir() if policy.use_shipped_tables else None,
            stale_entries=policy.effective_stale_entries,
            triton_version=triton_version,
            cache=cache,
        )

    @property
    def files(self) -> list[str]:
        """Loaded table files in search order (shipped ones appear once loaded)."""
        return [name for name, _ in self._tables]

    def __len__(self) -> int:
        return len(self._index)

    def find(self, kernel: str, key: str, *, arch: str) -> tuple[Entry, str] | None:
        """The first entry for (arch, kernel, key) and its file, without validators."""
        self._load_shipped(arch)
        return self._index.get((arch, kernel, key))

    def lookup(self, kernel: str, key: str, *, arch: str, source_hash: str | None = None) -> TableHit | None:
        """The config to launch for (kernel, key) on ``arch``, or ``None`` (a miss).

        The kernel id's own entry first; where it is missing or tuned for other source, an entry
        of the same code under another module name (a content match, ``TableHit.kernel`` set).
        """
        self._load_shipped(arch)
        ident = (arch, kernel, key)
        if source_hash is not None and not self._has_own_entry(ident, source_hash):
            hit = self._content_hit(arch, kernel, key, source_hash, self.stale_entries)
            if hit is not None:
                return hit
        return self._resolve(ident, source_hash, self.stale_entries)

    def _has_own_entry(self, ident: _Ident, source_hash: str) -> bool:
        """Whether an entry of this very kernel id may be for the running source (then it wins)."""
        first = self._index.get(ident)
        if first is None:
            return False
        if first[0].source_hash in (None, source_hash):
            return True
        return any(entry.source_hash in (None, source_hash) for entry, _ in self._all_for(ident))

    def neighbours(
        self, kernel: str, key: str, *, arch: str, source_hash: str | None = None
    ) -> list[TableHit]:
        """Usable entries of ``kernel`` on ``arch`` for comparable keys, nearest first.

        Stale neighbours are used only under ``stale_entries='use'``; otherwise they are skipped
        (never raised: a neighbour is a fallback, not what the caller asked for).
        """
        self._load_shipped(arch)
        with self._lock:
            keys = list(self._keys.get((arch, kernel), ()))
        strictness = "use" if self.stale_entries == "use" else "miss"
        hits = []
        for other in nearest_keys(key, keys):
            hit = self._resolve((arch, kernel, other), source_hash, strictness)
            if hit is not None:
                hits.append(TableHit(hit.config, hit.origin, other))
        if source_hash is None:
            return hits
        # Then the same code's entries under other module names, twin by twin in search order.
        for twin in self._twins(arch, kernel):
            with self._lock:
                twin_keys = list(self._keys.get((arch, twin), ()))
            for other in nearest_keys(key, twin_keys):
                hit = self._twin_hit((arch, twin, other), source_hash, strictness)
                if hit is not None:
                    hits.append(TableHit(hit.config, hit.origin, other, kernel=twin))
        return hits

    def _content_hit(
        self, arch: str, kernel: str, key: str, source_hash: str, stale_entries: str
    ) -> TableHit | None:
        for twin in self._twins(arch, kernel):
            hit = self._twin_hit((arch, twin, key), source_hash, stale_entries)
            if hit is not None:
                return TableHit(hit.config, hit.origin, kernel=twin)
        return None

    def _twin_hit(self, ident: _Ident, source_hash: str, stale_entries: str) -> TableHit | None:
        same_code = [(e, origin) for e, origin in self._all_for(ident) if e.source_hash == source_hash]
        return self._pick(ident, same_code, source_hash, stale_entries)

    def _twins(self, arch: str, kernel: str) -> list[str]:
        """Other kernel ids with this one's content name on ``arch``, in search order."""
        with self._lock:
            if self._content is None:
                content: dict[tuple[str, str], list[str]] = {}
                for entry_arch, entry_kernel in self._keys:
                    content.setdefault((entry_arch, content_name(entry_kernel)), []).append(entry_kernel)
                self._content = content
            named = self._content.get((arch, content_name(kernel)), ())
            return [other for other in named if other != kernel]

    def _resolve(self, ident: _Ident, source_hash: str | None, stale_entries: str) -> TableHit | None:
        first = self._index.get(ident)
        if first is None:
            return None
        candidates = (
            [first] if stale_entries != "miss" and first[1] != self._cache_file else self._all_for(ident)
        )
        return self._pick(ident, candidates, source_hash, stale_entries)

    def _pick(
        self,
        ident: _Ident,
        candidates: list[tuple[Entry, str]],
        source_hash: str | None,
        stale_entries: str,
    ) -> TableHit | None:
        arch, kernel, key = ident
        for entry, origin in candidates:
            detail = self._staleness(entry, source_hash)
            if detail is None:
                return TableHit(MappingProxyType(entry.config), origin)
            if origin == self._cache_file:
                # A cache is ours, not the user's: an entry tuned for other code is re-tuned.
                logger.debug(
                    "cache entry for %s [%s] in %s is stale (%s): a miss", kernel, key, origin, detail
                )
                continue
            if stale_entries == "error":
                raise StaleEntryError(kernel, key, origin, detail)
            # One warning per cause: a kernel edit or a Triton upgrade makes every key of
            # the kernel stale at once, and one line per key would bury the log.
            cause = ("stale-entry", arch, kernel, origin, detail)
            if stale_entries == "use":
                warn_once(
                    cause,
                    "Table entry for kernel %s key %s in %s is stale (%s); using it anyway "
                    "(stale_entries='use'). Re-tune to refresh it. Other keys of this kernel "
                    "stale for the same reason are used without another warning.",
                    kernel,
                    key,
                    origin,
                    detail,
                )
                return TableHit(MappingProxyType(entry.config), origin)
            warn_once(
                cause,
                "Table entry for kernel %s key %s in %s is stale (%s); ignoring it (stale_entries='miss'). "
                "Other keys of this kernel stale for the same reason are ignored without another warning.",
                kernel,
                key,
                origin,
                detail,
            )
        return None

    # -- internals -----------------------------------------------------------------
    def _staleness(self, entry: Entry, source_hash: str | None) -> str | None:
        problems = []
        if entry.source_hash is not None and source_hash is not None and entry.source_hash != source_hash:
            problems.append(
                f"kernel source hash {entry.source_hash[:12]} in the table, {source_hash[:12]} running"
            )
        if (
            entry.triton_version is not None
            and self.triton_version is not None
            and entry.triton_version != self.triton_version
        ):
            problems.append(f"tuned with Triton {entry.triton_version}, running {self.triton_version}")
        return "; ".join(problems) or None

    def _all_for(self, ident: _Ident) -> list[tuple[Entry, str]]:
        with self._lock:
            tables = list(self._tables)
        found = []
        for name, table in tables:
            entry = table.get(*ident)
            if entry is not None:
                found.append((entry, name))
        return found

    def _add_to_index(self, name: str, table: Table) -> None:
        self._content = None  # rebuilt from _keys on the next content query
        for entry in table.values():
            if entry.ident not in self._index:
                self._index[entry.ident] = (entry, name)
                self._keys.setdefault((entry.arch, entry.kernel), []).append(entry.key)

    def _load_shipped(self, arch: str) -> None:
        if self._shipped_dir is None or arch in self._shipped_archs:
            return
        with self._lock:
            if arch in self._shipped_archs:
                return
            folder = self._shipped_dir / arch
            loaded = {os.path.realpath(name) for name, _ in self._tables}
            names = expand_table_paths([folder], allow_empty_folders=True) if folder.is_dir() else []
            for name in names:
                if os.path.realpath(name) in loaded:
                    continue
                table = load_table(name)
                self._tables.append((name, table))
                self._add_to_index(name, table)
                logger.info("Loaded shipped tuning table %s (%d entries)", name, len(table))
            self._shipped_archs.add(arch)


__all__ = ["TableSet", "expand_table_paths", "installed_triton_version", "shipped_tables_dir"]
