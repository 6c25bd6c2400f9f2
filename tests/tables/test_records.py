"""What runs record: decision logs, per-rank recordings and the table entries their decisions stand
for."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.errors import TableError
from megatron_tuning.core.identity import config_signature
from megatron_tuning.core.key import Key
from megatron_tuning.tables.entry import Timing
from megatron_tuning.tables.records import (
    entry_from_decision,
    read_decision_file,
    read_decisions,
    recording_path,
    recording_table,
    timing_from_decision,
    write_decisions,
    write_recording,
)
from megatron_tuning.tables.search import installed_triton_version
from megatron_tuning.tables.table import load_table

from ..keys import tag

KERNEL = "pkg.kernels:matmul"
M1, M2 = Key({"M": 1}), Key({"M": 2})


def config(block: int, warps: int = 4) -> dict[str, object]:
    return {"kwargs": {"BLOCK": block}, "num_warps": warps, "num_stages": 3}


def decision(
    block: int,
    *,
    key: Key = M1,
    rank: int = 0,
    source: str = "recorded",
    timings: dict[str, object] | None = None,
    source_hash: str | None = "aa" * 32,
) -> Decision:
    cfg = config(block)
    return Decision(
        kernel=KERNEL,
        key=key,
        signature=config_signature(cfg),
        source=source,
        config=cfg,
        arch="sm90",
        rank=rank,
        source_hash=source_hash,
        timings=timings,
    )


def test_timing_from_interception_candidates():
    sig = config_signature(config(64))
    timings = {
        "candidates": {sig: [1.0, 0.9, 1.3], "other": [1.2, 1.1, 1.4], "failed": [math.inf] * 3},
        "bench_time_s": 0.5,
    }
    assert timing_from_decision(decision(64, timings=timings)) == Timing(
        median_ms=1.0, spread_ms=pytest.approx(0.4), candidates=3, runner_up_ms=1.2
    )


def test_timing_from_tuner_form_and_garbage():
    sig = config_signature(config(64))
    tuned = {"candidates": {sig: [2.0, 1.9, 2.1], "x": [None, None, None]}, "samples": {sig: [2.0] * 7}}
    assert timing_from_decision(decision(64, timings=tuned)) == Timing(
        median_ms=2.0, spread_ms=pytest.approx(0.2), samples=7, candidates=2
    )
    assert timing_from_decision(decision(64, timings={"median_ms": 1.5, "samples": 10})) == Timing(
        median_ms=1.5, samples=10
    )
    for junk in (None, "x", {"candidates": "x"}, {"median_ms": "fast"}, {"candidates": {sig: "?"}}):
        timing = timing_from_decision(decision(64, timings=junk))  # type: ignore[arg-type]
        assert timing is None or timing.median_ms is None


def test_recording_table_keeps_measured_winners_only():
    decisions = [
        decision(64, key=tag("a"), timings={"median_ms": 1.0}),
        decision(128, key=tag("a")),  # a later duplicate: the first (launched) one stays
        decision(32, key=tag("b"), source="tuned"),
        decision(16, key=tag("c"), source="cheapest"),
        Decision(kernel="pkg:other", key="*", signature="", source="out_of_scope"),
    ]
    table = recording_table(decisions, rank=3, triton_version="3.6.0")
    assert [(e.key, e.how, e.config["kwargs"]["BLOCK"]) for e in table.entries()] == [
        (tag("a"), "recorded", 64),
        (tag("b"), "tuned", 32),
    ]
    assert table.meta == {"kind": "recording", "rank": "3"}
    assert all(e.triton_version == "3.6.0" and e.source_hash == "aa" * 32 for e in table.entries())
    assert entry_from_decision(decisions[3]) is None


def test_write_recording_one_file_per_rank_and_accumulates(tmp_path):
    path0 = write_recording([decision(64, key=tag("a"))], tmp_path, rank=0)
    path1 = write_recording([decision(128, key=tag("a"), rank=1)], tmp_path, rank=1)
    assert (path0, path1) == (recording_path(tmp_path, 0), recording_path(tmp_path, 1))
    assert path0.name == "recording-rank00000.msgpack"
    write_recording([decision(32, key=tag("b"))], tmp_path, rank=0)  # a second run of the job
    assert sorted(e.key for e in load_table(path0).entries()) == [tag("a"), tag("b")]
    assert load_table(path1).get("sm90", KERNEL, tag("a")).config["kwargs"] == {"BLOCK": 128}


def test_a_decision_log_keeps_each_keys_order_and_types_and_an_older_log_reads_as_written(tmp_path):
    key = Key({"n": 40, "flag": True}, {"x_ptr": "torch.float32"})  # its order is not sorted order
    path = tmp_path / "d.json"
    out_of_scope = Decision(kernel="pkg:o", key="*", signature="", source="out_of_scope")
    write_decisions(path, [decision(64, key=key), out_of_scope])
    back, again = read_decisions(path)
    assert (back.key, back.key.names, type(back.key.values[1]), again.key) == (key, ("n", "flag"), bool, "*")
    fixtures = Path(__file__).parent / "fixtures" / "schema1"
    old = read_decisions(fixtures / "decisions.json")
    expected = json.loads((fixtures / "expected.json").read_text(encoding="utf-8"))["decisions.json"]
    assert [[d.arch, d.kernel, d.key, d.signature] for d in old] == expected
    assert entry_from_decision(old[0]).key.values == (40,)  # an entry of it keeps its parts
    doc = json.loads(path.read_text())
    doc["decisions"][0]["key"] = "n=40, flag=True | x_ptr:torch.float32"  # text in a version-2 log
    path.write_text(json.dumps(doc))
    with pytest.raises(
        TableError, match="decision 0: key of kernel 'pkg.kernels:matmul': key 'n=40, flag=Tr"
    ):
        read_decisions(path)


def test_a_decision_log_records_the_triton_that_made_its_decisions(tmp_path):
    path = tmp_path / "d.json"
    write_decisions(path, [decision(64)])  # this process's: the installed Triton
    log = read_decision_file(path)
    assert (log.path, log.triton_version, log.versioned) == (str(path), installed_triton_version(), True)
    assert list(json.loads(path.read_text()))[:3] == ["format", "version", "triton_version"]
    write_decisions(path, [decision(64)], triton_version="2.0.0")  # pooled from processes that ran it
    assert read_decision_file(path)[2:4] == ("2.0.0", True)
    write_decisions(path, [decision(64)], triton_version=None)  # not one Triton: none recorded
    assert read_decision_file(path)[2:4] == (None, True)
    old = read_decision_file(Path(__file__).parent / "fixtures" / "schema1" / "decisions.json")
    assert (old.triton_version, old.versioned) == (None, False)  # written before logs said
    doc = json.loads(path.read_text())
    for bad, problem in ((3.9, "must be a string or null, got 3.9"), ("3.9\ud800", "lone surrogate")):
        path.write_text(json.dumps({**doc, "triton_version": bad}))
        with pytest.raises(TableError, match=rf"d\.json.*triton_version.*{problem}"):
            read_decisions(path)


def test_a_pooled_decision_log_says_how_many_decisions_each_process_gave(tmp_path):
    path = tmp_path / "d.json"
    write_decisions(path, [decision(64), decision(64, rank=1), decision(32)], processes=[2, 0, 1])
    assert read_decision_file(path).processes == (2, 0, 1)
    write_decisions(path, [decision(64)])  # one process's: no count
    assert "processes" not in json.loads(path.read_text()) and read_decision_file(path).processes is None
    with pytest.raises(ValueError, match=r"processes \[2\] must count the 1 decisions"):
        write_decisions(path, [decision(64)], processes=[2])
    doc = json.loads(path.read_text())
    for bad in ([2], [-1, 2], "1", [True]):
        path.write_text(json.dumps({**doc, "processes": bad}))
        with pytest.raises(TableError, match=r"d\.json.*'processes' must count its 1 decisions per process"):
            read_decisions(path)


def test_recording_table_keeps_an_explicit_triton_version_of_none(tmp_path):
    # A log whose header says "triton_version": null (processes that ran different Tritons) was
    # stamped by `tune` with the installed Triton, and by `merge` with none.
    assert recording_table([decision(64)], triton_version=None).entries()[0].triton_version is None
    assert recording_table([decision(64)]).entries()[0].triton_version == installed_triton_version()


def test_a_decision_with_a_text_key_is_refused_before_its_log_is_written_naming_the_fix(tmp_path):
    """Text would make a log ``read_decisions`` refuses (text is never read back): the writer says so."""
    path = tmp_path / "d.json"
    write_decisions(path, [decision(64)])
    written = path.read_bytes()
    text = Decision(kernel=KERNEL, key="M=1 | a_ptr:torch.float16", signature="S", source="tuned")
    with pytest.raises(
        ValueError,
        match=r"decision of kernel 'pkg.kernels:matmul': key 'M=1 \| a_ptr:torch.fl.*"
        r"is text.*megatron_tuning.tuning_key\(autotuner, args, kwargs\).*core.key.Key\(",
    ):
        write_decisions(path, [decision(32), text])
    assert path.read_bytes() == written  # nothing written over the log that was there
    out_of_scope = Decision(kernel="pkg:o", key="*", signature="", source="out_of_scope")
    write_decisions(path, [decision(32), out_of_scope])  # the one text a log holds: "*"
    assert [d.key for d in read_decisions(path)] == [M1, "*"]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty file"),
        (" \n", "empty file"),
        ('{"format": ', r"not valid JSON \(JSONDecodeError: Expecting value"),
        ("[" * 50_000, r"not valid JSON \(RecursionError"),
    ],
)
def test_an_unreadable_decision_log_names_the_file_and_the_problem(tmp_path, text, problem):
    path = tmp_path / "decisions-rank00000.json"
    path.write_text(text, encoding="utf-8")
    expected = rf"decisions-rank00000\.json.*not a readable decision log: {problem}"
    with pytest.raises(TableError, match=expected):
        read_decisions(path)
