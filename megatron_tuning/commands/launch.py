"""Start a user's job from a launcher command (``run``, ``tune``) and report how it ended.

Shared by both launchers so they read a command line the same way and end the same way:

* ``add_job_argument`` / ``job_command``: the job is everything after ``--``.
* ``job_argv``: ``script.py args`` and ``-m pkg args`` run with this interpreter; anything else
  (``python ...``, ``torchrun ...``, a program) runs as given, found on ``PATH``.
* ``command_problem``: a missing script or program is reported before anything starts.
* ``run_job``: the job runs as a child process; SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 sent to the
  launcher are passed on to it (Ctrl-C and Ctrl-\\ reach it from the terminal directly, so the
  launcher ignores those while it waits rather than deliver them twice). Its exit status is
  passed through; a death by signal N becomes ``128 + N`` and is named, as a shell does.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

EXIT_USAGE = 2
EXIT_CANNOT_EXECUTE = 126  # as the shell and env(1) report a command that cannot be executed
EXIT_NOT_FOUND = 127  # ... and one that is not found

_FORWARDED = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, name)
)
_IGNORED_WHILE_WAITING = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGQUIT") if hasattr(signal, name)
)


def add_job_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """The job, everything after ``--``; dest "job", not "command": the top-level parser keeps the
    subcommand's name there."""
    parser.add_argument("job", metavar="COMMAND", nargs=argparse.REMAINDER, help=help)


def job_command(args: argparse.Namespace) -> list[str]:
    """The job's words, without the ``--`` that separates them (empty: none given)."""
    command = list(args.job or [])
    return command[1:] if command and command[0] == "--" else command


def job_argv(command: Sequence[str]) -> list[str]:
    """The argv to start for ``command`` (non-empty): scripts and ``-m`` get this interpreter."""
    first = command[0]
    if first.endswith(".py") or first == "-m":
        return [sys.executable, *command]
    return list(command)


def command_problem(argv: Sequence[str], env: Mapping[str, str]) -> tuple[int, str] | None:
    """``(exit status, message)`` when ``argv`` cannot start, else ``None``; checked up front."""
    program = argv[0]
    if program == sys.executable and len(argv) > 1 and argv[1].endswith(".py"):
        script = argv[1]
        if not os.path.isfile(script):
            return EXIT_USAGE, f"no such script: {script}"
        if not os.access(script, os.R_OK):
            return EXIT_USAGE, f"cannot read the script {script}"
        return None
    if os.sep in program:
        if not os.path.exists(program):
            return EXIT_NOT_FOUND, f"no such program: {program}"
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            return EXIT_CANNOT_EXECUTE, f"{program} is not an executable program"
        return None
    if shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        hint = " (a Python script? give its path, e.g. ./job.py)" if "." not in program else ""
        return EXIT_NOT_FOUND, f"command not found on PATH: {program}{hint}"
    return None


def exit_status(returncode: int) -> tuple[int, str | None]:
    """The launcher's own exit status for a job's ``returncode``, and what to say about it."""
    if returncode >= 0:
        return returncode, None
    number = -returncode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return 128 + number, f"the job was killed by {name} (exit status {128 + number})"


def run_job(argv: Sequence[str], env: Mapping[str, str], prog: str) -> int:
    """Run the job to its end; return the status a shell would report for it.

    Messages (a command that cannot start, a death by signal) go to stderr, prefixed ``prog``.
    """
    problem = command_problem(argv, env)
    if problem is not None:
        status, message = problem
        print(f"{prog}: {message}", file=sys.stderr)
        return status
    try:
        process = subprocess.Popen(list(argv), env=dict(env))
    except FileNotFoundError as exc:  # vanished since the check, or a bad #! interpreter
        print(f"{prog}: cannot run {argv[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except OSError as exc:
        print(f"{prog}: cannot run {argv[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_CANNOT_EXECUTE
    with _signals_passed_to(process):
        returncode = process.wait()
    code, note = exit_status(returncode)
    if note:
        print(f"{prog}: {note}", file=sys.stderr)
    return code


@contextmanager
def _signals_passed_to(process: subprocess.Popen[bytes]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can only be set from the main thread: the child still gets terminal signals
        return

    def forward(number: int, frame: object) -> None:
        if process.poll() is None:
            process.send_signal(number)

    saved = {}
    for number in _FORWARDED:
        saved[number] = signal.signal(number, forward)
    for number in _IGNORED_WHILE_WAITING:
        saved[number] = signal.signal(number, signal.SIG_IGN)
    try:
        yield
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)
