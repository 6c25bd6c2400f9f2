"""``score/pinned.py``: a record's pinning names, per decision, the entry it launched and whether that
entry was stale; a stale one is flagged ``stale_entry``, a fresh one is not."""

from __future__ import annotations

from pathlib import Path

import pytest
import triton

from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.identity import config_data
from megatron_tuning.core.key import Key
from megatron_tuning.score.pinned import pinning, stale_flags
from megatron_tuning.tables.entry import Entry
from megatron_tuning.tables.table import Table, save_table

KEY, NEAR = Key({"n": 64}), Key({"n": 60})
RUNNING = "ab" * 32


def _decision(table: Path, **fields: object) -> Decision:
    base = {"kernel": "cand_mod:add_kernel", "key": KEY, "signature": "BLOCK=64", "source": "table"}
    return Decision(**{**base, "origin": str(table), "source_hash": RUNNING, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(("entry_hash", "stale"), [("cd" * 32, True), (RUNNING, False), (None, False)])
def test_an_entry_tuned_for_other_code_is_named_and_flagged(
    tmp_path: Path, entry_hash: str | None, stale: bool
) -> None:
    """Before, the record said source "table" and nothing else: a candidate scored in the config
    another candidate of the same module name was tuned to (the review's stale entry) passed as ok."""
    table = tmp_path / "t.msgpack"
    config = config_data(triton.Config({"BLOCK": 64}))
    entry = Entry(
        arch="unknown", kernel="cand_mod:add_kernel", key=KEY, config=config, source_hash=entry_hash
    )
    save_table(Table([entry]), table)
    pinned = pinning([_decision(table)], 0)
    (config_record,) = pinned["configs"]
    assert config_record["source_hash"] == RUNNING and config_record["matched_by"] is None
    flags = stale_flags(pinned)
    if stale:
        assert config_record["stale"] == f"kernel source hash {'cd' * 6} in the table, {'ab' * 6} running"
        (found,) = flags
        assert found["name"] == "stale_entry" and found["demotes"]
        assert f"cand_mod:add_kernel at key {KEY} launched a stale entry of {table}" in found["message"]
    else:
        assert config_record["stale"] is None and flags == []


def test_a_nearest_decision_is_checked_against_the_entry_it_launched(tmp_path: Path) -> None:
    table = tmp_path / "t.msgpack"
    config = config_data(triton.Config({"BLOCK": 64}))
    entry = Entry(
        arch="unknown", kernel="cand_mod:add_kernel", key=NEAR, config=config, source_hash="cd" * 32
    )
    save_table(Table([entry]), table)
    pinned = pinning([_decision(table, source="nearest", nearest_key=str(NEAR))], 0)
    assert pinned["configs"][0]["nearest_key"] == str(NEAR) and pinned["configs"][0]["stale"]
    assert len(stale_flags(pinned)) == 1


def test_a_table_file_that_no_longer_loads_leaves_the_score_alone(tmp_path: Path) -> None:
    table = tmp_path / "t.msgpack"
    table.write_bytes(b"\x80")
    pinned = pinning([_decision(table)], 0)
    assert pinned["configs"][0]["stale"] is None and stale_flags(pinned) == []
