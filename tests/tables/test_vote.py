"""The vote: majority over recordings and tables, the disagreement report, and a voted table pinning."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_tuning.core.decisions import Decision, decision_log, get_decisions
from megatron_tuning.core.errors import TableError
from megatron_tuning.core.identity import config_signature, kernel_id
from megatron_tuning.core.key import Key
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.runtime import interception
from megatron_tuning.tables.entry import Entry, Timing, entry_with
from megatron_tuning.tables.records import read_decisions, recording_path, write_decisions, write_recording
from megatron_tuning.tables.review import diff_tables
from megatron_tuning.tables.search import TableSet, installed_triton_version
from megatron_tuning.tables.table import Table, load_table
from megatron_tuning.tables.vote import vote_files, vote_tables

from .. import support_kernels as sk
from ..keys import tag
from ..support_kernels import grid
from .test_records import KERNEL, M1, M2, config, decision


def entry(
    block: int,
    *,
    key: Key = M1,
    median: float | None = None,
    warps: int = 4,
    source_hash: str | None = None,
) -> Entry:
    return Entry(
        arch="sm90",
        kernel=KERNEL,
        key=key,
        config=config(block, warps),
        how="recorded",
        source_hash=source_hash,
        timing=Timing(median_ms=median) if median is not None else None,
    )


def inputs(*tables: list[Entry]) -> list[tuple[str, Table]]:
    return [(f"rank{i}", Table(entries)) for i, entries in enumerate(tables)]


def chosen(result, key: Key = M1) -> int:
    return result.table.get("sm90", KERNEL, key).config["kwargs"]["BLOCK"]


def test_majority_wins_and_disagreement_is_reported():
    result = vote_tables(inputs([entry(64)], [entry(128)], [entry(64)], [entry(64, key=M2)]))
    assert chosen(result) == 64
    assert result.table.get("sm90", KERNEL, M1).votes == (2, 3)
    assert result.table.get("sm90", KERNEL, M2).votes == (1, 1)
    (item,) = result.disagreements
    assert (item.kernel, item.key, item.rule) == (KERNEL, M1, "majority")
    assert [(v.signature, v.inputs) for v in item.votes] == [
        (config_signature(config(64)), ("rank0", "rank2")),
        (config_signature(config(128)), ("rank1",)),
    ]
    assert result.to_json()["disagreements"][0]["chosen"] == config_signature(config(64))


def test_tie_goes_to_lowest_median_time():
    result = vote_tables(inputs([entry(64, median=2.0)], [entry(128, median=1.0)]))
    assert chosen(result) == 128
    assert result.disagreements[0].rule == "tie: lowest median time"


def test_tie_without_timings_goes_to_static_cost_then_signature():
    result = vote_tables(inputs([entry(128)], [entry(64)]))
    assert chosen(result) == 64 and result.disagreements[0].rule == "tie: lowest static cost"
    # GROUP is not a tile extent, so both cost the same: the signature text decides.
    group8, group4 = (
        Entry(
            arch="sm90",
            kernel=KERNEL,
            key=M1,
            how="recorded",
            config={"kwargs": {"BLOCK": 64, "GROUP": g}, "num_warps": 4, "num_stages": 3},
        )
        for g in (8, 4)
    )
    result = vote_tables(inputs([group8], [group4]))
    assert result.table.get("sm90", KERNEL, M1).config["kwargs"]["GROUP"] == 4
    assert result.disagreements[0].rule == "tie: signature order"


def test_merge_is_independent_of_input_order():
    tables = [
        [entry(64, median=1.0), entry(16, key=tag("k"))],
        [entry(128, median=1.0)],
        [entry(32, median=3.0, key=tag("k"), source_hash="bb" * 32)],
        [entry(16, key=tag("k"), median=0.5)],
    ]
    outputs = set()
    for order in itertools.permutations(range(len(tables))):
        named = [(f"in{i}", Table(tables[i])) for i in order]
        outputs.add(vote_tables(named).table.to_bytes())
    assert len(outputs) == 1


def test_one_source_under_two_module_names_votes_as_one_kernel_only_with_one_config_list():
    def under(name: str, block: int, digest: str | None) -> Entry:
        return entry_with(
            entry(block, source_hash="aa" * 32), kernel=f"{name}:matmul", config_list_digest=digest
        )

    lists = {"a": "aaaaaaaaaaaa", "b": "bbbbbbbbbbbb"}
    apart = vote_tables(inputs([under("cand_a", 32, lists["a"])], [under("cand_b", 64, lists["b"])]))
    assert {(e.kernel, e.config["kwargs"]["BLOCK"], e.votes) for e in apart.table} == {
        ("cand_a:matmul", 32, (1, 1)),
        ("cand_b:matmul", 64, (1, 1)),
    }
    assert apart.disagreements == []
    one = vote_tables(inputs([under("cand_a", 32, lists["a"])], [under("cand_c", 64, lists["a"])]))
    assert [(e.kernel, e.votes) for e in one.table] == [("cand_a:matmul", (1, 2))] and one.disagreements
    changes = diff_tables(apart.table, Table([under("cand_b", 64, lists["b"])]), ignore_provenance=True)
    assert changes["removed"] and not changes["changed"]  # cand_a is not cand_b renamed


def test_one_kernel_named_plain_in_one_run_and_digest_in_another_votes_as_one():
    # The plain/@digest choice reads the module at the first launch: one kernel, two names by run.
    plain = entry_with(entry(32, source_hash="aa" * 32), kernel="cand:matmul", config_list_digest="a" * 12)
    split = entry_with(plain, kernel=f"cand:matmul@{'a' * 12}", config=config(64))
    result = vote_tables(inputs([plain], [split]))
    assert [(e.kernel, e.votes) for e in result.table] == [("cand:matmul", (1, 2))] and result.disagreements


def test_mixed_source_hashes_are_reported():
    result = vote_tables(inputs([entry(64, source_hash="aa" * 32)], [entry(64, source_hash="bb" * 32)]))
    assert result.disagreements == []
    assert result.mixed_source_hashes == [("sm90", KERNEL, M1, ("aa" * 32, "bb" * 32))]
    assert result.to_json()["mixed_source_hashes"][0]["source_hashes"] == ["aa" * 32, "bb" * 32]


def test_vote_files_reads_folders_and_skips_the_output(tmp_path):
    for rank, block in enumerate((64, 64, 128)):
        write_recording([decision(block, rank=rank)], tmp_path, rank=rank)
    out = tmp_path / "merged.msgpack"
    vote_files(out, [tmp_path])
    again = vote_files(out, [tmp_path])  # the earlier output in the same folder is not a vote
    assert again.inputs == [str(recording_path(tmp_path, r)) for r in range(3)]
    assert load_table(out).get("sm90", KERNEL, M1).votes == (2, 3)


def test_vote_files_refuses_to_write_an_empty_table(tmp_path):
    empty = tmp_path / "rec"
    empty.mkdir()
    out = tmp_path / "merged.msgpack"
    with pytest.raises(TableError, match="no \\*.msgpack tables"):
        vote_files(out, [empty])
    # A folder holding only an earlier output: nothing to vote with either.
    write_recording([decision(64, rank=0)], tmp_path / "only", rank=0)
    only_out = tmp_path / "only" / "merged.msgpack"
    vote_files(only_out, [tmp_path / "only"])
    (tmp_path / "only" / "recording-rank00000.msgpack").unlink()
    before = only_out.read_bytes()
    with pytest.raises(TableError, match="no input tables to merge"):
        vote_files(only_out, [tmp_path / "only"])
    assert only_out.read_bytes() == before and not out.exists()


def test_vote_files_reads_decision_logs_one_vote_per_process(tmp_path):
    # What `tune` keeps per process (its tuned-<host>-<pid>.json) and its pooled --results: `merge`
    # refused both as "not a megatron_tuning.table JSON document".
    logs = [tmp_path / f"tuned-host-{rank}.json" for rank in range(3)]
    for rank, (path, block) in enumerate(zip(logs, (64, 64, 128))):
        write_decisions(path, [decision(block, rank=rank, source="tuned"), decision(32, key=M2, rank=rank)])
    pooled = tmp_path / "t.tuning.json"  # one decision per process for each key, as --results holds
    write_decisions(pooled, [d for path in logs for d in read_decisions(path)], processes=[2, 2, 2])
    per_process, from_pooled = (
        vote_files(tmp_path / "a.msgpack", logs),
        vote_files(tmp_path / "b.msgpack", [pooled]),
    )
    assert per_process.inputs == [str(p) for p in logs]
    assert from_pooled.inputs == [f"{pooled}#{n}" for n in (1, 2, 3)]
    for path in ("a.msgpack", "b.msgpack"):
        table = load_table(tmp_path / path)
        assert table.get("sm90", KERNEL, M1).votes == (2, 3) and chosen_block(table) == 64
        assert table.get("sm90", KERNEL, M2).votes == (3, 3)
        assert table.get("sm90", KERNEL, M1).how == "tuned"
    assert per_process.table == from_pooled.table
    renamed = tmp_path / "decisions.log"  # told by content, as `run --decision-log` may name it
    renamed.write_bytes(logs[0].read_bytes())
    assert vote_files(tmp_path / "c.msgpack", [renamed]).inputs == [str(renamed)]


def test_a_decision_log_not_pooled_votes_once_its_first_decision_per_key_as_tune_counts_it(tmp_path):
    # One process that ran two sessions logs two decisions for a key: `tune` counts it once (its
    # first); `merge` counted each repeat as a vote of its own.
    twice, once = tmp_path / "tuned-host-0.json", tmp_path / "tuned-host-1.json"
    write_decisions(twice, [decision(64, source="tuned"), decision(128, source="tuned")])
    write_decisions(once, [decision(128, rank=1, source="tuned")])
    result = vote_files(tmp_path / "out.msgpack", [twice, once])
    assert result.inputs == [str(twice), str(once)]
    assert load_table(tmp_path / "out.msgpack").get("sm90", KERNEL, M1).votes == (1, 2)
    pooled = tmp_path / "t.tuning.json"  # tune's --results of that job: each process's vote kept
    write_decisions(pooled, [*read_decisions(twice), *read_decisions(once)], processes=[2, 1])
    assert vote_files(tmp_path / "pooled.msgpack", [pooled]).inputs == [f"{pooled}#1", f"{pooled}#2"]
    assert load_table(tmp_path / "pooled.msgpack") == load_table(tmp_path / "out.msgpack")


def test_a_merged_decision_log_stamps_its_entries_with_the_triton_that_measured_them(tmp_path, notices):
    # Merged on another machine or after a Triton upgrade, its entries claimed the installed Triton.
    tuned_with, out = "2.0.0", tmp_path / "out.msgpack"
    assert installed_triton_version() != tuned_with
    log, pooled = tmp_path / "tuned-host-0.json", tmp_path / "t.tuning.json"
    write_decisions(log, [decision(64, source="tuned")], triton_version=tuned_with)
    write_decisions(
        pooled, [decision(64, rank=r, source="tuned") for r in range(2)], triton_version=tuned_with
    )
    unknown = tmp_path / "mixed.tuning.json"  # --results of a job whose processes ran different Tritons
    write_decisions(unknown, [decision(64, source="tuned")], triton_version=None)
    for path, stamped in ((log, tuned_with), (pooled, tuned_with), (unknown, None)):
        vote_files(out, [path])
        assert load_table(out).get("sm90", KERNEL, M1).triton_version == stamped
    assert notices.messages == []


def test_a_decision_log_written_before_logs_recorded_their_triton_is_stamped_with_the_installed_one(
    tmp_path, notices
):
    logs = [tmp_path / f"tuned-host-{rank}.json" for rank in range(2)]
    for rank, path in enumerate(logs):
        write_decisions(path, [decision(64, rank=rank, source="tuned")])
        doc = json.loads(path.read_text())
        del doc["triton_version"]  # as logs were written before
        path.write_text(json.dumps(doc))
    vote_files(tmp_path / "out.msgpack", logs)
    assert (
        load_table(tmp_path / "out.msgpack").get("sm90", KERNEL, M1).triton_version
        == installed_triton_version()
    )
    (message,) = notices.messages  # once, for all such logs
    assert f"decision log {logs[0]} (and any other written before" in message
    assert f"stamped with the installed Triton {installed_triton_version()}" in message
    assert 'Merge such logs where they were tuned, or add "triton_version"' in message


def chosen_block(table: Table) -> int:
    return table.get("sm90", KERNEL, M1).config["kwargs"]["BLOCK"]


def test_vote_files_refuses_a_decision_log_without_measurements(tmp_path):
    pinned = tmp_path / "decisions-rank0.json"
    write_decisions(pinned, [decision(64, source="table")])
    with pytest.raises(TableError, match="holds no tuned or recorded decision; a pinned run's log"):
        vote_files(tmp_path / "out.msgpack", [pinned])
    other = tmp_path / "other.json"  # JSON that is neither a table nor a log: the table reader's word
    other.write_text('{"format": "something else"}')
    with pytest.raises(TableError, match='missing "format": "megatron_tuning.table"'):
        vote_files(tmp_path / "out.msgpack", [other])
    assert not (tmp_path / "out.msgpack").exists()


def test_merging_into_a_listed_output_holds_its_lock(tmp_path, monkeypatch):
    write_recording([decision(64, rank=0)], tmp_path / "rec", rank=0)
    out = tmp_path / "merged.msgpack"
    vote_files(out, [tmp_path / "rec"])
    probes: list[int] = []

    real_replace = os.replace

    def probe(tmp: str, dest: str) -> None:  # another process tries the lock while merge writes
        code = "import filelock, sys; filelock.FileLock(sys.argv[1], timeout=0).acquire()"
        proc = subprocess.run([sys.executable, "-c", code, f"{out}.lock"], capture_output=True, timeout=60)
        probes.append(proc.returncode)
        real_replace(tmp, dest)

    monkeypatch.setattr(os, "replace", probe)
    vote_files(out, [out, tmp_path / "rec"])  # read-modify-write of out
    assert probes and probes[0] != 0, "the lock on the output was free during the write"


# -- end to end: record, merge, pin ------------------------------------------------
@pytest.fixture
def _clean_kernels():
    sk.BENCH_CALLS.clear()
    decision_log().clear()
    sk.scale_add.cache.clear()
    yield
    interception.uninstall()
    decision_log().clear()
    sk.scale_add.cache.clear()


def _run_scale_add(n: int) -> None:
    x, y = torch.randn(n), torch.randn(n)
    out = torch.empty(n)
    sk.scale_add[grid(n)](x, y, out, n, 0.5)
    torch.testing.assert_close(out, 0.5 * x + y)


@pytest.mark.usefixtures("_clean_kernels")
def test_recorded_and_merged_table_pins_the_next_run(tmp_path):
    record_dir = tmp_path / "rec"
    interception.install(TuningPolicy(mode="record"))
    _run_scale_add(40)
    recorded = get_decisions()
    assert [d.source for d in recorded] == ["recorded"]
    # Two "ranks" recorded the same winner; a third disagreed.
    write_recording(recorded, record_dir, rank=0)
    write_recording(recorded, record_dir, rank=1)
    other = sk.ADD_CONFIGS[-1]
    dissent = Decision(
        kernel=recorded[0].kernel,
        key=recorded[0].key,
        signature=config_signature(other),
        source="recorded",
        config={
            "kwargs": dict(other.kwargs),
            "num_warps": other.num_warps,
            "num_stages": other.num_stages,
            "num_ctas": 1,
            "maxnreg": None,
        },
        arch=recorded[0].arch,
        source_hash=recorded[0].source_hash,
    )
    write_recording([dissent], record_dir, rank=2)
    merged = tmp_path / "merged.msgpack"
    result = vote_files(merged, [record_dir])
    assert len(result.disagreements) == 1
    interception.uninstall()
    decision_log().clear()
    sk.BENCH_CALLS.clear()

    interception.install(TuningPolicy(mode="deterministic"), table=TableSet([merged]))
    _run_scale_add(40)
    (pinned,) = get_decisions()
    assert (pinned.source, pinned.origin) == ("table", str(merged))
    assert pinned.signature == recorded[0].signature
    assert pinned.kernel == kernel_id(sk.scale_add)
    assert sk.BENCH_CALLS == []
