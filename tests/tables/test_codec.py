"""The table codec: canonical bytes, and bounded decoding of hostile files (issue 12).

Memory is measured with ``tracemalloc`` (it sees every Python object msgpack and json build).
Before decoding was bounded these files cost 15-80 bytes per file byte before being refused.
"""

from __future__ import annotations

import codecs
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from megatron_tuning.core.errors import TableError
from megatron_tuning.core.key import Key
from megatron_tuning.tables import codec
from megatron_tuning.tables.files import BUDGET_FACTOR
from megatron_tuning.tables.search import shipped_tables_dir
from megatron_tuning.tables.table import Entry, Table, Timing

MB = 1 << 20
FORMAT = "megatron_tuning.table"
BASE = {
    "strings": ["hand", "m:k", "sm90"],
    "configs": [{"kwargs": {}, "num_stages": 3, "num_warps": 4}],
    "arch": [2],
    "config": [0],
    "how": [0],
    "kernel": [1],
    "key": [0],
    "key_shapes": [[["k"], {}]],
    "key_values": [1],
}


def _doc(body: dict[str, Any], header: dict[str, Any] | None = None) -> bytes:
    return msgpack.packb([FORMAT, 2, header or {"library_version": "1"}, body], use_bin_type=True)


def _with_raw_column(name: str, raw: bytes) -> bytes:
    """A table whose column ``name`` is the msgpack bytes ``raw`` (spliced, not packed)."""
    marker = "\x00" * 7
    packed = _doc({**BASE, name: marker})
    return packed.replace(msgpack.packb(marker), raw)


def _array(n: int, element: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + element * n


def _with_raw_header_value(raw: bytes) -> bytes:
    """A table whose header ``library_version`` is the msgpack bytes ``raw`` (spliced, not packed)."""
    marker = "\x00" * 7
    return _doc(BASE, header={"library_version": marker}).replace(msgpack.packb(marker), raw)


def _nested_lists(widths: list[int], leaf: bytes = b"\x90") -> bytes:
    """Lists of ``widths[0]`` lists of ``widths[1]`` lists ... of ``leaf`` values, as msgpack bytes."""
    node = leaf
    for width in reversed(widths):
        node = b"\xdc" + width.to_bytes(2, "big") + node * width
    return node


def test_shipped_tables_re_encode_to_their_own_bytes():
    # The canonical format: the shipped tables load and re-encode byte for byte, also through
    # the JSON view (what `export` then `import` does).
    paths = sorted(Path(shipped_tables_dir()).glob("*/*.msgpack"))
    assert paths, f"no shipped tables under {shipped_tables_dir()}"
    for path in paths:
        data = path.read_bytes()
        table = Table.from_bytes(data, path=str(path))
        assert table.to_bytes() == data, path
        assert Table.from_json(table.to_json()).to_bytes() == data, path


def _peak(load: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        with pytest.raises(TableError) as info:
            load()
        return tracemalloc.get_traced_memory()[1], str(info.value)  # type: ignore[return-value]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("name", "data", "match"),
    [
        ("a top-level array of empty arrays", _array(2 * MB, b"\x90"), "format marker"),
        ("a key column of empty arrays", _with_raw_column("key", _array(2 * MB, b"\x90")), "values for"),
        ("a key column of maps", _with_raw_column("key", _array(MB, b"\x80")), "values for"),
        ("an index column of negative ints", _with_raw_column("arch", _array(2 * MB, b"\xe0")), "over the"),
        (
            "a strings column of negative ints",
            _with_raw_column("strings", _array(2 * MB, b"\xe0")),
            "over the 1000000 limit",
        ),
        ("a column claiming 2**32-1 values", _with_raw_column("key", b"\xdd\xff\xff\xff\xff"), "claimed"),
        ("a header value claiming 2**32-1 items", _with_raw_header_value(b"\xdd\xff\xff\xff\xff"), "exceeds"),
        (
            "a header value nested 4096 deep",
            _with_raw_header_value(b"\x91" * 4096 + b"\xc0"),
            "inside a single",
        ),
        (
            "a table of two million one-byte entries",
            _doc(
                {
                    **BASE,
                    "key": [""] * (2 * MB),
                    **{c: [0] * (2 * MB) for c in ("arch", "config", "how", "kernel")},
                }
            ),
            "column arch has 2097152 values, over the 1000000 limit",
        ),
    ],
)
def test_hostile_msgpack_is_refused_before_it_is_built(name, data, match):
    peak, message = _peak(lambda: Table.from_bytes(data, path="hostile"))
    assert match in message
    # The file itself and msgpack's copy of it, plus a little: never the decoded objects.
    assert peak < 3 * len(data) + 4 * MB, f"{name}: {peak / len(data):.1f} bytes per file byte"


@pytest.mark.parametrize("leaf", [b"\x90", b"\x80"], ids=["empty lists", "empty maps"])
@pytest.mark.parametrize("where", ["header", "key column"])
def test_lists_and_maps_inside_a_single_value_are_refused_as_met(leaf, where):
    # 8 MiB of empty lists or maps nested inside one value: ~65 bytes of objects per file byte,
    # were they all built. A value that holds a list or map is refused at the first one.
    bomb = _nested_lists([128, 128, 128, 4], leaf)
    data = _with_raw_header_value(bomb) if where == "header" else _with_raw_column("key", b"\x91" + bomb)
    peak, message = _peak(lambda: Table.from_bytes(data, path="hostile"))
    assert "a list or map inside a single value" in message and "exceeds max_array_len(0)" in message
    assert peak < 3 * len(data) + 4 * MB


def test_a_map_column_over_its_byte_limit_is_refused_unbuilt(monkeypatch):
    # Configs hold maps: their column is measured (msgpack's skip builds nothing) before it is decoded.
    monkeypatch.setattr(codec, "MAX_MAP_COLUMN_BYTES", MB)
    bomb = _nested_lists([128, 128, 128], b"\x80")  # 2 MiB of empty maps inside one config
    data = _with_raw_column("configs", b"\x91\x81\xa6kwargs" + bomb)
    peak, message = _peak(lambda: Table.from_bytes(data, path="hostile"))
    assert f"column configs is over the {MB}-byte limit" in message
    assert peak < 3 * len(data) + 4 * MB
    monkeypatch.setattr(codec, "MAX_MAP_COLUMN_BYTES", 4 * MB)  # within it: decoded, then refused
    assert "configs[0]: config.kwargs must be a map" in _peak(lambda: Table.from_bytes(data))[1]


def test_keys_whose_text_would_pass_the_limit_are_refused_before_it_is_built(monkeypatch):
    # One key shape naming a 1 MiB argument, and 300 rows of it: 300 MiB of key text, were it built.
    rows = 300
    columns = {c: [0] * rows for c in ("arch", "config", "how", "kernel", "key")}
    data = _doc({**BASE, **columns, "key_shapes": [[["n" * MB], {}]], "key_values": [1] * rows})
    peak, message = _peak(lambda: Table.from_bytes(data, path="hostile"))
    assert "characters of text, over the 268435456 limit" in message
    assert peak < 3 * len(data) + 4 * MB


def test_hostile_json_is_refused_before_it_is_parsed():
    for text in ("[" + ",".join(["[]"] * MB) + "]", "[" + ",".join(["{}"] * MB) + "]"):
        data = text.encode()
        peak, message = _peak(lambda d=data: Table.from_json(d, path="hostile.json"))
        assert "would need about" in message and f"{BUDGET_FACTOR}x the file size" in message
        assert peak < 3 * len(data) + 4 * MB


def _big_table(count: int) -> Table:
    return Table(
        Entry(
            arch="sm90",
            kernel=f"pkg.ops:kernel_{i % 20}",
            key=Key({"M": i, "N": 4096, "K": 4096}, {"a_ptr": "torch.bfloat16", "b_ptr": "torch.bfloat16"}),
            config={"kwargs": {"BLOCK_M": 64 << (i % 2)}, "num_warps": 4, "num_stages": 3},
            how="tuned",
            source_hash=f"{i:064x}",
            triton_version="3.6.0",
            timing=Timing(median_ms=0.5 + i / 1e5, spread_ms=0.01, samples=100, candidates=16),
        )
        for i in range(count)
    )


def test_genuine_tables_stay_well_inside_the_budget():
    table = _big_table(5_000)
    for data, load in ((table.to_bytes(), Table.from_bytes), (table.to_json().encode(), Table.from_json)):
        tracemalloc.start()
        try:
            assert load(data) == table
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        # JSON within half its budget; msgpack (no budget: caps) builds its keys' text from parts
        # stored once per kernel, so its file is small for what it builds (measured: 10.3x).
        assert peak < (BUDGET_FACTOR / 2 if load is Table.from_json else 12) * len(data)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (
            _doc(BASE, header={"library_version": "1", "meta": {"a": "1", "b": "2"}}).replace(
                b"\xa1b", b"\xa1a"
            ),
            "header meta: duplicate field 'a'",
        ),
        (
            _doc(BASE, header={"library_version": "1", "meta": {}}).replace(
                b"\xa4meta\x80", b"\xaflibrary_version\xa12"
            ),
            "header: duplicate field 'library_version'",
        ),
        (_doc(BASE).replace(b"\xa3how", b"\xa4arch"), "duplicate column 'arch'"),
    ],
)
def test_duplicate_msgpack_map_keys_are_refused(data, match):
    # msgpack itself keeps the last of two equal keys; the JSON view refuses them, so must msgpack.
    with pytest.raises(TableError, match=match):
        Table.from_bytes(data)


def test_duplicate_config_keys_are_refused():
    config = (
        b"\x83\xa6kwargs\x80\xa9num_warps\x04\xa9num_warps\x08"  # num_warps twice: msgpack keeps the last
    )
    data = _with_raw_column("configs", b"\x91" + config)
    with pytest.raises(TableError, match="duplicate map key 'num_warps'"):
        Table.from_bytes(data)


@pytest.mark.parametrize("data", [b"\xc1", b"\x94\xc1", b"\x94\xa5mega", b"\x94\xa1x", _doc(BASE)[:-3]])
def test_corrupt_msgpack_errors_always_say_what_is_wrong(data):
    with pytest.raises(TableError) as info:
        Table.from_bytes(data)
    assert not info.value.problem.rstrip().endswith(":"), info.value.problem


@pytest.mark.parametrize(
    ("encode", "match"),
    [
        (lambda text: codecs.BOM_UTF8 + text.encode(), "byte-order mark"),
        (lambda text: text.encode("utf-16"), "not UTF-8"),
        (lambda text: text.encode("utf-16-le"), "not UTF-8"),
        (lambda text: text.encode("utf-32"), "not UTF-8"),
    ],
)
def test_json_views_must_be_utf8_without_bom(tmp_path, encode, match):
    text = Table(
        [
            Entry(
                arch="sm90",
                kernel="m:k",
                key=Key({"n": 1}, {"x": "torch.float16"}),
                config=BASE["configs"][0],
            )
        ]
    ).to_json()
    assert Table.from_json(text.encode()) is not None
    path = tmp_path / "t.json"
    path.write_bytes(encode(text))
    from megatron_tuning.tables.table import load_table

    with pytest.raises(TableError, match=match):
        load_table(path)
