"""``python -m megatron_tuning tune -- <command>``: tune a real job, write a table.

``tune`` runs the user's command (a Python script, ``python -m ...`` or a ``torchrun`` job) with
``MEGATRON_TUNING_MODE=tune`` and the shared bootstrap (``commands/bootstrap.py``, as ``run``) on
``PYTHONPATH`` that, in every Python process that imports Triton, installs the interception with
the noise-aware tuner and writes each process's ``tuned`` decisions (with all their samples) to
its own file as they happen. Each job works in a fresh folder of its own (under ``--work-dir``,
or a temporary one), so nothing an earlier job or anyone else left there is pooled or run. After
the command ends the per-process results are pooled per (arch, kernel, key), so ranks that
tuned the same shape collapse into one answer, and merged into the ``--out`` table, together
with a results file that keeps every candidate's statistics for review and plotting.
Pooling and merging live in ``tuning.results``; ``report`` prints and plots the statistics.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..core.decisions import decision_log, get_decisions
from ..core.policy import (
    ENV_MODE,
    ENV_RECORD_DIR,
    ENV_TUNE_DIR,
    ENV_TUNE_ROUNDS,
    ENV_TUNE_TIE_BAND,
    read_knob,
)
from ..tables.decision_files import write_decisions
from ..tables.files import output_file_problem, output_folder_problem, write_atomic
from ..tuning.results import (
    PROCESS_PREFIX,
    default_results_path,
    format_summary,
    merge_into_table,
    pool_directory,
    write_results,
)
from ..tuning.stats import TuneSettings
from .bootstrap import job_environment, write_bootstrap
from .launch import EXIT_USAGE, add_job_argument, command_problem, job_argv, job_command, run_job
from .report import plot_records_to

WORK_DIR_MARKER = ".megatron_tuning_tune"
"""Written into a ``--work-dir`` that tune created or adopted (empty): later jobs may use it too."""


class _Refused(Exception):
    """A check before the job failed: the message says why (a usage error, exit 2)."""


# --------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        default="tuned.msgpack",
        help="table to merge the tuned entries into (msgpack; .json for the JSON view)",
    )
    parser.add_argument(
        "--results",
        default=None,
        help="where to write every candidate's statistics (default: <out stem>.tuning.json)",
    )
    parser.add_argument(
        "--plot", metavar="DIR", default=None, help="also draw one PNG per (kernel, key) here"
    )
    parser.add_argument(
        "--tie-band",
        type=float,
        default=None,
        help="candidates within this fraction of the best median are tied (default 0.02)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per candidate (default 10)")
    parser.add_argument(
        "--work-dir",
        default=None,
        help="keep per-process results in a new subfolder of this folder for each job "
        "(a new or empty folder, or one tune used before; default: a temp dir, removed)",
    )
    add_job_argument(
        parser, "the job to run after `--`: script.py [args], -m mod, python -m mod, torchrun ..."
    )


# --------------------------------------------------------------------------- tune


def run(args: argparse.Namespace) -> int:
    command = job_command(args)
    if not command:
        print(
            "tune: give the command to run after `--`, e.g. "
            "`python -m megatron_tuning tune --out t.msgpack -- train.py --steps 3`",
            file=sys.stderr,
        )
        return EXIT_USAGE
    settings = TuneSettings.from_env(**_setting_overrides(args))  # validate before the long run
    problem = command_problem(job_argv(command), os.environ)
    if problem is not None:
        print(f"tune: {problem[1]}", file=sys.stderr)
        return problem[0]
    try:
        _check_outputs(args)  # written after the job: a path that cannot be written fails now
        work, temporary = _job_folder(args.work_dir)
    except _Refused as exc:
        print(f"tune: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        returncode, records = _run_job(command, work, settings, args)
    except BaseException:
        # Writing the table failed, or the run was interrupted: what was measured stays on disk.
        if temporary and any((work / "results").glob(f"{PROCESS_PREFIX}*.json")):
            print(f"tune: per-process results kept in {work / 'results'}", file=sys.stderr)
            temporary = False
        raise
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)  # everything kept is in --out and --results now
    if records and args.plot:
        plot_records_to(records, args.plot, prog="tune")
    if records and returncode:
        print(
            f"tune: the job exited with status {returncode}; the table holds what it tuned before that",
            file=sys.stderr,
        )
    return returncode


def _check_outputs(args: argparse.Namespace) -> None:
    out = Path(args.out)
    results = Path(args.results) if args.results else default_results_path(out)
    for flag, path in (("--out", out), ("--results", results)):
        # A missing folder is created when the file is written: then that folder must be creatable.
        parent = path.parent if str(path.parent) else Path(".")
        problem = output_file_problem(str(path)) if parent.is_dir() else output_folder_problem(str(parent))
        if problem:
            raise _Refused(f"cannot write {flag} {path}: {problem}")
    if args.plot:
        from ..tuning.plotting import require_matplotlib

        try:
            require_matplotlib()  # before the long run, not after it
        except ImportError as exc:
            raise _Refused(str(exc)) from None
        problem = output_folder_problem(args.plot)
        if problem:
            raise _Refused(f"cannot write plots into --plot {args.plot}: {problem}")


def _job_folder(work_dir: str | None) -> tuple[Path, bool]:
    """A fresh folder for this job's files, and whether it is temporary (removed at the end).

    Under ``--work-dir`` each job gets a new subfolder, so a second job pools only its own
    results; a folder that holds files tune did not write is refused, not mixed into.
    """
    if not work_dir:
        return Path(tempfile.mkdtemp(prefix="megatron_tuning_tune_")), True
    root = Path(work_dir)
    if root.exists() and not root.is_dir():
        raise _Refused(f"--work-dir {root} is not a folder")
    if root.is_dir() and any(root.iterdir()) and not (root / WORK_DIR_MARKER).is_file():
        raise _Refused(
            f"--work-dir {root} already holds files tune did not write; name a new or empty folder "
            "(each job gets a fresh subfolder of it)"
        )
    problem = output_folder_problem(str(root))
    if problem:
        raise _Refused(f"cannot use --work-dir {root}: {problem}")
    root.mkdir(parents=True, exist_ok=True)
    if not (root / WORK_DIR_MARKER).is_file():
        write_atomic(
            root / WORK_DIR_MARKER,
            b"Per-job folders of `python -m megatron_tuning tune --work-dir`; safe to delete.\n",
        )
    job = tempfile.mkdtemp(prefix=time.strftime("job-%Y%m%d-%H%M%S-"), dir=root)
    return Path(job), False


def _run_job(
    command: list[str], work: Path, settings: TuneSettings, args: argparse.Namespace
) -> tuple[int, list[dict[str, Any]]]:
    """Run the job, pool its per-process results, write ``--results`` and merge into ``--out``."""
    results_dir = work / "results"
    results_dir.mkdir()
    env = tune_environment(work, settings)
    argv = job_argv(command)
    print(f"tune: running {' '.join(argv)} (per-process results in {results_dir})", file=sys.stderr)
    returncode = run_job(argv, env, prog="tune")
    records = pool_directory(results_dir, settings)
    if not records:
        print(
            "tune: the job recorded no tuned (kernel, key). Did it launch an in-scope autotuned kernel "
            "with more than one live config? (MEGATRON_TUNING_SCOPE limits the scope.)",
            file=sys.stderr,
        )
        return returncode or 1, []
    out = Path(args.out)
    results_path = Path(args.results) if args.results else default_results_path(out)
    write_results(results_path, records)
    written = merge_into_table(out, records)
    print(format_summary(records))
    print(
        f"tune: {written} entr{'y' if written == 1 else 'ies'} merged into {out}; "
        f"statistics in {results_path}"
    )
    return returncode, records


def _setting_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if getattr(args, "rounds", None) is not None:
        overrides["rounds"] = args.rounds
    if getattr(args, "tie_band", None) is not None:
        overrides["tie_band"] = args.tie_band
    return overrides


def tune_environment(work: Path, settings: TuneSettings) -> dict[str, str]:
    """The job's environment: tune mode, where to write, the bootstrap (written into ``work``)."""
    env = job_environment(write_bootstrap(work / "bootstrap", "tune"), "tune")
    env[ENV_MODE] = "tune"
    env[ENV_TUNE_DIR] = str(work / "results")
    # The session also writes each rank's winners (summary only) there at exit; harmless, and it
    # keeps the session from warning that the winners live only in the decision log.
    env[ENV_RECORD_DIR] = str(work / "recordings")
    env[ENV_TUNE_ROUNDS] = str(settings.rounds)
    env[ENV_TUNE_TIE_BAND] = repr(settings.tie_band)
    return env


# --------------------------------------------------------------------------- inside the job


def activate() -> None:
    """Install tune mode in this process and persist its tuned decisions as they happen.

    Called by the bootstrap at the process's ``import triton``. A failure is reported and the
    process goes on untuned: the job's own work matters more than one process's measurements,
    and ``tune`` says at the end when nothing was tuned.
    """
    from .. import session

    directory = read_knob(ENV_TUNE_DIR)
    if not directory:
        return
    try:
        session.init_deterministic_tuning()  # the policy comes from MEGATRON_TUNING_MODE=tune
    except Exception as exc:
        print(f"megatron_tuning tune: could not enable tune mode: {exc!r}", file=sys.stderr)
        return
    path = Path(directory) / f"{PROCESS_PREFIX}{socket.gethostname()}-{os.getpid()}.json"
    decision_log().add_listener(_ResultWriter(path))


class _ResultWriter:
    """Rewrites this process's file at each new tuned decision, so a crash loses nothing measured."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, decision: Any) -> None:
        if decision.source != "tuned":
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_decisions(self.path, [d for d in get_decisions() if d.source == "tuned"])
