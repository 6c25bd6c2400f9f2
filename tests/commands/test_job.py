"""``commands/job.py``: a job's whole process group ends with its launcher (killed, signalled or
done), its temporary folder with it, and a group the launcher did not make is never signalled."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.commands.test_run import _alive, _env, _script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc: Linux"),
]


def _leaving_a_sleeper(tmp_path: Path, then: str) -> tuple[str, Path]:
    """A job whose first process starts ``sleep`` (no Python: nothing arms it), writes both pids,
    then runs ``then``."""
    pids = tmp_path / "pids"
    job = _script(
        tmp_path,
        f"""
        import os, subprocess, time
        sleeper = subprocess.Popen(["sleep", "600"])
        with open({str(pids)!r} + ".tmp", "w") as f:
            f.write(f"{{os.getpid()}} {{sleeper.pid}}")
        os.rename({str(pids)!r} + ".tmp", {str(pids)!r})
        {then}
        """,
    )
    return job, pids


def _pids(path: Path, launcher: subprocess.Popen[bytes]) -> list[int]:
    deadline = time.monotonic() + 60
    while not path.exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"the job never wrote its pids (launcher status {launcher.poll()})"
    return [int(p) for p in path.read_text().split()]


def _gone(pids: list[int], within_s: float = 2.0) -> list[int]:
    """The pids of ``pids`` still running after ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if _alive(pid)]


def _start(
    tmp_path: Path, *words: str, argv: list[str] | None = None, **popen: object
) -> subprocess.Popen[bytes]:
    env = {**_env(tmp_path), "TMPDIR": str(tmp_path / "tmp")}  # the launcher's folders go there
    (tmp_path / "tmp").mkdir()
    argv = argv or [sys.executable, "-m", "megatron_tuning", *words]
    return subprocess.Popen(argv, env=env, cwd=tmp_path, **popen)  # type: ignore[call-overload, no-any-return]


def killed_launcher_leaves_nothing(tmp_path: Path, command: str) -> None:
    """SIGKILL ``python -m megatron_tuning COMMAND -- <a job that starts a sleep>`` alone, as a
    harness's timeout does: no process of the job and no launcher folder may be left."""
    job, pids_file = _leaving_a_sleeper(tmp_path, "time.sleep(600)")
    launcher = _start(tmp_path, command, "--", job, stdin=subprocess.DEVNULL, start_new_session=True)
    pids = _pids(pids_file, launcher)
    try:
        launcher.kill()
        launcher.wait()
        assert _gone(pids) == [], "the job outlived its launcher"
        deadline = time.monotonic() + 2.0
        while list((tmp_path / "tmp").iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list((tmp_path / "tmp").iterdir()) == []
    finally:
        for pid in filter(_alive, pids):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_launcher_takes_every_process_of_the_jobs_group_and_its_folder(tmp_path: Path) -> None:
    """A harness's timeout SIGKILLs `run` alone. Before, the job's ``sleep`` (a program it started,
    which no lifeline reaches) ran on, reparented to init, and ``megatron_tuning_run_*`` stayed."""
    killed_launcher_leaves_nothing(tmp_path, "run")


@pytest.mark.parametrize("ending", ["a group SIGTERM", "the job's own exit"])
def test_what_the_job_started_ends_with_it(tmp_path: Path, ending: str) -> None:
    """timeout(1) signals the launcher's group: the job's group gets it passed on, ``sleep`` too (it
    got nothing before, and ran on). A job that exits leaving ``sleep`` behind: the job is over."""
    job, pids_file = _leaving_a_sleeper(tmp_path, "time.sleep(600)" if "SIGTERM" in ending else "")
    launcher = _start(tmp_path, "run", "--", job, stdin=subprocess.DEVNULL, start_new_session=True)
    pids = _pids(pids_file, launcher)
    try:
        if "SIGTERM" in ending:
            os.killpg(launcher.pid, signal.SIGTERM)
        assert launcher.wait(timeout=60) == (143 if "SIGTERM" in ending else 0)
        assert _gone(pids) == [], "a process of the job outlived it"
    finally:
        for pid in filter(_alive, pids):
            os.kill(pid, signal.SIGKILL)


def test_in_a_terminals_foreground_the_shells_group_is_never_signalled(tmp_path: Path) -> None:
    """There the job shares the group of the shell's job (Ctrl-C reaches it directly): `run` kills
    no group, so what the job left there is the shell's to stop."""
    job, pids_file = _leaving_a_sleeper(tmp_path, "")
    status = tmp_path / "status"
    master, slave = os.openpty()

    def take_the_terminal() -> None:  # a new session's terminal: its group is the foreground one
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    # The session's leader stays: its exit would hang the terminal up, and SIGHUP its group.
    shell = f"{sys.executable} -m megatron_tuning run -- {job}; echo $? > {status}; sleep 60"
    session = _start(
        tmp_path, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
        preexec_fn=take_the_terminal, argv=["sh", "-c", shell],
    )  # fmt: skip
    os.close(slave)
    pids: list[int] = []
    try:
        pids = _pids(pids_file, session)
        deadline = time.monotonic() + 60
        while not status.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status.read_text().strip() == "0"
        assert os.getpgid(pids[1]) == session.pid  # the shell's group, not one of the job's
        time.sleep(0.5)
        assert _alive(pids[1])
    finally:
        os.close(master)
        os.killpg(session.pid, signal.SIGKILL)
        session.wait()
        for pid in filter(_alive, pids):
            os.kill(pid, signal.SIGKILL)
