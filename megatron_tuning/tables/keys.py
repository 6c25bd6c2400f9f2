"""How tables store keys: schema 2's columns of parts, and schema 1's text, read (never written).
Schema 2: each distinct (names, dtypes) once in ``key_shapes``; each row's key as its index in
``key``, its values one after another in ``key_values``."""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from ..core.key import Key, Shown, key_value, stored_value, value_from_stored
from .entry import Invalid

_MAX_KEY_TEXT = 65536  # a schema-1 key's characters (real keys hold well under a thousand)
MAX_KEYS_TEXT = 256 * 1024 * 1024  # all keys of a table together (a million real keys: ~100 MB)


def key_columns(keys: Sequence[Key]) -> dict[str, list[Any]]:
    shapes = {(key.names, key.dtypes) for key in keys}
    index = {
        shape: i for i, shape in enumerate(sorted(shapes, key=lambda s: msgpack.packb([s[0], dict(s[1])])))
    }
    return {
        "key": [index[key.names, key.dtypes] for key in keys],
        "key_shapes": [[list(names), dict(dtypes)] for names, dtypes in index],
        "key_values": [stored_value(value) for key in keys for value in key.values],
    }


def keys_from_columns(body: dict[str, list[Any]], schema: int) -> list[Key]:
    if schema == 1:
        return [_checked(key_from_text, text, f"key[{i}]") for i, text in enumerate(body["key"])]
    shapes = [
        _checked(_key_shape, shape, f"key_shapes[{i}]") for i, shape in enumerate(body.get("key_shapes", ()))
    ]
    column, flat, keys, at = body["key"], body.get("key_values", []), [], 0
    bad = next(
        (i for i, index in enumerate(column) if type(index) is not int or not 0 <= index < len(shapes)), None
    )
    if bad is not None:
        raise Invalid(f"column key[{bad}]: not an index into key_shapes")
    # Each key's text is built, not read: its names and dtypes per row, each value's (a string's
    # repr may escape a character as 10). A file that would build more is refused before.
    text = (
        sum(shapes[i][2] for i in column) + 24 * len(flat) + 10 * sum(len(v) for v in flat if type(v) is str)
    )
    if text > MAX_KEYS_TEXT:
        raise Invalid(f"its keys would take {text} characters of text, over the {MAX_KEYS_TEXT} limit")
    try:
        for index in column:
            names, dtypes, _ = shapes[index]
            keys.append(Key.of(names, tuple(map(value_from_stored, flat[at : at + len(names)])), dtypes))
            at += len(names)
    except ValueError as exc:
        raise Invalid(f"column key[{len(keys)}]: {exc}") from None
    if at != len(flat):
        raise Invalid(f"column key_values: {len(flat)} values for keys of {at}")
    return keys


def _key_shape(shape: Any) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...], int]:
    """Names, dtypes, and how much text they add to each key of theirs."""
    if type(shape) is not list or len(shape) != 2 or type(shape[0]) is not list or type(shape[1]) is not dict:
        raise ValueError("not [names, dtypes]")
    names, dtypes = tuple(shape[0]), tuple(shape[1].items())
    if not all(type(n) is str for n in names) or not all(type(d) is str for _, d in dtypes):
        raise ValueError("names and dtypes must be strings")
    return names, dtypes, 64 + sum(len(n) + 3 for n in names) + sum(len(n) + len(d) + 3 for n, d in dtypes)


def _checked(build: Callable[[Any], Any], data: Any, where: str) -> Any:
    try:
        return build(data)
    except (Invalid, ValueError) as exc:
        raise Invalid(f"column {where}: {exc}") from None


def key_from_text(text: str) -> Key:
    """A schema-1 key, ``NAME=VALUE, ... | ARG:DTYPE, ...``, read by Python's own parser."""
    if type(text) is not str:
        raise Invalid(f"key must be a string, got {text!r}")
    values_text, bar, dtypes_text = text.rpartition("|")  # dtype names never hold "|"
    source = f"_({values_text})"
    problem = f"schema-1 key {text[:200]!r} is not NAME=VALUE, ... | ARG:DTYPE, ..."
    try:
        if len(text) > _MAX_KEY_TEXT:
            raise ValueError(text)
        call = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise Invalid(problem) from None
    if not bar or not isinstance(call, ast.Call) or call.args:
        raise Invalid(problem)
    names = [keyword.arg for keyword in call.keywords]
    if None in names or len(set(names)) != len(names):  # **spread, or a name twice
        raise Invalid(problem)
    values: dict[str, Any] = {}
    for keyword in call.keywords:
        try:
            value = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            value = ()  # not a literal (a tensor, inf, a type name): kept as its text, as a tuple is
        scalar = value is None or type(value) in (bool, int, float, str)
        values[str(keyword.arg)] = (
            key_value(value) if scalar else Shown(ast.get_source_segment(source, keyword.value) or "")
        )
    dtypes = [item.partition(":") for item in dtypes_text.split(",") if dtypes_text.strip()]
    if any(not sep or not name.strip().isidentifier() for name, sep, _ in dtypes):
        raise Invalid(problem)
    try:
        pairs = tuple((name.strip(), dtype.strip()) for name, _, dtype in dtypes)
        return Key.of(tuple(values), tuple(values.values()), pairs)
    except ValueError as exc:
        raise Invalid(f"{problem}: {exc}") from None
