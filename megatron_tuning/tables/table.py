"""Tuning tables: (GPU arch, kernel id, key) to a config with provenance, canonical msgpack on disk
and a lossless JSON view. Loading is all-or-nothing, one ``TableError`` naming the file."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ..core import __version__
from ..core.errors import TableError
from . import files
from .codec import Decoded, check_header, decode_json, decode_msgpack, encode_json, encode_msgpack
from .entry import Entry, Ident, Invalid, Timing, entry_order, entry_with
from .files import LOCK_TIMEOUT_S, locked, read_regular_file, write_atomic


class Table:
    def __init__(
        self,
        entries: Iterable[Entry] = (),
        *,
        library_version: str | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> None:
        version = __version__ if library_version is None else library_version
        self.library_version, self.meta = check_header(version, dict(meta or {}))
        self._entries: dict[Ident, Entry] = {}
        for entry in entries:
            self.add(entry)

    def get(self, arch: str, kernel: str, key: str) -> Entry | None:
        return self._entries.get((arch, kernel, key))

    def add(self, entry: Entry, *, replace: bool = True) -> bool:
        """Insert ``entry`` (an existing one is kept unless ``replace``); return whether it changed."""
        if not isinstance(entry, Entry):
            raise TypeError(f"expected Entry, got {type(entry).__name__}")
        old = self._entries.get(entry.ident)
        if old is not None and (not replace or old == entry):
            return False
        self._entries[entry.ident] = entry
        return True

    def remove(self, arch: str, kernel: str, key: str) -> Entry | None:
        return self._entries.pop((arch, kernel, key), None)

    def values(self) -> list[Entry]:
        """Entries in the order they were added (loaded: the file's row order)."""
        return list(self._entries.values())

    def entries(self) -> list[Entry]:
        """Entries in the order people read them (``entry_order``)."""
        return sorted(self._entries.values(), key=lambda e: entry_order(*e.ident))

    def copy(self) -> Table:
        twin = Table(library_version=self.library_version, meta=self.meta)
        twin._entries = dict(self._entries)
        return twin

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries())

    def __contains__(self, ident: object) -> bool:
        return ident in self._entries

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Table):
            return NotImplemented
        mine = (self.library_version, self.meta, self._entries)
        return mine == (other.library_version, other.meta, other._entries)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"Table({len(self)} entries, library_version={self.library_version!r})"

    def to_bytes(self, *, keep_order: bool = False) -> bytes:
        """Canonical msgpack bytes: same content, same bytes. ``keep_order`` (``auto``'s cache:
        its eviction order) writes rows as added: readable, but not canonical, so not for commits."""
        rows = self.values() if keep_order else [self._entries[i] for i in sorted(self._entries)]
        with _no_gc():
            return encode_msgpack(self.library_version, self.meta, rows)

    def to_json(self, *, keep_order: bool = False) -> str:
        rows = self.values() if keep_order else self.entries()
        return encode_json(self.library_version, self.meta, rows)

    @classmethod
    def from_bytes(cls, data: bytes, *, path: str = "<bytes>") -> Table:
        return cls._decode(decode_msgpack, data, path)

    @classmethod
    def from_json(cls, text: str | bytes, *, path: str = "<json>") -> Table:
        return cls._decode(decode_json, text, path)

    @classmethod
    def _decode(cls, decode: Callable[[Any], Decoded], data: bytes | str, path: str) -> Table:
        try:
            with _no_gc():
                version, meta, entries = decode(data)
        except Invalid as exc:
            raise TableError(path, str(exc)) from None
        except Exception as exc:  # belt and braces: a loader must only ever raise TableError
            raise TableError(path, f"unreadable table ({type(exc).__name__}: {exc})") from exc
        table = cls(library_version=version, meta=meta)
        table._entries = entries
        return table


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    # A load or save builds ~10 containers per entry, none in cycles; the cyclic GC would rescan
    # the growing heap over and over (measured: 2-3x slower loads).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def load_table(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> Table:
    """Load a msgpack table, or the JSON view when the name ends in ``.json``; ``max_bytes`` raises
    the read limit (default ``files.MAX_FILE_BYTES``) for a file known to be genuine."""
    name = os.fspath(path)
    return table_from_data(table_bytes(name, max_bytes=max_bytes), name)


def table_bytes(path: str, *, max_bytes: int | None = None) -> bytes:
    """The bytes of a table file; one over the read limit is refused saying how to read it anyway."""
    limit = files.MAX_FILE_BYTES if max_bytes is None else max_bytes
    with contextlib.suppress(OSError):  # the reader reports missing files and odd kinds itself
        size = os.stat(path).st_size
        if size > limit:
            raise TableError(
                path,
                f"file is {size} bytes, over the {limit}-byte limit for reading a table. If it is "
                "genuine (e.g. an auto cache an older megatron_tuning let grow), `show` and `export` "
                f"read it with `--max-size {-(-size // 2**20)}` (MiB)",
            )
    return read_regular_file(path, max_bytes=limit)


def table_from_data(data: bytes, name: str) -> Table:
    if name.endswith(".json"):
        return Table.from_json(data, path=name)
    return Table.from_bytes(data, path=name)


def save_table(table: Table, path: str | os.PathLike[str]) -> None:
    """Write atomically, the JSON view when the name ends in ``.json``."""
    name = os.fspath(path)
    write_atomic(name, table.to_json().encode("utf-8") if name.endswith(".json") else table.to_bytes())


def update_table(
    path: str | os.PathLike[str], mutate: Callable[[Table], None], *, timeout_s: float = LOCK_TIMEOUT_S
) -> Table:
    """Read-modify-write ``path`` under its lock: ``mutate`` changes the table; written if it changed."""
    name = os.fspath(path)
    with locked(name, timeout_s=timeout_s):
        exists = os.path.exists(name)
        table = load_table(name) if exists else Table()
        # A snapshot, not the encoding: comparing mappings whose unchanged entries are the same
        # objects costs milliseconds, encoding a 100k-entry table twice cost seconds.
        before = (table.library_version, dict(table.meta), dict(table._entries))
        mutate(table)
        table.library_version = __version__
        if not exists or (table.library_version, table.meta, table._entries) != before:
            save_table(table, name)
    return table


def add_entries(
    path: str | os.PathLike[str],
    entries: Iterable[Entry],
    *,
    replace: bool = True,
    timeout_s: float = LOCK_TIMEOUT_S,
) -> Table:
    items = list(entries)

    def _mutate(table: Table) -> None:
        for entry in items:
            table.add(entry, replace=replace)

    return update_table(path, _mutate, timeout_s=timeout_s)


__all__ = ["Entry", "Table", "Timing", "entry_with", "load_table", "save_table"]
