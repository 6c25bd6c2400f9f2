"""How tables store keys (issue 35): schema 2's parts, and schema 1's text read as the version that
wrote it read it (today's shipped tables and an old auto cache, ``fixtures/schema1``)."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tuning.core.identity import config_signature
from megatron_tuning.core.key import Key, Shown, call_key
from megatron_tuning.tables.entry import Invalid
from megatron_tuning.tables.keys import key_from_text
from megatron_tuning.tables.table import Table, load_table

SCHEMA1 = Path(__file__).parent / "fixtures" / "schema1"
CONFIGS = Path(__file__).parents[2] / "configs"


def _parts(key: Key) -> tuple[object, ...]:
    return (key.names, tuple(map(type, key.values)), key.values, key.dtypes)


def test_schema_1_files_read_as_the_version_that_wrote_them_and_rewrite_as_schema_2():
    expected = json.loads((SCHEMA1 / "expected.json").read_text(encoding="utf-8"))
    for name in sorted(set(expected) - {"decisions.json"}):
        table = load_table(SCHEMA1 / name)
        assert [[e.arch, e.kernel, e.key, config_signature(e.config)] for e in table.entries()] == expected[
            name
        ]
        for again in (Table.from_bytes(table.to_bytes()), Table.from_json(table.to_json())):
            assert again == table and list(map(_parts, (e.key for e in again.entries()))) == [
                _parts(e.key) for e in table.entries()
            ]
        shipped = CONFIGS / name.replace("_", "/", 1)  # configs/ holds the same tables as schema 2
        if shipped.exists():
            assert load_table(shipped) == table and msgpack.unpackb(shipped.read_bytes())[1] == 2
    odd = next(
        e.key for e in load_table(SCHEMA1 / "auto_cache.msgpack").entries() if e.kernel == "pkg.odd:kern"
    )
    assert list(zip(odd.names, odd.values)) == [
        ("s", "a, b=c | d"),
        ("none", None),
        ("f", 0.5),
        ("neg", -3),
        ("big", Shown("12345678901234567890123")),
        ("t", Shown("tensor([4], torch.float32)")),
        ("inf", Shown("inf")),
        ("tup", Shown("(1, 2)")),
    ]
    flags = [e.key.values[1] for e in load_table(SCHEMA1 / "auto_cache.msgpack").entries() if "flag" in e.key]
    assert sorted(map(type, flags), key=str) == [bool, float, int]


_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.tuples(st.integers(-5, 5), st.text(max_size=4)),
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(_VALUES, max_size=4), st.lists(st.sampled_from(["torch.float16", "torch.int8"]), max_size=3))
def test_schema_1_text_reads_back_to_the_key_a_launch_built(values, dtypes):
    names, tensors = [f"k{i}" for i in range(len(values))], [f"t{i}" for i in range(len(dtypes))]
    key = call_key([*names, *tensors], names, [*values, *(type("T", (), {"dtype": d})() for d in dtypes)], {})
    assert _parts(key_from_text(str(key))) == _parts(key)


@pytest.mark.parametrize("text", ["M=32,N=32", "k", "32 | a_ptr:torch.float16", "M=1 | a", "M=1, M=2 | "])
def test_schema_1_text_that_is_no_key_is_refused_naming_the_form(text):
    with pytest.raises(Invalid, match=r"is not NAME=VALUE, \.\.\. \| ARG:DTYPE"):
        key_from_text(text)
