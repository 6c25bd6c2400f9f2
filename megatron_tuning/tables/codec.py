"""Table encodings: columnar canonical msgpack (on disk) and row-wise JSON (for review).

msgpack layout, schema 1: ``[FORMAT, SCHEMA, header, body]``. ``body`` is columnar
because a load builds every entry: one list per field, repeated strings (arch, kernel,
how, hashes, versions, notes) and configs stored once and referenced by index. Column
checks then run at C speed (``set(map(type, col))``, ``min``/``max``) and distinct
values are validated once, which is what keeps a 100k-entry load well under a second.

Canonical: ``strings`` sorted, ``configs`` sorted by their packed bytes, rows sorted by
(arch, kernel, key), every map's keys sorted, optional columns omitted when all nil.

body fields: ``strings`` [str]; ``configs`` [config map]; ``arch``/``kernel``/``how``/
``config`` [index]; ``key`` [str]; optional ``source_hash``/``triton_version``/``note``
[index|nil], ``median_ms``/``spread_ms``/``runner_up_ms`` [float|nil],
``samples``/``candidates``/``votes_for``/``votes_total`` [int|nil].
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import msgpack

from .entry import (
    HOW_VALUES,
    INT_MAX,
    KEY_FORM,
    Entry,
    Invalid,
    Timing,
    canonical_key,
    check_config,
    check_text,
    entry_from_data,
    make_entry,
)
from .unpacking import ENTRY_BYTES, check_json_budget, json_text, unique_map, unpack_table

FORMAT = "megatron_tuning.table"
SCHEMA = 1
MAX_ENTRIES = 5_000_000

_Ident = tuple[str, str, str]
_Decoded = tuple[str, dict[str, str], dict[_Ident, Entry]]

_HEADER_FIELDS = frozenset({"library_version", "meta"})
_STRING_COLUMNS = ("source_hash", "triton_version", "note")
_FLOAT_COLUMNS = ("median_ms", "spread_ms", "runner_up_ms")
_COUNT_COLUMNS = ("samples", "candidates", "votes_for", "votes_total")
_REQUIRED = ("strings", "configs", "arch", "kernel", "key", "config", "how")
_BODY_FIELDS = frozenset(_REQUIRED + _STRING_COLUMNS + _FLOAT_COLUMNS + _COUNT_COLUMNS)
_NONE = type(None)
_NO_TIMING = Timing()
_EMPTY_BODY: dict[str, list[Any]] = {name: [] for name in sorted(_REQUIRED)}


# -- msgpack -----------------------------------------------------------------------
def encode_msgpack(library_version: str, meta: dict[str, str], entries: Sequence[Entry]) -> bytes:
    """Canonical bytes for ``entries`` (already in (arch, kernel, key) order)."""
    header: dict[str, Any] = {"library_version": library_version}
    if meta:
        header["meta"] = dict(sorted(meta.items()))
    if not entries:
        return msgpack.packb([FORMAT, SCHEMA, header, _EMPTY_BODY], use_bin_type=True)
    # Entries are named tuples: zip(*entries) gives each field as a column at C speed.
    arch, kernel, keys, configs, how, source_hash, triton_version, timing, votes, note = zip(*entries)
    strings = sorted(set(arch) | set(kernel) | set(how) | ({*source_hash, *triton_version, *note} - {None}))
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
        "key": list(keys),
        "config": [cidx[packed_by_id[id(c)]] for c in configs],
        "how": [sidx[s] for s in how],
    }
    optional: dict[str, Sequence[Any]] = {
        name: [None if s is None else sidx[s] for s in col]
        for name, col in (("source_hash", source_hash), ("triton_version", triton_version), ("note", note))
    }
    timing_cols = zip(*(t if t is not None else _NO_TIMING for t in timing))
    optional.update(zip(Timing._fields, timing_cols))
    optional["votes_for"] = [None if v is None else v[0] for v in votes]
    optional["votes_total"] = [None if v is None else v[1] for v in votes]
    body.update({name: list(col) for name, col in optional.items() if col.count(None) != len(col)})
    return msgpack.packb([FORMAT, SCHEMA, header, dict(sorted(body.items()))], use_bin_type=True)


def decode_msgpack(data: bytes) -> _Decoded:
    """Validate and decode a whole file; any problem raises ``Invalid``.

    The structure and the memory decoding would cost are checked before objects are built
    (``unpacking.unpack_table``): a hostile file cannot make the loader allocate without bound.
    """
    if not data:
        raise Invalid("empty file")
    header, body = unpack_table(data, fmt=FORMAT, check_schema=check_schema)
    if type(header) is not dict or not header.keys() <= _HEADER_FIELDS:
        raise Invalid(f"header must be a map with fields {sorted(_HEADER_FIELDS)}")
    version, meta = check_header(header.get("library_version"), header.get("meta"))
    return version, meta, _decode_body(body)


def _decode_body(body: Any) -> dict[_Ident, Entry]:
    if type(body) is not dict:
        raise Invalid("table body must be a map of columns")
    unknown = body.keys() - _BODY_FIELDS
    missing = [name for name in _REQUIRED if name not in body]
    if unknown or missing:
        raise Invalid(f"table body: unknown columns {sorted(unknown)}, missing columns {missing}")
    strings, configs = body["strings"], body["configs"]
    if type(strings) is not list or not set(map(type, strings)) <= {str}:
        raise Invalid("strings must be a list of strings")
    if type(configs) is not list:
        raise Invalid("configs must be a list")
    checked_configs = []
    for index, config in enumerate(configs):
        try:
            checked_configs.append(check_config(config))
        except Invalid as exc:
            raise Invalid(f"configs[{index}]: {exc}") from None
    keys = _column(body, "key", {str})
    count = len(keys)
    if count > MAX_ENTRIES:
        raise Invalid(f"{count} entries, over the {MAX_ENTRIES} limit")

    def index_column(name: str, size: int, nullable: bool) -> list[Any]:
        col = _column(body, name, {int, _NONE} if nullable else {int}, count)
        present = [v for v in col if v is not None] if nullable else col
        if present and not (min(present) >= 0 and max(present) < size):
            raise Invalid(f"column {name}: index out of range")
        return col

    arch = _strings_of(index_column("arch", len(strings), False), strings)
    kernel = _strings_of(index_column("kernel", len(strings), False), strings)
    how = _strings_of(index_column("how", len(strings), False), strings)
    config_ix = index_column("config", len(checked_configs), False)
    if "" in set(arch):
        raise Invalid("column arch: empty arch")
    bad_kernel = next((k for k in set(kernel) if ":" not in k), None)
    if bad_kernel is not None:
        raise Invalid(f"column kernel: {bad_kernel!r} is not a 'module:qualname' kernel id")
    bad_how = set(how) - set(HOW_VALUES)
    if bad_how:
        raise Invalid(f"column how: {sorted(bad_how)} not among {HOW_VALUES}")
    text = {
        n: _strings_of(index_column(n, len(strings), True), strings) if n in body else None
        for n in _STRING_COLUMNS
    }
    floats = {n: _float_column(body, n, count) for n in _FLOAT_COLUMNS}
    counts = {n: _count_column(body, n, count) for n in _COUNT_COLUMNS}
    timings = _timings(floats, counts, count)
    votes = _votes(counts["votes_for"], counts["votes_total"], count)

    nones = repeat(None)
    rows = zip(
        arch, kernel, keys, (checked_configs[i] for i in config_ix), how,
        text["source_hash"] or nones, text["triton_version"] or nones, timings or nones, votes or nones,
        text["note"] or nones,
    )  # fmt: skip
    entries = {(row[0], row[1], row[2]): make_entry(row) for row in rows}
    if len(entries) != count:
        seen: set[_Ident] = set()
        for ident in zip(arch, kernel, keys):
            if ident in seen:
                raise Invalid(f"duplicate entry for arch={ident[0]!r} kernel={ident[1]!r} key={ident[2]!r}")
            seen.add(ident)
    return entries


def _column(body: dict[str, Any], name: str, types: set[type], count: int | None = None) -> list[Any]:
    col = body[name]
    if type(col) is not list:
        raise Invalid(f"column {name} must be a list")
    if count is not None and len(col) != count:
        raise Invalid(f"column {name} has {len(col)} values for {count} entries")
    found = set(map(type, col))
    if not found <= types:
        wrong = sorted(t.__name__ for t in found - types)
        raise Invalid(f"column {name}: values of type {', '.join(wrong)} are not allowed")
    return col


def _strings_of(col: list[Any], strings: list[str]) -> list[Any]:
    return [None if i is None else strings[i] for i in col]


def _float_column(body: dict[str, Any], name: str, count: int) -> list[Any] | None:
    if name not in body:
        return None
    col = _column(body, name, {float, _NONE}, count)
    present = [v for v in col if v is not None]
    if present and not (all(map(math.isfinite, present)) and min(present) >= 0):
        raise Invalid(f"column {name}: values must be finite and >= 0")
    return col


def _count_column(body: dict[str, Any], name: str, count: int) -> list[Any] | None:
    if name not in body:
        return None
    col = _column(body, name, {int, _NONE}, count)
    present = [v for v in col if v is not None]
    if present and not (min(present) >= 0 and max(present) <= INT_MAX):
        raise Invalid(f"column {name}: values must be integers >= 0")
    return col


def _timings(floats: dict[str, Any], counts: dict[str, Any], count: int) -> list[Timing | None] | None:
    names = ("median_ms", "spread_ms", "samples", "candidates", "runner_up_ms")  # Timing field order
    cols = [floats.get(n) or counts.get(n) for n in names]
    if not any(c is not None for c in cols):
        return None
    new = tuple.__new__
    filled = [c if c is not None else repeat(None) for c in cols]
    return [
        None if values == (None, None, None, None, None) else new(Timing, values) for values in zip(*filled)
    ]


def _votes(won: list[Any] | None, total: list[Any] | None, count: int) -> list[Any] | None:
    if won is None and total is None:
        return None
    if won is None or total is None:
        raise Invalid("columns votes_for and votes_total must come together")
    out: list[Any] = []
    for a, b in zip(won, total):
        if a is None and b is None:
            out.append(None)
        elif a is None or b is None or not 0 < a <= b:
            raise Invalid("votes must satisfy 0 < votes_for <= votes_total")
        else:
            out.append((a, b))
    return out


def check_schema(schema: Any) -> None:
    if type(schema) is not int:
        raise Invalid(f"schema must be an integer, got {schema!r}")
    if schema != SCHEMA:
        raise Invalid(f"schema {schema} is not supported (this library reads schema {SCHEMA}); upgrade")


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


# -- JSON --------------------------------------------------------------------------
def encode_json(library_version: str, meta: dict[str, str], entries: Sequence[Entry]) -> str:
    """Row-wise JSON view: one object per entry, sorted keys, so reviews diff per field."""
    doc: dict[str, Any] = {
        "format": FORMAT,
        "schema": SCHEMA,
        "library_version": library_version,
        "entries": [entry.to_data() for entry in entries],
    }
    if meta:
        doc["meta"] = meta
    return json.dumps(doc, indent=1, sort_keys=True, allow_nan=False, ensure_ascii=False) + "\n"


def decode_json(text: str | bytes) -> _Decoded:
    """Validate and decode the JSON view (UTF-8, no BOM); any problem raises ``Invalid``."""
    size = len(text) if isinstance(text, bytes) else None
    text = json_text(text)
    if not text.strip():
        raise Invalid("empty file")
    # Each entry has at least three maps (entry, config, kwargs): its cost is spread over them.
    check_json_budget(text, per_object=ENTRY_BYTES // 3, size=size)

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        return unique_map(pairs, "JSON field")

    def no_constants(name: str) -> Any:
        raise Invalid(f"non-finite number {name} is not allowed")

    try:
        doc = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants)
    except Invalid:
        raise
    except (ValueError, RecursionError) as exc:
        raise Invalid(f"not valid JSON: {exc}") from None
    if type(doc) is not dict or doc.get("format") != FORMAT:
        raise Invalid(f'not a {FORMAT} JSON document (missing "format": "{FORMAT}")')
    extra = doc.keys() - {"format", "schema", "library_version", "meta", "entries"}
    if extra:
        raise Invalid(f"unknown top-level fields {sorted(extra)}")
    check_schema(doc.get("schema"))
    version, meta = check_header(doc.get("library_version"), doc.get("meta"))
    rows = doc.get("entries")
    if type(rows) is not list:
        raise Invalid("entries must be a list")
    entries: dict[_Ident, Entry] = {}
    for index, row in enumerate(rows):
        try:
            entry = entry_from_data(row)
        except Invalid as exc:
            raise Invalid(f"entry {index}: {exc}") from None
        # JSON is what people edit: a key spelt "M=32,N=32" would import fine and never match.
        key = canonical_key(entry.key)
        if key is None:
            raise Invalid(
                f"entry {index}: key {entry.key!r} (kernel {entry.kernel!r}) is not a tuning key: expected "
                f"{KEY_FORM}, as a decision log or `show` prints it"
            )
        if key != entry.key:
            entry = make_entry((*entry[:2], key, *entry[3:]))
        if entry.ident in entries:
            raise Invalid(f"entry {index}: duplicate entry for arch={entry.arch!r} kernel={entry.kernel!r}")
        entries[entry.ident] = entry
    return version, meta, entries
