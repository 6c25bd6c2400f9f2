"""Decision logs on disk: the JSON file ``coverage``, ``report`` and tune pooling read."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from ..core.decisions import Decision, get_decisions
from ..core.errors import DecisionLogError
from .files import write_atomic

FORMAT = "megatron_tuning.decisions"


def write_decisions(path: str | os.PathLike[str], decisions: Iterable[Decision] | None = None) -> None:
    """Write decisions as JSON (atomically) for ``python -m megatron_tuning coverage``."""
    rows = [d.to_json() for d in (get_decisions() if decisions is None else decisions)]
    payload = json.dumps({"format": FORMAT, "version": 1, "decisions": rows}, indent=1, sort_keys=True)
    write_atomic(path, payload.encode("utf-8"))


def read_decisions(path: str | os.PathLike[str]) -> list[Decision]:
    """Read a file written by ``write_decisions``; any problem raises ``DecisionLogError``."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise DecisionLogError(name, "no such file") from None
    except (OSError, ValueError, RecursionError) as exc:  # json errors are ValueErrors
        raise DecisionLogError(name, f"not a readable decision log ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DecisionLogError(name, "not a megatron_tuning decision log (wrong or missing 'format')")
    try:
        return [Decision.from_json(row) for row in data["decisions"]]
    except (KeyError, TypeError, AttributeError) as exc:  # a wrong row shape
        raise DecisionLogError(name, f"not a readable decision log ({type(exc).__name__}: {exc})") from None
