"""The table search path and its validators on use (arch, stale source hash / Triton version)."""

from __future__ import annotations

import pytest

from megatron_tuning.core.choice import ConfigTable, TableHit
from megatron_tuning.core.errors import StaleEntryError, TableError
from megatron_tuning.core.identity import config_signature
from megatron_tuning.core.key import Key
from megatron_tuning.core.notices import reset_warnings
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.tables.entry import Entry
from megatron_tuning.tables.search import TableSet, expand_table_paths
from megatron_tuning.tables.table import Table, save_table

from ..keys import tag

KERNEL = "pkg.kernels:matmul"
KEY = Key({"M": 64}, {"a": "torch.float16"})
HASH = "11" * 32


def find(tables: TableSet, kernel: str, key: Key, **code: object) -> TableHit | None:
    """``tables.lookup``'s one hit, or ``None``."""
    hits = tables.lookup(kernel, key, **code)  # type: ignore[arg-type]
    assert len(hits) <= 1
    return hits[0] if hits else None


def entry(block: int = 64, **changes: object) -> Entry:
    fields: dict[str, object] = {
        "arch": "sm90",
        "kernel": KERNEL,
        "key": KEY,
        "how": "tuned",
        "config": {"kwargs": {"BLOCK": block}, "num_warps": 4, "num_stages": 3},
        "source_hash": HASH,
        "triton_version": "3.6.0",
    }
    fields.update(changes)
    return Entry(**fields)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _fresh_warnings():
    reset_warnings()
    yield
    reset_warnings()


def write(path, *entries: Entry):
    save_table(Table(entries), path)
    return str(path)


def stale_warnings(notices) -> list[str]:
    return notices.matching("stale")


def test_hit_reports_config_and_origin(tmp_path):
    path = write(tmp_path / "a.msgpack", entry(64))
    tables = TableSet([path], triton_version="3.6.0")
    assert isinstance(tables, ConfigTable)
    hit = find(tables, KERNEL, KEY, arch="sm90", source_hash=HASH)
    assert isinstance(hit, TableHit) and hit.origin == path
    assert config_signature(hit.config) == "BLOCK=64, num_warps=4, num_stages=3"
    with pytest.raises(TypeError):
        hit.config["kwargs"] = {}  # type: ignore[index]  # read-only view of the shared config
    assert find(tables, KERNEL, tag("other key"), arch="sm90") is None


def test_a_plain_entry_that_stored_the_kernels_own_digest_answers_its_digest_id(tmp_path, notices):
    """Whether a kernel id gets ``@digest`` can depend on launch order; the stored digest decides."""
    mine, other = "0123456789ab", "ba9876543210"
    tables = TableSet(
        [write(tmp_path / "t.msgpack", entry(32, config_list_digest=mine))], triton_version="3.6.0"
    )
    code = {"arch": "sm90", "source_hash": HASH}
    hit = find(tables, f"{KERNEL}@{mine}", KEY, config_list_digest=mine, **code)
    assert hit is not None and hit.config["kwargs"] == {"BLOCK": 32}
    assert find(tables, f"{KERNEL}@{other}", KEY, config_list_digest=other, **code) is None  # another list's
    assert notices.matching("several autotuners") == []
    # An entry without a stored digest cannot say whose it is: ambiguous, as before.
    old = TableSet([write(tmp_path / "old.msgpack", entry(32))], triton_version="3.6.0")
    assert find(old, f"{KERNEL}@{mine}", KEY, config_list_digest=mine, **code) is None
    assert len(notices.matching("several autotuners")) == 1


def test_wrong_arch_never_applies(tmp_path):
    path = write(tmp_path / "a.msgpack", entry(64, arch="sm80"))
    tables = TableSet([path], triton_version="3.6.0", stale_entries="use")
    assert find(tables, KERNEL, KEY, arch="sm90", source_hash=HASH) is None
    assert find(tables, KERNEL, KEY, arch="unknown", source_hash=HASH) is None
    assert find(tables, KERNEL, KEY, arch="sm80", source_hash=HASH) is not None


def test_earlier_file_wins_and_folders_expand(tmp_path):
    first = write(tmp_path / "first.msgpack", entry(32))
    (tmp_path / "dir").mkdir()
    second = write(tmp_path / "dir" / "b.msgpack", entry(128), entry(256, key=tag("only here")))
    tables = TableSet([first, tmp_path / "dir", first], triton_version="3.6.0")
    assert tables.files == [first, second]  # duplicates dropped
    assert find(tables, KERNEL, KEY, arch="sm90").config["kwargs"] == {"BLOCK": 32}
    assert find(tables, KERNEL, tag("only here"), arch="sm90").origin == second


def test_changed_source_hash_warns_once_then_uses_entry(tmp_path, notices):
    path = write(tmp_path / "a.msgpack", entry(64))
    tables = TableSet([path], triton_version="3.6.0", stale_entries="use")
    for _ in range(3):
        hit = find(tables, KERNEL, KEY, arch="sm90", source_hash="22" * 32)
        assert hit is not None and hit.config["kwargs"] == {"BLOCK": 64}
    (message,) = stale_warnings(notices)
    assert KERNEL in message and KEY in message and path in message and "source hash" in message
    # A fresh hash is not stale and says nothing.
    notices.clear()
    assert find(tables, KERNEL, KEY, arch="sm90", source_hash=HASH) is not None
    assert stale_warnings(notices) == []


def test_stale_entry_as_miss_falls_through_to_a_fresh_later_entry(tmp_path, notices):
    stale = write(tmp_path / "a.msgpack", entry(64, source_hash="00" * 32))
    fresh = write(tmp_path / "b.msgpack", entry(128))
    tables = TableSet([stale, fresh], triton_version="3.6.0", stale_entries="miss")
    hit = find(tables, KERNEL, KEY, arch="sm90", source_hash=HASH)
    assert hit is not None and hit.origin == fresh
    alone = TableSet([stale], triton_version="3.6.0", stale_entries="miss")
    assert find(alone, KERNEL, KEY, arch="sm90", source_hash=HASH) is None
    assert len(stale_warnings(notices)) == 1  # once per (kernel, key, file)


def test_strict_raises_stale_entry_error(tmp_path):
    path = write(tmp_path / "a.msgpack", entry(64))
    tables = TableSet.from_policy(
        TuningPolicy(tables=(path,), strict=True, use_shipped_tables=False), triton_version="3.6.0"
    )
    with pytest.raises(StaleEntryError) as info:
        find(tables, KERNEL, KEY, arch="sm90", source_hash="33" * 32)
    assert (info.value.kernel, info.value.key, info.value.path) == (KERNEL, KEY, path)
    assert "source hash" in info.value.detail
    assert find(tables, KERNEL, KEY, arch="sm90", source_hash=HASH) is not None  # fresh: no error


def test_triton_version_mismatch_is_stale(tmp_path, notices):
    path = write(tmp_path / "a.msgpack", entry(64))
    with pytest.raises(StaleEntryError, match="Triton 3.6.0"):
        find(TableSet([path], triton_version="3.9.0", stale_entries="error"), KERNEL, KEY, arch="sm90")
    assert find(TableSet([path], triton_version="3.9.0"), KERNEL, KEY, arch="sm90") is not None
    assert any("running 3.9.0" in m for m in stale_warnings(notices))


def test_entries_without_provenance_are_never_stale(tmp_path, caplog):
    path = write(tmp_path / "a.msgpack", entry(64, how="hand", source_hash=None, triton_version=None))
    tables = TableSet([path], triton_version="9.9.9", stale_entries="error")
    assert find(tables, KERNEL, KEY, arch="sm90", source_hash="44" * 32) is not None


def test_missing_or_corrupt_paths_fail_at_construction(tmp_path):
    with pytest.raises(TableError, match="no such file"):
        TableSet([tmp_path / "typo.msgpack"])
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"\x01\x02")
    with pytest.raises(TableError, match="bad.msgpack"):
        TableSet([bad])


def test_empty_folder_or_relative_typo_fails_naming_the_path(tmp_path, monkeypatch):
    # A folder without tables pins nothing, exactly like a typo'd path: both must fail.
    empty = tmp_path / "tables"
    empty.mkdir()
    (empty / "view.json").write_text("{}")
    with pytest.raises(TableError, match="no \\*.msgpack tables.*JSON views") as info:
        TableSet([empty])
    assert info.value.path == str(empty) and "MEGATRON_TUNING_TABLE" in str(info.value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TableError, match=f"relative to {tmp_path}"):
        TableSet(["typo.msgpack"])


def test_a_single_path_string_is_one_path_not_its_characters(tmp_path):
    path = write(tmp_path / "a.msgpack", entry(64))
    assert TableSet(path, triton_version="3.6.0").files == [path]
    assert expand_table_paths(tmp_path) == [path]


def test_a_stale_entry_is_said_on_a_rank_other_than_0(tmp_path, notices, monkeypatch):
    """Staleness follows this rank's kernel id and source: rank 0 may find none (before, the other
    ranks only logged it at INFO)."""
    monkeypatch.setenv("RANK", "1")
    path = write(tmp_path / "a.msgpack", entry(64))
    assert find(TableSet([path], triton_version="3.9.0"), KERNEL, KEY, arch="sm90") is not None
    assert any("running 3.9.0" in m for m in stale_warnings(notices))


def test_stale_warning_once_per_cause_not_per_key(tmp_path, notices):
    keys = [Key({"M": m}, {"a": "torch.float16"}) for m in range(5)]
    path = write(
        tmp_path / "a.msgpack",
        *(entry(64, key=k) for k in keys),
        entry(64, key=tag("other hash"), source_hash="99" * 32),
    )
    tables = TableSet([path], triton_version="3.6.0", stale_entries="use")
    for key in [*keys, tag("other hash")]:
        assert find(tables, KERNEL, key, arch="sm90", source_hash="22" * 32) is not None
    messages = stale_warnings(notices)
    assert len(messages) == 2  # one kernel edit, two different tuned sources: two causes
    assert keys[0] in messages[0] and tag("other hash") in messages[1]


def test_search_order_policy_then_shipped(tmp_path, monkeypatch):
    policy_path = write(tmp_path / "policy.msgpack", entry(32))
    env_path = write(tmp_path / "env.msgpack", entry(64), entry(64, key=tag("env key")))
    shipped = tmp_path / "shipped"
    (shipped / "sm90").mkdir(parents=True)
    shipped_path = write(
        shipped / "sm90" / "ref.msgpack",
        entry(128),
        entry(128, key=tag("env key")),
        entry(128, key=tag("shipped key")),
    )
    monkeypatch.setattr("megatron_tuning.tables.search.shipped_tables_dir", lambda: shipped)
    tables = TableSet.from_policy(TuningPolicy(tables=(policy_path, env_path)), triton_version="3.6.0")
    assert tables.files == [policy_path, env_path]  # shipped tables load on first use of their arch
    assert find(tables, KERNEL, KEY, arch="sm90").origin == policy_path
    assert find(tables, KERNEL, tag("env key"), arch="sm90").origin == env_path
    assert find(tables, KERNEL, tag("shipped key"), arch="sm90").origin == str(shipped_path)
    assert tables.files[-1] == str(shipped_path)
    assert find(tables, KERNEL, tag("shipped key"), arch="sm80") is None  # no sm80 folder: nothing loaded
    # The variable reaches the search path through the policy (from_env) only, and once.
    monkeypatch.setenv("MEGATRON_TUNING_TABLE", env_path)
    from_env = TableSet.from_policy(TuningPolicy.from_env(use_shipped_tables=False), triton_version="3.6.0")
    assert from_env.files == [env_path]


def test_shipped_tables_can_be_turned_off(tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    (shipped / "sm90").mkdir(parents=True)
    write(shipped / "sm90" / "ref.msgpack", entry(128))
    monkeypatch.setattr("megatron_tuning.tables.search.shipped_tables_dir", lambda: shipped)
    monkeypatch.delenv("MEGATRON_TUNING_TABLE", raising=False)
    off = TableSet.from_policy(TuningPolicy(use_shipped_tables=False))
    assert find(off, KERNEL, KEY, arch="sm90") is None


def test_repository_shipped_tables_load():
    # Every table shipped in configs/ must load (a broken one would only fail at first lookup).
    from megatron_tuning.tables.search import expand_table_paths, shipped_tables_dir

    root = shipped_tables_dir()
    folders = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    for folder in folders:
        for name in expand_table_paths([folder]):
            TableSet([name])


def test_cache_sits_after_explicit_and_shipped_tables(tmp_path, monkeypatch):
    """The cache is this node's; the tables are inputs every rank compared: it must not shadow them."""
    explicit = write(tmp_path / "mine.msgpack", entry(32))
    cache_path = str(tmp_path / "auto.msgpack")
    cache = Table([entry(64), entry(64, key=tag("cached key")), entry(64, key=tag("both"))])
    shipped = tmp_path / "shipped"
    (shipped / "sm90").mkdir(parents=True)
    write(shipped / "sm90" / "ref.msgpack", entry(128, key=tag("both")), entry(128, key=tag("shipped key")))
    monkeypatch.setattr("megatron_tuning.tables.search.shipped_tables_dir", lambda: shipped)
    tables = TableSet.from_policy(
        TuningPolicy(tables=(explicit,)), triton_version="3.6.0", cache=(cache_path, cache)
    )
    assert tables.files == [explicit, cache_path]
    assert find(tables, KERNEL, KEY, arch="sm90").origin == explicit
    assert find(tables, KERNEL, tag("both"), arch="sm90").origin.endswith("ref.msgpack")
    assert find(tables, KERNEL, tag("shipped key"), arch="sm90").origin.endswith("ref.msgpack")
    assert find(tables, KERNEL, tag("cached key"), arch="sm90").origin == cache_path
    assert tables.files == [explicit, str(shipped / "sm90" / "ref.msgpack"), cache_path]


def test_a_stale_cache_entry_is_a_miss_even_when_stale_entries_are_used(tmp_path, notices):
    cache_path = str(tmp_path / "auto.msgpack")
    cache = Table([entry(64, source_hash="22" * 32), entry(64, key=tag("fresh"))])
    tables = TableSet(stale_entries="use", triton_version="3.6.0", cache=(cache_path, cache))
    assert find(tables, KERNEL, KEY, arch="sm90", source_hash=HASH) is None  # re-tuned, not reused
    assert find(tables, KERNEL, tag("fresh"), arch="sm90", source_hash=HASH).origin == cache_path
    assert stale_warnings(notices) == []  # our own cache going stale is not the user's problem


def nkey(m: int) -> Key:
    return Key({"M": m}, {"a": "torch.float16"})


def test_neighbours_are_nearest_first_across_files_first_file_winning(tmp_path):
    first = write(tmp_path / "a.msgpack", entry(16, key=nkey(1024)), entry(16, key=nkey(8192)))
    second = write(tmp_path / "b.msgpack", entry(32, key=nkey(1024)), entry(32, key=nkey(2048)))
    tables = TableSet([first, second], triton_version="3.6.0")
    hits = tables.lookup(KERNEL, nkey(1536), arch="sm90", source_hash=HASH, nearest=True)
    assert [(h.key, h.origin, h.config["kwargs"]["BLOCK"]) for h in hits] == [
        (nkey(2048), second, 32),
        (nkey(1024), first, 16),  # the first file's entry for 1024 hides the second's
        (nkey(8192), first, 16),
    ]
    assert tables.lookup(KERNEL, nkey(1536), arch="sm80", nearest=True) == []
    assert tables.lookup("pkg:other", nkey(1536), arch="sm90", nearest=True) == []


def test_stale_neighbours_are_skipped_unless_stale_entries_are_used(tmp_path):
    path = write(
        tmp_path / "t.msgpack",
        entry(16, key=nkey(2048), source_hash="22" * 32),
        entry(32, key=nkey(512)),
    )
    strict = TableSet([path], stale_entries="error", triton_version="3.6.0")
    assert [
        h.key for h in strict.lookup(KERNEL, nkey(1536), arch="sm90", source_hash=HASH, nearest=True)
    ] == [nkey(512)]
    lenient = TableSet([path], stale_entries="use", triton_version="3.6.0")
    hits = lenient.lookup(KERNEL, nkey(1536), arch="sm90", source_hash=HASH, nearest=True)
    assert [h.key for h in hits] == [nkey(2048), nkey(512)]


# ------------------------------------------------------------------ content matches

TWIN = "candidate:matmul"  # the same code as KERNEL ("pkg.kernels:matmul"), loaded under another name
OTHER_HASH = "22" * 32


def test_the_same_code_under_another_module_name_hits_by_content(tmp_path):
    path = write(tmp_path / "a.msgpack", entry(64))
    tables = TableSet([path], triton_version="3.6.0")
    hit = find(tables, TWIN, KEY, arch="sm90", source_hash=HASH)
    assert hit is not None and (hit.kernel, hit.origin) == (KERNEL, path)
    assert hit.config["kwargs"] == {"BLOCK": 64}
    own = find(tables, KERNEL, KEY, arch="sm90", source_hash=HASH)
    assert own is not None and own.kernel is None  # found by its own id: no content match


def test_a_content_match_needs_the_same_source_hash_never_the_qualname_alone(tmp_path, notices):
    path = write(
        tmp_path / "a.msgpack",
        entry(64),
        entry(32, kernel="pkg.nohash:matmul", key=tag("k2"), source_hash=None),
    )
    tables = TableSet([path], triton_version="3.6.0", stale_entries="use")
    assert find(tables, TWIN, KEY, arch="sm90", source_hash=OTHER_HASH) is None
    assert find(tables, TWIN, KEY, arch="sm90", source_hash=None) is None  # no source here
    assert find(tables, TWIN, tag("k2"), arch="sm90", source_hash=HASH) is None  # no hash in the entry
    assert find(tables, TWIN, KEY, arch="sm80", source_hash=HASH) is None  # arch still applies
    assert stale_warnings(notices) == []


def test_the_config_list_digest_is_part_of_a_content_match(tmp_path):
    path = write(tmp_path / "a.msgpack", entry(64, kernel=KERNEL + "@aaaaaaaaaaaa"))
    tables = TableSet([path], triton_version="3.6.0")
    hit = find(tables, TWIN + "@aaaaaaaaaaaa", KEY, arch="sm90", source_hash=HASH)
    assert hit is not None and hit.kernel == KERNEL + "@aaaaaaaaaaaa"
    assert find(tables, TWIN + "@bbbbbbbbbbbb", KEY, arch="sm90", source_hash=HASH) is None
    assert find(tables, TWIN, KEY, arch="sm90", source_hash=HASH) is None


def test_one_source_with_another_config_list_is_another_kernel_and_an_unknown_list_still_matches(tmp_path):
    lists = {"aaaaaaaaaaaa": 64, "bbbbbbbbbbbb": 32}
    path = write(
        tmp_path / "a.msgpack",
        *(entry(block, kernel=f"cand_{block}:matmul", config_list_digest=d) for d, block in lists.items()),
        entry(
            16, key=tag("k2")
        ),  # written before entries kept their config list (shipped tables, old caches)
    )
    tables = TableSet([path], triton_version="3.6.0")
    for digest, block in lists.items():
        hit = find(tables, TWIN, KEY, arch="sm90", source_hash=HASH, config_list_digest=digest)
        assert hit is not None and (hit.kernel, hit.config["kwargs"]) == (
            f"cand_{block}:matmul",
            {"BLOCK": block},
        )
        near = tables.lookup(
            TWIN, nkey(128), arch="sm90", source_hash=HASH, config_list_digest=digest, nearest=True
        )
        assert [h.config["kwargs"]["BLOCK"] for h in near] == [block]
    assert find(tables, TWIN, KEY, arch="sm90", source_hash=HASH, config_list_digest="cccccccccccc") is None
    assert (
        find(tables, TWIN, tag("k2"), arch="sm90", source_hash=HASH, config_list_digest="cccccccccccc")
        is not None
    )


def test_an_own_fresh_entry_beats_a_twin_and_a_fresh_twin_beats_an_own_stale_entry(tmp_path, notices):
    own = write(tmp_path / "own.msgpack", entry(16, kernel=TWIN))
    twin = write(tmp_path / "twin.msgpack", entry(64))
    tables = TableSet([own, twin], triton_version="3.6.0")
    hit = find(tables, TWIN, KEY, arch="sm90", source_hash=HASH)
    assert hit is not None and hit.kernel is None and hit.config["kwargs"] == {"BLOCK": 16}
    stale_own = write(tmp_path / "stale.msgpack", entry(16, kernel=TWIN, source_hash=OTHER_HASH))
    tables = TableSet([stale_own, twin], triton_version="3.6.0", stale_entries="use")
    hit = find(tables, TWIN, KEY, arch="sm90", source_hash=HASH)
    assert hit is not None and hit.kernel == KERNEL and hit.config["kwargs"] == {"BLOCK": 64}
    assert stale_warnings(notices) == []  # the stale own entry was not needed


def test_twins_answer_in_search_order(tmp_path):
    first = write(tmp_path / "first.msgpack", entry(32, kernel="zz.late:matmul"))
    second = write(tmp_path / "second.msgpack", entry(64), entry(128, kernel="aa.early:matmul"))
    tables = TableSet([first, second], triton_version="3.6.0")
    hit = find(tables, TWIN, KEY, arch="sm90", source_hash=HASH)
    assert hit is not None and (hit.kernel, hit.origin) == ("zz.late:matmul", first)


def test_a_twin_stale_only_by_triton_version_follows_stale_entries(tmp_path):
    path = write(tmp_path / "a.msgpack", entry(64, triton_version="3.5.0"))
    assert (
        find(
            TableSet([path], triton_version="3.6.0", stale_entries="miss"),
            TWIN,
            KEY,
            arch="sm90",
            source_hash=HASH,
        )
        is None
    )
    with pytest.raises(StaleEntryError, match="Triton 3.5.0"):
        find(
            TableSet([path], triton_version="3.6.0", stale_entries="error"),
            TWIN,
            KEY,
            arch="sm90",
            source_hash=HASH,
        )


def test_neighbours_include_a_twins_entries_after_the_kernels_own(tmp_path):
    path = write(
        tmp_path / "a.msgpack",
        entry(16, key=nkey(1024)),
        entry(32, kernel=TWIN, key=nkey(4096)),
        entry(64, kernel=TWIN, key=nkey(1024), source_hash=OTHER_HASH),
    )
    tables = TableSet([path], triton_version="3.6.0", stale_entries="miss")
    hits = tables.lookup(TWIN, nkey(1536), arch="sm90", source_hash=HASH, nearest=True)
    assert [(h.key, h.kernel, h.config["kwargs"]["BLOCK"]) for h in hits] == [
        (nkey(4096), None, 32),  # its own fresh entry first (the stale own one is skipped)
        (nkey(1024), KERNEL, 16),  # then the same code's entry under another module name
    ]
