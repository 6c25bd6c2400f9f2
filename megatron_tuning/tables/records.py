"""What runs record: decision-log files, per-rank recordings, and the table entries they stand for."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import EllipsisType
from typing import Any, NamedTuple

from ..core.decisions import Decision, get_decisions
from ..core.errors import TableError
from ..core.identity import current_rank, shared_kernel_id
from ..core.key import render
from ..core.notices import warn_once
from .codec import FILE_PREFIX
from .entry import Invalid, Numerics, check_numerics, check_text, key_from_data
from .files import load_json, read_regular_file, write_atomic
from .keys import key_from_text
from .search import installed_triton_version
from .table import Entry, Table, Timing, update_table

logger = logging.getLogger(__name__)

DECISIONS_FORMAT = "megatron_tuning.decisions"
RECORDING_PREFIX = "recording-rank"
_HOW = {"recorded": "recorded", "tuned": "tuned", "adopted": "tuned"}


def write_decisions(
    path: str | os.PathLike[str],
    decisions: Iterable[Decision] | None = None,
    *,
    triton_version: str | None | EllipsisType = ...,
    processes: Sequence[int] | None = None,
) -> None:
    """Write decisions (default: this process's log) as JSON: what ``coverage`` reads. A config value
    JSON has no form for (a jit function as a constexpr: only modes that store nothing launch one) is
    written as its text, as in the signature; no table entry is made from such a decision.
    ``triton_version``: the Triton that made them, which the entries made of them are stamped with
    (default: the installed one; ``None``: not one known). ``processes``: a log pooled from several
    processes (``tune --results``) gives how many decisions each contributed, in order: ``merge``
    gives each process its vote, as ``tune`` did."""
    rows = [d.to_json() for d in (get_decisions() if decisions is None else decisions)]
    version = installed_triton_version() if triton_version is ... else triton_version
    if processes is not None and not _counts(processes, len(rows)):
        raise ValueError(f"processes {list(processes)} must count the {len(rows)} decisions, in order")
    # not sort_keys: keys keep order
    doc: dict[str, Any] = {"format": DECISIONS_FORMAT, "version": 2, "triton_version": version}
    if processes is not None:
        doc["processes"] = list(processes)
    doc["decisions"] = rows
    write_atomic(path, json.dumps(doc, indent=1, default=render).encode("utf-8"), error=_log_error)


def _counts(processes: Sequence[Any], total: int) -> bool:
    """Whether ``processes`` counts ``total`` decisions per process: whole numbers, none negative."""
    return all(type(n) is int and n >= 0 for n in processes) and sum(processes) == total


class DecisionFile(NamedTuple):
    """A decision log as read."""

    path: str
    decisions: list[Decision]
    triton_version: str | None  # the Triton that made the decisions, as the log says (None: not known)
    versioned: bool  # False: written before logs said which Triton made them
    processes: tuple[int, ...] | None = None  # a pooled log's decisions per process, in order; None: one's


def read_decisions(path: str | os.PathLike[str]) -> list[Decision]:
    return read_decision_file(path).decisions


def read_decision_file(path: str | os.PathLike[str]) -> DecisionFile:
    name = os.fspath(path)
    raw = read_regular_file(name, error=_log_error)
    if raw.startswith(FILE_PREFIX):  # a table file, not a log
        fix = "give the decision logs a run wrote (`run --decision-log`); `show` or `validate` read tables"
        raise _log_error(name, f"a tuning table, not a decision log; {fix}")
    try:
        data = load_json(raw)
    except Invalid as exc:
        raise _log_error(name, f"not a readable decision log: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != DECISIONS_FORMAT:
        raise _log_error(name, "not a megatron_tuning decision log (wrong or missing 'format')")
    rows, version = data.get("decisions"), data.get("version", 1)
    if type(rows) is not list or type(version) is not int or version not in (1, 2):
        raise _log_error(name, "not a readable decision log ('decisions' must be a list, 'version' 1 or 2)")
    triton = data.get("triton_version")
    if triton is not None and type(triton) is not str:
        raise _log_error(name, f"'triton_version' must be a string or null, got {triton!r}")
    try:
        check_text("triton_version", triton or "")
    except Invalid as exc:
        raise _log_error(name, str(exc)) from None
    processes = data.get("processes")
    if processes is not None and not (type(processes) is list and _counts(processes, len(rows))):
        raise _log_error(
            name, f"'processes' must count its {len(rows)} decisions per process, got {processes!r}"
        )
    decisions = []
    for index, row in enumerate(rows):
        problem = _row_problem(row)
        try:
            if problem is None and (key := row.get("key")) != "*":  # version 1 holds keys as text
                key = key_from_text(key) if version == 1 else key_from_data(key, row["kernel"])
                row = {**row, "key": key}
        except Invalid as exc:
            problem = str(exc)
        if problem:
            raise _log_error(name, f"decision {index}: {problem}")
        decisions.append(Decision(**row))
    pooled = None if processes is None else tuple(processes)
    return DecisionFile(name, decisions, triton, "triton_version" in data, pooled)


def log_triton_version(log: DecisionFile) -> str | None:
    """The Triton version to stamp the entries of ``log`` with: the one it records. A log written
    before logs recorded it is read as it was then, stamped with the installed Triton, and that is
    said once: merged elsewhere, its entries would claim a Triton that did not measure them."""
    if log.versioned:
        return log.triton_version
    installed = installed_triton_version()
    stamped = f"the installed Triton {installed}" if installed else "no Triton version (none is installed)"
    message = (
        "decision log %s (and any other written before logs recorded their Triton) does not say which "
        "Triton measured it: its entries are stamped with %s. Merge such logs where they were tuned, or "
        'add "triton_version": "<the version that tuned it>" next to its "format"'
    )
    warn_once(("unversioned-decision-log",), message, log.path, stamped)
    return installed


def _log_error(path: str, problem: str) -> TableError:
    return TableError(path, problem, "Decision log")


_REQUIRED = ("kernel", "signature", "source")
_ROW_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(_REQUIRED, (str,)),
    **dict.fromkeys(("arch", "origin", "source_hash", "config_list_digest"), (str, type(None))),
    **dict.fromkeys(("nearest_key", "matched_by", "entry_kernel", "chaos"), (str, type(None))),
    **{"rank": (int,), "deterministic": (bool, type(None)), "config": (dict,), "timings": (dict, type(None))},
}
_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    bool: "true or false",
    dict: "an object",
    type(None): "null",
}


def _row_problem(row: Any) -> str | None:
    """Why a hand-edited or hostile row cannot be a ``Decision`` (readers rely on the types)."""
    if type(row) is not dict:
        return f"must be an object, got {type(row).__name__}"
    if unknown := sorted(map(str, row.keys() - Decision.__dataclass_fields__.keys())):
        return f"unknown fields {unknown}"
    for name, types in _ROW_TYPES.items():
        if (name in row or name in _REQUIRED) and type(row.get(name)) not in types:
            return f"{name} must be {' or '.join(_TYPE_NAMES[t] for t in types)}, got {row.get(name)!r}"
    return None


def content_ident(entry: Entry) -> tuple[str | None, ...]:
    """What makes entries under different module names, or under a plain and an ``@digest`` id of one
    config list, one (kernel, key): ``shared_kernel_id`` by content. Without a source hash, an entry
    is only its own ident."""
    if entry.source_hash is None:
        return entry.ident
    return (
        entry.arch,
        shared_kernel_id(entry.kernel, entry.config_list_digest, entry.source_hash),
        entry.key,
    )


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
    """The winner's timing from ``{"candidates": {signature: [median, p20, p80] | median}}`` or the
    flat ``Timing`` fields; anything odd is ignored."""
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
    decisions: Iterable[Decision],
    *,
    rank: int | None = None,
    triton_version: str | None | EllipsisType = ...,
) -> Table:
    """The measured winners in ``decisions``, first per ident, stamped with ``triton_version``
    (default: the installed one; ``None``: not one known)."""
    version = installed_triton_version() if triton_version is ... else triton_version
    table = Table(meta={"kind": "recording"} if rank is None else {"kind": "recording", "rank": str(rank)})
    for decision in decisions:
        entry = entry_from_decision(decision, triton_version=version)
        if entry is not None:
            table.add(entry, replace=False)
    return table


def is_decision_log(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a JSON document of the decision-log format (unreadable: ``False``)."""
    try:
        data = load_json(read_regular_file(path))
    except (TableError, Invalid):
        return False
    return isinstance(data, dict) and data.get("format") == DECISIONS_FORMAT


def decision_votes(path: str | os.PathLike[str]) -> list[tuple[str, Table]]:
    """A decision log as ``vote_tables`` inputs, as ``tune`` pools its per-process logs: one vote per
    process, its first measured winner per ident (``recording_table``). A log pooled from several
    processes (``tune --results``, which says how many decisions each gave) votes once per process;
    any other, once. Stamped with the Triton the log says measured it (``log_triton_version``)."""
    log = read_decision_file(path)
    name, version = log.path, log_triton_version(log)
    chunks, start = [], 0
    for count in log.processes or (len(log.decisions),):
        chunks.append(log.decisions[start : start + count])
        start += count
    tables = [t for t in (recording_table(c, triton_version=version) for c in chunks) if len(t)]
    if not tables:
        fix = "a pinned run's log has nothing to merge (`coverage` reads those)"
        raise _log_error(name, f"holds no tuned or recorded decision; {fix}")
    if len(tables) == 1:
        return [(name, tables[0])]
    return [(f"{name}#{n}", t) for n, t in enumerate(tables, 1)]


def recording_path(directory: str | os.PathLike[str], rank: int) -> Path:
    return Path(directory) / f"{RECORDING_PREFIX}{int(rank):05d}.msgpack"


def write_recording(
    decisions: Iterable[Decision] | None, directory: str | os.PathLike[str], rank: int | None = None
) -> Path:
    """Write this rank's recorded winners (default: this process's log) to ``recording_path``,
    updating an earlier run's: new winners replace old ones, the others stay."""
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
