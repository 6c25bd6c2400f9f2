"""``auto`` mode's cache table: where it lives, how it is read, and how decisions are persisted.

The cache is an ordinary table file (``show``, ``validate``, ``coverage`` read it like any
other), kept per user and per GPU arch: ``<user cache dir>/megatron_tuning/<arch>/auto.msgpack``
(``platformdirs``; ``XDG_CACHE_HOME`` is respected), or ``MEGATRON_TUNING_CACHE`` / the policy's
``cache``. Decisions that ``auto`` tuned or adopted are merged into it under its file lock with an
atomic write, so a crash loses at most the entries not yet written, never the file.

The cache is ours, not the user's, so problems with it never stop a job: a corrupt cache is left
untouched and ignored for the run (with one warning that names it and the fix), and an unwritable
folder turns persistence off for the run (one warning at start, naming the path).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..core.decisions import Decision
from ..core.errors import TableError
from ..core.policy import CACHE_OFF, ENV_CACHE, TuningPolicy, cache_from_env
from .entry import entry_with
from .recording import entry_from_decision
from .search import installed_triton_version
from .table import Table, load_table, merge_entries

logger = logging.getLogger(__name__)

CACHE_FILE_NAME = "auto.msgpack"
PERSISTED_SOURCES = ("tuned", "adopted")
_LOCK_TIMEOUT_S = 60.0


def default_cache_dir() -> Path:
    """``<user cache dir>/megatron_tuning``: ``$XDG_CACHE_HOME/megatron_tuning`` or ``~/.cache/...``."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("megatron_tuning", appauthor=False))


def cache_path(policy: TuningPolicy, arch: str) -> str | None:
    """The cache file for ``arch``: the policy's ``cache``, else ``MEGATRON_TUNING_CACHE`` (read now,
    as ``MEGATRON_TUNING_TABLE`` is for a policy built in code), else the per-user default.
    ``None`` when the cache is ``off``."""
    chosen = policy.cache or cache_from_env()  # by the knob rule: "OFF" and "0" are off, not files
    if chosen == CACHE_OFF:
        return None
    if chosen:
        return os.path.abspath(os.path.expanduser(chosen))
    return str(default_cache_dir() / arch / CACHE_FILE_NAME)


@dataclass
class AutoCache:
    """One run's view of the cache: what was loaded, and the decisions still to persist."""

    path: str
    table: Table
    writable: bool
    _written: set[tuple[str, str, str]] = field(default_factory=set)

    def persist(self, decisions: Iterable[Decision]) -> int:
        """Merge this run's ``tuned``/``adopted`` decisions not yet written; return how many were new.

        Never raises: a failed write is logged as an error naming the cache file (the run's
        results are not at stake, only the next run's start-up time).
        """
        if not self.writable:
            return 0
        version = installed_triton_version()
        entries = []
        for decision in decisions:
            ident = (decision.arch, decision.kernel, decision.key)
            if decision.source not in PERSISTED_SOURCES or ident in self._written:
                continue
            entry = entry_from_decision(decision, triton_version=version)
            if entry is None:
                continue
            if decision.source == "adopted":
                entry = entry_with(
                    entry, note=f"adopted in auto mode from {decision.origin or 'another rank'}"
                )
            entries.append((ident, entry))
        if not entries:
            return 0
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            merge_entries(self.path, [entry for _, entry in entries], timeout_s=_LOCK_TIMEOUT_S)
        except (OSError, TableError) as exc:
            logger.error(
                "megatron_tuning: could not write %d tuned entr%s to the auto cache %s: %s. "
                "They will be tuned again next run; set %s to a writable file to keep them.",
                len(entries),
                "y" if len(entries) == 1 else "ies",
                self.path,
                exc,
                ENV_CACHE,
            )
            return 0
        self._written.update(ident for ident, _ in entries)
        logger.info(
            "auto cache: %d entr%s merged into %s",
            len(entries),
            "y" if len(entries) == 1 else "ies",
            self.path,
        )
        return len(entries)


def open_cache(policy: TuningPolicy, arch: str) -> AutoCache | None:
    """Load the cache ``policy`` names for ``arch`` (missing file: empty); ``None`` when off or corrupt."""
    path = cache_path(policy, arch)
    if path is None:
        return None
    if os.path.isdir(path):
        logger.warning(
            "megatron_tuning: the auto cache %s is a folder, not a table file; running without a cache. "
            "Set %s to a file path (e.g. %s).",
            path,
            ENV_CACHE,
            os.path.join(path, CACHE_FILE_NAME),
        )
        return None
    table = Table(meta={"kind": "auto-cache"})
    if os.path.exists(path):
        try:
            table = load_table(path)
        except TableError as exc:
            logger.warning(
                "megatron_tuning: ignoring the auto cache for this run, it is unreadable (%s). The file "
                "is left as it is; delete or move it to start a new cache, or set %s elsewhere.",
                exc,
                ENV_CACHE,
            )
            return None
    return AutoCache(path=path, table=table, writable=_writable(path))


def _writable(path: str) -> bool:
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        problem = f"cannot create its folder ({exc.strerror or exc})"
    else:
        if os.access(folder, os.W_OK | os.X_OK) and (not os.path.exists(path) or os.access(path, os.W_OK)):
            return True
        problem = "it is not writable"
    logger.warning(
        "megatron_tuning: the auto cache %s cannot be written (%s); decisions tuned in this run will "
        "not persist. Set %s to a writable file, or to 'off'.",
        path,
        problem,
        ENV_CACHE,
    )
    return False


__all__ = ["AutoCache", "cache_path", "default_cache_dir", "open_cache"]
