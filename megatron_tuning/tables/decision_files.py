"""Decision logs on disk: the JSON file ``coverage``, ``report`` and tune pooling read."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from ..core.decisions import Decision, get_decisions
from ..core.errors import TableError
from .files import read_json_file, write_atomic

FORMAT = "megatron_tuning.decisions"


def _log_error(path: str, problem: str) -> TableError:
    return TableError(path, problem, "Decision log")


def write_decisions(path: str | os.PathLike[str], decisions: Iterable[Decision] | None = None) -> None:
    """Write decisions as JSON (atomically) for ``python -m megatron_tuning coverage``."""
    rows = [d.to_json() for d in (get_decisions() if decisions is None else decisions)]
    payload = json.dumps({"format": FORMAT, "version": 1, "decisions": rows}, indent=1, sort_keys=True)
    write_atomic(path, payload.encode("utf-8"), error=_log_error)


def read_decisions(path: str | os.PathLike[str]) -> list[Decision]:
    """Read a file written by ``write_decisions``; any problem raises ``TableError``."""
    name = os.fspath(path)
    data = read_json_file(name, error=_log_error, what="decision log")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
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


# What ``Decision.to_json`` writes. Every reader (coverage, report, tune pooling) relies on these
# types, so a hand-edited or hostile log fails here, named, instead of deep inside a reader.
_TEXT_FIELDS = ("kernel", "key", "signature", "source")
_OPTIONAL_TEXT = ("arch", "origin", "source_hash", "nearest_key", "matched_by", "entry_kernel", "chaos")


def _row_problem(row: Any) -> str | None:
    if type(row) is not dict:
        return f"must be an object, got {type(row).__name__}"
    unknown = sorted(map(str, row.keys() - _KNOWN))
    if unknown:
        return f"unknown fields {unknown}"
    for name in _TEXT_FIELDS:
        if type(row.get(name)) is not str:
            return f"{name} must be a string, got {row.get(name)!r}"
    if "rank" in row and type(row["rank"]) is not int:
        return f"rank must be an integer, got {row['rank']!r}"
    for name in _OPTIONAL_TEXT:
        if row.get(name) is not None and type(row[name]) is not str:
            return f"{name} must be a string or null, got {row[name]!r}"
    if "config" in row and type(row["config"]) is not dict:
        return f"config must be an object, got {type(row['config']).__name__}"
    if row.get("timings") is not None and type(row["timings"]) is not dict:
        return f"timings must be an object or null, got {type(row['timings']).__name__}"
    return None


_KNOWN = frozenset(Decision.__dataclass_fields__)
