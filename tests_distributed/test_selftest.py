"""``python -m megatron_tuning selftest``: passes on a working install, fails when the check is blind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _launch import gloo_available, run_bounded


def _selftest(tmp_path: Path, *extra: str, timeout_s: float = 200.0) -> subprocess.CompletedProcess[str]:
    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    command = [
        sys.executable,
        "-m",
        "megatron_tuning",
        "selftest",
        "--nproc",
        "2",
        "--timeout",
        "90",
        "--keep",
        str(tmp_path / "kept"),
        *extra,
    ]
    return run_bounded(command, tmp_path, timeout_s, "selftest", merge_stderr=True)


def test_selftest_passes_and_reports_both_runs(tmp_path: Path) -> None:
    done = _selftest(tmp_path)
    assert done.returncode == 0, done.stdout
    assert "deterministic PASS" in done.stdout
    assert "chaos         PASS  DivergenceError on ranks [0, 1]" in done.stdout
    assert "for megatron_tuning.kernels:" in done.stdout
    assert (tmp_path / "kept" / "chaos" / "rank1.json").exists()


def test_selftest_fails_when_the_check_is_off(tmp_path: Path) -> None:
    done = _selftest(tmp_path, "--agreement", "off")
    assert done.returncode == 1, done.stdout
    assert "deterministic PASS" in done.stdout
    assert "chaos         FAIL" in done.stdout and "blind" in done.stdout


@pytest.mark.parametrize("chaos_detected", [True, False])
def test_selftest_removes_its_temp_dir_unless_a_run_failed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], chaos_detected: bool
) -> None:
    import argparse
    import tempfile

    from megatron_tuning.commands import selftest

    def fake_launch(args: argparse.Namespace, mode: str, folder: str, interpret: bool) -> dict[str, Any]:
        os.makedirs(folder, exist_ok=True)
        Path(folder, "torchrun.log").write_text("log")
        error = {"error": "DivergenceError", "message": "m", "kernel": "k", "key": "x"}
        chaos = error if chaos_detected else {}
        decisions = [["k", "x", "sig", "table"]]
        ranks = {
            r: ({"decisions": decisions, "shared": 1} if mode == "deterministic" else chaos) for r in (0, 1)
        }
        return {"returncode": 0, "output": "", "ranks": ranks, "seconds": 0.0}

    monkeypatch.setattr(selftest, "_launch", fake_launch)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parser = argparse.ArgumentParser()
    selftest.add_selftest(parser)
    code = selftest.run_selftest(parser.parse_args(["--interpret"]))
    printed = capsys.readouterr().out
    if chaos_detected:
        assert code == 0 and list(tmp_path.iterdir()) == []  # left every run's logs in /tmp before
    else:
        (kept,) = tmp_path.iterdir()
        assert code == 1 and f"results kept in {kept}" in printed
