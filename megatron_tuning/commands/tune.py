"""``tune`` (tune a job, write a table), ``report`` (print and plot what it measured), and the
in-process side of ``tune`` and ``audit`` (``activate``).

``tune`` runs the job armed in tune mode, in a fresh folder per job so nothing another job left is
pooled. Every process writes its ``tuned`` decisions as they happen; after the job each process's
winners are one table, voted into ``--out`` (``tables.vote.vote_tables``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import textwrap
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..core import policy as knobs
from ..core.decisions import Decision, decision_log, get_decisions
from ..core.errors import TableError, printable
from ..tables.files import output_file_problem, output_folder_problem, write_atomic
from ..tables.records import read_decisions, recording_table, write_decisions
from ..tables.table import add_entries
from ..tables.vote import vote_tables
from ..tuning.stats import TuneSettings
from . import EXIT_USAGE
from .bootstrap import job_environment, write_bootstrap
from .job import add_job_argument, command_problem, job_argv, job_command, run_job

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
        help="keep per-process results in a new subfolder of this folder for each job (a new or empty "
        "folder, or one tune used before; default: a temp dir, removed)",
    )
    add_job_argument(parser)


def _knob_help(name: str) -> str:
    return f"{knobs.KNOBS[name].doc} (default {knobs.KNOBS[name].default}; sets {name})"


def run_tune(args: argparse.Namespace) -> int:
    command = job_command(args, "tune", "tune --out t.msgpack -- train.py --steps 3")
    if command is None:
        return EXIT_USAGE
    overrides = {k: v for k, v in (("rounds", args.rounds), ("tie_band", args.tie_band)) if v is not None}
    settings = TuneSettings.from_env(**overrides)  # validated before the long run
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
        returncode, decisions = _run_job(command, work, settings, args)
    except BaseException:
        # Writing the table failed, or the run was interrupted: what was measured stays on disk.
        if temporary and any((work / "results").glob(f"{PROCESS_PREFIX}*.json")):
            print(f"tune: per-process results kept in {work / 'results'}", file=sys.stderr)
            temporary = False
        raise
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)  # everything kept is in --out and --results now
    if decisions and args.plot:
        plot_into(decisions, args.plot, prog="tune")
    if decisions and returncode:
        message = f"the job exited with status {returncode}; the table holds what it tuned before that"
        print(f"tune: {message}", file=sys.stderr)
    return returncode


def _results_path(args: argparse.Namespace) -> Path:
    out = Path(args.out)
    return Path(args.results) if args.results else out.with_name(out.name.split(".")[0] + ".tuning.json")


def _check_outputs(args: argparse.Namespace) -> None:
    for flag, path in (("--out", Path(args.out)), ("--results", _results_path(args))):
        # A missing folder is created when the file is written: then that folder must be creatable.
        parent = path.parent if str(path.parent) else Path(".")
        problem = output_file_problem(str(path)) if parent.is_dir() else output_folder_problem(str(parent))
        if problem:
            raise _Refused(f"cannot write {flag} {path}: {problem}")
    if args.plot:
        try:
            _require_matplotlib()  # before the long run, not after it
        except ImportError as exc:
            raise _Refused(str(exc)) from None
        problem = output_folder_problem(args.plot)
        if problem:
            raise _Refused(f"cannot write plots into --plot {args.plot}: {problem}")


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
    command: list[str], work: Path, settings: TuneSettings, args: argparse.Namespace
) -> tuple[int, list[Decision]]:
    """Run the job, pool its per-process results, write ``--results`` and merge into ``--out``."""
    results = work / "results"
    results.mkdir()
    bootstrap = write_bootstrap(work / "bootstrap", "tune")
    env = job_environment(bootstrap, "tune")
    env.update({knobs.ENV_MODE: "tune", knobs.ENV_TUNE_DIR: str(results)})
    env.update({knobs.ENV_RECORD_DIR: str(work / "recordings"), knobs.ENV_TUNE_ROUNDS: str(settings.rounds)})
    env[knobs.ENV_TUNE_TIE_BAND] = repr(settings.tie_band)
    if args.numerics:  # --out's entries (if any) are the bits to keep: searched first
        keep = args.out if os.path.exists(args.out) else None
        env[knobs.ENV_NUMERICS] = args.numerics
        env[knobs.ENV_TABLE] = ":".join(filter(None, (keep, env.get(knobs.ENV_TABLE))))
    argv = job_argv(command)
    print(f"tune: running {' '.join(argv)} (per-process results in {results})", file=sys.stderr)
    returncode = run_job(argv, env, "tune", bootstrap)
    logs = [(str(f), read_decisions(f)) for f in sorted(results.glob(f"{PROCESS_PREFIX}*.json"))]
    decisions = [d for _, ds in logs for d in ds if d.source == "tuned"]
    if not decisions:
        why = "Did it launch an in-scope autotuned kernel with more than one live config?"
        scope = "(MEGATRON_TUNING_SCOPE limits the scope.)"
        print(f"tune: the job recorded no tuned (kernel, key). {why} {scope}", file=sys.stderr)
        return returncode or 1, []
    merged = vote_tables([(name, recording_table(ds)) for name, ds in logs])
    write_decisions(_results_path(args), decisions)
    add_entries(args.out, merged.table.entries())
    print(summary(decisions))
    count = len(merged.table)
    entries = f"{count} entr{'y' if count == 1 else 'ies'}"
    print(f"tune: {entries} merged into {args.out}; statistics in {_results_path(args)}")
    return returncode, decisions


def activate() -> None:
    """At ``import triton`` in a ``tune`` or ``audit`` job: start the session, write results as they
    come (a crash loses nothing). A failure is reported and the job goes on: the command says at the
    end when nothing was measured."""
    from .. import session

    directory, audits = knobs.read_knob(knobs.ENV_TUNE_DIR), knobs.read_knob(knobs.ENV_AUDIT_DIR)
    if not (directory or audits):
        return
    try:
        session.init_deterministic_tuning()  # the policy comes from the MEGATRON_TUNING_* the command set
    except Exception as exc:
        print(f"megatron_tuning: could not start the session: {exc!r}", file=sys.stderr)
        return
    name = f"{socket.gethostname()}-{os.getpid()}.json"
    if audits:
        from ..core.identity import arch_tag, current_rank
        from ..runtime import pinning
        from ..tuning.audit import make_audit_hook

        def never_tune(installation: pinning.Installation) -> pinning.Installation:
            # An audit never tunes, also after the job's own init: an ``auto`` miss takes the miss rule.
            if installation.policy.mode != "auto" or installation.measure is None:
                return installation
            return dataclasses.replace(installation, measure=None)

        pinning.before_decision.append(never_tune)

        entries: list[dict[str, Any]] = []

        def record(entry: dict[str, Any]) -> None:
            entries.append({**entry, "arch": arch_tag(), "rank": current_rank()})
            write_atomic(Path(audits) / f"audited-{name}", json.dumps(entries).encode())

        pinning.after_decision.append(make_audit_hook(record, knobs.read_knob(knobs.ENV_AUDIT_RUNS)))
        return
    path = Path(directory) / f"{PROCESS_PREFIX}{name}"

    def write(decision: Decision) -> None:
        if decision.source == "tuned":
            path.parent.mkdir(parents=True, exist_ok=True)
            write_decisions(path, [d for d in get_decisions() if d.source == "tuned"])

    decision_log().add_listener(write)


def add_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="decision logs (tune's --results), or folders of them")
    parser.add_argument("--plot", metavar="DIR", help="draw one PNG per (kernel, key, rank) here")


def run_report(args: argparse.Namespace) -> int:
    decisions: list[Decision] = []
    try:
        for name in args.inputs:
            files = sorted(Path(name).glob("*.json")) if Path(name).is_dir() else [Path(name)]
            for path in files:
                found = [d for d in read_decisions(path) if d.source in ("tuned", "recorded")]
                for d in found:
                    problem = _timings_problem(d.timings)
                    if problem:
                        raise TableError(str(path), f"{d.kernel} [{d.key}]: {problem}", "Tuning results")
                decisions += found
    except TableError as exc:
        print(f"report: cannot read {printable(str(exc))}", file=sys.stderr)
        return 2
    if not decisions:
        print("report: no tuned or recorded timings in the inputs", file=sys.stderr)
        return 1
    print(summary(decisions))
    if args.plot:
        try:
            plot_into(decisions, args.plot, prog="report")
        except ImportError as exc:
            print(f"report: {exc}", file=sys.stderr)
            return 2
    return 0


def _timings_problem(timings: Any) -> str | None:
    """What makes a decision's timings unusable by ``summary`` and the plots (hand-edited logs)."""
    if not isinstance(timings, dict) or not isinstance(timings.get("candidates", {}), dict):
        return "timings.candidates must be an object"
    for signature, value in timings.get("candidates", {}).items():
        values = value if type(value) is list else [value]
        if len(values) > 16 or not all(
            v is None or (type(v) in (int, float) and not math.isnan(v)) for v in values
        ):
            return f"timings.candidates[{signature!r}] must be a number or a list of numbers"
    tied, band = timings.get("tied", []), timings.get("tie_band", 0.0)
    if type(tied) is not list or not all(type(t) is str for t in tied):
        return "timings.tied must be a list of signatures"
    if type(band) not in (int, float) or not 0 <= band < 1:
        return f"timings.tie_band must be a fraction in [0, 1), got {band!r}"
    return None


def summary(decisions: Sequence[Decision]) -> str:
    """A plain-text table: kernel, key, rank, the winner's median, how many tied, the fastest median."""
    lines = [f"{'kernel':<28} {'key':<36} {'rank':>4} {'median ms':>10} {'tied':>4} {'best ms':>9}  winner"]
    for d in decisions:
        timings = d.timings or {}
        candidates = timings.get("candidates", {})
        medians = [v[0] for v in candidates.values() if isinstance(v, list) and v and v[0] is not None]
        win = candidates.get(d.signature) or [None]
        win_ms = f"{win[0]:.4f}" if isinstance(win, list) and win[0] is not None else "-"
        best = f"{min(medians):.4f}" if medians else "-"
        tied = len(timings.get("tied", [d.signature]))
        name = d.kernel.rsplit(":", 1)[-1][:28]
        row = f"{name:<28} {d.key[:36]:<36} {d.rank:>4} {win_ms:>10} {tied:>4} {best:>9}  {d.signature}"
        lines.append(printable(row))
    return "\n".join(lines)


def _require_matplotlib() -> None:
    try:
        import matplotlib.backends.backend_agg  # noqa: F401
        import matplotlib.figure  # noqa: F401
    except ImportError as exc:
        how = "pip install matplotlib (or install megatron_tuning with the [plot] extra)"
        raise ImportError(f"Plotting needs matplotlib: {how}.") from exc


def plot_into(decisions: Sequence[Decision], directory: str, *, prog: str) -> list[Path]:
    """One PNG per decision (candidate medians, p20-p80 bars, the tie band, the winner) under ``directory``.

    File names keep only ``[A-Za-z0-9_]`` of kernel and key (a hand-made log's ``/`` or ``..`` cannot
    place a plot elsewhere), plus a digest so they stay unique."""
    paths = []
    for d in decisions:
        slug = "__".join(
            re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:60] or "x"
            for text in (d.kernel.rsplit(":", 1)[-1], d.key.split("|")[0])
        )
        digest = hashlib.sha256(f"{d.kernel}\n{d.key}\n{d.rank}".encode()).hexdigest()[:10]
        paths.append(plot_decision(d, Path(directory) / f"{slug}__{digest}.png"))
    print(f"{prog}: {len(paths)} plot(s) written to {directory}")
    return paths


def plot_decision(d: Decision, path: Path) -> Path:
    """Draw one decision's candidate timings to ``path`` as a PNG (no pyplot state, no display)."""
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    timings: Mapping[str, Any] = d.timings or {}
    rows, failed = [], []  # rows: (median, p20, p80, signature), fastest first
    for signature, value in timings.get("candidates", {}).items():
        values = [
            math.nan if v is None else float(v) for v in (value if isinstance(value, list) else [value])
        ]
        if values and math.isfinite(values[0]):
            rows.append((values[0], *(values + values[:1] * 2)[1:3], signature))
        else:
            failed.append(signature)
    rows.sort()
    tied, band = set(timings.get("tied", [d.signature])), float(timings.get("tie_band", 0.02))
    height = 2.0 + 0.34 * max(1, len(rows) + len(failed))
    figure = Figure(figsize=(11.0, height), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    green, light = "#1b7837", "#7fbf7b"
    handles = [
        Patch(color=green, label="winner"),
        Patch(color=light, label="tied (lost the static-cost tie-break)"),
    ]
    if rows:
        best = rows[0][0]
        label = f"tie band ({band:.1%} of best median)"
        handles.append(
            axes.axvspan(best, best * (1 + band), color="#fee08b", alpha=0.45, zorder=4, label=label)
        )
        colors = [green if r[3] == d.signature else light if r[3] in tied else "#9e9e9e" for r in rows]
        spread = [[r[0] - r[1] for r in rows], [r[2] - r[0] for r in rows]]
        axes.barh(range(len(rows)), [r[0] for r in rows], xerr=spread, color=colors, height=0.7, capsize=3)
    labels = [("★ " if r[3] == d.signature else "") + r[3] for r in rows] + [f"{s} (failed)" for s in failed]
    axes.set_yticks(range(len(labels)))
    axes.set_yticklabels(labels, fontsize=7)
    axes.invert_yaxis()  # fastest on top
    axes.set_xlabel(f"median time per launch ({timings.get('unit', 'ms')}), bars: p20-p80")
    key_lines = textwrap.wrap(d.key, 120) or [""]
    figure.suptitle("\n".join([f"{d.kernel} (rank {d.rank})", *key_lines]), fontsize=8)
    figure.legend(handles=handles, fontsize=7, ncol=3, loc="lower center")
    figure.tight_layout(rect=(0.0, 0.4 / height, 1.0, 1.0 - (0.2 + 0.14 * len(key_lines)) / height))
    image = io.BytesIO()
    figure.savefig(image, format="png")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, image.getvalue(), error=lambda p, problem: TableError(p, problem, "Plot"))
    return path
