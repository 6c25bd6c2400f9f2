"""Table encodings: columnar canonical msgpack, ``[FORMAT, SCHEMA, header, body]`` with one list per
field, strings and configs stored once and referenced by index (a 100k-entry load checks columns at C
speed), bounded by msgpack's own limits and size caps; and row-wise JSON for review. Schema 1 (keys as
text) is read, never written."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from itertools import islice, repeat
from typing import Any

import msgpack

from ..core import __version__
from ..core.key import INT_MAX
from .entry import (
    HOW_VALUES,
    Entry,
    Ident,
    Invalid,
    Timing,
    check_config,
    check_numerics,
    check_text,
    entry_from_data,
    make_entry,
)
from .files import load_json
from .keys import key_columns, key_from_text, keys_from_columns

FORMAT = "megatron_tuning.table"
SCHEMA = 2
SCHEMAS = (1, 2)  # read; 1 stored keys as text
# The first bytes of every table file: the 4-item array ``encode`` writes, then FORMAT.
FILE_PREFIX = msgpack.packb([FORMAT, None, None, None])[:-3]
MAX_ENTRIES = 1_000_000  # as many as auto's cache may be allowed to keep

Decoded = tuple[str, dict[str, str], dict[Ident, Entry]]  # library version, header meta, entries

_HEADER_FIELDS = frozenset({"library_version", "meta"})
_STRING_COLUMNS = ("source_hash", "triton_version", "note", "config_list_digest")
_FLOAT_COLUMNS = ("median_ms", "spread_ms", "runner_up_ms")
_COUNT_COLUMNS = ("samples", "candidates", "votes_for", "votes_total")
_REQUIRED = ("strings", "configs", "arch", "kernel", "key", "config", "how")
_COLUMN_TYPES: dict[str, frozenset[type]] = {
    "strings": frozenset({str}),
    "key": frozenset({str, int}),  # schema 1: text; 2: an index into key_shapes
    "key_shapes": frozenset({list}),  # [names, dtypes]
    "key_values": frozenset({type(None), bool, int, float, str, dict}),  # every key's values, in row order
    "configs": frozenset({dict}),
    **dict.fromkeys(("arch", "kernel", "how", "config"), frozenset({int})),
    **dict.fromkeys(_STRING_COLUMNS + _COUNT_COLUMNS, frozenset({int, type(None)})),
    **dict.fromkeys(_FLOAT_COLUMNS, frozenset({float, type(None)})),
    "numerics": frozenset({dict, type(None)}),
}
_NO_TIMING = Timing()

MAX_META_ITEMS = 4096
# Values are single: a list or map inside one (a nesting bomb) is refused as soon as it is met. The
# columns whose values are lists or maps are decoded apart, each at most this many bytes: what
# decoding a file built to amplify can cost is bounded (~70x of this per column).
MAX_MAP_COLUMN_BYTES = 16 * 1024 * 1024
_MAP_COLUMNS = ("configs", "numerics", "key_shapes", "key_values")
_LIMITS = {"raw": False, "strict_map_key": True, "max_bin_len": 0, "max_ext_len": 0}
# msgpack's messages for these are empty: say what they mean.
_ERRORS = {msgpack.OutOfData: "the file ends early", msgpack.StackError: "data nested too deeply"}
_ERRORS[msgpack.FormatError] = "an invalid type byte"


def encode_msgpack(library_version: str, meta: dict[str, str], entries: Sequence[Entry]) -> bytes:
    header: dict[str, Any] = {"library_version": library_version}
    if meta:
        header["meta"] = dict(sorted(meta.items()))
    # Entries are named tuples: zip(*entries) gives each field as a column at C speed.
    columns = list(zip(*entries)) or [()] * len(Entry._fields)
    arch, kernel, keys, configs, how, _, _, timing, votes, _, numerics, _ = columns
    texts = [columns[Entry._fields.index(name)] for name in _STRING_COLUMNS]
    strings = sorted(set(arch) | set(kernel) | set(how) | (set().union(*texts) - {None}))
    sidx = {s: i for i, s in enumerate(strings)}
    packed_by_id: dict[int, bytes] = {}  # configs are interned: pack each distinct dict once
    config_of: dict[bytes, dict[str, Any]] = {}
    for config in configs:
        if id(config) not in packed_by_id:
            blob = packed_by_id[id(config)] = msgpack.packb(config, use_bin_type=True)
            config_of.setdefault(blob, config)
    distinct = sorted(config_of)
    cidx = {blob: i for i, blob in enumerate(distinct)}
    body: dict[str, Any] = {
        "strings": strings,
        "configs": [config_of[blob] for blob in distinct],
        "arch": [sidx[s] for s in arch],
        "kernel": [sidx[s] for s in kernel],
        **key_columns(keys),
        "config": [cidx[packed_by_id[id(c)]] for c in configs],
        "how": [sidx[s] for s in how],
    }
    optional: dict[str, Sequence[Any]] = {
        name: list(map(sidx.get, col)) for name, col in zip(_STRING_COLUMNS, texts)
    }
    optional.update(zip(Timing._fields, zip(*(t or _NO_TIMING for t in timing))))
    optional.update(zip(("votes_for", "votes_total"), zip(*(v or (None, None) for v in votes))))
    optional["numerics"] = [None if n is None else n.to_data() for n in numerics]
    body.update({name: list(col) for name, col in optional.items() if col.count(None) != len(col)})
    return msgpack.packb([FORMAT, SCHEMA, header, dict(sorted(body.items()))], use_bin_type=True)


def decode_msgpack(data: bytes) -> Decoded:
    if not data:
        raise Invalid("empty file")
    if data.lstrip()[:1] == b"{":
        hint = "name JSON views *.json, or convert with `megatron-tuning import FILE OUT.msgpack`"
        raise Invalid(f"this is JSON, not msgpack: {hint}")
    schema, header, body = _unpack(data)
    if not header.keys() <= _HEADER_FIELDS:
        raise Invalid(f"header must be a map with fields {sorted(_HEADER_FIELDS)}")
    version, meta = check_header(header.get("library_version"), header.get("meta"))
    return version, meta, _decode_body(body, schema)


def _unpack(data: bytes) -> tuple[int, dict[str, Any], dict[str, list[Any]]]:
    up = msgpack.Unpacker(max_buffer_size=max(1, len(data)), max_array_len=0, max_map_len=0, **_LIMITS)
    up.feed(data)
    where, header, body, count = "", {}, {}, None
    try:
        if _length(up.read_array_header) != 4 or up.unpack() != FORMAT:
            raise Invalid(f"not a {FORMAT} file (missing format marker)")
        schema = check_schema(up.unpack())
        where = "header: "
        for key in _fields(up, "header", len(_HEADER_FIELDS)):
            items = _fields(up, "header meta", MAX_META_ITEMS) if key == "meta" else None  # read lazily
            header[key] = up.unpack() if items is None else {k: up.unpack() for k in items}
        for name in _fields(up, "table body", len(data), "column"):  # unknown names are refused as met
            start, types = up.tell(), _COLUMN_TYPES.get(name)
            where, n = f"column {name}: ", _length(up.read_array_header)
            if types is None:
                raise Invalid(f"table body: unknown columns {[name]}")
            if n is None:
                raise Invalid(f"column {name} must be a list")
            if n > len(data) - up.tell():  # each value takes a byte: refused before anything is sized by it
                raise Invalid(f"column {name}: truncated or corrupt ({n} values claimed)")
            if name not in ("strings", "configs", "key_shapes", "key_values"):
                if count is not None and n != count:
                    raise Invalid(f"column {name} has {n} values for {count} entries")
                count = n
            if n > MAX_ENTRIES:
                raise Invalid(f"column {name} has {n} values, over the {MAX_ENTRIES} limit")
            if name in _MAP_COLUMNS:
                for _ in range(n):
                    up.skip()  # measures the column without building it
                if up.tell() - start > MAX_MAP_COLUMN_BYTES:
                    raise Invalid(f"column {name} is over the {MAX_MAP_COLUMN_BYTES}-byte limit")
                body[name] = column = msgpack.unpackb(
                    data[start : up.tell()], object_pairs_hook=unique_map, **_LIMITS
                )
            else:
                body[name] = column = list(islice(up, n))
            if len(column) != n:
                raise Invalid(f"column {name}: not valid msgpack (truncated or corrupt): the file ends early")
            if wrong := sorted(t.__name__ for t in set(map(type, column)) - types):
                raise Invalid(f"column {name}: values of type {', '.join(wrong)} are not allowed")
        if up.tell() != len(data):
            raise Invalid("trailing bytes after the table (corrupt or concatenated file)")
    except Invalid:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        detail = next((text for kind, text in _ERRORS.items() if isinstance(exc, kind)), str(exc))
        if detail.endswith("_len(0)"):  # msgpack: "3 exceeds max_array_len(0)"
            detail = f"a list or map inside a single value ({detail})"
        message = f"{where}not valid msgpack (truncated or corrupt): {detail} at byte {up.tell()}"
        raise Invalid(message) from None
    return schema, header, body


def _length(read_header: Callable[[], int]) -> int | None:
    """The length of the list or map starting here; ``None``, having read nothing, for other values."""
    try:
        return int(read_header())
    except ValueError:  # msgpack: "Unexpected type header on stream"
        return None


def _fields(up: msgpack.Unpacker, what: str, limit: int, item: str = "field") -> Iterator[str]:
    """The keys of the map starting here, each a string met once; the caller reads each value."""
    n = _length(up.read_map_header)
    if n is None:
        raise Invalid(f"{what} must be a map")
    if n > limit:
        raise Invalid(f"{what} has {n} {item}s, over the {limit} limit")
    seen: set[str] = set()
    for _ in range(n):
        key = up.unpack()
        if type(key) is not str:
            raise Invalid(f"{what}: {item} names must be strings")
        if key in seen:
            raise Invalid(f"{what}: duplicate {item} {key!r}")
        seen.add(key)
        yield key


def unique_map(pairs: list[tuple[Any, Any]], what: str = "map key") -> dict[Any, Any]:
    """A dict of ``pairs``, refusing a repeated key (msgpack and json would keep the last)."""
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise Invalid(f"duplicate {what} {key!r}")
        out[key] = value
    return out


def _decode_body(body: dict[str, list[Any]], schema: int) -> dict[Ident, Entry]:
    # ``_unpack`` checked each column's value types and that entry columns have one length.
    if missing := [name for name in _REQUIRED if name not in body]:
        raise Invalid(f"table body: missing columns {missing}")
    strings, keys, configs = body["strings"], keys_from_columns(body, schema), []
    for index, config in enumerate(body["configs"]):
        try:
            configs.append(check_config(config))
        except Invalid as exc:
            raise Invalid(f"configs[{index}]: {exc}") from None

    def column(name: str, values: list[Any] = strings) -> Iterable[Any]:
        if name not in body:
            return repeat(None)
        present = [i for i in body[name] if i is not None]
        if present and not (min(present) >= 0 and max(present) < len(values)):
            raise Invalid(f"column {name}: index out of range")
        return [None if i is None else values[i] for i in body[name]]

    arch, kernel, how, config = column("arch"), column("kernel"), column("how"), column("config", configs)
    if "" in set(arch):
        raise Invalid("column arch: empty arch")
    bad_kernel = next((k for k in set(kernel) if ":" not in k), None)
    if bad_kernel is not None:
        raise Invalid(f"column kernel: {bad_kernel!r} is not a 'module:qualname' kernel id")
    if bad_how := set(how) - set(HOW_VALUES):
        raise Invalid(f"column how: {sorted(bad_how)} not among {HOW_VALUES}")
    source_hash, triton_version, note, digest = (column(name) for name in _STRING_COLUMNS)
    for name in _FLOAT_COLUMNS + _COUNT_COLUMNS:
        present = [v for v in body.get(name, ()) if v is not None] or [0]
        if name in _FLOAT_COLUMNS and not (all(map(math.isfinite, present)) and min(present) >= 0):
            raise Invalid(f"column {name}: values must be finite and >= 0")
        if name in _COUNT_COLUMNS and not (min(present) >= 0 and max(present) <= INT_MAX):
            raise Invalid(f"column {name}: values must be integers >= 0")
    timings: Iterable[Any] = repeat(None)
    if any(name in body for name in Timing._fields):
        columns = zip(*(body.get(name, repeat(None)) for name in Timing._fields))
        timings = [None if row == _NO_TIMING else tuple.__new__(Timing, row) for row in columns]
    votes: Iterable[Any] = repeat(None)
    if ("votes_for" in body) != ("votes_total" in body):
        raise Invalid("columns votes_for and votes_total must come together")
    if "votes_for" in body:
        votes = [None if v == (None, None) else v for v in zip(body["votes_for"], body["votes_total"])]
        if any(v is not None and (None in v or not 0 < v[0] <= v[1]) for v in votes):
            raise Invalid("votes must satisfy 0 < votes_for <= votes_total")
    numerics = map(check_numerics, body.get("numerics", repeat(None, len(keys))))
    rows = zip(
        arch, kernel, keys, config, how, source_hash, triton_version, timings, votes, note, numerics, digest
    )
    entries = {(row[0], row[1], row[2]): make_entry(row) for row in rows}
    if len(entries) != len(keys):
        ident = next(ident for ident, n in Counter(zip(arch, kernel, keys)).items() if n > 1)
        raise Invalid(f"duplicate entry for arch={ident[0]!r} kernel={ident[1]!r} key={ident[2]!r}")
    return entries


def check_schema(schema: Any) -> int:
    if type(schema) is not int:
        raise Invalid(f"schema must be an integer, got {schema!r}")
    if schema not in SCHEMAS:
        raise Invalid(f"schema {schema} is not supported (this library reads schemas {SCHEMAS}); upgrade")
    return schema


def check_header(version: Any, meta: Any) -> tuple[str, dict[str, str]]:
    if type(version) is not str:
        raise Invalid("header library_version must be a string")
    meta = {} if meta is None else meta
    if type(meta) is not dict or not all(type(k) is str and type(v) is str for k, v in meta.items()):
        raise Invalid("header meta must map strings to strings")
    check_text("header library_version", version)
    for k, v in meta.items():
        check_text("header meta key", k)
        check_text("header meta value", v)
    return version, meta


def encode_json(library_version: str, meta: dict[str, str], entries: Sequence[Entry]) -> str:
    """One object per entry, fields sorted, so reviews diff per field. Not ``sort_keys``: a key's maps
    keep its order (``Entry.to_data`` sorts every other map)."""
    doc: dict[str, Any] = {"entries": [entry.to_data() for entry in entries], "format": FORMAT}
    doc.update(library_version=library_version, meta=dict(sorted(meta.items())), schema=SCHEMA)
    if not meta:
        del doc["meta"]
    return json.dumps(doc, indent=1, allow_nan=False, ensure_ascii=False) + "\n"


def decode_json(text: str | bytes) -> Decoded:
    def no_constants(name: str) -> Any:
        raise Invalid(f"non-finite number {name} is not allowed")

    hook = partial(unique_map, what="JSON field")
    # ~450 bytes an entry, spread over its three maps at least (entry, config, kwargs).
    doc = load_json(text, per_object=150, object_pairs_hook=hook, parse_constant=no_constants)
    if type(doc) is not dict or doc.get("format") != FORMAT:
        raise Invalid(f'not a {FORMAT} JSON document (missing "format": "{FORMAT}")')
    if extra := doc.keys() - {"format", "schema", "library_version", "meta", "entries"}:
        raise Invalid(f"unknown top-level fields {sorted(extra)}")
    schema = check_schema(doc.get("schema"))
    # Optional in JSON, which people write by hand: without it, the table reads as this library's.
    version, meta = check_header(doc.get("library_version", __version__), doc.get("meta"))
    rows = doc.get("entries")
    if type(rows) is not list:
        raise Invalid("entries must be a list")
    entries: dict[Ident, Entry] = {}
    for index, row in enumerate(rows):
        try:
            if schema == 1 and type(row) is dict and type(row.get("key")) is str:  # text, maybe hand-spaced
                row = {**row, "key": key_from_text(row["key"])}
            entry = entry_from_data(row)
        except Invalid as exc:
            raise Invalid(f"entry {index}: {exc}") from None
        if entry.ident in entries:
            raise Invalid(f"entry {index}: duplicate entry for arch={entry.arch!r} kernel={entry.kernel!r}")
        entries[entry.ident] = entry
    return version, meta, entries
