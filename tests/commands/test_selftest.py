"""How ``selftest`` judges its chaos run: only a divergence is proof; a run that could not differ is
inconclusive, not "blind" and not a pass; and what the whole report says and keeps. (The real torchrun
runs are in tests_distributed.)"""

from __future__ import annotations

import argparse
import os
import sys
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
    assert ok and "DivergenceError on ranks [0, 1]" in summary
    # How many keys a run reaches before the error stops it varies: a lower bound, and said so.
    assert "at least 1 chaos key(s) could differ (those reached before the error stopped the run)" in summary


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

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parser = argparse.ArgumentParser()
    selftest.add_selftest(parser)
    code = selftest.run_selftest(
        parser.parse_args(["--interpret", "--agreement", agreement]), launch=fake_launch
    )
    printed = capsys.readouterr().out
    assert seen == [("deterministic", agreement), ("chaos", agreement)]
    assert "deterministic PASS" in printed
    if agreement == "store":
        assert code == 0 and list(tmp_path.iterdir()) == []  # left every run's logs in /tmp before
    else:
        (kept,) = tmp_path.iterdir()
        assert code == 1 and "chaos         FAIL" in printed and "blind" in printed
        assert f"results kept in {kept}" in printed


# -- selftest -- <command>: the user's job under run's launcher ---------------------------------


def _fake_job(monkeypatch: pytest.MonkeyPatch, ends: dict[str, tuple[int, int]], noise: int = 0) -> list[str]:
    """``run_armed`` replaced: each mode's run prints ``noise`` traceback lines and ends as ``ends``
    says (exit status, processes that raised DivergenceError)."""
    modes: list[str] = []

    def fake_run_armed(argv: list[str], updates: dict[str, str], prog: str, **job: Any) -> tuple[int, int]:
        mode = updates["MEGATRON_TUNING_MODE"]
        modes.append(mode)
        job["output"].write(b"".join(b"  File 'train.py', line %d, in step\n" % i for i in range(noise)))
        return ends[mode]

    monkeypatch.setattr(selftest, "run_armed", fake_run_armed)
    monkeypatch.setattr(selftest.job, "command_problem", lambda argv, env: None)  # train.py is pretend
    return modes


def _selftest_your_job(*argv: str) -> int:
    from megatron_tuning import commands as cli

    return cli.main(["selftest", *argv, "--", "train.py"])


@pytest.mark.parametrize(
    "chaos, passed, shown",
    [
        (
            (3, 0),
            False,
            "chaos could not fire: no process raised DivergenceError (exit status 3, which is not",
        ),
        ((0, 0), False, "chaos could not fire: no process raised DivergenceError (exit status 0"),
        ((1, 2), True, "2 process(es) raised DivergenceError (exit status 1): the check fired"),
        ((0, 1), True, "1 process(es) raised DivergenceError (exit status 0): the check fired"),  # caught
    ],
)
def test_your_job_passes_only_on_a_divergence_raised_in_the_chaos_run(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    chaos: tuple[int, int],
    passed: bool,
    shown: str,
) -> None:
    """A job exiting 3 in chaos mode used to pass: the status is the job's to choose, not proof."""
    modes = _fake_job(monkeypatch, {"deterministic": (0, 0), "chaos": chaos})
    code = _selftest_your_job("--keep", str(tmp_path))
    out = capsys.readouterr().out
    assert modes == ["deterministic", "chaos"]
    assert "deterministic PASS  exited 0, no divergence" in out and shown in out, out
    assert code == (0 if passed else 1) and ("chaos         PASS" in out) == passed


def test_your_job_must_agree_in_the_deterministic_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    modes = _fake_job(monkeypatch, {"deterministic": (0, 1), "chaos": (3, 2)})
    assert _selftest_your_job("--keep", str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert modes == ["deterministic"]  # no chaos run to prove anything after that
    assert "deterministic FAIL  1 process(es) raised DivergenceError: ranks launched different configs" in out


def test_a_passing_selftest_of_your_job_prints_a_summary_and_keeps_each_runs_output(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Ranks' tracebacks (124-169 lines) made a passing CI log look failed: they go to a folder."""
    _fake_job(monkeypatch, {"deterministic": (0, 0), "chaos": (1, 2)}, noise=150)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert _selftest_your_job() == 0
    out, err = capfd.readouterr()
    (logs,) = tmp_path.iterdir()
    assert "File 'train.py'" not in out + err and len((out + err).splitlines()) <= 5, out + err
    assert "selftest passed" in out and f"Each run's full output: {logs}" in out
    for mode in ("deterministic", "chaos"):
        assert (logs / f"{mode}.log").read_text().count("File 'train.py'") == 150


def test_a_failing_run_of_your_job_shows_the_tail_of_its_output(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_job(monkeypatch, {"deterministic": (1, 0), "chaos": (1, 2)}, noise=150)
    assert _selftest_your_job("--keep", str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "deterministic FAIL  exited 1; it must exit 0 first" in out
    assert "line 149, in step" in out and "line 124, in step" not in out  # the last 25 lines
    assert f"selftest FAILED. Each run's full output: {tmp_path}" in out


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux")
def test_the_timeout_stops_a_hung_job_and_its_armed_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--timeout was ignored with `-- <command>`: a hung job hung selftest. Now each run has it, and
    the whole job stops there, a grandchild in a session of its own (as torchrun's workers) too."""
    import time

    from megatron_tuning import commands as cli
    from tests.commands.test_run import _alive

    pid = tmp_path / "grandchild"
    job = tmp_path / "hangs.py"
    job.write_text(
        "import subprocess, sys, time\n"
        "sleeper = [sys.executable, '-c', 'import time; time.sleep(600)']\n"
        "child = subprocess.Popen(sleeper, start_new_session=True)\n"
        f"open({str(pid)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(20)\n"  # before: each run waited for it, and selftest took 40 s to say "FAILED"
    )
    start = time.monotonic()
    code = cli.main(["selftest", "--timeout", "3", "--keep", str(tmp_path / "logs"), "--", str(job)])
    took = time.monotonic() - start
    out, err = capsys.readouterr()
    grandchild = int(pid.read_text())
    try:
        assert code == 1 and took < 30, (took, out, err)
        assert "deterministic FAIL  exited 124; it must exit 0 first" in out
        assert "selftest: the job ran past 3 s: stopped it (exit status 124)" in err
        deadline = time.monotonic() + 2.0
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild), "the job's grandchild outlived the timeout"
    finally:
        if _alive(grandchild):
            os.kill(grandchild, 9)


def _tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment holds ``MT_TEST_TAG=tag``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"MT_TEST_TAG={tag}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and the parent-death signal")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_the_builtin_job_dies_with_a_killed_selftest(tmp_path: Path, how: str) -> None:
    """A harness's timeout kills `selftest --nproc 2`: torchrun and its ranks must not outlive it."""
    import signal
    import subprocess
    import time

    tag = f"{os.getpid()}-{how}"
    env = {**os.environ, "MT_TEST_TAG": tag, "TMPDIR": str(tmp_path)}
    process = subprocess.Popen(
        [sys.executable, "-m", "megatron_tuning", "selftest", "--nproc", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(_tagged(tag)) < 4 and time.monotonic() < deadline:  # selftest, torchrun, 2 ranks
            time.sleep(0.1)
        assert len(_tagged(tag)) >= 4, "the selftest job never started"
        process.send_signal(getattr(signal, how))
        assert process.wait(timeout=30) == (-9 if how == "SIGKILL" else 143)
        # Tied to it: gone in moments (10 s allows a loaded machine), not when a store call fails.
        deadline = time.monotonic() + 10
        while _tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _tagged(tag) == []
        assert list(tmp_path.glob("megatron_tuning_selftest_*")) == []  # its temp root went too
    finally:
        for pid in _tagged(tag):
            os.kill(pid, signal.SIGKILL)


def test_a_job_command_that_is_not_found_exits_127_as_run_does(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_tuning import commands as cli

    assert cli.main(["selftest", "--", "/no/such/command"]) == 127
    assert "no such program: /no/such/command" in capsys.readouterr().err
