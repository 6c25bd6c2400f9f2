"""``report`` on hostile or malformed input: exit 2 with one line naming the file, never a traceback;
plots stay inside ``--plot DIR`` whatever the kernel ids say."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from megatron_tuning.cli import main
from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.errors import TableError
from megatron_tuning.tables.decision_files import write_decisions
from megatron_tuning.tuning.results import RESULTS_FORMAT, read_results, write_results
from megatron_tuning.tuning.stats import TIMINGS_FORMAT

SIG = "BLOCK=64, num_warps=1, num_stages=3"


def _record(**changes: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "arch": "sm90",
        "kernel": "pkg.mod:k",
        "key": "n=8",
        "winner": SIG,
        "config": {"kwargs": {"BLOCK": 64}, "num_warps": 1, "num_stages": 3},
        "votes": [1, 1],
        "timings": {"candidates": {SIG: [1.0, 0.9, 1.1]}, "tied": [SIG], "tie_band": 0.02, "unit": "ms"},
    }
    record.update(changes)
    return record


def _results(path: Path, records: Any) -> Path:
    path.write_text(json.dumps({"format": RESULTS_FORMAT, "version": 1, "results": records}))
    return path


def _report(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = main(["report", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("records", "problem"),
    [
        ([{"kernel": 1}], "must be a string"),  # was TypeError
        ([{k: v for k, v in _record().items() if k != "timings"}], "timings must be an object"),  # KeyError
        ([_record(timings=[])], "timings must be an object"),  # AttributeError
        ([[]], "must be an object"),
        ("abc", "'results' must be a list"),
        ([_record(timings={"candidates": {SIG: "fast"}})], "must be a number"),
        ([_record(timings={"candidates": {SIG: [1.0]}, "tie_band": "wide"})], "tie_band"),
        ([_record(timings={"candidates": {SIG: [10**400]}})], "must be a number"),
        ([_record(votes=[1])], "votes"),
    ],
)
def test_malformed_results_exit_2_naming_the_file(capsys, tmp_path, records, problem):
    path = _results(tmp_path / "r.tuning.json", records)
    code, _, err = _report(capsys, path, "--plot", tmp_path / "plots")
    assert code == 2 and problem in err and str(path) in err and "Traceback" not in err


def test_deeply_nested_json_exits_2(capsys, tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000)
    code, _, err = _report(capsys, path)
    assert code == 2 and "RecursionError" in err and str(path) in err


def test_decision_log_with_unpoolable_tuned_timings_exits_2(capsys, tmp_path):
    log = tmp_path / "log.json"
    bad = Decision(
        kernel="pkg.mod:k",
        key="n=8",
        signature=SIG,
        source="tuned",
        config={},
        timings={"format": TIMINGS_FORMAT, "configs": {SIG: {}}, "samples": [1.0], "tie_band": 0.02},
    )
    write_decisions(log, [bad])
    code, _, err = _report(capsys, log)
    assert code == 2 and "cannot pool the tuned timings of kernel pkg.mod:k" in err and str(log) in err


def test_an_unknown_document_is_named(capsys, tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"format": "something"}')
    code, _, err = _report(capsys, path)
    assert code == 2 and "neither a tuning results file" in err


def test_plots_stay_inside_their_folder(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    outside = tmp_path / "outside"
    outside.mkdir()
    records = [
        _record(kernel="m:../../x", key="../../y"),
        _record(kernel=f"m:{outside}/abs", key=f"{outside}/k"),
        _record(kernel="m:\x1b[2Kevil\r", key="..\\..\\z"),
    ]
    path = _results(tmp_path / "r.tuning.json", records)
    plots = tmp_path / "deep" / "plots"
    code, out, err = _report(capsys, path, "--plot", plots)
    assert code == 0, err
    written = sorted(p.name for p in plots.iterdir())
    assert len(written) == 3 and all(name.endswith(".png") and "/" not in name for name in written)
    everything = {p for p in tmp_path.rglob("*") if p.is_file()}
    assert everything == {path} | {plots / name for name in written}


def test_results_writer_never_follows_a_planted_link_and_cleans_up(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    target = tmp_path / "t.tuning.json"
    (tmp_path / f"t.tuning.json.tmp.{os.getpid()}").symlink_to(victim)  # the old predictable name
    write_results(target, [_record()])
    assert victim.read_text() == "keep me"
    assert read_results(target)[0]["kernel"] == "pkg.mod:k"
    folder_target = tmp_path / "a_folder"
    folder_target.mkdir()
    with pytest.raises(OSError, match=f"cannot write {folder_target}"):
        write_results(folder_target, [_record()])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []


def test_results_writer_refuses_a_fifo(tmp_path):
    fifo = tmp_path / "r.tuning.json"
    os.mkfifo(fifo)
    with pytest.raises(TableError, match="Tuning results .*FIFO"):
        write_results(fifo, [_record()])
    assert fifo.is_fifo()
