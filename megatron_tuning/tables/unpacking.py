"""Bounded decoding: a file's structure and the memory it would cost are checked before any
Python object is built from it.

A msgpack or JSON decoder turns every byte into objects that cost far more than the byte:
an array of empty arrays is one byte per ``list`` (~80 bytes), so a 20 MB hostile file cost
1.5 GB. Here a table is walked first with msgpack's C skipper (which builds nothing): the top
level must be ``[format, schema, header, body]``, the body a map of known columns, each column
an array whose element count and byte span are read from its header. The cost of decoding is
then estimated from those counts and refused above ``BUDGET_FACTOR`` x the file size (+
``BUDGET_SLACK``). Columns are then decoded flat (a nested list or map in a scalar column is
refused at its header) in chunks whose element types are checked as they arrive, so a wrong
value costs one chunk, not the file. JSON has no C skipper; its element and container counts
are bounded from separator and bracket counts (which over-count: strings may hold them).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from itertools import islice
from typing import Any

import msgpack

from .entry import Invalid

BUDGET_FACTOR = 16
BUDGET_SLACK = 128 * 1024 * 1024
ENTRY_BYTES = 448
"""Memory per loaded entry besides its column values (Entry, ident, index slot, timing, votes);
measured ~380 bytes on CPython 3.11."""
MAX_META_ITEMS = 4096
_CHUNK = 65536
_WORST_VALUE_BYTES = 96  # a list slot plus the largest scalar msgpack can make from a few bytes

STRING_COLUMNS = frozenset({"strings", "key"})
FLOAT_COLUMNS = frozenset({"median_ms", "spread_ms", "runner_up_ms"})
INDEX_COLUMNS = frozenset({"arch", "kernel", "how", "config", "source_hash", "triton_version", "note"})
COUNT_COLUMNS = frozenset({"samples", "candidates", "votes_for", "votes_total"})
COLUMNS = STRING_COLUMNS | FLOAT_COLUMNS | INDEX_COLUMNS | COUNT_COLUMNS | {"configs"}
_NONE = type(None)


def budget(size: int) -> int:
    """Bytes of decoded objects a file of ``size`` bytes may cost."""
    return BUDGET_FACTOR * size + BUDGET_SLACK


def _over_budget(estimate: int, size: int) -> Invalid:
    return Invalid(
        f"decoding would need about {estimate / 2**20:.0f} MiB of memory for a {size}-byte file "
        f"(limit: {BUDGET_FACTOR}x the file size + {BUDGET_SLACK // 2**20} MiB), so it is refused "
        "unread, as a hostile file would be; split a genuine table this large into several files"
    )


# -- msgpack -----------------------------------------------------------------------
def unpack_table(
    data: bytes, *, fmt: str, check_schema: Callable[[Any], None]
) -> tuple[Any, dict[str, list[Any]]]:
    """The header and the body columns of ``[format, schema, header, body]``, decoded with bounds.

    ``check_schema`` runs on the schema before the body is read (a future schema may lay the
    body out differently). Raises ``Invalid`` naming the problem.
    """
    walker = _Walker(data)
    if walker.container() != ("array", 4):
        if data.lstrip()[:1] == b"{":
            raise Invalid(
                "this is JSON, not msgpack: name JSON views *.json, or convert with "
                "`megatron-tuning import FILE OUT.msgpack`"
            )
        raise Invalid(f"not a {fmt} file (missing format marker)")
    walker.enter()
    if walker.scalar("format marker") != fmt:
        raise Invalid(f"not a {fmt} file (missing format marker)")
    check_schema(walker.scalar("schema"))
    header = walker.header()
    spans = walker.body_spans()
    if walker.position() != len(data):
        raise Invalid("trailing bytes after the table (corrupt or concatenated file)")
    count = spans["key"][0] if "key" in spans else 0
    costs = {}
    for name, (n, start, end) in spans.items():
        if n != count and name not in ("strings", "configs"):
            raise Invalid(f"column {name} has {n} values for {count} entries")
        costs[name] = _column_cost(name, n, end - start)
    estimate = 2 * len(data) + ENTRY_BYTES * count + sum(costs.values())
    limit = budget(len(data))
    if estimate > limit:
        raise _over_budget(estimate, len(data))
    body = {}
    for name, (n, start, end) in spans.items():
        # The estimate assumed each value is of its column's kind. When even the worst value of any
        # kind (~90 bytes) fits the budget, the column is decoded in one C call; otherwise in
        # chunks whose kinds are checked as they arrive, so a wrong value costs one chunk.
        whole = estimate - costs[name] + _WORST_VALUE_BYTES * n + end - start <= limit
        body[name] = _decode_column(data, name, n, start, end, whole=whole)
    return header, body


def _column_cost(name: str, n: int, nbytes: int) -> int:
    extra = max(0, nbytes - n)  # bytes beyond one per element
    if name == "configs":
        return 160 * nbytes  # built, then canonicalised (a second copy)
    if name in STRING_COLUMNS:
        return 104 * n + nbytes  # list slot + str object (<= 80 + rounding) + payload
    if name in FLOAT_COLUMNS:
        return 8 * n + 8 * extra  # a float object (32 B) takes >= 5 bytes; nil is a singleton
    return 8 * n + 16 * extra  # ints 0..256 are singletons; a larger one (32 B) takes >= 3 bytes


class _Walker:
    """Reads the document's skeleton with msgpack's C unpacker; values are skipped, not built."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        # Flat limits: ``next`` refuses any container at its header; ``skip`` ignores limits.
        self.unpacker = msgpack.Unpacker(
            raw=False,
            strict_map_key=True,
            timestamp=0,
            max_buffer_size=max(1, len(data)),
            max_array_len=0,
            max_map_len=0,
            max_ext_len=0,
        )
        self.unpacker.feed(data)

    def position(self) -> int:
        return int(self.unpacker.tell())

    def container(self) -> tuple[str, int] | None:
        """The kind and length of the container starting here, without consuming it."""
        return _container_at(self.data, self.position())

    def enter(self) -> None:
        kind_len = self.container()
        try:
            if kind_len is not None and kind_len[0] == "array":
                self.unpacker.read_array_header()
            else:
                self.unpacker.read_map_header()
        except (ValueError, msgpack.UnpackException, StopIteration) as exc:
            raise _unpack_error(exc, self.position()) from None

    def scalar(self, what: str) -> Any:
        if self.container() is not None:
            raise Invalid(f"{what} must be a plain value, not a list or map")
        try:
            return next(self.unpacker)
        except (ValueError, msgpack.UnpackException, StopIteration, TypeError) as exc:
            raise _unpack_error(exc, self.position()) from None

    def skip(self) -> None:
        try:
            self.unpacker.skip()
        except (ValueError, msgpack.UnpackException, StopIteration) as exc:
            raise _unpack_error(exc, self.position()) from None

    def flat_map(self, what: str, limit: int) -> dict[Any, Any]:
        kind_len = self.container()
        if kind_len is None or kind_len[0] != "map":
            raise Invalid(f"{what} must be a map")
        if kind_len[1] > limit:
            raise Invalid(f"{what} has {kind_len[1]} fields, over the {limit} limit")
        self.enter()
        out: dict[Any, Any] = {}
        for _ in range(kind_len[1]):
            key = self.scalar(f"{what} key")
            if key in out:
                raise Invalid(f"{what}: duplicate field {key!r}")
            out[key] = self.scalar(f"{what} value")
        return out

    def header(self) -> Any:
        kind_len = self.container()
        if kind_len is None or kind_len[0] != "map" or kind_len[1] > 8:
            raise Invalid("header must be a map with fields ['library_version', 'meta']")
        self.enter()
        header: dict[Any, Any] = {}
        for _ in range(kind_len[1]):
            key = self.scalar("header field")
            if key in header:
                raise Invalid(f"header: duplicate field {key!r}")
            if key == "meta" and self.container() is not None:
                header[key] = self.flat_map("header meta", MAX_META_ITEMS)
            else:
                header[key] = self.scalar(f"header {key!r}")
        return header

    def body_spans(self) -> dict[str, tuple[int, int, int]]:
        """Column name -> (element count, first element offset, end offset)."""
        kind_len = self.container()
        if kind_len is None or kind_len[0] != "map":
            raise Invalid("table body must be a map of columns")
        if kind_len[1] > 4 * len(COLUMNS):
            raise Invalid(f"table body has {kind_len[1]} columns; this schema has {len(COLUMNS)}")
        self.enter()
        spans: dict[str, tuple[int, int, int]] = {}
        unknown = []
        for _ in range(kind_len[1]):
            name = self.scalar("column name")
            if type(name) is not str or name not in COLUMNS:
                unknown.append(str(name))
                self.skip()
                continue
            if name in spans:
                raise Invalid(f"table body: duplicate column {name!r}")
            column = self.container()
            if column is None or column[0] != "array":
                raise Invalid(f"column {name} must be a list")
            start = self.position() + _header_size(self.data[self.position()])
            self.skip()
            spans[name] = (column[1], start, self.position())
        if unknown:
            raise Invalid(f"table body: unknown columns {sorted(unknown)}")
        return spans


def _container_at(data: bytes, pos: int) -> tuple[str, int] | None:
    if pos >= len(data):
        raise Invalid(f"not valid msgpack (truncated or corrupt): the file ends at byte {pos}")
    byte = data[pos]
    if 0x90 <= byte <= 0x9F:
        return "array", byte & 0x0F
    if 0x80 <= byte <= 0x8F:
        return "map", byte & 0x0F
    size = {0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}.get(byte)
    if size is None:
        return None
    if pos + 1 + size > len(data):
        raise Invalid(f"not valid msgpack (truncated or corrupt): the file ends at byte {len(data)}")
    length = int.from_bytes(data[pos + 1 : pos + 1 + size], "big")
    # Every element takes at least one byte: a longer claim is a corrupt header, refused
    # before anything sized by it is allocated.
    if length > len(data) - pos:
        raise Invalid(f"not valid msgpack (truncated or corrupt): a length of {length} at byte {pos}")
    return ("array" if byte in (0xDC, 0xDD) else "map"), length


def _header_size(byte: int) -> int:
    return {0xDC: 3, 0xDD: 5, 0xDE: 3, 0xDF: 5}.get(byte, 1)


def _unpack_error(exc: BaseException, pos: int) -> Invalid:
    # msgpack's own messages can be empty (FormatError(), StackError(), OutOfData()): say what it is.
    if isinstance(exc, (StopIteration, msgpack.OutOfData)):
        detail = f"the file ends early, at byte {pos}"
    elif isinstance(exc, msgpack.StackError):
        detail = f"data nested too deeply at byte {pos}"
    elif isinstance(exc, msgpack.FormatError):
        detail = f"an invalid type byte at or after byte {pos}"
    else:
        detail = f"{str(exc) or type(exc).__name__} (at byte {pos})"
    return Invalid(f"not valid msgpack (truncated or corrupt): {detail}")


def _decode_column(data: bytes, name: str, n: int, start: int, end: int, *, whole: bool) -> list[Any]:
    if name == "configs":
        return _decode_configs(memoryview(data)[start:end], n)
    if whole:
        return _decode_whole(data, name, n, start, end)
    unpacker = msgpack.Unpacker(
        raw=False, timestamp=0, max_buffer_size=max(1, end - start), max_array_len=0, max_map_len=0
    )
    unpacker.feed(memoryview(data)[start:end])
    out: list[Any] = []
    check = _CHECKS[_kind(name)]
    while len(out) < n:
        try:
            chunk = list(islice(unpacker, min(_CHUNK, n - len(out))))
        except (ValueError, msgpack.UnpackException) as exc:
            if "exceeds max_" in str(exc):  # the flat limits refused a nested list or map
                raise Invalid(f"column {name}: values of type list/map are not allowed") from None
            raise Invalid(f"column {name}: {_unpack_error(exc, start + int(unpacker.tell()))}") from None
        if not chunk:
            raise Invalid(f"column {name}: not valid msgpack (truncated or corrupt)")
        check(name, chunk)
        out.extend(chunk)
    return out


def _decode_whole(data: bytes, name: str, n: int, start: int, end: int) -> list[Any]:
    lists = 0

    def one_list(items: list[Any]) -> list[Any]:
        nonlocal lists
        lists += 1  # inner lists finish before the column's own: a second call means nesting
        if lists > 1:
            raise Invalid(f"column {name}: values of type list/map are not allowed")
        return items

    # The elements with a fresh header in front: one msgpack array, decoded by one C call.
    header = b"\xdd" + n.to_bytes(4, "big")
    try:
        column = msgpack.unpackb(
            header + memoryview(data)[start:end],
            raw=False,
            timestamp=0,
            max_map_len=0,
            max_bin_len=0,
            max_ext_len=0,
            list_hook=one_list,
        )
    except Invalid:
        raise
    except (ValueError, msgpack.UnpackException) as exc:
        if "exceeds max_" in str(exc):
            raise Invalid(f"column {name}: values of type list/map are not allowed") from None
        raise Invalid(f"column {name}: {_unpack_error(exc, start)}") from None
    _CHECKS[_kind(name)](name, column)
    return list(column)


def _kind(name: str) -> str:
    if name in STRING_COLUMNS:
        return "str"
    return "float" if name in FLOAT_COLUMNS else "int"


def _check_strings(name: str, chunk: list[Any]) -> None:
    if not set(map(type, chunk)) <= {str}:
        raise Invalid(
            "strings must be a list of strings" if name == "strings" else f"column {name}: not text"
        )


def _check_floats(name: str, chunk: list[Any]) -> None:
    wrong = set(map(type, chunk)) - {float, _NONE}
    if wrong:
        raise Invalid(
            f"column {name}: values of type {', '.join(sorted(t.__name__ for t in wrong))} are not allowed"
        )


def _check_ints(name: str, chunk: list[Any]) -> None:
    types = set(map(type, chunk))
    wrong = types - {int, _NONE}
    if wrong:
        raise Invalid(
            f"column {name}: values of type {', '.join(sorted(t.__name__ for t in wrong))} are not allowed"
        )
    ints = chunk if types == {int} else [v for v in chunk if v is not None]
    if ints and min(ints) < 0:
        raise Invalid(
            f"column {name}: index out of range"
            if name in INDEX_COLUMNS
            else f"column {name}: values must be integers >= 0"
        )


_CHECKS = {"str": _check_strings, "float": _check_floats, "int": _check_ints}


def _decode_configs(view: memoryview, n: int) -> list[Any]:
    # Configs may nest (kwargs values); their cost was budgeted per byte, so they are built whole.
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=True,
        timestamp=0,
        max_buffer_size=max(1, len(view)),
        max_bin_len=0,
        max_ext_len=0,
        object_pairs_hook=unique_map,
    )
    unpacker.feed(view)
    try:
        configs = list(islice(unpacker, n))
    except Invalid as exc:
        raise Invalid(f"configs: {exc}") from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise Invalid(f"configs: {_unpack_error(exc, 0)}") from None
    if len(configs) != n:
        raise Invalid("configs: not valid msgpack (truncated or corrupt)")
    return configs


def unique_map(pairs: list[tuple[Any, Any]], what: str = "map key") -> dict[Any, Any]:
    """A dict of ``pairs``, refusing a repeated key (msgpack and json would keep the last silently)."""
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise Invalid(f"duplicate {what} {key!r}")
        out[key] = value
    return out


# -- JSON --------------------------------------------------------------------------
def json_text(data: str | bytes) -> str:
    """The text of a JSON file: strict UTF-8, no byte-order mark (JSON files here are UTF-8)."""
    if isinstance(data, str):
        return data
    if data.startswith(codecs.BOM_UTF8):
        raise Invalid("starts with a byte-order mark: JSON files here are UTF-8 without one")
    if b"\x00" in data:  # valid UTF-8, but what UTF-16/32 text looks like: name the real problem
        raise Invalid("not UTF-8 (it holds NUL bytes: UTF-16 or UTF-32?); JSON files here are UTF-8")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Invalid(f"not UTF-8 (byte {exc.start}: {exc.reason}); JSON files here are UTF-8") from None


def check_json_budget(text: str, *, per_object: int = 0, size: int | None = None) -> None:
    """Refuse JSON whose decoded form could need more than ``budget`` bytes, before parsing it.

    Every value is separated by ``,`` or ``:`` or opens a container, so those counts bound the
    number of objects (over-counting separators inside strings only makes the bound safer).
    ``per_object`` adds what the caller builds per container on top (e.g. a table entry).
    ``size`` is the file's size in bytes (default: the text's length).
    """
    size = len(text) if size is None else size
    containers = text.count("[") + text.count("{")
    values = text.count(",") + text.count(":") + 1
    strings = text.count('"') // 2  # a str object costs more than a number: up to ~90 bytes
    estimate = 2 * size + (80 + per_object) * containers + 48 * values + 48 * strings
    if estimate > budget(size):
        raise _over_budget(estimate, size)
