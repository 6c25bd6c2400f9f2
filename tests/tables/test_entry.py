"""Tuning keys in tables: every key ``tuning_key`` writes is canonical; a hand-spelt one is respelt
when a JSON view is read, and what is no key at all is refused naming the form (issue 17 item 5)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tuning.commands.validate import validate_tables
from megatron_tuning.core.errors import TableError
from megatron_tuning.core.identity import tuning_key
from megatron_tuning.tables.entry import Entry, canonical_key
from megatron_tuning.tables.table import Table, load_table, save_table

CONFIG = {"kwargs": {"BLOCK": 64}, "num_warps": 4, "num_stages": 3}
LIVE = "M=32, N=32, K=32 | a_ptr:torch.float16, b_ptr:torch.float16"


def _view(key: str) -> str:
    entry = Entry(arch="sm90", kernel="pkg:matmul", key=LIVE, config=CONFIG)
    doc = json.loads(Table([entry]).to_json())
    doc["entries"][0]["key"] = key
    return json.dumps(doc)


@pytest.mark.parametrize(
    "spelt",
    [
        "M=32,N=32,K=32 | a_ptr:torch.float16,b_ptr:torch.float16",
        "M=32,N=32,K=32|a_ptr:torch.float16, b_ptr:torch.float16",
        " M = 32 , N=32,  K =32  |  a_ptr : torch.float16 ,b_ptr:torch.float16 ",
        LIVE,
    ],
)
def test_a_hand_spelt_key_is_imported_as_launches_spell_it(spelt):
    table = Table.from_json(_view(spelt))
    (entry,) = table.entries()
    assert entry.key == LIVE
    assert table.get("sm90", "pkg:matmul", LIVE) is not None


@pytest.mark.parametrize(
    "bad", ["M=32,N=32,K=32", "M=32, N=32, K=32", "k", "32 | a_ptr:torch.float16", "M=1 | a"]
)
def test_what_is_no_tuning_key_is_refused_naming_the_form(bad):
    with pytest.raises(TableError) as info:
        Table.from_json(_view(bad))
    message = str(info.value)
    assert f"key {bad!r} (kernel 'pkg:matmul') is not a tuning key" in message
    assert "'NAME=VALUE, NAME=VALUE | ARG:DTYPE, ARG:DTYPE'" in message


def test_validate_flags_keys_that_can_never_match(tmp_path):
    path = tmp_path / "t.msgpack"
    entries = [
        Entry(arch="sm90", kernel="pkg:matmul", key=LIVE, config=CONFIG),
        Entry(arch="sm90", kernel="pkg:matmul", key="M=64,N=32 | a:torch.float16", config=CONFIG),
        Entry(arch="sm90", kernel="pkg:matmul", key="M=128", config=CONFIG),
    ]
    save_table(Table(entries), path)  # msgpack is not respelt: validate is where it shows
    report = validate_tables([str(path)], arch="sm90", triton_version="3.9.0")
    problems = {p.key: p.problem for p in report.problems}
    assert LIVE not in problems
    assert problems["M=64,N=32 | a:torch.float16"] == (
        "key is not spelt as launches spell it, so it never matches; "
        "write it as [M=64, N=32 | a:torch.float16]"
    )
    assert "is not a tuning key" in problems["M=128"] and "never match a launch" in problems["M=128"]


def test_export_then_import_keeps_every_key_the_library_writes(tmp_path):
    keys = [LIVE, "M=1 | ", " | x:torch.float32", "s='a, b=1', t=(1, 2), u=None | x:torch.float32"]
    table = Table([Entry(arch="sm90", kernel="pkg:k", key=k, config=CONFIG) for k in keys])
    back = Table.from_json(table.to_json())
    assert back.to_bytes() == table.to_bytes()
    view = tmp_path / "t.json"
    view.write_text(table.to_json(), encoding="utf-8")
    assert load_table(view).to_bytes() == table.to_bytes()


_VALUES = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.tuples(st.integers(-5, 5), st.text(max_size=4)),
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(_VALUES, min_size=0, max_size=4), st.integers(0, 3))
def test_every_key_tuning_key_writes_is_already_canonical(values, tensors):
    names = [f"k{i}" for i in range(len(values))]
    tensor_names = [f"t{i}_ptr" for i in range(tensors)]
    autotuner = SimpleNamespace(arg_names=[*names, *tensor_names], keys=names)
    args = [*values, *(torch.zeros(1, dtype=torch.float16) for _ in tensor_names)]
    key = tuning_key(autotuner, args, {})
    assert canonical_key(key) == key
