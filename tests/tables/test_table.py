"""Tuning tables: canonical encoding, lossless JSON, validation on load, safe writes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest

from megatron_tuning.core import __version__
from megatron_tuning.core.errors import MegatronTuningError, TableError
from megatron_tuning.core.key import Key
from megatron_tuning.tables.entry import Entry, Timing, entry_with
from megatron_tuning.tables.files import write_atomic
from megatron_tuning.tables.table import Table, add_entries, load_table, save_table, update_table

REPO = Path(__file__).resolve().parents[2]


def make_entry(index: int = 0, **changes: object) -> Entry:
    fields: dict[str, object] = {
        "arch": "sm90",
        "kernel": f"pkg.kernels:kernel_{index % 3}",
        "key": Key({"M": 64 * (index + 1), "N": 128}, {"a_ptr": "torch.float16"}),
        "config": {
            "kwargs": {"BLOCK_M": 64, "BLOCK_N": 32 * (1 + index % 2), "EVEN": True},
            "num_warps": 4,
            "num_stages": 3,
            "num_ctas": 1,
            "maxnreg": None,
        },
        "how": "tuned",
        "source_hash": "ab" * 32,
        "triton_version": "3.6.0",
        "timing": Timing(
            median_ms=0.125 + index, spread_ms=0.01, samples=50, candidates=8, runner_up_ms=0.13
        ),
    }
    fields.update(changes)
    return Entry(**fields)  # type: ignore[arg-type]


def sample_table(count: int = 6) -> Table:
    entries = [make_entry(i) for i in range(count)]
    entries.append(
        make_entry(99, how="hand", source_hash=None, triton_version=None, timing=None, note="why: ok")
    )
    entries.append(
        make_entry(98, arch="sm80", how="recorded", votes=(2, 3), config_list_digest="0123456789ab")
    )
    return Table(entries, library_version="0.1.0", meta={"gpu": "H200"})


# -- canonical encoding ------------------------------------------------------------
def test_msgpack_json_msgpack_round_trip_is_byte_identical():
    original = sample_table()
    data = original.to_bytes()
    text = Table.from_bytes(data).to_json()
    assert Table.from_json(text).to_bytes() == data
    assert Table.from_json(text) == original
    assert Table.from_bytes(data).to_json() == text
    assert [e.config_list_digest for e in Table.from_bytes(data)].count("0123456789ab") == 1


def test_insertion_order_does_not_change_bytes():
    entries = sample_table().entries()
    shuffled = list(entries)
    random.Random(3).shuffle(shuffled)
    a = Table(entries, library_version="1", meta={"x": "1", "a": "2"})
    b = Table(shuffled, library_version="1", meta={"a": "2", "x": "1"})
    assert a.to_bytes() == b.to_bytes()
    assert a.to_json() == b.to_json()


def test_config_key_order_and_tuples_are_canonicalised():
    one = make_entry(config={"num_stages": 3, "num_warps": 4, "kwargs": {"B": 2, "A": (1, 2)}})
    two = make_entry(config={"kwargs": {"A": [1, 2], "B": 2}, "num_warps": 4, "num_stages": 3})
    assert one == two
    assert list(one.config) == ["kwargs", "num_stages", "num_warps"]
    assert Table([one]).to_bytes() == Table([two]).to_bytes()


def test_json_keeps_bool_int_float_distinct():
    entry = make_entry(
        config={
            "kwargs": {"FLAG": True, "ONE": 1, "HALF": 1.0, "S": "x", "N": None},
            "num_warps": 4,
            "num_stages": 3,
        }
    )
    back = Table.from_json(Table([entry]).to_json()).entries()[0]
    kwargs = back.config["kwargs"]
    assert [type(kwargs[k]) for k in ("FLAG", "ONE", "HALF", "S", "N")] == [bool, int, float, str, type(None)]
    assert Table([back]).to_bytes() == Table([entry]).to_bytes()
    back2 = Table.from_bytes(Table([entry]).to_bytes()).entries()[0]
    assert back2.config == entry.config and type(back2.config["kwargs"]["FLAG"]) is bool


def test_same_config_with_bool_and_int_are_different_entries():
    as_bool = make_entry(config={"kwargs": {"EVEN": True}, "num_warps": 4, "num_stages": 3})
    as_int = make_entry(config={"kwargs": {"EVEN": 1}, "num_warps": 4, "num_stages": 3})
    assert as_bool != as_int
    assert Table([as_bool]).to_bytes() != Table([as_int]).to_bytes()


def test_empty_table_round_trips(tmp_path):
    path = tmp_path / "empty.msgpack"
    save_table(Table(library_version="x"), path)
    assert len(load_table(path)) == 0
    assert Table.from_json(load_table(path).to_json()).to_bytes() == path.read_bytes()


def test_lookup_and_mutation():
    table = sample_table()
    entry = make_entry(2)
    assert table.get(*entry.ident) == entry
    assert entry.ident in table
    assert table.get("sm90", "pkg.kernels:kernel_2", "nope") is None
    changed = entry_with(entry, config={"kwargs": {"BLOCK_M": 128}, "num_warps": 8, "num_stages": 2})
    assert table.add(changed, replace=False) is False
    assert table.add(changed) is True and table.get(*entry.ident) == changed
    assert table.remove(*entry.ident) == changed and entry.ident not in table


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"arch": ""}, "arch"),
        ({"kernel": "no_colon"}, "module:qualname"),
        ({"how": "guessed"}, "how"),
        ({"config": {"kwargs": {}, "num_warps": 4}}, "num_stages"),
        (
            {"config": {"kwargs": {}, "num_warps": -(2**63), "num_stages": 3}},
            "num_warps=-9223372036854775808",
        ),
        ({"config": {"kwargs": {}, "num_warps": 0, "num_stages": 3}}, "outside 1..1024"),
        ({"config": {"kwargs": {}, "num_warps": 4, "num_stages": -1}}, "num_stages=-1 is outside"),
        ({"config": {"kwargs": {"A": float("nan")}, "num_warps": 4, "num_stages": 3}}, "non-finite.* A"),
        (
            {"config": {"kwargs": {"A": [1, object()]}, "num_warps": 4, "num_stages": 3}},
            "config field A holds a value of type object, which cannot be stored",
        ),
        ({"config": {"kwargs": {1: 2}, "num_warps": 4, "num_stages": 3}}, "keys must be strings"),
        ({"timing": {"median_ms": -1.0}}, "median_ms"),
        ({"timing": {"median_ms": 10**400}}, "median_ms"),
        ({"votes": (3, 2)}, "votes"),
        ({"source_hash": 5}, "source_hash"),
    ],
)
def test_bad_entries_are_rejected_when_built(changes, match):
    with pytest.raises(ValueError, match=match):
        make_entry(**changes)


# -- validation on load ------------------------------------------------------------
def _duplicated() -> bytes:
    # Two entries that differ only in key; then make the keys equal.
    doc = msgpack.unpackb(Table([make_entry(0), make_entry(3)]).to_bytes(), raw=False)
    doc[3]["key_values"] = doc[3]["key_values"][:2] * 2  # the second key takes the first's values
    return msgpack.packb(doc, use_bin_type=True)


def _packed(
    body_changes: dict[str, object] | None = None,
    *,
    header: object = None,
    schema: object = 2,
    fmt: object = "megatron_tuning.table",
) -> bytes:
    doc = msgpack.unpackb(sample_table().to_bytes(), raw=False)
    if body_changes:
        doc[3].update(body_changes)
    if header is not None:
        doc[2] = header
    doc[0], doc[1] = fmt, schema
    return msgpack.packb(doc, use_bin_type=True)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (b"\x00\x01garbage", "format marker|msgpack"),
        (sample_table().to_bytes()[:-7], "truncated"),
        (sample_table().to_bytes() + b"\x00", "trailing"),
        (msgpack.packb({"not": "a table"}), "format marker"),
        (_packed(fmt="something.else"), "format marker"),
        (_packed(schema=3), "schema 3 is not supported"),
        (_packed(schema="1"), "schema must be an integer"),
        (_packed(header={"library_version": 1}), "library_version"),
        (_packed(header={"library_version": "1", "meta": {"a": 1}}), "meta"),
        (_packed(header={"library_version": "1", "extra": 1}), "header"),
        (_packed({"arch": [0.5]}), "arch"),
        (_packed({"arch": [10_000] * 8}), "out of range"),
        (_packed({"key": ["k"] * 3}), "values for"),
        (_packed({"how": [True] * 8}), "how"),
        (_packed({"median_ms": [float("inf")] * 8}), "finite"),
        (_packed({"median_ms": [1] * 8}), "median_ms"),
        (_packed({"votes_for": None}), "votes|column"),
        (_packed({"configs": [{"kwargs": {}, "num_warps": "4", "num_stages": 3}]}), "num_warps"),
        (_packed({"surprise": []}), "unknown columns"),
        (_duplicated(), "duplicate entry"),
    ],
)
def test_bad_files_raise_one_table_error_naming_file_and_problem(tmp_path, data, match):
    path = tmp_path / "bad.msgpack"
    path.write_bytes(data)
    with pytest.raises(TableError, match=match) as info:
        load_table(path)
    assert info.value.path == str(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, MegatronTuningError)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty"),
        ("{", "not valid JSON"),
        ("[" * 50_000, "not valid JSON"),
        ('{"format": "megatron_tuning.table", "format": "x"}', "duplicate"),
        ('{"format": "other"}', "not a megatron_tuning.table"),
        (
            '{"format": "megatron_tuning.table", "schema": 1, "library_version": "1", "entries": [], "x": 1}',
            "unknown top-level",
        ),
        (
            '{"format": "megatron_tuning.table", "schema": 1, "library_version": "1", "entries": [{'
            '"arch": "a", "kernel": "m:f", "key": "k", '
            '"config": {"kwargs": {}, "num_warps": 1, "num_stages": NaN}}]}',
            "NaN",
        ),
        ('{"format": "megatron_tuning.table", "schema": 1, "library_version": "1", "entries": {}}', "list"),
    ],
)
def test_bad_json_raises_table_error(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(TableError, match=match):
        load_table(path)


@pytest.mark.parametrize(
    ("field", "value"),
    [("key", "\ud800"), ("note", "\udfff"), ("meta", "\ud800"), ("config", "\ud800")],
)
def test_json_with_lone_surrogates_is_rejected_at_load(tmp_path, field, value):
    # json.loads turns a "\ud800" escape into a str that msgpack cannot encode; it used to
    # load fine and then fail with UnicodeEncodeError on save (a traceback in `import`).
    doc = json.loads(sample_table().to_json())
    if field == "meta":
        doc["meta"] = {"who": value}
    elif field == "config":
        doc["entries"][0]["config"]["kwargs"]["MODE"] = value
    elif field == "key":
        doc["entries"][0]["key"]["values"]["M"] = value
    else:
        doc["entries"][0][field] = value
    path = tmp_path / "sur.json"
    path.write_text(json.dumps(doc))  # ensure_ascii: the surrogate is written as an escape
    with pytest.raises(TableError, match="lone surrogate") as info:
        load_table(path)
    assert info.value.path == str(path)
    with pytest.raises(ValueError, match="lone surrogate"):
        Entry(
            arch="sm90",
            kernel="m:f",
            key=Key({"M": value}),
            config={"kwargs": {}, "num_warps": 4, "num_stages": 3},
        )


def test_json_view_named_msgpack_gets_a_clear_error(tmp_path):
    path = tmp_path / "view.msgpack"
    path.write_text(sample_table().to_json())
    with pytest.raises(TableError, match="this is JSON, not msgpack"):
        load_table(path)


def test_a_hand_written_json_table_may_leave_out_library_version():
    doc = json.loads(sample_table().to_json())
    del doc["library_version"]
    table = Table.from_json(json.dumps(doc))
    assert table.library_version == __version__ and table.entries() == sample_table().entries()


def test_duplicate_json_entries_are_rejected():
    doc = json.loads(sample_table().to_json())
    doc["entries"].append(doc["entries"][0])
    with pytest.raises(TableError, match="duplicate entry"):
        Table.from_json(json.dumps(doc))


def test_missing_file_and_directory_raise_table_error(tmp_path):
    with pytest.raises(TableError, match="no such file"):
        load_table(tmp_path / "absent.msgpack")
    with pytest.raises(TableError, match="directory"):
        load_table(tmp_path)


def test_loaded_configs_are_shared_not_copied():
    table = Table.from_bytes(Table([make_entry(0), make_entry(2)]).to_bytes())
    first, second = table.entries()
    assert first.config is second.config  # 100k entries, a handful of configs


# -- safe writes -------------------------------------------------------------------
def test_write_atomic_replaces_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "t.msgpack"
    save_table(sample_table(), path)
    save_table(Table([make_entry(0)]), path)
    assert len(load_table(path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.msgpack"]
    mode = path.stat().st_mode & 0o777
    assert mode & 0o044, "tables must stay readable by the group/others the umask allows"


def test_rewriting_a_table_keeps_its_permissions(tmp_path):
    path = tmp_path / "private.msgpack"
    save_table(sample_table(), path)
    path.chmod(0o600)
    save_table(Table([make_entry(0)]), path)
    assert path.stat().st_mode & 0o777 == 0o600 and len(load_table(path)) == 1


def test_writing_a_symlinked_table_writes_through_the_link(tmp_path):
    real = tmp_path / "v3.msgpack"
    save_table(sample_table(), real)
    link = tmp_path / "current.msgpack"
    link.symlink_to(real.name)
    add_entries(link, [make_entry(99)])
    assert link.is_symlink() and os.readlink(link) == real.name
    assert load_table(real).get(*make_entry(99).ident) is not None
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_failed_write_keeps_previous_file_and_cleans_up(tmp_path, monkeypatch):
    path = tmp_path / "t.msgpack"
    save_table(sample_table(), path)
    before = path.read_bytes()

    def boom(tmp: str, dest: str) -> None:
        raise OSError(28, "disk full (simulated)")

    monkeypatch.setattr(os, "replace", boom)  # the temp file is written and fsynced by then
    with pytest.raises(OSError, match="simulated"):
        write_atomic(path, b"new")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.msgpack"]


def test_update_table_creates_merges_and_skips_unchanged_writes(tmp_path):
    path = tmp_path / "t.msgpack"
    add_entries(path, [make_entry(0)])
    add_entries(path, [make_entry(1), make_entry(2)])
    assert len(load_table(path)) == 3
    stamp = path.stat().st_mtime_ns
    time.sleep(0.01)
    add_entries(path, [make_entry(1)])  # no change: no rewrite
    assert path.stat().st_mtime_ns == stamp
    add_entries(path, [entry_with(make_entry(1), note="x")], replace=False)
    assert load_table(path).get(*make_entry(1).ident).note is None
    assert load_table(path).library_version == __version__


def test_update_table_refuses_a_corrupt_existing_file(tmp_path):
    path = tmp_path / "t.msgpack"
    path.write_bytes(b"\x93garbage")
    with pytest.raises(TableError):
        update_table(path, lambda t: None)
    assert path.read_bytes() == b"\x93garbage"  # never silently replaced


_WRITER = textwrap.dedent(
    """
    import sys
    from megatron_tuning.core.key import Key
    from megatron_tuning.tables.table import Entry, add_entries
    path, worker, batches, per_batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    for batch in range(batches):
        add_entries(path, [
            Entry(arch="sm90", kernel=f"pkg:k{worker}", key=Key({"b": batch, "i": i}),
                  config={"kwargs": {"W": worker}, "num_warps": 4, "num_stages": 3}, how="recorded")
            for i in range(per_batch)
        ])
    """
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def test_concurrent_writers_lose_no_entry(tmp_path):
    path = tmp_path / "shared.msgpack"
    workers, batches, per_batch = 4, 25, 8
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(path), str(w), str(batches), str(per_batch)],
            env=_env(),
            stderr=subprocess.PIPE,
        )
        for w in range(workers)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
    table = load_table(path)
    assert len(table) == workers * batches * per_batch
    assert {e.config["kwargs"]["W"] for e in table.values()} == set(range(workers))


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import os
    from megatron_tuning.core.key import Key
    from megatron_tuning.tables import table as t
    path, marker = sys.argv[1], sys.argv[2]
    def pause(tmp, dest):  # the temp file is written and fsynced: the writer dies before the replace
        open(marker, "w").write(tmp)
        time.sleep(120)
    os.replace = pause
    t.add_entries(path, [t.Entry(arch="sm90", kernel="pkg:new", key=Key({"k": 1}),
                                   config={"kwargs": {}, "num_warps": 1, "num_stages": 1})])
    """
)


def test_writer_killed_mid_write_leaves_previous_table_intact(tmp_path):
    path = tmp_path / "t.msgpack"
    marker = tmp_path / "marker"
    save_table(sample_table(), path)
    before = path.read_bytes()
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path), str(marker)], env=_env())
    try:
        deadline = time.monotonic() + 60
        # The child creates the marker, then writes the temporary file's name into it: wait for both.
        while not (marker.exists() and marker.read_text()):
            assert proc.poll() is None, "writer exited before reaching the pause"
            assert time.monotonic() < deadline, "writer never reached the pause"
            time.sleep(0.02)
        tmp = Path(marker.read_text())
        assert tmp.exists() and tmp.read_bytes() != before  # the new table is fully written...
        proc.send_signal(signal.SIGKILL)  # ...and the writer dies before os.replace
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert path.read_bytes() == before
    assert load_table(path) == sample_table()
    # The orphaned temp file neither breaks folder loads nor later writers (the lock is free again).
    from megatron_tuning.tables.search import TableSet

    assert TableSet([tmp_path]).files == [str(path)]
    add_entries(path, [make_entry(50)])
    assert len(load_table(path)) == len(sample_table()) + 1
