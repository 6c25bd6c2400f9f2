"""Record mode output and merging: per-rank recordings in, one voted table out.

In record mode Triton autotunes as usual and the interception logs each winner as a
``Decision(source="recorded", timings=...)``. At exit every rank writes its winners to
its own file (``recording-rank00003.msgpack``), so ranks never contend for a lock.
``merge_tables`` then combines recordings (or any tables): one vote per input for each
(arch, kernel, key), the majority wins, ties are broken deterministically, and every
entry where inputs disagreed is reported, which is itself a measurement of how
unstable autotuning was for that job.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import filelock
import msgpack

from megatron_tuning.decisions import Decision
from megatron_tuning.errors import TableError
from megatron_tuning.selection import config_signature, estimate_config_cost
from megatron_tuning.table import Entry, Table, Timing, entry_with, load_table, save_table, update_table
from megatron_tuning.tableset import expand_table_paths, installed_triton_version

logger = logging.getLogger(__name__)

RECORDING_PREFIX = "recording-rank"
_RECORDED_SOURCES = {"recorded": "recorded", "tuned": "tuned"}


# -- recording ---------------------------------------------------------------------
def recording_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where ``rank`` writes its recording inside ``directory``."""
    return Path(directory) / f"{RECORDING_PREFIX}{int(rank):05d}.msgpack"


def entry_from_decision(decision: Decision, *, triton_version: str | None = None) -> Entry | None:
    """The table entry for a ``recorded``/``tuned`` decision; ``None`` for other sources."""
    how = _RECORDED_SOURCES.get(decision.source)
    if how is None or not decision.config:
        return None
    return Entry(
        arch=decision.arch,
        kernel=decision.kernel,
        key=decision.key,
        config=dict(decision.config),
        how=how,
        source_hash=decision.source_hash,
        triton_version=triton_version,
        timing=timing_from_decision(decision),
    )


def recording_table(
    decisions: Iterable[Decision], *, rank: int | None = None, triton_version: str | None = None
) -> Table:
    """A table of the measured winners among ``decisions`` (first decision per ident wins)."""
    version = triton_version if triton_version is not None else installed_triton_version()
    table = Table(meta={"kind": "recording"} if rank is None else {"kind": "recording", "rank": str(rank)})
    for decision in decisions:
        entry = entry_from_decision(decision, triton_version=version)
        if entry is not None:
            table.add(entry, replace=False)
    return table


def write_recording(
    decisions: Iterable[Decision] | None,
    directory: str | os.PathLike[str],
    rank: int | None = None,
) -> Path:
    """Write this rank's recorded winners to ``directory`` and return the file's path.

    ``decisions=None`` takes the process's decision log; ``rank=None`` takes
    ``selection.current_rank()``. An existing recording for the rank (an earlier run of
    the job) is updated: new winners replace old ones for the same (arch, kernel, key),
    entries only the earlier run saw are kept. The file is only ever touched by this
    rank, so the lock it takes is uncontended.
    """
    if decisions is None:
        from megatron_tuning.decisions import get_decisions

        decisions = get_decisions()
    if rank is None:
        from megatron_tuning.selection import current_rank

        rank = current_rank()
    fresh = recording_table(decisions, rank=rank)
    os.makedirs(directory, exist_ok=True)
    path = recording_path(directory, rank)

    def _mutate(table: Table) -> None:
        table.meta = dict(fresh.meta)
        for entry in fresh.values():
            table.add(entry)

    update_table(path, _mutate)
    logger.info("Recorded %d autotune winner(s) for rank %d to %s", len(fresh), rank, path)
    return path


def timing_from_decision(decision: Decision) -> Timing | None:
    """Timing statistics of the decision's winner, from whatever the measurement left.

    Understands ``{"candidates": {signature: [median, p20, p80] | median}, "samples": n}``
    (what the interception records from Triton's ``configs_timings``; the tuner's form,
    with ``"samples": {signature: [...]}``, too) and the flat
    ``{"median_ms", "spread_ms", "samples", "candidates", "runner_up_ms"}`` form. Anything
    else is ignored: an odd timing must never stop a recording from being written.
    """
    raw = decision.timings
    if not isinstance(raw, Mapping):
        return None
    values: dict[str, Any] = {}
    candidates = raw.get("candidates")
    if isinstance(candidates, Mapping) and candidates:
        medians = {sig: _quantiles(t) for sig, t in candidates.items()}
        values["candidates"] = len(candidates)
        winner = medians.get(decision.signature)
        if winner:
            values["median_ms"] = winner[0]
            if len(winner) >= 3 and winner[2] >= winner[1]:
                values["spread_ms"] = winner[2] - winner[1]
        others = [q[0] for sig, q in medians.items() if sig != decision.signature and q]
        if others:
            values["runner_up_ms"] = min(others)
    for name in ("median_ms", "spread_ms", "runner_up_ms"):
        number = raw.get(name)
        if isinstance(number, (int, float)) and _finite(number) and number >= 0:
            values[name] = float(number)
    for name in ("samples", "candidates"):
        count = raw.get(name)
        if name == "samples" and isinstance(count, Mapping):  # the tuner keeps every sample
            count = _sample_count(count.get(decision.signature))
        if type(count) is int and count >= 0:
            values[name] = count
    return Timing(**values) if values else None


def _sample_count(samples: Any) -> int | None:
    return len(samples) if isinstance(samples, (list, tuple)) else None


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _quantiles(timing: Any) -> list[float]:
    # Triton scores a config that failed to compile or ran out of resources as inf: it has
    # no usable time, so it counts as a candidate but never as the runner-up.
    values = list(timing) if isinstance(timing, (list, tuple)) else [timing]
    if not values or not all(_finite(v) and v >= 0 for v in values):
        return []
    return [float(v) for v in values]


# -- merging -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Vote:
    """The inputs that chose one config for an entry."""

    signature: str
    inputs: tuple[str, ...]
    median_ms: float | None
    """Median over the voters' measured medians, when they measured."""

    def to_json(self) -> dict[str, Any]:
        return {
            "signature": self.signature,
            "votes": len(self.inputs),
            "inputs": list(self.inputs),
            "median_ms": self.median_ms,
        }


@dataclass(frozen=True, slots=True)
class Disagreement:
    """An entry for which the inputs chose more than one config."""

    arch: str
    kernel: str
    key: str
    votes: tuple[Vote, ...]
    """Winner first, then the others in tie-break order."""
    rule: str
    """Why the winner won: ``majority`` or ``tie: ...``."""

    def to_json(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "kernel": self.kernel,
            "key": self.key,
            "rule": self.rule,
            "chosen": self.votes[0].signature,
            "votes": [v.to_json() for v in self.votes],
        }


@dataclass(slots=True)
class MergeResult:
    """The merged table and what the merge found."""

    table: Table
    inputs: list[str]
    disagreements: list[Disagreement] = field(default_factory=list)
    mixed_source_hashes: list[tuple[str, str, str, tuple[str, ...]]] = field(default_factory=list)
    """Entries whose inputs were recorded from different kernel sources: (arch, kernel, key, hashes)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "entries": len(self.table),
            "disagreements": [d.to_json() for d in self.disagreements],
            "mixed_source_hashes": [
                {"arch": a, "kernel": k, "key": key, "source_hashes": list(h)}
                for a, k, key, h in self.mixed_source_hashes
            ],
        }

    def report(self, *, max_inputs_listed: int = 8) -> str:
        """Human-readable disagreement report."""
        lines = [
            f"Merged {len(self.inputs)} input(s) into {len(self.table)} entries; "
            f"{len(self.disagreements)} with disagreement."
        ]
        for item in self.disagreements:
            lines.append(f"{item.arch}  {item.kernel}  [{item.key}]  ({item.rule})")
            for index, vote in enumerate(item.votes):
                mark = "->" if index == 0 else "  "
                timing = f", median {vote.median_ms:.4g} ms" if vote.median_ms is not None else ""
                who = ", ".join(vote.inputs) if len(vote.inputs) <= max_inputs_listed else "..."
                lines.append(f"  {mark} {len(vote.inputs)} vote(s){timing}: {vote.signature}  [{who}]")
        for arch, kernel, key, hashes in self.mixed_source_hashes:
            lines.append(
                f"warning: {arch} {kernel} [{key}] was recorded from different kernel sources: "
                + ", ".join(h[:12] for h in hashes)
            )
        return "\n".join(lines)


def merge_tables(inputs: Sequence[tuple[str, Table]]) -> MergeResult:
    """Majority vote per (arch, kernel, key) over ``inputs`` (name, table), one vote each.

    Ties go to the lowest median time among the tied configs' voters, then the lowest
    static cost (``selection.estimate_config_cost``), then the signature text: a total
    order, so the result does not depend on the order of the inputs.
    """
    names = [name for name, _ in inputs]
    ballots: dict[tuple[str, str, str], dict[str, list[tuple[str, Entry]]]] = {}
    for name, table in inputs:
        for entry in table.values():
            by_signature = ballots.setdefault(entry.ident, {})
            by_signature.setdefault(config_signature(entry.config), []).append((name, entry))

    merged = Table(meta={"kind": "merged"})
    result = MergeResult(table=merged, inputs=names)
    for ident in sorted(ballots):
        by_signature = ballots[ident]
        votes = sorted(
            (_vote(sig, voters) for sig, voters in by_signature.items()), key=_rank_key(by_signature)
        )
        winner = votes[0]
        total = sum(len(v.inputs) for v in votes)
        representative = min(by_signature[winner.signature], key=_representative_key)[1]
        merged.add(entry_with(representative, votes=(len(winner.inputs), total)))
        if len(votes) > 1:
            result.disagreements.append(
                Disagreement(*ident, votes=tuple(votes), rule=_rule(votes, by_signature))
            )
        hashes = sorted(
            {e.source_hash for voters in by_signature.values() for _, e in voters if e.source_hash}
        )
        if len(hashes) > 1:
            result.mixed_source_hashes.append((*ident, tuple(hashes)))
    return result


def _vote(signature: str, voters: list[tuple[str, Entry]]) -> Vote:
    medians = sorted(
        e.timing.median_ms for _, e in voters if e.timing is not None and e.timing.median_ms is not None
    )
    median = None
    if medians:
        mid = len(medians) // 2
        median = medians[mid] if len(medians) % 2 else (medians[mid - 1] + medians[mid]) / 2
    return Vote(signature, tuple(sorted(name for name, _ in voters)), median)


def _rank_key(by_signature: Mapping[str, list[tuple[str, Entry]]]) -> Any:
    def key(vote: Vote) -> tuple[Any, ...]:
        config = by_signature[vote.signature][0][1].config
        return (-len(vote.inputs), _time_or_inf(vote.median_ms), estimate_config_cost(config), vote.signature)

    return key


def _rule(votes: Sequence[Vote], by_signature: Mapping[str, list[tuple[str, Entry]]]) -> str:
    first, second = votes[0], votes[1]
    if len(first.inputs) != len(second.inputs):
        return "majority"
    if _time_or_inf(first.median_ms) != _time_or_inf(second.median_ms):
        return "tie: lowest median time"
    cost = [estimate_config_cost(by_signature[v.signature][0][1].config) for v in (first, second)]
    return "tie: lowest static cost" if cost[0] != cost[1] else "tie: signature order"


def _time_or_inf(value: float | None) -> float:
    return math.inf if value is None else value


def _representative_key(voter: tuple[str, Entry]) -> tuple[float, bytes]:
    # The entry whose provenance is kept: the fastest measurement, then a content order,
    # never the input order (merging the same inputs in any order gives the same bytes).
    _, entry = voter
    median = entry.timing.median_ms if entry.timing is not None else None
    return (_time_or_inf(median), msgpack.packb(entry.to_data(), use_bin_type=True))


def load_inputs(
    paths: Iterable[str | os.PathLike[str]], *, exclude: Iterable[str] = ()
) -> list[tuple[str, Table]]:
    """Load tables/recordings (folders expand to their ``*.msgpack``); ``exclude`` skips files."""
    skip = {os.path.realpath(p) for p in exclude}
    return [
        (name, load_table(name)) for name in expand_table_paths(paths) if os.path.realpath(name) not in skip
    ]


def merge_files(out: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]]) -> MergeResult:
    """Merge recordings/tables into ``out`` (written atomically; replaced, not merged into).

    To keep what ``out`` already holds, list it among ``inputs`` too; it then votes once.
    """
    target = os.fspath(out)
    inputs = list(inputs)
    listed = _listed(target, inputs)
    # Listing ``out`` among the inputs makes this a read-modify-write of ``out``: hold the
    # same lock as ``update_table`` so a concurrent ``merge_entries`` (tune) loses nothing.
    with filelock.FileLock(target + ".lock") if listed else contextlib.nullcontext():
        loaded = load_inputs(inputs, exclude=[] if listed else [target])
        if not loaded:  # e.g. a folder holding only an earlier output: never write an empty table
            raise TableError(
                ", ".join(os.fspath(p) for p in inputs), f"no input tables to merge besides {target}"
            )
        result = merge_tables(loaded)
        save_table(result.table, target)
    if result.disagreements:
        logger.warning(
            "%d of %d merged entries had disagreeing inputs", len(result.disagreements), len(result.table)
        )
    return result


def _listed(target: str, inputs: Iterable[str | os.PathLike[str]]) -> bool:
    real = os.path.realpath(target)
    return any(os.path.realpath(os.fspath(p)) == real for p in inputs)


__all__ = [
    "Disagreement",
    "MergeResult",
    "Vote",
    "entry_from_decision",
    "load_inputs",
    "merge_files",
    "merge_tables",
    "recording_path",
    "recording_table",
    "timing_from_decision",
    "write_recording",
]
