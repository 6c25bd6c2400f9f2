"""Merging recordings and tables: one vote per input for each (arch, kernel, key).

The majority wins, ties are broken deterministically (never by input order: merging the same
inputs in any order gives the same bytes), and every entry where inputs disagreed is reported,
which is itself a measurement of how unstable autotuning was for that job.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..core.cost import estimate_config_cost
from ..core.errors import TableError
from ..core.identity import config_signature
from ..core.warn import printable
from .files import LOCK_TIMEOUT_S, locked
from .search import expand_table_paths
from .table import Entry, Table, entry_with, load_table, save_table

logger = logging.getLogger(__name__)


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
            lines.append(printable(f"{item.arch}  {item.kernel}  [{item.key}]  ({item.rule})"))
            for index, vote in enumerate(item.votes):
                mark = "->" if index == 0 else "  "
                timing = f", median {vote.median_ms:.4g} ms" if vote.median_ms is not None else ""
                who = ", ".join(vote.inputs) if len(vote.inputs) <= max_inputs_listed else "..."
                lines.append(
                    printable(f"  {mark} {len(vote.inputs)} vote(s){timing}: {vote.signature}  [{who}]")
                )
        for arch, kernel, key, hashes in self.mixed_source_hashes:
            lines.append(
                printable(
                    f"warning: {arch} {kernel} [{key}] was recorded from different kernel sources: "
                    + ", ".join(h[:12] for h in hashes)
                )
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


def merge_files(
    out: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]],
    *,
    timeout_s: float = LOCK_TIMEOUT_S,
) -> MergeResult:
    """Merge recordings/tables into ``out`` (written atomically; replaced, not merged into).

    To keep what ``out`` already holds, list it among ``inputs`` too; it then votes once, and
    the merge holds ``out``'s lock (waiting at most ``timeout_s`` for another writer).
    """
    target = os.fspath(out)
    inputs = list(inputs)
    listed = _listed(target, inputs)
    # Listing ``out`` among the inputs makes this a read-modify-write of ``out``: hold the
    # same lock as ``update_table`` so a concurrent ``merge_entries`` (tune) loses nothing.
    with locked(target, timeout_s=timeout_s) if listed else contextlib.nullcontext():
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


__all__ = ["Disagreement", "MergeResult", "Vote", "load_inputs", "merge_files", "merge_tables"]
