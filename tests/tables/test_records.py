"""What runs record: per-rank recordings and the table entries their decisions stand for."""

from __future__ import annotations

import math

import pytest

from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.identity import config_signature
from megatron_tuning.tables.entry import Timing
from megatron_tuning.tables.records import (
    entry_from_decision,
    recording_path,
    recording_table,
    timing_from_decision,
    write_recording,
)
from megatron_tuning.tables.table import load_table

KERNEL = "pkg.kernels:matmul"


def config(block: int, warps: int = 4) -> dict[str, object]:
    return {"kwargs": {"BLOCK": block}, "num_warps": warps, "num_stages": 3}


def decision(
    block: int,
    *,
    key: str = "M=1",
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
        decision(64, key="a", timings={"median_ms": 1.0}),
        decision(128, key="a"),  # a later duplicate: the first (launched) one stays
        decision(32, key="b", source="tuned"),
        decision(16, key="c", source="cheapest"),
        Decision(kernel="pkg:other", key="*", signature="", source="out_of_scope"),
    ]
    table = recording_table(decisions, rank=3, triton_version="3.6.0")
    assert [(e.key, e.how, e.config["kwargs"]["BLOCK"]) for e in table.entries()] == [
        ("a", "recorded", 64),
        ("b", "tuned", 32),
    ]
    assert table.meta == {"kind": "recording", "rank": "3"}
    assert all(e.triton_version == "3.6.0" and e.source_hash == "aa" * 32 for e in table.entries())
    assert entry_from_decision(decisions[3]) is None


def test_write_recording_one_file_per_rank_and_accumulates(tmp_path):
    path0 = write_recording([decision(64, key="a")], tmp_path, rank=0)
    path1 = write_recording([decision(128, key="a", rank=1)], tmp_path, rank=1)
    assert (path0, path1) == (recording_path(tmp_path, 0), recording_path(tmp_path, 1))
    assert path0.name == "recording-rank00000.msgpack"
    write_recording([decision(32, key="b")], tmp_path, rank=0)  # a second run of the job
    assert sorted(e.key for e in load_table(path0).entries()) == ["a", "b"]
    assert load_table(path1).get("sm90", KERNEL, "a").config["kwargs"] == {"BLOCK": 128}
