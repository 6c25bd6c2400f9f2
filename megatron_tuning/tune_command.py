"""``python -m megatron_tuning tune -- <command>`` and ``report``: tune a real job, write a table.

``tune`` runs the user's command (a Python script, ``python -m ...`` or a ``torchrun`` job) with
``MEGATRON_TUNING_MODE=tune`` and a bootstrap on ``PYTHONPATH`` that, in every Python process
that imports Triton, installs the interception with the noise-aware tuner and writes each
process's ``tuned`` decisions (with all their samples) to its own file as they happen. After
the command ends the per-process results are pooled per (arch, kernel, key), so ranks that
tuned the same shape collapse into one answer, and merged into the ``--out`` table, together
with a results file that keeps every candidate's statistics for review and plotting.

``report`` prints (and with ``--plot`` draws) those statistics from a results file, a
decision log (``tuned`` or ``recorded`` decisions) or a folder of per-process results.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .tune_stats import TIMINGS_FORMAT, TuneResult, TuneSettings, pool

logger = logging.getLogger(__name__)

ENV_TUNE_DIR = "MEGATRON_TUNING_TUNE_DIR"
RESULTS_FORMAT = "megatron_tuning.tuning_results"
_PROCESS_PREFIX = "tuned-"

_SITECUSTOMIZE = """\
# Written by `python -m megatron_tuning tune`: turns tune mode on in every Python process of the job.
try:
    from megatron_tuning.tune_command import bootstrap_process as _mt_bootstrap
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


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs",
        nargs="+",
        help="tuning results (*.tuning.json), decision logs, or per-process result folders",
    )
    parser.add_argument("--plot", metavar="DIR", default=None, help="draw one PNG per (kernel, key) here")


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
        from .plotting import require_matplotlib

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
        if temporary and any((work / "results").glob(f"{_PROCESS_PREFIX}*.json")):
            print(f"tune: per-process results kept in {work / 'results'}", file=sys.stderr)
            temporary = False
        raise
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)  # everything kept is in --out and --results now
    if records and args.plot:
        _plot(records, args.plot)
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


def default_results_path(table: Path) -> Path:
    """``tuned.msgpack`` -> ``tuned.tuning.json``: the statistics live next to the table."""
    return table.with_name(table.name.split(".")[0] + ".tuning.json")


def job_environment(
    work: Path, settings: TuneSettings, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The job's environment: tune mode, where to write, the bootstrap first on ``PYTHONPATH``."""
    from .tune_stats import ENV_ROUNDS, ENV_TIE_BAND

    env = dict(os.environ if base is None else base)
    bootstrap = work / "bootstrap"
    bootstrap.mkdir(parents=True, exist_ok=True)
    (bootstrap / "sitecustomize.py").write_text(_SITECUSTOMIZE, encoding="utf-8")
    package_parent = str(Path(__file__).resolve().parent.parent)
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
    from . import session
    from .decisions import decision_log

    directory = os.environ.get(ENV_TUNE_DIR)
    if not directory:
        return
    session.init_deterministic_tuning()  # the policy comes from MEGATRON_TUNING_MODE=tune
    path = Path(directory) / f"{_PROCESS_PREFIX}{socket.gethostname()}-{os.getpid()}.json"
    decision_log().add_listener(_ResultWriter(path))


class _ResultWriter:
    """Rewrites this process's file at each new tuned decision, so a crash loses nothing measured."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, decision: Any) -> None:
        from .decisions import get_decisions, write_decisions

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


# --------------------------------------------------------------------------- pooling and output


def pool_directory(
    directory: str | os.PathLike[str], settings: TuneSettings | None = None
) -> list[dict[str, Any]]:
    """Pool every per-process file under ``directory`` into one record per (arch, kernel, key)."""
    from .decisions import read_decisions

    files = sorted(Path(directory).glob(f"{_PROCESS_PREFIX}*.json"))
    return pool_decisions([d for f in files for d in read_decisions(f)], settings)


def pool_decisions(decisions: Iterable[Any], settings: TuneSettings | None = None) -> list[dict[str, Any]]:
    """Records ``{arch, kernel, key, source_hash, votes, timings}`` sorted by (arch, kernel, key)."""
    groups: dict[tuple[str, str, str], list[Any]] = {}
    for d in decisions:
        ours = isinstance(d.timings, Mapping) and d.timings.get("format") == TIMINGS_FORMAT
        if d.source == "tuned" and ours:
            groups.setdefault((d.arch, d.kernel, d.key), []).append(d)
    records = []
    for (arch, kernel, key), group in sorted(groups.items()):
        # Files are found in no meaningful order; sort so the pooled samples (and so the written
        # results) do not depend on it.
        group.sort(key=lambda d: (d.rank, json.dumps(d.timings, sort_keys=True)))
        result: TuneResult = pool([d.timings for d in group], settings)
        hashes = sorted({d.source_hash for d in group if d.source_hash})
        if len(hashes) > 1:
            logger.warning(
                "kernel %s was tuned with %d different sources; keeping %s", kernel, len(hashes), hashes[0]
            )
        own_votes = sum(1 for d in group if d.signature == result.winner_signature)
        records.append(
            {
                "arch": arch,
                "kernel": kernel,
                "key": key,
                "source_hash": hashes[0] if hashes else None,
                "winner": result.winner_signature,
                "config": result.configs[result.winner],
                "votes": [own_votes, len(group)],
                "timings": result.to_timings(),
            }
        )
    return records


def write_results(path: str | os.PathLike[str], records: Sequence[Mapping[str, Any]]) -> None:
    doc = {"format": RESULTS_FORMAT, "version": 1, "results": list(records)}
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, target)


def read_results(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records from a results file, a decision log, or a folder of per-process results."""
    from .decisions import read_decisions

    source = Path(path)
    if source.is_dir():
        return pool_directory(source)
    doc = json.loads(source.read_text(encoding="utf-8"))
    if isinstance(doc, dict) and doc.get("format") == RESULTS_FORMAT:
        return list(doc["results"])
    decisions = read_decisions(source)
    tuned = pool_decisions(decisions)
    # Record-mode logs carry Triton's own per-candidate timings: show them too, for comparison.
    recorded = [
        {
            "arch": d.arch,
            "kernel": d.kernel,
            "key": d.key,
            "source_hash": d.source_hash,
            "winner": d.signature,
            "config": d.config,
            "votes": [1, 1],
            "timings": dict(d.timings),
        }
        for d in decisions
        if d.source == "recorded" and isinstance(d.timings, Mapping)
    ]
    return tuned + recorded


def merge_into_table(out: str | os.PathLike[str], records: Sequence[Mapping[str, Any]]) -> int:
    """Merge the records' winners into the table at ``out`` (new entries replace old ones)."""
    from .decisions import Decision
    from .recording import entry_from_decision
    from .table import merge_entries
    from .table_entry import entry_with
    from .tableset import installed_triton_version

    version = installed_triton_version()
    entries = []
    for r in records:
        decision = Decision(
            kernel=r["kernel"],
            key=r["key"],
            signature=r["winner"],
            source="tuned",
            config=dict(r["config"]),
            arch=r["arch"],
            source_hash=r.get("source_hash"),
            timings=dict(r["timings"]),
        )
        entry = entry_from_decision(decision, triton_version=version)
        if entry is None:
            continue
        votes = r.get("votes")
        if votes and 0 < votes[0] <= votes[1]:
            entry = entry_with(entry, votes=(int(votes[0]), int(votes[1])))
        tied = r["timings"].get("tied", [])
        if len(tied) > 1:
            entry = entry_with(
                entry,
                note=f"tie-break by static cost among {len(tied)} candidates "
                f"within {r['timings']['tie_band']:.1%}",
            )
        entries.append(entry)
    merge_entries(out, entries)
    return len(entries)


def format_summary(records: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table: kernel, key, winner, its median, how many tied, the fastest's median."""
    lines = [f"{'kernel':<28} {'key':<36} {'median ms':>10} {'tied':>4} {'best ms':>9}  winner"]
    for r in records:
        t = r["timings"]
        cands = t.get("candidates", {})
        medians = [v[0] for v in cands.values() if isinstance(v, list) and v and v[0] is not None]
        win = cands.get(r["winner"]) or [None]
        win_ms = f"{win[0]:.4f}" if isinstance(win, list) and win[0] is not None else "-"
        best = f"{min(medians):.4f}" if medians else "-"
        lines.append(
            f"{r['kernel'].rsplit(':', 1)[-1][:28]:<28} {r['key'][:36]:<36} {win_ms:>10} "
            f"{len(t.get('tied', [r['winner']])):>4} {best:>9}  {r['winner']}"
        )
    return "\n".join(lines)


def _plot(records: Sequence[Mapping[str, Any]], directory: str) -> None:
    from .plotting import plot_records

    paths = plot_records(records, directory)
    print(f"tune: {len(paths)} plot(s) written to {directory}")


# --------------------------------------------------------------------------- report


def run_report(args: argparse.Namespace) -> int:
    records: list[dict[str, Any]] = []
    for name in args.inputs:
        try:
            records.extend(read_results(name))
        except (OSError, ValueError, KeyError) as exc:
            print(f"report: cannot read {name}: {exc}", file=sys.stderr)
            return 2
    if not records:
        print("report: no tuned or recorded timings in the inputs", file=sys.stderr)
        return 1
    print(format_summary(records))
    if args.plot:
        try:
            _plot(records, args.plot)
        except ImportError as exc:
            print(f"report: {exc}", file=sys.stderr)
            return 2
    return 0
