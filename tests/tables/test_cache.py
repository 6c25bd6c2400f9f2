"""auto mode's cache table: where it lives, corrupt and unwritable caches, crash safety."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time

from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.tables.cache import AutoCache, cache_path, default_cache_dir, open_cache
from megatron_tuning.tables.table import Table, load_table

CONFIG = {"kwargs": {"BLOCK": 64}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}


def decision(key: str, source: str = "tuned", **changes) -> Decision:
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
    # A policy built in code without a cache takes MEGATRON_TUNING_CACHE, as tables take _TABLE.
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", str(tmp_path / "env.msgpack"))
    assert cache_path(TuningPolicy(mode="auto"), "sm90") == str(tmp_path / "env.msgpack")
    assert cache_path(TuningPolicy(mode="auto", cache=str(mine)), "sm90") == str(mine)
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", "off")
    assert cache_path(TuningPolicy(mode="auto"), "sm90") is None


def test_persist_merges_tuned_and_adopted_only_once_each(tmp_path):
    cache = open_cache(TuningPolicy(mode="auto", cache=str(tmp_path / "c" / "auto.msgpack")), "sm90")
    assert cache is not None and len(cache.table) == 0 and cache.writable
    decisions = [
        decision("n=1 | x:f"),
        decision("n=2 | x:f", source="adopted", origin="rank 3"),
        decision("n=3 | x:f", source="cheapest"),
        decision("n=4 | x:f", source="table"),
    ]
    assert cache.persist(decisions) == 2
    assert cache.persist(decisions) == 0  # nothing new: no rewrite
    table = load_table(cache.path)
    assert sorted(e.key for e in table) == ["n=1 | x:f", "n=2 | x:f"]
    adopted = table.get("sm90", "pkg.k:kern", "n=2 | x:f")
    assert adopted.how == "tuned" and "rank 3" in adopted.note


def test_a_corrupt_cache_is_ignored_for_the_run_and_left_untouched(tmp_path, caplog):
    path = tmp_path / "auto.msgpack"
    path.write_bytes(b"\x93garbage")
    with caplog.at_level(logging.WARNING):
        assert open_cache(TuningPolicy(mode="auto", cache=str(path)), "sm90") is None
    assert path.read_bytes() == b"\x93garbage"
    (message,) = [r.getMessage() for r in caplog.records if "auto cache" in r.getMessage()]
    assert str(path) in message and "MEGATRON_TUNING_CACHE" in message


def test_a_folder_named_as_the_cache_is_refused_with_the_fix(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert open_cache(TuningPolicy(mode="auto", cache=str(tmp_path)), "sm90") is None
    assert any("is a folder" in r.getMessage() for r in caplog.records)


def test_an_unwritable_cache_folder_warns_once_and_never_raises(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")  # unwritable even for root
    with caplog.at_level(logging.WARNING):
        cache = open_cache(TuningPolicy(mode="auto", cache=str(blocker / "sm90" / "auto.msgpack")), "sm90")
        assert cache is not None and not cache.writable
        assert cache.persist([decision("n=1 | x:f")]) == 0
    assert blocker.read_text().startswith("a file")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot be written" in warnings[0] and str(blocker) in warnings[0]


def test_a_failed_write_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")  # the folder went away after start-up
    cache = AutoCache(path=str(blocker / "auto.msgpack"), table=Table(), writable=True)
    with caplog.at_level(logging.ERROR):
        assert cache.persist([decision("n=1 | x:f")]) == 0
    assert any("could not write" in r.getMessage() and str(blocker) in r.getMessage() for r in caplog.records)


_KILLED = textwrap.dedent(
    """
    import sys, time
    from megatron_tuning.core.decisions import Decision
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.tables import files
    from megatron_tuning.tables.cache import open_cache
    path, marker = sys.argv[1], sys.argv[2]
    def pause(tmp):
        open(marker, "w").write(tmp)
        time.sleep(120)
    files._BEFORE_REPLACE = pause
    cache = open_cache(TuningPolicy(mode="auto", cache=path), "sm90")
    config = {"kwargs": {"BLOCK": 64}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    cache.persist([Decision(kernel="pkg.k:kern", key="n=2 | x:f", signature="s", source="tuned",
                            config=config, arch="sm90")])
    """
)


def test_a_process_killed_mid_write_leaves_a_loadable_cache(tmp_path):
    path = tmp_path / "auto.msgpack"
    first = open_cache(TuningPolicy(mode="auto", cache=str(path)), "sm90")
    first.persist([decision("n=1 | x:f")])
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
    assert [e.key for e in load_table(path)] == ["n=1 | x:f"]
    again = open_cache(TuningPolicy(mode="auto", cache=str(path)), "sm90")
    assert again is not None and len(again.table) == 1
