"""``audit``: which configs of a job's kernels give bit-identical outputs (``tuning/audit.py``); and
its side inside the job's processes (``activate``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..core import policy as knobs
from ..core.errors import MegatronTuningError
from ..tables.files import output_file_problem, write_atomic
from . import EXIT_USAGE
from .job import WorkFolder, add_job_argument, command_problem, job_argv, job_command, run_armed
from .launch import validated_policy
from .tune import start_job_session

AUDIT_MODES = ("deterministic", "auto")


def add_audit(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a job unedited, pinned as `run` pins it. At each (kernel, key) it reaches, launch every live "
        "config --runs times on the job's own inputs and report which configs give bit-identical outputs "
        "(numerics classes) and which differ from run to run on their own. docs/numerics.md"
    )
    parser.add_argument(
        "--runs", type=int, help=f"launches per config (default {knobs.default(knobs.ENV_AUDIT_RUNS)})"
    )
    mode = f"pin as this mode would (auto: from its cache and tables, never tuning); default {knobs.ENV_MODE}"
    parser.add_argument("--mode", choices=AUDIT_MODES, help=f"{mode} if set, else deterministic")
    parser.add_argument("--out", default="audit.json", help="the JSON report (default audit.json)")
    parser.add_argument("--table", help="pin from this table first, and record the audit in its entries")
    add_job_argument(parser)


def run_audit(args: argparse.Namespace) -> int:
    from ..tuning.audit import audit_table, record_numerics

    command = job_command(args, "audit", "audit --out audit.json -- train.py --steps 3")
    if command is None:
        return EXIT_USAGE
    exported = os.environ.get(knobs.ENV_MODE, "").strip().lower() or None
    mode = args.mode or exported or knobs.default(knobs.ENV_MODE)
    if mode not in AUDIT_MODES:
        why = f"{knobs.ENV_MODE}={exported} is set; audit pins as deterministic or auto: pass --mode"
        print(f"audit: {why}", file=sys.stderr)
        return EXIT_USAGE
    if exported not in (None, mode):
        print(f"audit: --mode {mode} overrides {knobs.ENV_MODE}={exported}", file=sys.stderr)
    updates = {knobs.ENV_MODE: mode}
    if args.runs is not None:
        updates[knobs.ENV_AUDIT_RUNS] = str(args.runs)
    if args.table:
        updates[knobs.ENV_TABLE] = ":".join(filter(None, (args.table, os.environ.get(knobs.ENV_TABLE))))
    runs = validated_policy(updates).audit_runs  # a bad value or table fails now, not in every process
    problem = output_file_problem(args.out) or command_problem(job_argv(command), os.environ)
    if problem:
        print(f"audit: {problem if isinstance(problem, str) else problem[1]}", file=sys.stderr)
        return EXIT_USAGE if isinstance(problem, str) else problem[0]
    with WorkFolder(Path(tempfile.mkdtemp(prefix="megatron_tuning_audit_")), _say_kept) as folder:
        work = folder.path
        job = job_argv(command)  # its folder is removed by the job's watcher should `audit` be killed
        returncode, _ = run_armed(job, updates, "audit", launcher="audit", folder=work, leftovers=[work])
        entries = [e for f in sorted(work.glob("audited-*.json")) for e in json.loads(f.read_text())]
        report = {"format": "megatron_tuning.audit/2", "mode": mode, "runs": runs, "command": command}
        report.update(exit_status=returncode, entries=entries)
        text = json.dumps(report, indent=1, sort_keys=True).encode()
        written, unwritable = Path(args.out), None
        try:
            write_atomic(args.out, text)
        except (OSError, MegatronTuningError) as exc:  # its folder went since the check, a full disk...
            written, unwritable = work / "audit.json", str(exc)  # kept with the per-process reports
            write_atomic(written, text)
            folder.keep = True
    print(audit_table(entries, mode))
    if args.table and entries:
        print(f"audit: numerics recorded in {record_numerics(args.table, entries)} entries of {args.table}")
    if unwritable:
        print(f"audit: cannot write --out {args.out} ({unwritable}); report in {written}", file=sys.stderr)
    if returncode:
        print(
            f"audit: the job exited with status {returncode}; the report has what it audited", file=sys.stderr
        )
    print(f"audit: {len(entries)} (kernel, key) audited; report in {written}")
    return returncode or (1 if unwritable or not entries else 0)


def _say_kept(work: Path) -> bool:
    print(f"audit: stopped; the job's per-process reports are kept in {work}", file=sys.stderr)
    return True


def activate() -> None:
    """At ``import triton`` in an ``audit`` job: audit each new (kernel, key), never tune, and write
    this process's findings as they come."""
    from ..core.identity import arch_tag, current_rank
    from ..runtime import pinning
    from ..tuning.audit import make_audit_hook

    path = start_job_session("audited-")
    if path is None:
        return

    def never_tune(installation: pinning.Installation) -> pinning.Installation:
        # An audit never tunes, also after the job's own init: an ``auto`` miss takes the miss rule.
        tunes = installation.policy.mode == "auto" and installation.measure is not None
        return dataclasses.replace(installation, measure=None) if tunes else installation

    pinning.before_decision.append(never_tune)
    entries: list[dict[str, Any]] = []

    def record(entry: dict[str, Any]) -> None:
        entries.append({**entry, "arch": arch_tag(), "rank": current_rank()})
        write_atomic(path, json.dumps(entries).encode())

    policy = pinning.current_policy()  # the command's, started just now
    runs = policy.audit_runs if policy is not None else knobs.default(knobs.ENV_AUDIT_RUNS)
    pinning.after_decision.append(make_audit_hook(record, runs))
