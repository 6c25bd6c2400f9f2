"""auto mode's cache table: where it lives, corrupt and unwritable caches, crash safety."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest

from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.key import Key
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.tables.cache import AutoCache, cache_path, default_cache_dir, open_cache
from megatron_tuning.tables.entry import Entry
from megatron_tuning.tables.table import Table, load_table, save_table

from ..keys import nx, tag

CONFIG = {"kwargs": {"BLOCK": 64}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}


def decision(key: Key, source: str = "tuned", **changes) -> Decision:
    fields = dict(
        kernel="pkg.k:kern",
        key=key,
        signature="BLOCK=64, num_warps=4, num_stages=3",
        source=source,
        config=CONFIG,
        arch="sm90",
        source_hash="ab" * 32,
    )
    fields.update(changes)
    return Decision(**fields)


def test_default_path_is_per_user_and_per_arch_and_respects_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "megatron_tuning"
    assert cache_path(TuningPolicy(mode="auto"), "sm90") == str(
        tmp_path / "xdg/megatron_tuning/sm90/auto.msgpack"
    )
    assert cache_path(TuningPolicy(mode="auto", cache="off"), "sm90") is None
    mine = tmp_path / "mine.msgpack"
    assert cache_path(TuningPolicy(mode="auto", cache=str(mine)), "sm90") == str(mine)
    # The variable reaches the cache through the policy (from_env) only.
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", "off")
    assert cache_path(TuningPolicy.from_env(mode="auto"), "sm90") is None


def test_persist_merges_tuned_and_adopted_only_once_each(tmp_path):
    cache = open_cache(TuningPolicy(mode="auto", cache=str(tmp_path / "c" / "auto.msgpack")), "sm90")
    assert cache is not None and len(cache.table) == 0 and cache.writable
    decisions = [
        decision(nx(1)),
        decision(nx(2), source="adopted", origin="rank 3"),
        decision(nx(3), source="cheapest"),
        decision(nx(4), source="table"),
    ]
    assert cache.persist(decisions) == 2
    assert cache.persist(decisions) == 0  # nothing new: no rewrite
    table = load_table(cache.path)
    assert sorted(e.key for e in table) == [nx(1), nx(2)]
    adopted = table.get("sm90", "pkg.k:kern", nx(2))
    assert adopted.how == "tuned" and "rank 3" in adopted.note


def test_a_corrupt_cache_is_ignored_for_the_run_and_left_untouched(tmp_path, notices):
    path = tmp_path / "auto.msgpack"
    path.write_bytes(b"\x93garbage")
    assert open_cache(TuningPolicy(mode="auto", cache=str(path)), "sm90") is None
    assert path.read_bytes() == b"\x93garbage"
    (message,) = notices.matching("auto cache")
    assert str(path) in message and "MEGATRON_TUNING_CACHE" in message


def test_a_folder_named_as_the_cache_is_refused_with_the_fix(tmp_path, notices):
    assert open_cache(TuningPolicy(mode="auto", cache=str(tmp_path)), "sm90") is None
    (message,) = notices.messages
    assert "is a folder" in message and str(tmp_path / "auto.msgpack") in message


def test_an_unwritable_cache_folder_warns_once_and_never_raises(tmp_path, notices):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")  # unwritable even for root
    cache = open_cache(TuningPolicy(mode="auto", cache=str(blocker / "sm90" / "auto.msgpack")), "sm90")
    assert cache is not None and not cache.writable
    assert cache.persist([decision(nx(1))]) == 0
    assert blocker.read_text().startswith("a file")
    (warning,) = notices.messages
    assert "cannot be written" in warning and str(blocker) in warning


def test_a_failed_write_is_one_notice_not_an_error_and_keeps_its_entries(tmp_path, caplog, notices):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")  # the folder went away after start-up
    cache = AutoCache(path=str(blocker / "auto.msgpack"), table=Table(), writable=True, max_entries=10)
    with caplog.at_level(logging.INFO, logger="megatron_tuning"):
        assert cache.persist([decision(nx(1))]) == 0
        assert cache.persist([decision(nx(1))]) == 0  # kept, tried again: logged at INFO
    (warning,) = notices.messages
    assert str(blocker) in warning and "1 new entry kept in memory" in warning
    assert "MEGATRON_TUNING_CACHE" in warning
    assert sum("was not written" in r.getMessage() for r in caplog.records) == 1  # the repeat


_KILLED = textwrap.dedent(
    """
    import sys, time
    from megatron_tuning.core.decisions import Decision
    from megatron_tuning.core.key import Key
    from megatron_tuning.core.policy import TuningPolicy
    import os
    from megatron_tuning.tables.cache import open_cache
    path, marker = sys.argv[1], sys.argv[2]
    def pause(tmp, dest):  # the temp file is written and fsynced: the process dies before the replace
        open(marker, "w").write(tmp)
        time.sleep(120)
    os.replace = pause
    cache = open_cache(TuningPolicy(mode="auto", cache=path), "sm90")
    config = {"kwargs": {"BLOCK": 64}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    cache.persist([Decision(kernel="pkg.k:kern", key=Key({"n": 2}, {"x": "f"}), signature="s", source="tuned",
                            config=config, arch="sm90")])
    """
)


def test_a_process_killed_mid_write_leaves_a_loadable_cache(tmp_path):
    path = tmp_path / "auto.msgpack"
    first = open_cache(TuningPolicy(mode="auto", cache=str(path)), "sm90")
    first.persist([decision(nx(1))])
    before = path.read_bytes()
    marker = tmp_path / "marker"
    child = subprocess.Popen([sys.executable, "-c", _KILLED, str(path), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the writer never reached the replace step"
    finally:
        child.kill()
        child.wait()
    assert path.read_bytes() == before
    assert [e.key for e in load_table(path)] == [nx(1)]
    again = open_cache(TuningPolicy(mode="auto", cache=str(path)), "sm90")
    assert again is not None and len(again.table) == 1


# -- first persisted wins (issue 16 item 2) ------------------------------------------------------
def config(block: int) -> dict:
    return {**CONFIG, "kwargs": {"BLOCK": block}}


def blocks(path) -> dict[str, int]:
    return {e.key: e.config["kwargs"]["BLOCK"] for e in load_table(path)}


def auto(path, **policy) -> AutoCache:
    cache = open_cache(TuningPolicy(mode="auto", cache=str(path), **policy), "sm90")
    assert cache is not None
    return cache


def test_an_entry_already_in_the_cache_is_kept_not_replaced(tmp_path, caplog):
    path = tmp_path / "auto.msgpack"
    first, second = auto(path), auto(path)  # two jobs that started before either persisted
    assert first.persist([decision(nx(1), config=config(16))]) == 1
    with caplog.at_level(logging.INFO, logger="megatron_tuning"):
        assert second.persist([decision(nx(1), config=config(128))]) == 0
    assert blocks(path) == {nx(1): 16}
    (kept,) = [r.getMessage() for r in caplog.records if "persisted first" in r.getMessage()]
    assert str(path) in kept and "BLOCK=16" in kept and "BLOCK=128" in kept
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # Forever: later runs with yet another result leave it as it is.
    assert auto(path).persist([decision(nx(1), config=config(64))]) == 0
    assert blocks(path) == {nx(1): 16}


def test_a_stale_entry_is_replaced_by_a_new_result(tmp_path):
    path = tmp_path / "auto.msgpack"
    auto(path).persist([decision(nx(1), config=config(16)), decision(nx(2), config=config(16))])
    # The kernel was edited: its source hash changed, so the old entry is stale and replaced.
    assert auto(path).persist([decision(nx(1), config=config(128), source_hash="cd" * 32)]) == 1
    table = load_table(path)
    assert blocks(path) == {nx(1): 128}  # n=2, stale for the same reason, was evicted too
    assert table.get("sm90", "pkg.k:kern", nx(1)).source_hash == "cd" * 32


def offering(*blocks: int) -> dict:
    """A tuned decision's timings as the tuner writes them: every live candidate it timed."""
    return {"candidates": {f"BLOCK={b}, num_warps=4, num_stages=3": [1.0, 0.9, 1.1] for b in blocks}}


def test_an_entry_whose_config_the_kernel_no_longer_offers_is_replaced_one_it_offers_is_kept(
    tmp_path, caplog
):
    path = tmp_path / "auto.msgpack"
    auto(path).persist([decision(nx(1), config=config(32)), decision(nx(2), config=config(32))])
    with caplog.at_level(logging.INFO, logger="megatron_tuning"):
        # n=1: the list no longer has 32, so no run could launch the entry. n=2: it still has 32.
        new = [
            decision(nx(n), config=config(128), timings=offering(64, 128, *extra))
            for n, extra in ((1, ()), (2, (32,)))
        ]
        assert auto(path).persist(new) == 1
    assert blocks(path) == {nx(1): 128, nx(2): 32}
    (replaced,) = [r.getMessage() for r in caplog.records if "no longer offers" in r.getMessage()]
    assert f"{path}: replaced 1 entry" in replaced and "pkg.k:kern [n=1 | x:f]" in replaced
    assert "cache BLOCK=32" in replaced and "re-tuned BLOCK=128" in replaced
    (kept,) = [r.getMessage() for r in caplog.records if "persisted first" in r.getMessage()]
    assert "1 entry" in kept and "BLOCK=32" in kept


_RACER = textwrap.dedent(
    """
    import os, sys, time
    from megatron_tuning.core.decisions import Decision
    from megatron_tuning.core.key import Key
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.tables.cache import open_cache
    path, block, role, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    cache = open_cache(TuningPolicy(mode="auto", cache=path), "sm90")  # both open an empty cache
    open(marker + "." + role + ".open", "w").close()
    def wait_for(*names):  # bounded: a racer whose partner died must end too
        deadline = time.monotonic() + 60
        while not all(os.path.exists(marker + n) for n in names):
            if time.monotonic() > deadline:
                sys.exit("the other racer never wrote " + " ".join(names))
            time.sleep(0.01)
    wait_for(".first.open", ".second.open")
    if role == "first":
        real_replace = os.replace
        def hold(tmp, dest):  # written, not yet visible: the second job reads the old file meanwhile
            open(marker + ".holding", "w").close()
            deadline = time.monotonic() + 30
            while not os.path.exists(marker + ".read") and time.monotonic() < deadline:
                time.sleep(0.01)
            real_replace(tmp, dest)
        os.replace = hold
    else:
        wait_for(".holding")
        from megatron_tuning.tables import cache as cache_module
        real_read = cache_module._read
        def spy(name):  # say when the second job has read the cache (before the first replaced it)
            data = real_read(name)
            open(marker + ".read", "w").close()
            return data
        cache_module._read = spy
    config = {"kwargs": {"BLOCK": block}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    decisions = [Decision(kernel="pkg.k:kern", key=Key({"n": n}, {"x": "f"}), signature=f"BLOCK={block}",
                          source="tuned", config=config, arch="sm90", source_hash="ab" * 32)
                 for n in (1, 2, 3)]
    print(cache.persist(decisions))
    """
)


def test_two_processes_persisting_one_key_at_once_the_first_committed_wins(tmp_path):
    path, marker = tmp_path / "auto.msgpack", str(tmp_path / "marker")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(path), str(block), role, marker],
            stdout=subprocess.PIPE,
            text=True,
        )
        for block, role in ((16, "first"), (128, "second"))
    ]
    try:
        outs = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0]
    # The second read the cache while the first was writing, then found the first's entries
    # under the lock and kept them: before, it replaced them (last persisted won).
    assert outs == ["3", "0"]
    assert blocks(path) == {nx(1): 16, nx(2): 16, nx(3): 16}
    assert auto(path).persist([decision(nx(2), config=config(128))]) == 0
    assert blocks(path) == {nx(1): 16, nx(2): 16, nx(3): 16}


# -- a bounded cache (issue 16 item 7) -------------------------------------------------------------
def test_past_its_cap_the_cache_evicts_the_entries_persisted_longest_ago_with_one_notice(
    tmp_path, caplog, notices
):
    path = tmp_path / "auto.msgpack"
    cache = auto(path, cache_max_entries=3)
    assert cache.max_entries == 3
    with caplog.at_level(logging.INFO, logger="megatron_tuning"):
        # Keys in non-sorted order: eviction follows persist order, not key order.
        assert cache.persist([decision(k) for k in (nx(5), nx(1), nx(9))]) == 3
        assert notices.messages == []
        assert cache.persist([decision(nx(0))]) == 1
        assert [e.key for e in load_table(path).values()] == [nx(1), nx(9), nx(0)]
        assert cache.persist([decision(nx(7))]) == 1
    assert [e.key for e in load_table(path).values()] == [nx(9), nx(0), nx(7)]
    (warning,) = notices.messages
    for part in (str(path), "cap of 3 entries", "evicted the 1 entry persisted longest ago", nx(5)):
        assert part in warning
    for fix in ("megatron_tuning export", "delete the cache", "MEGATRON_TUNING_CACHE_MAX_ENTRIES"):
        assert fix in warning
    # The second eviction in the same run is logged at INFO, not warned again.
    assert any("cap" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    # A lower cap set later shrinks the cache at its next write.
    assert auto(path, cache_max_entries=1).persist([decision(nx(8))]) == 1
    assert [e.key for e in load_table(path).values()] == [nx(8)]


def test_the_byte_bound_keeps_every_file_the_cache_writes_readable(tmp_path, monkeypatch, notices):
    from megatron_tuning.tables import files

    monkeypatch.setattr(files, "MAX_FILE_BYTES", 4096)  # the cache's own bound: 1024 bytes
    path = tmp_path / "auto.msgpack"
    cache = auto(path)
    for batch in range(6):
        cache.persist([decision(nx(batch * 20 + i)) for i in range(20)])
        assert os.path.getsize(path) <= 1024
        assert len(load_table(path)) > 0  # the plain table reader, at its plain limit
    kept = [e.key for e in load_table(path).values()]
    assert kept[-1] == nx(119) and nx(0) not in kept  # the newest kept, the oldest gone
    (warning,) = notices.messages
    assert "bound of 1024 bytes" in warning and str(path) in warning
    again = auto(path)
    assert len(again.table) == len(kept) and len(notices.messages) == 1  # it reads back: no "over"


def test_stale_entries_are_evicted_at_persist_and_unknown_provenance_is_kept(tmp_path, caplog):
    path = tmp_path / "auto.msgpack"
    old_triton = Entry(arch="sm90", kernel="pkg.k:other", key=tag("a"), config=CONFIG, how="tuned",
                       triton_version="0.0.1")  # fmt: skip
    old_source = Entry(arch="sm90", kernel="pkg.k:kern", key=tag("b"), config=CONFIG, how="tuned",
                       source_hash="ef" * 32)  # fmt: skip
    unknown = Entry(arch="sm90", kernel="pkg.k:third", key=tag("c"), config=CONFIG, how="tuned")
    save_table(Table([old_triton, old_source, unknown]), path)
    with caplog.at_level(logging.INFO, logger="megatron_tuning"):
        assert auto(path).persist([decision(nx(1))]) == 1
    assert sorted(e.key for e in load_table(path)) == [nx(1), tag("c")]
    (message,) = [r.getMessage() for r in caplog.records if "stale entries (" in r.getMessage()]
    assert "evicted 2 stale entries" in message and "Triton 0.0.1" in message and "kernel source" in message


def test_a_persist_with_nothing_new_neither_locks_nor_writes(tmp_path, caplog):
    import filelock

    path = tmp_path / "auto.msgpack"
    auto(path).persist([decision(nx(1)), decision(nx(2), source="adopted", origin="rank 1")])
    before = os.stat(path)
    peer = auto(path)  # another rank: its decisions are already in the file
    peer.lock_timeout_s = 0.2
    with filelock.FileLock(str(path) + ".lock"), caplog.at_level(logging.INFO, logger="megatron_tuning"):
        assert peer.persist([decision(nx(1), source="adopted", origin="rank 0")]) == 0
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not [r for r in caplog.records if "waiting" in r.getMessage() or "not written" in r.getMessage()]


def test_a_writer_that_cannot_get_the_lock_warns_naming_the_holder_and_keeps_its_entries(tmp_path, notices):
    import filelock

    path = tmp_path / "auto.msgpack"
    cache = auto(path)
    cache.lock_timeout_s = 0.2
    decisions = [decision(nx(1))]
    with filelock.FileLock(str(path) + ".lock"):
        assert cache.persist(decisions) == 0
    (warning,) = notices.messages
    assert str(path) in warning and f"pid {os.getpid()}" in warning
    assert "1 new entry kept in memory for the next persist" in warning
    assert not path.exists()
    assert cache.persist(decisions) == 1  # the lock is free again: the kept entry is written
    assert blocks(path) == {nx(1): 64}


def key_ordered_cache(path, count: int) -> bytes:
    """A cache file of ``count`` entries in key order (as an older version or `merge` writes it)."""
    entries = [
        Entry(arch="sm90", kernel="pkg.k:kern", key=tag(f"{i:03}"), config=CONFIG) for i in range(count)
    ]
    save_table(Table(entries), path)
    return path.read_bytes()


def test_a_cache_over_the_read_limit_is_ignored_for_the_run_and_left_untouched(
    tmp_path, monkeypatch, notices
):
    from megatron_tuning.tables import files

    path = tmp_path / "auto.msgpack"
    data = key_ordered_cache(path, 400)
    monkeypatch.setattr(files, "MAX_FILE_BYTES", len(data) // 2)  # as an older version let it grow
    assert open_cache(TuningPolicy(mode="auto", cache=str(path)), "sm90") is None
    (warning,) = notices.messages
    assert str(path) in warning and f"{len(data)} bytes" in warning and "--max-size 1" in warning
    assert "MEGATRON_TUNING_CACHE" in warning
    assert path.read_bytes() == data


def test_a_cache_over_its_byte_bound_shrinks_at_its_next_write_from_its_first_rows(
    tmp_path, monkeypatch, notices
):
    from megatron_tuning.tables import files

    path = tmp_path / "auto.msgpack"
    size = len(key_ordered_cache(path, 400))
    monkeypatch.setattr(files, "MAX_FILE_BYTES", size * 2)  # readable; the cache's bound is size // 2
    cache = auto(path)
    assert len(cache.table) == 400
    assert cache.persist([decision(tag("new"))]) == 1
    assert os.path.getsize(path) <= size // 2
    kept = [e.key for e in load_table(path).values()]
    assert kept[-1] == tag("new") and kept[:-1] == [tag(f"{i:03}") for i in range(401 - len(kept), 400)]
    (warning,) = notices.messages
    assert f"bound of {size * 2 // 4} bytes" in warning and str(path) in warning


def test_a_persist_decodes_the_file_only_when_its_bytes_changed(tmp_path, monkeypatch):
    from megatron_tuning.tables import cache as cache_module

    path = tmp_path / "auto.msgpack"
    auto(path).persist([decision(nx(0))])
    decodes = []
    real = cache_module.table_from_data
    monkeypatch.setattr(cache_module, "table_from_data", lambda *a: decodes.append(a[1]) or real(*a))
    cache = auto(path)
    assert decodes == [str(path)]  # at open
    assert cache.persist([decision(nx(1))]) == 1
    assert cache.persist([decision(nx(2))]) == 1
    assert len(decodes) == 1  # the file held what this process last read, then what it wrote
    auto(path).persist([decision(nx(3))])  # another job writes
    decodes.clear()
    assert cache.persist([decision(nx(4))]) == 1
    assert decodes == [str(path)]  # changed: decoded once
    assert sorted(blocks(path)) == [nx(i) for i in range(5)]
    # Nothing pending: no I/O at all (the file is not even read).
    monkeypatch.setattr(cache_module, "_read", None)
    assert cache.persist([decision(nx(i)) for i in (1, 2, 4)]) == 0


def test_an_auto_cache_an_older_version_wrote_pins_its_configs_and_keeps_them_when_rewritten(
    tmp_path, monkeypatch
):
    import shutil

    import torch

    from megatron_tuning.core.decisions import get_decisions
    from megatron_tuning.runtime import interception
    from megatron_tuning.tables.search import TableSet

    from .. import support_kernels as sk

    path = tmp_path / "auto.msgpack"
    shutil.copyfile(Path(__file__).parent / "fixtures" / "schema1" / "auto_cache.msgpack", path)
    before = load_table(path)
    cache = auto(path)
    for jit in (sk.scale_add.fn, sk.maybe_double.fn.fn):  # what is launched, not run
        monkeypatch.setattr(jit, "run", lambda *args, **kwargs: None)
    interception.install(TuningPolicy(mode="auto"), table=TableSet([], cache=(cache.path, cache.table)))
    try:
        x = torch.zeros(40)
        sk.scale_add[sk.grid(40)](x, x, x, 40, 0.5)
        for flag in (True, 1, 1.0):  # three keys, three entries: never one for all
            sk.maybe_double[sk.grid(40)](x, x, 40, flag)
    finally:
        interception.uninstall()
    pinned = [(d.source, d.origin, d.config["kwargs"]["BLOCK_SIZE"]) for d in get_decisions()]
    assert pinned == [("table", str(path), block) for block in (64, 16, 32, 8)]
    assert cache.persist([decision(nx(1))]) == 1
    assert msgpack.unpackb(path.read_bytes())[1] == 2  # rewritten as schema 2, keeping every entry
    assert load_table(path) == Table(
        [*before.values(), *load_table(path).values()], meta=load_table(path).meta
    )


def test_a_cache_in_another_format_is_not_used_and_a_newer_one_is_never_rewritten(tmp_path, notices):
    older, newer = tmp_path / "older.msgpack", tmp_path / "newer.msgpack"
    for path, fmt in ((older, "0"), (newer, "2")):
        save_table(Table([Entry(arch="sm90", kernel="pkg.k:kern", key=nx(1), config=config(16))],
                         meta={"kind": "auto-cache", "cache_format": fmt}), path)  # fmt: skip
    data = newer.read_bytes()
    old_cache, new_cache = auto(older), auto(newer)
    assert len(old_cache.table) == 0 and len(new_cache.table) == 0
    assert new_cache.persist([decision(nx(1))]) == 0
    assert old_cache.persist([decision(nx(1))]) == 1
    assert newer.read_bytes() == data
    assert blocks(older) == {nx(1): 64}
    assert load_table(older).meta["cache_format"] == "1"
    warnings = list(notices.messages)
    assert len(warnings) == 2  # one per file, at open
    # A newer version that rewrites the cache while this run holds it open: not written either.
    current = auto(tmp_path / "current.msgpack")
    newer.rename(tmp_path / "current.msgpack")
    assert current.persist([decision(nx(2))]) == 0
    assert (tmp_path / "current.msgpack").read_bytes() == data
    assert "cache format 2, newer than this version's 1" in notices.messages[-1]
    assert "cache format 0" in warnings[0] and "the next persist replaces them" in warnings[0]
    assert "cache format 2" in warnings[1] and "does not write to it" in warnings[1]


def test_the_cap_comes_from_the_policy_which_reads_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_TUNING_CACHE_MAX_ENTRIES", "7")
    assert auto(tmp_path / "auto.msgpack").max_entries == 50_000  # a policy built in code: its own
    policy = TuningPolicy.from_env(mode="auto", cache=str(tmp_path / "auto.msgpack"))
    assert open_cache(policy, "sm90").max_entries == 7  # type: ignore[union-attr]


# -- kill-safe (issue 27 item 2): a key this run tuned is in the file before the run can die --------
_TUNE_THEN_DIE = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    import torch, megatron_tuning
    from tests import support_kernels as sk

    marker, how = pathlib.Path(sys.argv[1]), sys.argv[2]
    megatron_tuning.init_deterministic_tuning()
    x = torch.zeros(100)
    sk.scale_add[sk.grid(100)](x, x, torch.empty(100), 100, 1.0)  # auto: tunes this key
    marker.write_text("tuned")
    if how == "exit":
        time.sleep(1.0)
        os._exit(0)  # no atexit, no close
    time.sleep(600)  # the parent kills us
    """
)


def _auto_child_env(cache) -> dict[str, str]:  # noqa: ANN001
    """A child process's environment: this checkout importable, interpreter, ``auto`` on ``cache``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env.update(
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
        TRITON_INTERPRET="1",
        MEGATRON_TUNING_MODE="auto",
        MEGATRON_TUNING_CACHE=str(cache),
        MEGATRON_TUNING_TUNE_ROUNDS="1",
    )
    return env


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "exit"])
def test_a_run_killed_a_second_after_tuning_keeps_the_key(tmp_path, how):
    path, marker = tmp_path / "auto.msgpack", tmp_path / "tuned"
    env = _auto_child_env(path)
    child = subprocess.Popen(
        [sys.executable, "-c", _TUNE_THEN_DIE, str(marker), how],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), child.communicate(timeout=60)[1].decode()[-3000:]
        time.sleep(1.0)
        if how != "exit":
            child.send_signal(getattr(signal, how))
        child.wait(timeout=60)
    finally:
        child.kill()
        child.communicate()
    assert child.returncode == (0 if how == "exit" else -getattr(signal, how))
    (entry,) = load_table(path)  # the next run reads it: nothing is tuned again
    assert entry.kernel == "tests.support_kernels:scale_add" and entry.key.startswith("n=100 | ")
    assert entry.how == "tuned" and entry.timing is not None


def test_the_listener_persists_what_this_rank_measured_at_once_and_leaves_plain_adoptions(tmp_path):
    cache = auto(tmp_path / "auto.msgpack")
    cache.on_decision(decision(nx(1), timings={"median_ms": 1.0}))
    cache.on_decision(decision(nx(2), source="adopted", origin="rank 1", timings={"median_ms": 1.0}))
    cache.on_decision(decision(nx(3), source="adopted", origin="rank 1"))  # never measured here
    cache.on_decision(decision(nx(4), source="cheapest", timings={"median_ms": 1.0}))
    assert sorted(blocks(cache.path)) == [nx(1), nx(2)]


_COLD_RUN = textwrap.dedent(
    """
    import importlib.util, os, sys, time
    import torch, triton, megatron_tuning

    source, name, marker = sys.argv[1:4]
    megatron_tuning.init_deterministic_tuning()  # auto: reads the cache now, empty for both runs
    spec = importlib.util.spec_from_file_location(name, source)  # as eval pipelines load candidates
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    open(f"{marker}.{name}", "w").close()
    while not all(os.path.exists(f"{marker}.{other}") for other in ("cand_a", "cand_b")):
        time.sleep(0.01)
    for n in (40, 100):
        x = torch.zeros(n)
        module.add_one[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, torch.empty(n), n)
    """
)
_ADD_ONE_FILE = """
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (8, 16, 32, 64)], key=["n"])
@triton.jit
def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)
"""


@pytest.mark.slow
def test_concurrent_cold_runs_of_one_file_under_two_module_names_keep_one_entry_per_key(tmp_path):
    path, source, marker = tmp_path / "auto.msgpack", tmp_path / "kernel_file.py", str(tmp_path / "ready")
    source.write_text(_ADD_ONE_FILE)
    env = _auto_child_env(path)
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _COLD_RUN, str(source), name, marker],
            cwd=tmp_path,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("cand_a", "cand_b")
    ]
    errors = [run.communicate(timeout=240)[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], errors
    # Both tuned both keys; one kernel by content, so the first persisted entry per key wins.
    entries = load_table(path).entries()
    assert sorted(e.key.split(" |")[0] for e in entries) == ["n=100", "n=40"], entries
    assert {e.kernel.split(":")[1] for e in entries} == {"add_one"}
