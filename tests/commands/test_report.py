"""``report``: timings of tune's results printed and plotted; malformed inputs exit 2 naming the file."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest
from pytest import CaptureFixture, MonkeyPatch

from megatron_tuning.commands.report import add_report, run_report
from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.key import Key
from megatron_tuning.tables.records import write_decisions

from .test_tune import PNG_MAGIC, no_matplotlib, tiny_records


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_report(parser)
    return parser.parse_args(argv)


def test_report_reads_decision_logs_and_draws_plots(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    log = tmp_path / "decisions.json"
    recorded = Decision(
        kernel="pkg.mod:k2",
        key=Key({"n": 8}),
        signature="BLOCK=64, num_warps=1, num_stages=3",
        source="recorded",
        config={},
        arch="sm90",
        timings={
            "candidates": {
                "BLOCK=64, num_warps=1, num_stages=3": [1.0, 0.9, 1.1],
                "BLOCK=128, num_warps=2, num_stages=3": [1.01, 0.95, 1.2],
                "BLOCK=512, num_warps=8, num_stages=3": [float("inf")] * 3,
            }
        },
    )
    write_decisions(log, tiny_records() + [recorded])
    plots = tmp_path / "plots"
    assert run_report(_parse([str(log), "--plot", str(plots)])) == 0
    printed = capsys.readouterr().out
    assert "k2" in printed and "median ms" in printed
    pngs = sorted(plots.iterdir())
    assert len(pngs) == 3  # one per decision: the key tuned on rank 0 and rank 1, and the recorded one
    for png in pngs:
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000


def test_report_on_an_unreadable_input_fails_cleanly(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert run_report(_parse([str(bad)])) == 2
    assert "cannot read" in capsys.readouterr().err


def test_plotting_without_matplotlib_says_how_to_install(monkeypatch: MonkeyPatch, tmp_path: Path) -> None:
    from megatron_tuning.commands import report

    no_matplotlib(monkeypatch)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        report.plot_decision(tiny_records()[0], tmp_path / "x.png")


# -- hostile or malformed input: exit 2 with one line naming the file, never a traceback; plots
# stay inside --plot DIR whatever the kernel ids say.
SIG = "BLOCK=64, num_warps=1, num_stages=3"


def _tuned(**changes: Any) -> Decision:
    fields: dict[str, Any] = {
        "kernel": "pkg.mod:k",
        "key": Key({"n": 8}),
        "signature": SIG,
        "source": "tuned",
        "timings": {"candidates": {SIG: [1.0, 0.9, 1.1]}, "tied": [SIG], "tie_band": 0.02, "unit": "ms"},
    }
    fields.update(changes)
    return Decision(**fields)


def _report(capsys: CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    from megatron_tuning.commands import main

    code = main(["report", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("timings", "problem"),
    [
        ([], "timings must be an object"),
        ({"candidates": []}, "timings.candidates must be an object"),
        ({"candidates": {SIG: "fast"}}, "must be a number"),
        ({"candidates": {SIG: [1.0]}, "tie_band": "wide"}, "tie_band"),
        ({"candidates": {SIG: [float("nan")]}}, "must be a number"),
        ({"candidates": {SIG: [1.0]}, "tied": "all"}, "timings.tied"),
    ],
)
def test_malformed_timings_exit_2_naming_the_file(capsys, tmp_path, timings, problem):
    path = tmp_path / "r.tuning.json"
    write_decisions(path, [_tuned(timings=timings)])
    code, _, err = _report(capsys, path, "--plot", tmp_path / "plots")
    assert code == 2 and problem in err and str(path) in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "problem"),
    [("[" * 100_000, "RecursionError"), ('{"format": "something"}', "not a megatron_tuning decision log")],
)
def test_a_file_that_is_not_a_decision_log_exits_2(capsys, tmp_path, text, problem):
    path = tmp_path / "x.json"
    path.write_text(text)
    code, _, err = _report(capsys, path)
    assert code == 2 and problem in err and str(path) in err


def test_plots_stay_inside_their_folder(capsys, tmp_path, recwarn):
    pytest.importorskip("matplotlib")
    outside = tmp_path / "outside"
    outside.mkdir()
    decisions = [
        _tuned(kernel="m:../../x", key=Key({"../../y": 1})),
        _tuned(kernel=f"m:{outside}/abs", key=Key({f"{outside}/k": 1})),
        _tuned(kernel="m:\x1b[2Kevil\r", key=Key({"..\\..\\z": 1})),
    ]
    path = tmp_path / "r.tuning.json"
    write_decisions(path, decisions)
    plots = tmp_path / "deep" / "plots"
    code, out, err = _report(capsys, path, "--plot", plots)
    assert code == 0, err
    written = sorted(p.name for p in plots.iterdir())
    assert len(written) == 3 and all(name.endswith(".png") and "/" not in name for name in written)
    everything = {p for p in tmp_path.rglob("*") if p.is_file()}
    assert everything == {path} | {plots / name for name in written}
    assert "\x1b" not in out
    # a control character in a name is escaped on the plot too (matplotlib warns of a missing glyph)
    assert not [w for w in recwarn if "Glyph" in str(w.message)]


def test_the_results_writer_refuses_a_fifo(tmp_path):
    from megatron_tuning.core.errors import TableError

    fifo = tmp_path / "r.tuning.json"
    os.mkfifo(fifo)
    with pytest.raises(TableError, match="Decision log .*FIFO"):
        write_decisions(fifo, [_tuned()])
    assert fifo.is_fifo()
