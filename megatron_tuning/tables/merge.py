"""What runs record, and how it becomes one table: decision logs, per-rank recordings, the vote, diffs.

``merge`` and ``tune`` pool recordings through one vote per input for each (arch, kernel, key): the
majority wins, ties go to the lowest median time, static cost, then signature text, so inputs in any
order give the same bytes. Every disagreement is reported: it measures how unstable autotuning was.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from ..core.decisions import Decision, get_decisions
from ..core.errors import TableError
from ..core.fallback import estimate_config_cost
from ..core.identity import config_signature, content_name, current_rank
from .entry import Invalid, Numerics, check_numerics, same_config
from .files import LOCK_TIMEOUT_S, locked, read_json_file, write_atomic
from .search import expand_table_paths, installed_triton_version
from .table import Entry, Table, Timing, entry_with, load_table, save_table, update_table

logger = logging.getLogger(__name__)

DECISIONS_FORMAT = "megatron_tuning.decisions"
RECORDING_PREFIX = "recording-rank"
_HOW = {"recorded": "recorded", "tuned": "tuned", "adopted": "tuned"}
# What ``diff --ignore-provenance`` skips; ``kernel``: the module name of a content match.
_PROVENANCE = ("kernel", "how", "source_hash", "triton_version", "timing", "votes", "note", "numerics")


def write_decisions(path: str | os.PathLike[str], decisions: Iterable[Decision] | None = None) -> None:
    """Write decisions (default: this process's log) as JSON, atomically: what ``coverage`` reads."""
    rows = [d.to_json() for d in (get_decisions() if decisions is None else decisions)]
    doc = {"format": DECISIONS_FORMAT, "version": 1, "decisions": rows}
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=True).encode("utf-8"), error=_log_error)


def read_decisions(path: str | os.PathLike[str]) -> list[Decision]:
    """Read a file ``write_decisions`` wrote; any problem raises one ``TableError`` naming it."""
    name = os.fspath(path)
    data = read_json_file(name, error=_log_error, what="decision log")
    if not isinstance(data, dict) or data.get("format") != DECISIONS_FORMAT:
        raise _log_error(name, "not a megatron_tuning decision log (wrong or missing 'format')")
    rows = data.get("decisions")
    if type(rows) is not list:
        raise _log_error(name, "not a readable decision log ('decisions' must be a list)")
    decisions = []
    for index, row in enumerate(rows):
        problem = _row_problem(row)
        if problem:
            raise _log_error(name, f"decision {index}: {problem}")
        decisions.append(Decision.from_json(row))
    return decisions


def _log_error(path: str, problem: str) -> TableError:
    return TableError(path, problem, "Decision log")


_TEXT_FIELDS = ("kernel", "key", "signature", "source")
_OPTIONAL_TEXT = (
    *("arch", "origin", "source_hash", "config_list_digest"),
    *("nearest_key", "matched_by", "entry_kernel", "chaos"),
)


def _row_problem(row: Any) -> str | None:
    """Why a hand-edited or hostile row cannot be a ``Decision`` (every reader relies on the types)."""
    if type(row) is not dict:
        return f"must be an object, got {type(row).__name__}"
    if unknown := sorted(map(str, row.keys() - Decision.__dataclass_fields__.keys())):
        return f"unknown fields {unknown}"
    for name in _TEXT_FIELDS:
        if type(row.get(name)) is not str:
            return f"{name} must be a string, got {row.get(name)!r}"
    if "rank" in row and type(row["rank"]) is not int:
        return f"rank must be an integer, got {row['rank']!r}"
    if row.get("deterministic") is not None and type(row["deterministic"]) is not bool:
        return f"deterministic must be true, false or null, got {row['deterministic']!r}"
    for name in _OPTIONAL_TEXT:
        if row.get(name) is not None and type(row[name]) is not str:
            return f"{name} must be a string or null, got {row[name]!r}"
    if "config" in row and type(row["config"]) is not dict:
        return f"config must be an object, got {type(row['config']).__name__}"
    if row.get("timings") is not None and type(row["timings"]) is not dict:
        return f"timings must be an object or null, got {type(row['timings']).__name__}"
    return None


def content_ident(entry: Entry) -> tuple[str | None, ...]:
    """What makes entries under different module names one (kernel, key): the id without its module,
    the same source hash and config list. An entry without a source hash is only its own ident."""
    if entry.source_hash is None:
        return entry.ident
    return (entry.arch, content_name(entry.kernel), entry.key, entry.source_hash, entry.config_list_digest)


def entry_from_decision(decision: Decision, *, triton_version: str | None = None) -> Entry | None:
    """The table entry a ``recorded``/``tuned``/``adopted`` decision stands for; ``None`` otherwise."""
    how = _HOW.get(decision.source)
    if how is None or not decision.config:
        return None
    timings = decision.timings if isinstance(decision.timings, Mapping) else {}
    tied, band = timings.get("tied"), timings.get("tie_band")
    note = None
    if isinstance(tied, list) and len(tied) > 1 and isinstance(band, (int, float)):
        note = f"tie-break by static cost among {len(tied)} candidates within {band:.1%}"
    try:  # what a tuner that audited the candidates (``numerics`` policy) left, if usable
        numerics = check_numerics({k: timings["numerics"][k] for k in Numerics._fields[:3]})
    except (Invalid, TypeError, KeyError):
        numerics = None
    return Entry(
        arch=decision.arch,
        kernel=decision.kernel,
        key=decision.key,
        config=dict(decision.config),
        how=how,
        source_hash=decision.source_hash,
        triton_version=triton_version,
        timing=timing_from_decision(decision),
        note=note,
        numerics=numerics,
        config_list_digest=decision.config_list_digest,
    )


def timing_from_decision(decision: Decision) -> Timing | None:
    """The winner's timing statistics from ``{"candidates": {signature: [median, p20, p80] | median}}``
    (the tuner's and Triton's timings) or the flat ``Timing`` fields; anything odd is ignored."""
    raw = decision.timings
    if not isinstance(raw, Mapping):
        return None
    values: dict[str, Any] = {}
    candidates = raw.get("candidates")
    if isinstance(candidates, Mapping) and candidates:
        quantiles = {sig: _quantiles(t) for sig, t in candidates.items()}
        values["candidates"] = len(candidates)
        winner = quantiles.get(decision.signature)
        if winner:
            values["median_ms"] = winner[0]
            if len(winner) >= 3 and winner[2] >= winner[1]:
                values["spread_ms"] = winner[2] - winner[1]
        others = [q[0] for sig, q in quantiles.items() if sig != decision.signature and q]
        if others:
            values["runner_up_ms"] = min(others)
        samples = raw.get("samples")
        if isinstance(samples, Mapping) and isinstance(samples.get(decision.signature), list):
            values["samples"] = len(samples[decision.signature])
    for name in ("median_ms", "spread_ms", "runner_up_ms"):
        if _finite(raw.get(name)) and raw[name] >= 0:
            values[name] = float(raw[name])
    for name in ("samples", "candidates"):
        if type(raw.get(name)) is int and raw[name] >= 0:
            values[name] = raw[name]
    return Timing(**values) if values else None


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _quantiles(timing: Any) -> list[float]:
    # A config that failed to compile or ran out of resources scores inf (or None): it counts as
    # a candidate, never as the runner-up.
    values = list(timing) if isinstance(timing, (list, tuple)) else [timing]
    return [float(v) for v in values] if values and all(_finite(v) and v >= 0 for v in values) else []


def recording_table(
    decisions: Iterable[Decision], *, rank: int | None = None, triton_version: str | None = None
) -> Table:
    """The measured winners in ``decisions`` (first per ident wins), stamped with ``triton_version``."""
    version = triton_version or installed_triton_version()
    table = Table(meta={"kind": "recording"} if rank is None else {"kind": "recording", "rank": str(rank)})
    for decision in decisions:
        entry = entry_from_decision(decision, triton_version=version)
        if entry is not None:
            table.add(entry, replace=False)
    return table


def recording_path(directory: str | os.PathLike[str], rank: int) -> Path:
    return Path(directory) / f"{RECORDING_PREFIX}{int(rank):05d}.msgpack"


def write_recording(
    decisions: Iterable[Decision] | None, directory: str | os.PathLike[str], rank: int | None = None
) -> Path:
    """Write this rank's recorded winners (default: this process's log) to ``recording_path``.
    A recording from an earlier run is updated: new winners replace old ones, the others stay."""
    rank = current_rank() if rank is None else rank
    fresh = recording_table(get_decisions() if decisions is None else decisions, rank=rank)
    os.makedirs(directory, exist_ok=True)
    path = recording_path(directory, rank)

    def mutate(table: Table) -> None:
        table.meta = dict(fresh.meta)
        for entry in fresh.values():
            table.add(entry)

    update_table(path, mutate)
    logger.info("Recorded %d autotune winner(s) for rank %d to %s", len(fresh), rank, path)
    return path


@dataclass(frozen=True, slots=True)
class Vote:
    """The inputs that chose one config for an entry; ``median_ms``: the median of their medians."""

    signature: str
    inputs: tuple[str, ...]
    median_ms: float | None


@dataclass(frozen=True, slots=True)
class Disagreement:
    """An entry for which the inputs chose more than one config; ``votes``: the winner first."""

    arch: str
    kernel: str
    key: str
    votes: tuple[Vote, ...]
    rule: str  # why the winner won: ``majority`` or ``tie: ...``


@dataclass(slots=True)
class MergeResult:
    """The merged table and what the merge found."""

    table: Table
    inputs: list[str]
    disagreements: list[Disagreement] = field(default_factory=list)
    mixed_source_hashes: list[tuple[str, str, str, tuple[str, ...]]] = field(default_factory=list)
    """Entries whose inputs came from different kernel sources: (arch, kernel, key, hashes)."""

    def to_json(self) -> dict[str, Any]:
        def vote(v: Vote) -> dict[str, Any]:
            return {**asdict(v), "inputs": list(v.inputs), "votes": len(v.inputs)}

        return {
            "inputs": self.inputs,
            "entries": len(self.table),
            "disagreements": [
                {**asdict(d), "chosen": d.votes[0].signature, "votes": [vote(v) for v in d.votes]}
                for d in self.disagreements
            ],
            "mixed_source_hashes": [
                {"arch": a, "kernel": k, "key": key, "source_hashes": list(h)}
                for a, k, key, h in self.mixed_source_hashes
            ],
        }


_RULES = ("majority", "tie: lowest median time", "tie: lowest static cost", "tie: signature order")


def merge_tables(inputs: Sequence[tuple[str, Table]]) -> MergeResult:
    """One vote per input (name, table) for each (arch, kernel, key); see the module docstring.
    Entries of one source under several module names vote as one kernel, kept under the first name."""
    names: dict[tuple[str | None, ...], str] = {}
    for entry in (entry for _, table in inputs for entry in table.values()):
        names[content_ident(entry)] = min(names.get(content_ident(entry), entry.kernel), entry.kernel)
    ballots: dict[tuple[str, str, str], dict[str, list[tuple[str, Entry]]]] = {}
    for name, table in inputs:
        for entry in table.values():
            ident = (entry.arch, names[content_ident(entry)], entry.key)
            ballots.setdefault(ident, {}).setdefault(config_signature(entry.config), []).append((name, entry))
    result = MergeResult(table=Table(meta={"kind": "merged"}), inputs=[name for name, _ in inputs])
    for ident in sorted(ballots):
        by_signature = ballots[ident]
        ranked = sorted(_vote(sig, voters) for sig, voters in by_signature.items())
        votes = tuple(vote for _, vote in ranked)
        winner = by_signature[votes[0].signature]
        kept = min(winner, key=_provenance_order)[1]
        # An audit's finding is kept whichever input carried it; any input that saw the config's
        # own launches differ makes it non-deterministic.
        audited = [e.numerics for _, e in sorted(winner, key=_provenance_order) if e.numerics is not None]
        numerics = (
            audited[0]._replace(deterministic=all(n.deterministic for n in audited)) if audited else None
        )
        total = sum(len(v.inputs) for v in votes)
        result.table.add(entry_with(kept, kernel=ident[1], votes=(len(winner), total), numerics=numerics))
        if len(votes) > 1:
            first, second = ranked[0][0], ranked[1][0]
            rule = _RULES[next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)]
            result.disagreements.append(Disagreement(*ident, votes=votes, rule=rule))
        hashes = sorted(
            {e.source_hash for voters in by_signature.values() for _, e in voters if e.source_hash}
        )
        if len(hashes) > 1:
            result.mixed_source_hashes.append((*ident, tuple(hashes)))
    return result


def _vote(signature: str, voters: list[tuple[str, Entry]]) -> tuple[tuple[Any, ...], Vote]:
    """The vote for ``signature`` and its rank key: most votes, lowest median, cost, signature."""
    medians = [e.timing.median_ms for _, e in voters if e.timing and e.timing.median_ms is not None]
    median = statistics.median(medians) if medians else None
    cost = estimate_config_cost(voters[0][1].config)
    rank = (-len(voters), math.inf if median is None else median, cost, signature)
    return rank, Vote(signature, tuple(sorted(name for name, _ in voters)), median)


def _provenance_order(voter: tuple[str, Entry]) -> tuple[float, bytes]:
    # The entry whose provenance is kept: the fastest measurement, then a content order, never
    # the input order (merging the same inputs in any order gives the same bytes).
    median = voter[1].timing and voter[1].timing.median_ms
    return (math.inf if median is None else median, msgpack.packb(voter[1].to_data()))


def merge_files(
    out: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]],
    *,
    timeout_s: float = LOCK_TIMEOUT_S,
) -> MergeResult:
    """Merge recordings/tables (folders: their ``*.msgpack``) into ``out``, replaced atomically. To
    keep what ``out`` holds, list it among ``inputs``: it votes once, and the merge holds its lock."""
    target, inputs = os.fspath(out), list(inputs)
    listed = any(os.path.realpath(os.fspath(p)) == os.path.realpath(target) for p in inputs)
    with locked(target, timeout_s=timeout_s) if listed else contextlib.nullcontext():
        skip = set() if listed else {os.path.realpath(target)}
        loaded = [(n, load_table(n)) for n in expand_table_paths(inputs) if os.path.realpath(n) not in skip]
        if not loaded:  # e.g. a folder holding only an earlier output: never write an empty table
            where = ", ".join(os.fspath(p) for p in inputs)
            raise TableError(where, f"no input tables to merge besides {target}")
        result = merge_tables(loaded)
        save_table(result.table, target)
    if result.disagreements:
        logger.warning(
            "%d of %d merged entries had disagreeing inputs", len(result.disagreements), len(result.table)
        )
    return result


def diff_tables(a: Table, b: Table, *, ignore_provenance: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Entries only in ``a`` (removed), only in ``b`` (added), in both but different (changed: each
    differing field as ``[old, new]``, and a config change's ``numerics`` verdict). An entry of the
    same source under another module name is the same kernel with its ``kernel`` changed."""

    def brief(entry: Entry) -> dict[str, str]:
        return {"arch": entry.arch, "kernel": entry.kernel, "key": entry.key}

    only_b = {content_ident(e): e for e in b.entries() if e.ident not in a}
    pairs = [(old, b.get(*old.ident) or only_b.pop(content_ident(old), None)) for old in a.entries()]
    removed = [dict(brief(old), config=config_signature(old.config)) for old, new in pairs if new is None]
    added = [dict(brief(e), config=config_signature(e.config)) for e in only_b.values()]
    changed = []
    for old, new in pairs:
        if new is None or new == old:
            continue
        fields: dict[str, list[Any]] = {}
        verdict: dict[str, str] = {}
        old_sig, new_sig = config_signature(old.config), config_signature(new.config)
        if not same_config(old.config, new.config):
            fields["config"] = [old_sig, new_sig] if old_sig != new_sig else [old.config, new.config]
            verdict = {"numerics": _numerics_verdict(old, new)}
        if not ignore_provenance:
            before, after = old.to_data(), new.to_data()
            fields.update(
                {n: [before.get(n), after.get(n)] for n in _PROVENANCE if before.get(n) != after.get(n)}
            )
        if fields:
            changed.append(dict(brief(old), fields=fields, **verdict))
    return {"added": added, "removed": removed, "changed": changed}


def _numerics_verdict(old: Entry, new: Entry) -> str:
    a, b = old.numerics, new.numerics
    if a is None or b is None or a.inputs != b.inputs:
        return "numerics unknown (not audited on the same inputs)"
    if a.class_id != b.class_id or not (a.deterministic and b.deterministic):
        return "changes numerics"
    return "same numerics class"


def review_view(table: Table) -> Table:
    """Configs, how each was chosen, and what content matches need (source hash, config list) only
    (``export --no-provenance``), so a re-tune's pull request does not show every timing and vote
    that moved. No header meta: a view is no cache or recording, whatever file it was made from."""
    keep = ("arch", "kernel", "key", "config", "how", "source_hash", "config_list_digest")
    return Table(
        [Entry(**{n: getattr(e, n) for n in keep}) for e in table.entries()],
        library_version=table.library_version,
    )
