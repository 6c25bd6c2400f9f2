"""How ``selftest`` judges its chaos run: only a divergence is proof; a run that could not differ is
inconclusive, not "blind" and not a pass; and what the whole report says and keeps. (The real torchrun
runs are in tests_distributed.)"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from megatron_tuning.commands import selftest
from megatron_tuning.commands.selftest import _judge

KERNEL = "megatron_tuning.kernels:add_one_kernel"


def _outcome(errors: bool, chaos: str | None) -> dict[str, Any]:
    decisions = [
        [KERNEL, "n=64 | x_ptr:torch.float32", "BLOCK=64, num_warps=4, num_stages=3", "chaos", chaos]
    ]
    ranks: dict[int, dict[str, Any]] = {}
    for rank in (0, 1):
        ranks[rank] = {"decisions": decisions, "error": None}
        if errors:
            ranks[rank].update(
                error="DivergenceError", message="m", kernel=KERNEL, key="n=64", signature_ranks=[0, 1]
            )
    return {"returncode": 0, "ranks": ranks, "seconds": 1.0}


def test_a_divergence_passes_and_counts_the_keys_that_could_differ():
    ok, summary = _judge("chaos", _outcome(errors=True, chaos="differs"), 2)
    assert ok and "DivergenceError on ranks [0, 1]" in summary and "1 chaos key(s) could differ" in summary


def test_no_divergence_where_keys_could_differ_is_blind():
    ok, summary = _judge("chaos", _outcome(errors=False, chaos="first"), 2)
    assert not ok and "the agreement check is blind" in summary


def test_no_divergence_where_no_key_could_differ_is_inconclusive_not_blind():
    ok, summary = _judge("chaos", _outcome(errors=False, chaos="no_other_config"), 2)
    assert not ok and "inconclusive" in summary and "proves nothing" in summary and "blind" not in summary


@pytest.mark.parametrize("agreement", ["store", "off"])
def test_selftest_removes_its_temp_dir_unless_a_run_failed(monkeypatch, tmp_path, capsys, agreement):
    """With the check off, chaos ranks launch different configs unnoticed: the report calls the check
    blind, exits 1 and keeps the logs. (The real torchrun runs: tests_distributed/test_demo.py.)"""
    seen = []

    def fake_launch(args: argparse.Namespace, mode: str, folder: str, interpret: bool) -> dict[str, Any]:
        seen.append((mode, args.agreement))
        os.makedirs(folder, exist_ok=True)
        Path(folder, "torchrun.log").write_text("log")
        if mode == "deterministic":
            ranks = {r: {"decisions": [[KERNEL, "n=64", "BLOCK=64", "table"]], "shared": 1} for r in (0, 1)}
        else:
            ranks = _outcome(errors=agreement != "off", chaos="differs")["ranks"]
        return {"returncode": 0, "output": "", "ranks": ranks, "seconds": 0.0}

    monkeypatch.setattr(selftest, "_launch", fake_launch)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parser = argparse.ArgumentParser()
    selftest.add_selftest(parser)
    code = selftest.run_selftest(parser.parse_args(["--interpret", "--agreement", agreement]))
    printed = capsys.readouterr().out
    assert seen == [("deterministic", agreement), ("chaos", agreement)]
    assert "deterministic PASS" in printed
    if agreement == "store":
        assert code == 0 and list(tmp_path.iterdir()) == []  # left every run's logs in /tmp before
    else:
        (kept,) = tmp_path.iterdir()
        assert code == 1 and "chaos         FAIL" in printed and "blind" in printed
        assert f"results kept in {kept}" in printed
