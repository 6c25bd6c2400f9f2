"""Fuzzing the table loaders: whatever the bytes, the only exception is ``TableError``.

Thousands of inputs per run: random bytes, byte-level mutations of a valid file (flips,
truncations, insertions, deletions), structure-level mutations (any node of a valid
decoded document replaced by any msgpack value), and mutated JSON views. A mutation that
happens to stay valid must load to a table that re-encodes canonically.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_tuning.core.errors import TableError
from megatron_tuning.core.key import Key
from megatron_tuning.tables.entry import Entry, Timing
from megatron_tuning.tables.table import Table

FUZZ = settings(
    max_examples=800,
    deadline=None,
    derandomize=True,  # the same inputs on every CI run; failures reproduce
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _valid_table() -> Table:
    entries = [
        Entry(
            arch="sm90",
            kernel=f"pkg.mod:k{i % 2}",
            key=Key({"M": i}, {"x": "torch.float16"}),
            config={
                "kwargs": {"BLOCK": 16 << (i % 3), "EVEN": i % 2 == 0, "F": 0.5},
                "num_warps": 4,
                "num_stages": 2 + i % 2,
                "maxnreg": None,
            },
            how=("tuned", "recorded", "hand")[i % 3],
            source_hash="cd" * 32 if i % 2 else None,
            triton_version="3.6.0",
            timing=Timing(median_ms=0.5 + i, samples=10) if i % 2 else None,
            votes=(2, 3) if i == 1 else None,
            note="n" if i == 2 else None,
        )
        for i in range(5)
    ]
    return Table(entries, library_version="0.1.0", meta={"k": "v"})


VALID = _valid_table().to_bytes()
VALID_DOC = msgpack.unpackb(VALID, raw=False)
VALID_JSON = _valid_table().to_json()


def _load_only_table_error(data: bytes, loader: Any = Table.from_bytes) -> None:
    try:
        table = loader(data, path="fuzz")
    except TableError as exc:
        assert exc.path == "fuzz" and exc.problem
        return
    # Still valid: it must be a fully usable table that re-encodes canonically.
    again = Table.from_bytes(table.to_bytes())
    assert again == table and again.to_bytes() == table.to_bytes()


@settings(FUZZ, max_examples=1000)
@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    _load_only_table_error(data)


@st.composite
def _byte_mutations(draw: st.DrawFn) -> bytes:
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
    return bytes(data)


@FUZZ
@given(_byte_mutations())
def test_mutated_valid_file(data: bytes) -> None:
    _load_only_table_error(data)


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.binary(max_size=8)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, list):
        for i, child in enumerate(node):
            out += _paths(child, (*prefix, i))
    elif isinstance(node, dict):
        for k, child in node.items():
            out += _paths(child, (*prefix, k))
    return out


_DOC_PATHS = _paths(VALID_DOC)


def _replace(node: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(node, list):
        copy = list(node)
    else:
        copy = dict(node)
    copy[head] = _replace(node[head], rest, value)
    return copy


@settings(FUZZ, max_examples=600)
@given(st.lists(st.tuples(st.sampled_from(_DOC_PATHS), _VALUES), min_size=1, max_size=3))
def test_structure_mutations(edits: list[tuple[tuple[Any, ...], Any]]) -> None:
    doc: Any = VALID_DOC
    for path, value in edits:
        try:
            doc = _replace(doc, path, value)
        except (KeyError, IndexError, TypeError, ValueError):  # an earlier edit removed this path
            continue
    _load_only_table_error(msgpack.packb(doc, use_bin_type=True))


@FUZZ
@given(
    st.lists(
        st.tuples(st.integers(0, len(VALID_JSON)), st.text(max_size=6), st.integers(0, 8)),
        min_size=1,
        max_size=3,
    )
)
def test_mutated_json(edits: list[tuple[int, str, int]]) -> None:
    text = VALID_JSON
    for pos, insert, delete in edits:
        text = text[:pos] + insert + text[pos + delete :]
    _load_only_table_error(text.encode("utf-8", "surrogatepass"), Table.from_json)


@settings(FUZZ, max_examples=300)
@given(
    st.dictionaries(st.sampled_from(["format", "schema", "library_version", "meta", "entries", "x"]), _VALUES)
)
def test_json_documents_of_any_shape(doc: dict[str, Any]) -> None:
    doc.setdefault("format", "megatron_tuning.table")
    try:
        text = json.dumps(doc, default=repr)
    except ValueError:
        return
    _load_only_table_error(text.encode(), Table.from_json)
