"""Tuning results: pool per-process tuned decisions per (arch, kernel, key), store and merge them.

Each process of a ``tune`` run writes its ``tuned`` decisions (with every sample) to its own
file; ``pool_directory`` collapses them into one record per (arch, kernel, key), so ranks that
tuned the same shape give one answer. ``merge_into_table`` turns records into table entries.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..core.decisions import Decision
from ..core.errors import TableError
from ..core.warn import printable
from ..tables.decision_files import FORMAT as DECISIONS_FORMAT
from ..tables.decision_files import read_decisions
from ..tables.entry import entry_with
from ..tables.files import read_json_file, write_atomic
from ..tables.recording import entry_from_decision
from ..tables.search import installed_triton_version
from ..tables.table import merge_entries
from .stats import TIMINGS_FORMAT, TuneResult, TuneSettings, pool

logger = logging.getLogger(__name__)

RESULTS_FORMAT = "megatron_tuning.tuning_results"


def _results_error(path: str, problem: str) -> TableError:
    return TableError(path, problem, "Tuning results")


PROCESS_PREFIX = "tuned-"
"""Per-process result files of a tune run are named ``tuned-<host>-<pid>.json``."""


def default_results_path(table: Path) -> Path:
    """``tuned.msgpack`` -> ``tuned.tuning.json``: the statistics live next to the table."""
    return table.with_name(table.name.split(".")[0] + ".tuning.json")


def pool_directory(
    directory: str | os.PathLike[str], settings: TuneSettings | None = None
) -> list[dict[str, Any]]:
    """Pool every per-process file under ``directory`` into one record per (arch, kernel, key)."""
    files = sorted(Path(directory).glob(f"{PROCESS_PREFIX}*.json"))
    return pool_decisions(
        [d for f in files for d in read_decisions(f)], settings, source=os.fspath(directory)
    )


def pool_decisions(
    decisions: Iterable[Any], settings: TuneSettings | None = None, *, source: str = "<decisions>"
) -> list[dict[str, Any]]:
    """Records ``{arch, kernel, key, source_hash, votes, timings}`` sorted by (arch, kernel, key).

    Timings that cannot be pooled (hand-edited or foreign logs) raise ``TableError``
    naming ``source`` and the (kernel, key).
    """
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
        try:
            result: TuneResult = pool([d.timings for d in group], settings)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError) as exc:
            raise _results_error(
                source,
                f"cannot pool the tuned timings of kernel {kernel} key {key} ({type(exc).__name__}: {exc})",
            ) from None
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
    """Write ``records`` as a tuning-results JSON file, atomically (the tables' safe writer)."""
    doc = {"format": RESULTS_FORMAT, "version": 1, "results": list(records)}
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    write_atomic(target, payload.encode("utf-8"), error=_results_error)


def read_results(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records from a results file, a decision log, or a folder of per-process results.

    Anything malformed raises ``TableError`` (or ``DecisionLogError`` for a bad log),
    naming the file and the problem, so ``report`` never shows a traceback.
    """
    source = Path(path)
    name = os.fspath(path)
    if source.is_dir():
        return _checked(pool_directory(source), name)
    doc = read_json_file(source, error=_results_error, what="tuning results file or decision log")
    if isinstance(doc, dict) and doc.get("format") == RESULTS_FORMAT:
        if type(doc.get("results")) is not list:
            raise _results_error(name, "'results' must be a list of records")
        return _checked(doc["results"], name)
    if not (isinstance(doc, dict) and doc.get("format") == DECISIONS_FORMAT):
        raise _results_error(
            name, f"neither a tuning results file ({RESULTS_FORMAT}) nor a decision log ({DECISIONS_FORMAT})"
        )
    decisions = read_decisions(source)
    tuned = pool_decisions(decisions, source=name)
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
    return _checked(tuned + recorded, name)


def _checked(records: list[Any], name: str) -> list[dict[str, Any]]:
    for index, record in enumerate(records):
        problem = record_problem(record)
        if problem is not None:
            raise _results_error(name, f"record {index}: {problem}")
    return records


def record_problem(record: Any) -> str | None:
    """What makes ``record`` unusable by ``format_summary`` and the plots; ``None`` when it is fine."""
    if type(record) is not dict:
        return f"must be an object, got {type(record).__name__}"
    for field in ("arch", "kernel", "key", "winner"):
        if type(record.get(field)) is not str:
            return f"{field} must be a string, got {record.get(field)!r}"
    if type(record.get("config")) is not dict:
        return "config must be an object"
    votes = record.get("votes")
    if votes is not None and not (
        type(votes) is list and len(votes) == 2 and all(type(v) is int for v in votes)
    ):
        return f"votes must be [winner votes, total], got {votes!r}"
    timings = record.get("timings")
    if type(timings) is not dict:
        return f"timings must be an object, got {type(timings).__name__}"
    candidates = timings.get("candidates", {})
    if type(candidates) is not dict:
        return "timings.candidates must be an object"
    for signature, value in candidates.items():
        values = value if type(value) is list else [value]
        if len(values) > 16 or not all(v is None or _is_number(v) for v in values):
            return f"timings.candidates[{signature!r}] must be a number or a list of numbers"
    tied = timings.get("tied", [])
    if type(tied) is not list or not all(type(t) is str for t in tied):
        return "timings.tied must be a list of signatures"
    band = timings.get("tie_band", 0.0)
    if not _is_number(band) or not 0 <= band < 1:
        return f"timings.tie_band must be a fraction in [0, 1), got {band!r}"
    if type(timings.get("unit", "ms")) is not str:
        return "timings.unit must be a string"
    return None


def _is_number(value: Any) -> bool:
    if type(value) is int:
        return abs(value) < 2**63  # float() of a huge JSON integer would overflow later
    return type(value) is float and not math.isnan(value)


def merge_into_table(out: str | os.PathLike[str], records: Sequence[Mapping[str, Any]]) -> int:
    """Merge the records' winners into the table at ``out`` (new entries replace old ones)."""
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
            printable(
                f"{r['kernel'].rsplit(':', 1)[-1][:28]:<28} {r['key'][:36]:<36} {win_ms:>10} "
                f"{len(t.get('tied', [r['winner']])):>4} {best:>9}  {r['winner']}"
            )
        )
    return "\n".join(lines)
