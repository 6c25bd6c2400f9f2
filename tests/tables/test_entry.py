"""Keys in table entries: stored as their parts, so every key a launch builds comes back from msgpack
and the JSON view with the same parts and types; text alone is no key."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tuning.core.errors import TableError
from megatron_tuning.core.key import Key, tuning_key
from megatron_tuning.tables.entry import Entry, Invalid
from megatron_tuning.tables.table import Table

CONFIG = {"kwargs": {"BLOCK": 64}, "num_warps": 4, "num_stages": 3}

_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.tuples(st.integers(-5, 5), st.text(max_size=4)),
)


def _typed(key: Key) -> list[tuple[str, type, object]]:
    return [(name, type(value), value) for name, value in zip(key.names, key.values)]


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(_VALUES, min_size=0, max_size=4), st.integers(0, 3))
def test_every_key_a_launch_builds_comes_back_with_its_parts_and_types(values, tensors):
    names = [f"k{i}" for i in range(len(values))]
    tensor_names = [f"t{i}_ptr" for i in range(tensors)]
    autotuner = SimpleNamespace(arg_names=[*names, *tensor_names], keys=list(reversed(names)))
    args = [*values, *(torch.zeros(1, dtype=torch.float16) for _ in tensor_names)]
    key = tuning_key(autotuner, args, {})
    table = Table([Entry(arch="sm90", kernel="pkg:k", key=key, config=CONFIG)])
    for back in (Table.from_bytes(table.to_bytes()), Table.from_json(table.to_json())):
        (entry,) = back.entries()
        assert entry.key == key and _typed(entry.key) == _typed(key) and entry.key.dtypes == key.dtypes
        assert back.to_bytes() == table.to_bytes()


def test_true_one_and_one_point_zero_are_three_entries():
    keys = [Key({"n": 40, "flag": flag}, {"x_ptr": "torch.float32"}) for flag in (True, 1, 1.0)]
    table = Table([Entry(arch="sm90", kernel="pkg:k", key=k, config=CONFIG) for k in keys])
    assert [str(k) for k in keys] == [f"n=40, flag={f} | x_ptr:torch.float32" for f in ("True", "1", "1.0")]
    for back in (Table.from_bytes(table.to_bytes()), Table.from_json(table.to_json())):
        assert len(back) == 3 and {type(e.key.values[1]) for e in back.entries()} == {bool, int, float}


def test_a_key_given_as_text_is_refused_naming_the_stored_form():
    with pytest.raises(
        Invalid,
        match=r"key of kernel 'pkg:k': key 'M=32, N=32 \| a:torch.float16' is text.*tuning_key.*"
        r"core.key.Key\(\{'M': 32, 'N': 32\}, \{'a_ptr': 'torch.float16'\}\).*a key reads \{\"values\"",
    ):
        Entry(arch="sm90", kernel="pkg:k", key="M=32, N=32 | a:torch.float16", config=CONFIG)
    doc = json.loads(Table([Entry(arch="sm90", kernel="pkg:k", key=Key({"M": 1}), config=CONFIG)]).to_json())
    doc["entries"][0]["key"] = "M=32, N=32 | a:torch.float16"
    with pytest.raises(TableError, match="entry 0: key of kernel 'pkg:k'.*in the kernel's key order"):
        Table.from_json(json.dumps(doc))


@pytest.mark.parametrize(
    "stored",
    [
        {"values": {"M": 1}},
        {"values": {"M": [1, 2]}, "dtypes": {}},
        {"values": {"M": {"txt": "x"}}, "dtypes": {}},
        {"values": {"M": 2**64}, "dtypes": {}},
        {"values": {}, "dtypes": {"a": 16}},
    ],
)
def test_a_stored_key_of_the_wrong_shape_is_refused(stored):
    with pytest.raises(Invalid, match="key of kernel 'pkg:k'"):
        Entry(arch="sm90", kernel="pkg:k", key=stored, config=CONFIG)
