"""``tune``: run a job armed in tune mode, in a fresh folder (nothing another job left is pooled); each
process writes its ``tuned`` decisions as they happen (``activate``), voted into ``--out`` after it."""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path

from ..core import policy as knobs
from ..core.decisions import Decision, decision_log, get_decisions
from ..core.errors import TableError
from ..core.notices import TuningWarning
from ..tables.files import output_file_problem, output_folder_problem, write_atomic
from ..tables.records import log_triton_version, read_decision_file, recording_table, write_decisions
from ..tables.table import add_entries, load_table
from ..tables.vote import vote_tables
from . import EXIT_USAGE
from .bootstrap import ENV_JOB_DIR, print_progress
from .job import WorkFolder, add_job_argument, command_problem, job_argv, job_command, run_armed, say
from .report import plot_into, require_matplotlib, summary

PROCESS_PREFIX = "tuned-"  # per-process decision logs: tuned-<host>-<pid>.json
WORK_DIR_MARKER = ".megatron_tuning_tune"  # in a --work-dir tune made or adopted: later jobs may use it


class _Refused(Exception):
    """A check before the job failed: the message says why (a usage error, exit 2)."""


def add_tune(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", default="tuned.msgpack", help="table to merge the tuned entries into (.json: the JSON view)"
    )
    parser.add_argument(
        "--results", help="every process's decisions and statistics (default: <out stem>.tuning.json)"
    )
    parser.add_argument("--plot", metavar="DIR", help="also draw one PNG per (kernel, key) here")
    parser.add_argument("--tie-band", type=float, help=_knob_help(knobs.ENV_TUNE_TIE_BAND))
    parser.add_argument("--rounds", type=int, help=_knob_help(knobs.ENV_TUNE_ROUNDS))
    numerics = _knob_help(knobs.ENV_NUMERICS) + "; keeps --out's classes"
    parser.add_argument("--numerics", choices=knobs.NUMERICS, help=numerics)
    parser.add_argument(
        "--work-dir",
        help="keep per-process results (tuned-<host>-<pid>.json: `merge` votes them into a table) in a new "
        "subfolder of this folder for each job (a new or empty folder, or one tune used before; default: "
        "a temp dir, removed)",
    )
    add_job_argument(parser)


def _knob_help(name: str) -> str:
    return f"{knobs.KNOBS[name].doc} (default {knobs.default(name)}; sets {name})"


def run_tune(args: argparse.Namespace) -> int:
    command = job_command(args, "tune", "tune --out t.msgpack -- train.py --steps 3")
    if command is None:
        return EXIT_USAGE
    options = (("tune_rounds", args.rounds), ("tune_tie_band", args.tie_band))
    with warnings.catch_warnings():  # checked now, before the long run; the job's rank 0 gives notices
        warnings.simplefilter("ignore", TuningWarning)
        policy = knobs.TuningPolicy.from_env(**{k: v for k, v in options if v is not None})
    problem = command_problem(job_argv(command), os.environ)
    if problem is not None:
        say("tune", problem[1])
        return problem[0]
    out = Path(args.out)
    args.results = args.results or str(out.with_name(out.name.split(".")[0] + ".tuning.json"))
    try:
        _check_outputs(args)  # written after the job: a path that cannot be written fails now
        work, temporary = _job_folder(args.work_dir)
    except _Refused as exc:
        say("tune", str(exc))
        return EXIT_USAGE
    with WorkFolder(work, _keep_results, temporary=temporary):  # then in --out and --results
        returncode, decisions = _run_job(command, work, policy, args, temporary=temporary)
    if decisions and args.plot:
        plot_into(decisions, args.plot, prog="tune")
    if decisions and returncode:
        message = f"the job exited with status {returncode}; the table holds what it tuned before that"
        print(f"tune: {message}", file=sys.stderr)
    return returncode


def _check_outputs(args: argparse.Namespace) -> None:
    for flag, path in (("--out", Path(args.out)), ("--results", Path(args.results))):
        # A missing folder is created when the file is written: then that folder must be creatable.
        parent = path.parent if str(path.parent) else Path(".")
        problem = output_file_problem(str(path)) if parent.is_dir() else output_folder_problem(str(parent))
        if problem:
            raise _Refused(f"cannot write {flag} {path}: {problem}")
    if os.path.exists(args.out):
        try:  # merged into after the job: a file it could not read would lose the job's work
            load_table(args.out)
        except TableError as exc:
            raise _Refused(f"--out {exc}; name another file, or move this one aside") from None
    if args.plot:
        try:
            require_matplotlib()  # before the long run, not after it
        except ImportError as exc:
            raise _Refused(str(exc)) from None
        problem = output_folder_problem(args.plot)
        if problem:
            raise _Refused(f"cannot write plots into --plot {args.plot}: {problem}")


def _keep_results(work: Path) -> bool:
    """Writing the table failed, or the run was interrupted: what was measured stays on disk."""
    if not any(work.glob(f"{PROCESS_PREFIX}*.json")):
        return False
    table = f"python -m megatron_tuning merge OUT {shlex.quote(str(work))}/{PROCESS_PREFIX}*.json"
    say("tune", f"per-process results kept in {work}; `{table}` votes them into a table")
    return True


def _job_folder(work_dir: str | None) -> tuple[Path, bool]:
    """A fresh folder for this job's files, and whether it is temporary. Under ``--work-dir`` each job
    gets a new subfolder (a job pools only its own results); foreign files are refused, not mixed into."""
    if not work_dir:
        return Path(tempfile.mkdtemp(prefix="megatron_tuning_tune_")), True
    root = Path(work_dir)
    if root.exists() and not root.is_dir():
        raise _Refused(f"--work-dir {root} is not a folder")
    if root.is_dir() and any(root.iterdir()) and not (root / WORK_DIR_MARKER).is_file():
        fix = "name a new or empty folder (each job gets a fresh subfolder of it)"
        raise _Refused(f"--work-dir {root} already holds files tune did not write; {fix}")
    problem = output_folder_problem(str(root))
    if problem:
        raise _Refused(f"cannot use --work-dir {root}: {problem}")
    root.mkdir(parents=True, exist_ok=True)
    if not (root / WORK_DIR_MARKER).is_file():
        marker = b"Per-job folders of `python -m megatron_tuning tune --work-dir`; safe to delete.\n"
        write_atomic(root / WORK_DIR_MARKER, marker)
    return Path(tempfile.mkdtemp(prefix=time.strftime("job-%Y%m%d-%H%M%S-"), dir=root)), False


def _run_job(
    command: list[str], work: Path, policy: knobs.TuningPolicy, args: argparse.Namespace, *, temporary: bool
) -> tuple[int, list[Decision]]:
    """Run the job, pool its per-process results, write ``--results`` and merge into ``--out``."""
    updates = {knobs.ENV_MODE: "tune", knobs.ENV_RECORD_DIR: str(work / "recordings")}
    updates[knobs.ENV_TUNE_ROUNDS] = str(policy.tune_rounds)
    updates[knobs.ENV_TUNE_TIE_BAND] = repr(policy.tune_tie_band)
    if args.numerics:  # --out's entries (if any) are the bits to keep: searched first
        keep = args.out if os.path.exists(args.out) else None
        updates[knobs.ENV_NUMERICS] = args.numerics
        updates[knobs.ENV_TABLE] = ":".join(filter(None, (keep, os.environ.get(knobs.ENV_TABLE))))
    argv = job_argv(command)
    print(f"tune: running {shlex.join(argv)} (per-process results in {work})", file=sys.stderr)
    leftovers = [work] if temporary else []  # removed by the job's watcher should `tune` be killed
    returncode, _ = run_armed(argv, updates, "tune", launcher="tune", folder=work, leftovers=leftovers)
    logs = [read_decision_file(f) for f in sorted(work.glob(f"{PROCESS_PREFIX}*.json"))]
    per_process = [[d for d in log.decisions if d.source == "tuned"] for log in logs]
    decisions = [d for tuned in per_process for d in tuned]
    if not decisions and returncode:  # the job's own error (above) says why: no guess added to it
        print(f"tune: the job exited with status {returncode} before it tuned anything", file=sys.stderr)
        return returncode, []
    if not decisions:
        why = "Did it launch an in-scope autotuned kernel with more than one live config?"
        scope = "(MEGATRON_TUNING_SCOPE limits the scope.)"
        print(f"tune: the job recorded no tuned (kernel, key). {why} {scope}", file=sys.stderr)
        return 1, []
    # Each process's entries carry the Triton it ran, which need not be the one installed here.
    versions = [log_triton_version(log) for log in logs]
    merged = vote_tables(
        [(log.path, recording_table(log.decisions, triton_version=v)) for log, v in zip(logs, versions)]
    )
    pooled = sorted(set(versions), key=str)
    if len(pooled) > 1:
        stamps = "each entry is stamped with its own process's, --results with none"
        print(
            f"tune: the job's processes ran different Tritons ({', '.join(map(str, pooled))}): {stamps}",
            file=sys.stderr,
        )
    for path in (args.results, args.out):  # folders checked creatable before the job
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_decisions(
        args.results,
        decisions,
        triton_version=pooled[0] if len(pooled) == 1 else None,
        processes=[len(tuned) for tuned in per_process],  # `merge` gives each process its vote, as here
    )
    add_entries(args.out, merged.table.entries())
    print(summary(decisions))
    count = len(merged.table)
    entries = f"{count} entr{'y' if count == 1 else 'ies'}"
    print(f"tune: {entries} merged into {args.out}; statistics in {args.results}")
    return returncode, decisions


def start_job_session(prefix: str) -> Path | None:
    """In a ``tune`` or ``audit`` job's process, at ``import triton``: start the session the command's
    variables describe; return this process's result file (``prefix``, host, pid) in the job folder,
    ``None`` where the session failed (said here; the command says so at the end too). The command's
    output, a line per key tuned or audited, goes to stderr; the job's logging is left alone."""
    from .. import session

    directory = os.environ.get(ENV_JOB_DIR)
    if not directory:
        return None
    print_progress("megatron_tuning.tuning.tuner.progress")
    try:
        session.init_deterministic_tuning()
    except Exception as exc:
        print(f"megatron_tuning: could not start the session: {exc!r}", file=sys.stderr)
        return None
    return Path(directory) / f"{prefix}{socket.gethostname()}-{os.getpid()}.json"


def activate() -> None:
    """At ``import triton`` in a ``tune`` job: write this process's tuned decisions as they come
    (a crash loses nothing)."""
    path = start_job_session(PROCESS_PREFIX)
    if path is None:
        return

    def write(decision: Decision) -> None:
        if decision.source == "tuned":
            write_decisions(path, [d for d in get_decisions() if d.source == "tuned"])

    decision_log().add_listener(write)
