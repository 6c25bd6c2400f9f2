"""The vote: recordings, tables and decision logs of many runs into one table, one vote per input (a
decision log: per process) for each ident. The majority wins; ties go to the lowest median time,
static cost, then signature text, so inputs in any order give the same bytes. Every disagreement is
reported."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from ..core.errors import TableError
from ..core.fallback import estimate_config_cost
from ..core.identity import config_signature
from .files import LOCK_TIMEOUT_S, locked
from .records import content_ident, decision_votes, is_decision_log
from .search import expand_table_paths
from .table import Entry, Table, entry_with, load_table, save_table

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Vote:
    """The inputs that chose one config; ``median_ms``: the median of their medians."""

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
class VoteResult:
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


def vote_tables(inputs: Sequence[tuple[str, Table]]) -> VoteResult:
    """One vote per input (name, table) for each ident; entries of one source under several module
    names vote as one kernel, kept under the first name."""
    names: dict[tuple[str | None, ...], str] = {}
    for entry in (entry for _, table in inputs for entry in table.values()):
        names[content_ident(entry)] = min(names.get(content_ident(entry), entry.kernel), entry.kernel)
    ballots: dict[tuple[str, str, str], dict[str, list[tuple[str, Entry]]]] = {}
    for name, table in inputs:
        for entry in table.values():
            ident: tuple[str, str, str] = (entry.arch, names[content_ident(entry)], entry.key)
            ballots.setdefault(ident, {}).setdefault(config_signature(entry.config), []).append((name, entry))
    result = VoteResult(table=Table(meta={"kind": "merged"}), inputs=[name for name, _ in inputs])
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


def _votes(name: str) -> list[tuple[str, Table]]:
    """One input's votes: a table's, or a decision log's measured winners (one per process)."""
    try:
        return [(name, load_table(name))]
    except TableError:
        if not is_decision_log(name):  # told by its content, whatever the file's name
            raise
    return decision_votes(name)


def vote_files(
    out: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]],
    *,
    timeout_s: float = LOCK_TIMEOUT_S,
) -> VoteResult:
    """Vote recordings/tables (folders: their ``*.msgpack``) and decision logs of measuring runs (named
    one by one) into ``out``. To keep what ``out`` holds, list it among ``inputs``: it votes once, and
    the merge holds its lock."""
    target, inputs = os.fspath(out), list(inputs)
    listed = any(os.path.realpath(os.fspath(p)) == os.path.realpath(target) for p in inputs)
    with locked(target, timeout_s=timeout_s) if listed else contextlib.nullcontext():
        skip = set() if listed else {os.path.realpath(target)}
        names = [n for n in expand_table_paths(inputs) if os.path.realpath(n) not in skip]
        loaded = [vote for name in names for vote in _votes(name)]
        if not loaded:  # e.g. a folder holding only an earlier output: never write an empty table
            where = ", ".join(os.fspath(p) for p in inputs)
            raise TableError(where, f"no input tables to merge besides {target}")
        result = vote_tables(loaded)
        save_table(result.table, target)
    if result.disagreements:
        logger.warning(
            "%d of %d merged entries had disagreeing inputs", len(result.disagreements), len(result.table)
        )
    return result
