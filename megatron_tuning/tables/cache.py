"""``auto`` mode's cache table: where it lives, how it is read, and how decisions are persisted.

The cache is an ordinary table file (``show``, ``validate``, ``coverage`` read it like any
other), kept per user and per GPU arch: ``<user cache dir>/megatron_tuning/<arch>/auto.msgpack``
(``platformdirs``; ``XDG_CACHE_HOME`` is respected), or ``MEGATRON_TUNING_CACHE`` / the policy's
``cache``. The full reference is ``docs/cache.md``; in short:

* **First persisted wins.** An entry already in the file that is still valid (same kernel source
  hash and Triton version as the running ones) is kept, never replaced: overlapping jobs that tuned
  one key differently leave the config of whichever persisted first, for every later run.
* **Bounded.** Each persist evicts stale entries (another source hash of a kernel this run used,
  another Triton version, an older cache format), then, past ``MEGATRON_TUNING_CACHE_MAX_ENTRIES``
  entries (default 50,000) or ``max_cache_bytes()`` (a quarter of the table read limit), the entries
  persisted longest ago, with one warning naming the file, the cap and the fix. The file's rows are
  kept in the order entries first entered the cache: that order *is* the eviction order.
* **Cheap and concurrent.** A persist with nothing new writes nothing and takes no lock. Otherwise
  it reads, merges and encodes without the lock, then takes the lock only to check that the file
  is unchanged and replace it (re-doing the merge if another writer got in first). A writer that
  cannot get the lock in time warns, naming the holder, and keeps its entries for the next persist.
* **Never stops a job.** A corrupt cache is left untouched and ignored for the run, an unwritable
  folder turns persistence off for the run (one warning each, naming the path and the fix), and
  a crash loses at most the entries not yet written (writes are atomic), never the file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from ..core.errors import TableError
from ..core.policy import CACHE_OFF, ENV_CACHE, ENV_CACHE_MAX_ENTRIES, TuningPolicy, read_knob
from . import files
from .cache_bounds import CACHE_FORMAT, CACHE_META, cache_format_of
from .cache_persist import (
    DEFAULT_MAX_ENTRIES,
    LOCK_TIMEOUT_S,
    PERSISTED_SOURCES,
    AutoCache,
    content_digest,
    legacy_read_bytes,
    max_cache_bytes,
    read_cache_bytes,
)
from .table import Table, table_from_data

logger = logging.getLogger(__name__)

CACHE_FILE_NAME = "auto.msgpack"


def default_cache_dir() -> Path:
    """``<user cache dir>/megatron_tuning``: ``$XDG_CACHE_HOME/megatron_tuning`` or ``~/.cache/...``."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("megatron_tuning", appauthor=False))


def cache_path(policy: TuningPolicy, arch: str | Callable[[], str]) -> str | None:
    """The cache file for ``arch``: the policy's ``cache``, else ``MEGATRON_TUNING_CACHE`` (read now,
    as ``MEGATRON_TUNING_TABLE`` is for a policy built in code), else the per-user default.
    ``None`` when the cache is ``off``. A callable ``arch`` is called only for the default folder,
    so a named cache file never reads the GPU."""
    chosen = policy.cache or read_knob(ENV_CACHE)  # by the knob rule: "OFF" and "0" are off, not files
    if chosen == CACHE_OFF:
        return None
    if chosen:
        return os.path.abspath(os.path.expanduser(chosen))
    return str(default_cache_dir() / (arch if isinstance(arch, str) else arch()) / CACHE_FILE_NAME)


def cache_max_entries() -> int:
    """``MEGATRON_TUNING_CACHE_MAX_ENTRIES`` (read now), default ``DEFAULT_MAX_ENTRIES``; a bad
    value raises ``PolicyError`` naming it."""
    return int(read_knob(ENV_CACHE_MAX_ENTRIES))


def open_cache(policy: TuningPolicy, arch: str | Callable[[], str]) -> AutoCache | None:
    """Load the cache ``policy`` names for ``arch`` (missing file: empty); ``None`` when off or corrupt.

    Reads ``MEGATRON_TUNING_CACHE_MAX_ENTRIES`` (a bad value raises ``PolicyError``).
    """
    path = cache_path(policy, arch)
    if path is None:
        return None
    max_entries = cache_max_entries()
    if os.path.isdir(path):
        logger.warning(
            "megatron_tuning: the auto cache %s is a folder, not a table file; running without a cache. "
            "Set %s to a file path (e.g. %s).",
            path,
            ENV_CACHE,
            os.path.join(path, CACHE_FILE_NAME),
        )
        return None
    table, data = Table(meta=CACHE_META), None
    if os.path.exists(path):  # a dangling symlink is a cache not written yet (written through)
        try:
            data, table = read_cache_file(path)
        except TableError as exc:
            logger.warning(
                "megatron_tuning: ignoring the auto cache for this run, it is unreadable (%s). The file "
                "is left as it is; delete or move it to start a new cache, or set %s elsewhere.",
                exc,
                ENV_CACHE,
            )
            return None
    found = cache_format_of(table)
    usable = found == CACHE_FORMAT
    if not usable:
        _warn_format(path, found)
    newer = not usable and not (isinstance(found, int) and found < CACHE_FORMAT)
    return AutoCache(
        path=path,
        table=table if usable else Table(meta=CACHE_META),
        writable=not newer and _writable(path),
        max_entries=max_entries,
        digest=content_digest(data),
        loaded=table if data is not None else None,
        warned_oversize=data is not None and len(data) > max_cache_bytes(),
        shrink_due=data is not None and (len(data) > max_cache_bytes() or len(table) > max_entries),
    )


def read_cache_file(path: str) -> tuple[bytes, Table]:
    """A cache file's bytes and table, read up to ``legacy_read_bytes()``: a file over the table
    read limit (older versions let caches grow) is read with one warning saying what happens to it.
    Problems raise ``TableError``."""
    data = read_cache_bytes(path)
    if data is None:
        raise TableError(path, "no such file")
    table = table_from_data(data, path)
    if len(data) > max_cache_bytes():
        over_limit = len(data) > files.MAX_FILE_BYTES
        logger.warning(
            "megatron_tuning: the auto cache %s is %d bytes (%d entries), over this version's bound "
            "of %d bytes%s: read anyway as the auto cache; the next persist evicts the entries "
            "persisted longest ago down to the cap (%s).%s",
            path,
            len(data),
            len(table),
            max_cache_bytes(),
            f" and the {files.MAX_FILE_BYTES}-byte read limit for tables" if over_limit else "",
            ENV_CACHE_MAX_ENTRIES,
            f" Until then `show`/`export` need `--max-size {-(-len(data) // 2**20)}`." if over_limit else "",
        )
    return data, table


def _warn_format(path: str, found: int | str) -> None:
    # Entries of another cache format mean something else (e.g. keys written another way): unused.
    older = isinstance(found, int) and found < CACHE_FORMAT
    logger.warning(
        "megatron_tuning: the auto cache %s is in cache format %s, this version uses %d: its "
        "entries are not used, and %s. Set %s to another file to keep versions apart.",
        path,
        found,
        CACHE_FORMAT,
        "the next persist replaces them" if older else "this run does not write to it (a newer version's)",
        ENV_CACHE,
    )


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


__all__ = [
    "CACHE_FILE_NAME",
    "DEFAULT_MAX_ENTRIES",
    "LOCK_TIMEOUT_S",
    "PERSISTED_SOURCES",
    "AutoCache",
    "cache_max_entries",
    "cache_path",
    "content_digest",
    "default_cache_dir",
    "legacy_read_bytes",
    "max_cache_bytes",
    "open_cache",
    "read_cache_file",
]
