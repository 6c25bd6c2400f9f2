"""``python -m megatron_tuning tune -- <command>``: tune a real job, write a table.

``tune`` runs the user's command (a Python script, ``python -m ...`` or a ``torchrun`` job) with
``MEGATRON_TUNING_MODE=tune`` and a bootstrap on ``PYTHONPATH`` that, in every Python process
that imports Triton, installs the interception with the noise-aware tuner and writes each
process's ``tuned`` decisions (with all their samples) to its own file as they happen. After
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
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core.decisions import decision_log, get_decisions
from ..tables.decision_files import write_decisions
from ..tables.files import write_atomic
from ..tuning.results import (
    PROCESS_PREFIX,
    default_results_path,
    format_summary,
    merge_into_table,
    pool_directory,
    write_results,
)
from ..tuning.stats import ENV_ROUNDS, ENV_TIE_BAND, TuneSettings
from .report import plot_records_to

ENV_TUNE_DIR = "MEGATRON_TUNING_TUNE_DIR"

_SITECUSTOMIZE = """\
# Written by `python -m megatron_tuning tune`: turns tune mode on in every Python process of the job.
try:
    from megatron_tuning.commands.tune import bootstrap_process as _mt_bootstrap
    _mt_bootstrap(__file__)
except Exception as _mt_exc:  # never stop the user's program from starting
    import sys as _mt_sys
    print(f"megatron_tuning tune: bootstrap failed: {_mt_exc!r}", file=_mt_sys.stderr)
"""


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
        "--work-dir", default=None, help="keep per-process results here (default: a temp dir)"
    )
    # dest "job", not "command": the top-level parser already keeps the subcommand's name there.
    parser.add_argument(
        "job",
        metavar="COMMAND",
        nargs=argparse.REMAINDER,
        help="the job to run after `--`: script.py [args], python -m mod, torchrun ...",
    )


# --------------------------------------------------------------------------- tune


def run(args: argparse.Namespace) -> int:
    command = list(args.job or [])
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print(
            "tune: give the command to run after `--`, e.g. "
            "`python -m megatron_tuning tune --out t.msgpack -- train.py --steps 3`",
            file=sys.stderr,
        )
        return 2
    settings = TuneSettings.from_env(**_setting_overrides(args))  # validate before the long run
    if args.plot:
        from ..tuning.plotting import require_matplotlib

        try:
            require_matplotlib()  # before the long run, not after it
        except ImportError as exc:
            print(f"tune: {exc}", file=sys.stderr)
            return 2
    temporary = not args.work_dir
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="megatron_tuning_tune_"))
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


def _run_job(
    command: list[str], work: Path, settings: TuneSettings, args: argparse.Namespace
) -> tuple[int, list[dict[str, Any]]]:
    """Run the job, pool its per-process results, write ``--results`` and merge into ``--out``."""
    results_dir = work / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    env = job_environment(work, settings)
    argv = [sys.executable, *command] if command[0].endswith(".py") else command
    print(f"tune: running {' '.join(argv)} (per-process results in {results_dir})", file=sys.stderr)
    try:
        returncode = subprocess.run(argv, env=env, check=False).returncode
    except FileNotFoundError as exc:
        print(f"tune: cannot run {argv[0]!r}: {exc}", file=sys.stderr)
        return 2, []
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


def job_environment(
    work: Path, settings: TuneSettings, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The job's environment: tune mode, where to write, the bootstrap first on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    bootstrap = work / "bootstrap"
    bootstrap.mkdir(parents=True, exist_ok=True)
    write_atomic(bootstrap / "sitecustomize.py", _SITECUSTOMIZE.encode("utf-8"))  # never via a planted link
    package_parent = str(Path(__file__).resolve().parents[2])
    paths = [str(bootstrap), package_parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["MEGATRON_TUNING_MODE"] = "tune"
    env[ENV_TUNE_DIR] = str(work / "results")
    # The session also writes each rank's winners (summary only) there at exit; harmless, and it
    # keeps the session from warning that the winners live only in the decision log.
    env["MEGATRON_TUNING_RECORD_DIR"] = str(work / "recordings")
    env[ENV_ROUNDS] = str(settings.rounds)
    env[ENV_TIE_BAND] = repr(settings.tie_band)
    return env


# --------------------------------------------------------------------------- inside the job


def bootstrap_process(sitecustomize_file: str) -> None:
    """Run from the generated ``sitecustomize``: arm tune mode, then chain any other sitecustomize."""
    _chain_sitecustomize(os.path.dirname(os.path.abspath(sitecustomize_file)))
    if "triton" in sys.modules:
        activate()
    else:
        # Importing Triton (and torch) in every Python process of the job, the torchrun launcher
        # included, would be slow and pointless: wait until the process imports Triton itself.
        sys.meta_path.insert(0, _AfterImport("triton", activate))


def activate() -> None:
    """Install tune mode in this process and persist its tuned decisions as they happen."""
    from .. import session

    directory = os.environ.get(ENV_TUNE_DIR)
    if not directory:
        return
    session.init_deterministic_tuning()  # the policy comes from MEGATRON_TUNING_MODE=tune
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


class _AfterImport:
    """A meta-path finder that runs ``callback`` once module ``name`` has finished importing."""

    def __init__(self, name: str, callback: Any) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, callback = spec.loader, self.callback

        class _Loader:
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def __getattr__(self, attr: str) -> Any:  # everything else: the real loader
                return getattr(loader, attr)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                try:
                    callback()
                except Exception as exc:
                    print(f"megatron_tuning tune: could not enable tune mode: {exc!r}", file=sys.stderr)

        spec.loader = _Loader()  # type: ignore[assignment]
        return spec


def _chain_sitecustomize(own_dir: str) -> None:
    """Import the sitecustomize ours shadows (a venv's or distro's), as if ours were not there."""
    import importlib

    saved = sys.path[:]
    ours = sys.modules.pop("sitecustomize", None)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != own_dir]
        importlib.import_module("sitecustomize")
    except ImportError as exc:
        if exc.name != "sitecustomize":  # it exists but failed: report it, as site.py does
            _report_sitecustomize_error(exc)
    except Exception as exc:  # a broken sitecustomize must not keep tune mode off
        _report_sitecustomize_error(exc)
    finally:
        sys.path[:] = saved
        if ours is not None:
            sys.modules["sitecustomize"] = ours


def _report_sitecustomize_error(exc: BaseException) -> None:
    print(
        f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}",
        file=sys.stderr,
    )
