"""``enable``/``disable``: the environment switch, round trip, refusals, and a real virtualenv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from pytest import CaptureFixture, MonkeyPatch

from megatron_tuning import commands as cli
from megatron_tuning.commands import launch as enable
from megatron_tuning.commands.bootstrap import PTH_MARKER, PTH_NAME

from .test_run import EVAL

REPO = Path(__file__).resolve().parents[2]


def _main(capsys: CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_enable_and_disable_round_trip_in_a_site_dir(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    site = str(tmp_path)
    pth = tmp_path / PTH_NAME
    code, out, _ = _main(capsys, "enable", "--site-dir", site)
    assert code == 0 and f"wrote {pth}" in out and "MEGATRON_TUNING_MODE=deterministic python" in out
    assert f"disable --site-dir {site}" in out and "is not one of this interpreter's site-packages" in out
    assert pth.read_text().startswith(PTH_MARKER)
    code, out, _ = _main(capsys, "enable", "--site-dir", site)
    assert code == 0 and f"already enabled: {pth} (unchanged)" in out
    code, out, _ = _main(capsys, "disable", "--site-dir", site)
    assert code == 0 and f"removed {pth}" in out and not pth.exists()
    code, out, _ = _main(capsys, "disable", "--site-dir", site)
    assert code == 0 and "nothing to do" in out


def test_enable_rewrites_an_older_switch_of_ours(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    (tmp_path / PTH_NAME).write_text(PTH_MARKER + " from an older version\nimport os\n")
    code, out, _ = _main(capsys, "enable", "--site-dir", str(tmp_path))
    assert code == 0 and f"updated {tmp_path / PTH_NAME}" in out


@pytest.mark.parametrize("command", ["enable", "disable"])
def test_a_file_of_our_name_that_is_not_ours_is_left_alone(
    tmp_path: Path, capsys: CaptureFixture[str], command: str
) -> None:
    foreign = tmp_path / PTH_NAME
    foreign.write_text("/some/path/someone/added\n")
    code, _, err = _main(capsys, command, "--site-dir", str(tmp_path))
    assert code == 2 and "was not written by megatron_tuning; left alone" in err
    assert foreign.read_text() == "/some/path/someone/added\n"


def test_a_site_dir_that_is_not_a_folder_is_refused(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    code, _, err = _main(capsys, "enable", "--site-dir", str(tmp_path / "missing"))
    assert code == 2 and "is not a folder" in err


def test_a_read_only_site_dir_is_refused_with_what_to_do(
    tmp_path: Path, monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]
) -> None:
    # Root writes through permission bits, so the check itself stands in for a read-only mount.
    monkeypatch.setattr(enable, "output_folder_problem", lambda path: f"{path} is not writable")
    code, _, err = _main(capsys, "enable", "--site-dir", str(tmp_path))
    assert code == 2 and f"cannot write {tmp_path}" in err and "--site-dir" in err and "run --" in err
    assert not (tmp_path / PTH_NAME).exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_site_dir_is_refused(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    tmp_path.chmod(0o555)
    try:
        code, _, err = _main(capsys, "enable", "--site-dir", str(tmp_path))
    finally:
        tmp_path.chmod(0o755)
    assert code == 2 and "is not writable" in err


def test_the_switch_in_a_real_virtualenv(tmp_path: Path) -> None:
    """enable (default site dir) -> MEGATRON_TUNING_MODE pins an unedited script -> disable."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # torch, Triton and msgpack come from the test's environment; megatron_tuning is not installed
    # there, so the switch must import the copy it belongs to.
    Path(purelib, "shared.pth").write_text(sysconfig.get_path("purelib") + "\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_") and k != "PYTHONPATH"}
    base.update(TRITON_INTERPRET="1", TRITON_CACHE_DIR=str(tmp_path / "tc"), OMP_NUM_THREADS="1")

    def venv_run(*argv: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [python, *argv], cwd=tmp_path, env={**base, **extra}, capture_output=True, text=True, timeout=240
        )

    done = venv_run("-m", "megatron_tuning", "enable", PYTHONPATH=str(REPO))
    assert done.returncode == 0, done.stderr
    assert f"wrote {Path(purelib) / PTH_NAME}" in done.stdout and "note:" not in done.stdout

    (tmp_path / "evaljob.py").write_text(EVAL)
    log = tmp_path / "d.json"
    done = venv_run("evaljob.py", MEGATRON_TUNING_MODE="deterministic", MEGATRON_TUNING_DECISION_LOG=str(log))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "benchmark calls: 0; library loaded: True" in done.stdout
    decisions = json.loads(log.read_text())["decisions"]
    assert {d["source"] for d in decisions} <= {"cheapest", "nearest"} and len(decisions) == 2
    assert decisions[0]["kernel"] == "__main__:double_kernel"

    probe = "import sys, triton; print('library loaded:', 'megatron_tuning' in sys.modules)"
    assert "library loaded: False" in venv_run("-c", probe).stdout  # mode unset: nothing armed

    done = venv_run("-m", "megatron_tuning", "disable", PYTHONPATH=str(REPO))
    assert done.returncode == 0 and "removed" in done.stdout
    assert not (Path(purelib) / PTH_NAME).exists()
    assert "library loaded: False" in venv_run("-c", probe, MEGATRON_TUNING_MODE="deterministic").stdout
