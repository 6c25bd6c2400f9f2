"""The job a launcher (``run``, ``tune``, ``audit``, ``selftest --``) runs: its words after ``--``, its
argv, and its process: armed, signals passed on, a timeout, its death with the launcher."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

from ..core.errors import printable
from . import EXIT_USAGE, watcher
from .bootstrap import hold_lifeline, job_environment

EXIT_TIMEOUT, EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND = 124, 126, 127  # as timeout(1), the shell, env(1)


def add_job_argument(parser: argparse.ArgumentParser, help: str = "") -> None:
    """The job, everything after ``--`` (dest "job": the top-level parser keeps the command's name)."""
    help = help or "the job to run after `--`: script.py [args], -m mod, python -m mod, torchrun ..."
    parser.add_argument("job", metavar="COMMAND", nargs=argparse.REMAINDER, help=help)


def job_command(args: argparse.Namespace, prog: str, example: str) -> list[str] | None:
    """The job's words after ``--``; ``None``, having said what to type, when none were given."""
    command = list(args.job or [])
    command = command[1:] if command[:1] == ["--"] else command
    if not command:
        hint = f"e.g. `python -m megatron_tuning {example}` (see {prog} --help)"
        print(f"{prog}: give the command to run after `--`, {hint}", file=sys.stderr)
    return command or None


def job_argv(command: Sequence[str]) -> list[str]:
    """The argv to start for ``command``: scripts and ``-m`` get this interpreter; ``python`` and
    ``torchrun`` are those next to it when it has them (its virtualenv's), else PATH's."""
    if command[0].endswith(".py") or command[0] == "-m":
        return [sys.executable, *command]
    beside = os.path.join(os.path.dirname(sys.executable), command[0])
    mine = command[0] in ("python", "python3", "torchrun") and os.access(beside, os.X_OK)
    return [beside if mine else command[0], *command[1:]]


def command_problem(argv: Sequence[str], env: Mapping[str, str]) -> tuple[int, str] | None:
    """``(exit status, message)`` when ``argv`` cannot start, else ``None``; checked up front."""
    program = argv[0]
    if program == sys.executable and len(argv) > 1 and argv[1].endswith(".py"):
        if not os.path.isfile(argv[1]):
            return EXIT_USAGE, f"no such script: {argv[1]}"
        return None if os.access(argv[1], os.R_OK) else (EXIT_USAGE, f"cannot read the script {argv[1]}")
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


def say(prog: str, message: str) -> None:
    """One line to stderr from a launcher, escaped: it quotes the user's words and paths."""
    print(printable(f"{prog}: {message}"), file=sys.stderr)


def run_armed(
    argv: Sequence[str],
    updates: Mapping[str, str],
    prog: str,
    *,
    launcher: str = "run",
    folder: Path | None = None,
    timeout: float | None = None,
    output: IO[bytes] | None = None,
    passed: list[int] | None = None,
    leftovers: Sequence[Path] = (),
) -> tuple[int, int]:
    """Run the job to its end, each Python process armed for ``launcher``, ``updates`` set and
    ``folder`` (default: a temporary one, removed) its job folder. Return the status a shell would
    report (messages prefixed ``prog``) and how many processes raised a ``DivergenceError``, handled
    or not.

    The job dies with this process, even by SIGKILL (a harness's timeout): its first process by a
    parent-death signal, each armed process below it (torchrun's workers) once its bootstrap, the
    lifeline, is let go (``bootstrap.hold_lifeline``), and every process of its group (programs it
    started, Python or not) by its watcher (``job_group``), which also removes the job's
    temporary folder and ``leftovers``. When the first process ends, the rest of its group is killed
    too. Past ``timeout`` seconds all is done on purpose: exit status 124, as timeout(1). ``output``
    gets the job's stdout and stderr; ``passed`` each signal sent to this process while the job ran
    (a launcher of several jobs stops there).
    """
    problem = command_problem(argv, os.environ)
    if problem is not None:
        say(prog, problem[1])
        return problem[0], 0
    work = folder or Path(tempfile.mkdtemp(prefix=f"megatron_tuning_{launcher}_"))
    try:
        env = {**job_environment(work, launcher), **updates}
        held = hold_lifeline(work / "bootstrap" / "sitecustomize.py")
        try:
            with job_group(not _owns_terminal(), [*([] if folder else [work]), *leftovers]) as group:
                try:
                    process = subprocess.Popen(
                        list(argv),
                        env=env,
                        stdout=output,
                        stderr=None if output is None else subprocess.STDOUT,
                        preexec_fn=preexec(group),
                    )
                except (OSError, subprocess.SubprocessError) as exc:  # vanished since the check, a bad #!
                    say(prog, f"cannot run {argv[0]!r}: {getattr(exc, 'strerror', None) or exc}")
                    return (EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_CANNOT_EXECUTE), 0
                code = _wait_passing_signals(process, timeout, group=group, passed=passed)
        finally:
            os.close(held)  # armed processes of the job outside its group (torchrun's workers) die now
        if code is None:  # past the timeout; a first process that is not armed is stopped here
            process.kill()
            process.wait()
        caught = len(list(work.glob("divergence-*")))
    finally:
        if folder is None:
            shutil.rmtree(work, ignore_errors=True)
    if code is None:
        print(f"{prog}: the job ran past {timeout:g} s: stopped it (exit status 124)", file=sys.stderr)
        return EXIT_TIMEOUT, caught
    if code >= 0:
        return code, caught
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    print(f"{prog}: the job was killed by {name} (exit status {128 - code})", file=sys.stderr)
    return 128 - code, caught


class WorkFolder:
    """``with``: a job's folder, removed at the end where ``temporary`` unless the block set ``keep``
    or raised and ``on_failure(path)``, which says where the files are kept, returned true."""

    def __init__(self, path: Path, on_failure: Callable[[Path], bool], *, temporary: bool = True) -> None:
        self.path, self.keep, self._on_failure = path, not temporary, on_failure

    def __enter__(self) -> WorkFolder:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is not None and not self.keep:
            self.keep = self._on_failure(self.path)
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)


PASSED_SIGNALS = frozenset(
    getattr(signal, name) for name in ("SIGINT", "SIGQUIT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
)  # what a launcher passes on to its job


def handle_signals(numbers: Iterable[int], handler: Callable[[int], None]) -> Callable[[], None]:
    """Until the returned function is called, ``handler(number)`` runs for each signal of ``numbers``
    this process gets (between jobs: ``run_armed`` passes them on during one); a no-op outside the
    main thread, where no handler can be set."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    saved = {n: signal.signal(n, lambda number, frame: handler(number)) for n in numbers}

    def restore() -> None:
        for number, previous in saved.items():
            signal.signal(number, previous)

    return restore


def _owns_terminal() -> bool:
    """Whether this process's group is its terminal's foreground group (an interactive shell's)."""
    for fd in (0, 1, 2):
        try:
            return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:  # not a terminal
            continue
    return False


def preexec(group: int | None) -> Callable[[], None] | None:
    """Popen's ``preexec_fn``: the job joins process group ``group`` (``None``: it stays in the
    launcher's); on Linux its first process gets SIGKILL when the launcher dies."""
    linux = sys.platform.startswith("linux")
    if not (linux or group is not None):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl if linux else None
    launcher = os.getpid()

    def arm() -> None:  # in the child, between fork and exec
        if group is not None:
            os.setpgid(0, group)
        if prctl is not None:
            prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG; kept across exec
            if os.getppid() != launcher:  # it died before that line
                os.kill(os.getpid(), signal.SIGKILL)

    return arm


@contextlib.contextmanager
def job_group(own_group: bool, folders: Sequence[Path]) -> Iterator[int | None]:
    """``with``: the process group to start the job in (``preexec``): with ``own_group``, a new one,
    else ``None`` (the launcher's: an interactive shell's, never signalled here). Its watcher, a
    process that outlives this one (``watcher.watch``), leads it, so its id stays the job's
    while the watcher is not reaped; once this process dies (SIGKILL included) the watcher kills
    the group and removes ``folders``. At the end of the block the rest of the group is killed: the
    job is over."""
    command = [sys.executable, "-I", "-S", watcher.__file__, "group" if own_group else "-"]
    watching = subprocess.Popen(
        [*command, *map(str, folders)],
        stdin=subprocess.PIPE,  # the kernel closes this process's end when it dies: the watcher's cue
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,  # it holds no harness's pipe open
        preexec_fn=os.setpgrp if own_group else None,
    )
    try:
        yield watching.pid if own_group else None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(watching.pid, signal.SIGKILL) if own_group else watching.kill()
        watching.wait()
        watching.stdin.close()  # type: ignore[union-attr]


def _wait_passing_signals(
    process: subprocess.Popen[bytes],
    timeout: float | None = None,
    *,
    group: int | None = None,
    passed: list[int] | None = None,
) -> int | None:
    """Wait for the job (``None`` when ``timeout`` seconds pass first), passing on each signal sent to
    the launcher (SIGINT from a scheduler or a notebook, SIGTERM...) once: to the job's process
    ``group``, as a group kill or a terminal would have sent it, else to its first process. A job in
    the launcher's group (no ``group``: it owns the terminal) already got what the terminal sends
    (Ctrl-C, Ctrl-\\, hang-up), which ``si_code`` tells apart from a program's ``kill``; a job of its
    own group got nothing, so every signal is passed on (a harness's group kill too)."""
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "sigtimedwait"):
        try:  # signals can only be taken from the main thread
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
    got = passed if passed is not None else []

    def send(number: int) -> None:
        if process.poll() is None:
            os.killpg(group, number) if group is not None else process.send_signal(number)

    def forward(number: int) -> None:  # delivered to another thread: sender unknown
        got.append(number)
        send(number)

    restore = handle_signals(PASSED_SIGNALS, forward)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_SIGNALS | {signal.SIGCHLD})
    try:
        while process.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            info = signal.sigtimedwait(PASSED_SIGNALS | {signal.SIGCHLD}, min(left, 0.5))
            if info is None or info.si_signo not in PASSED_SIGNALS:
                continue
            got.append(info.si_signo)
            # si_code <= 0: sent by a process (SI_USER, SI_QUEUE, SI_TKILL); > 0: by the kernel (a tty)
            if group is not None or info.si_code <= 0:
                send(info.si_signo)
        while (info := signal.sigtimedwait(PASSED_SIGNALS, 0)) is not None:
            got.append(info.si_signo)  # arrived as the job ended: nobody left to pass them to
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        restore()
    return process.returncode
