"""A score record's ``pinning``: the policy, every decision of the process as its decision log has it,
each table a decision came from, and which of those entries were stale, flagged (``stale_entry``): the
config timed was tuned for other code, or another Triton. Field by field: docs/score.md."""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.decisions import Decision
from ..core.errors import MegatronTuningError
from ..tables.search import installed_triton_version, staleness
from ..tables.table import Table, load_table
from .integrity import Flag, flag

FROM_TABLES = ("table", "nearest")  # the sources whose origin is a table file's entry


def pinning(decisions: Sequence[Decision], first_new: int) -> dict[str, Any]:
    """The active policy, and every decision of this process (``in_measure``: first made during it;
    ``stale``: why its table entry is stale, else null), with a digest of each table file a decision
    came from."""
    from ..runtime.pinning import current_policy

    policy = current_policy()
    origins = dict.fromkeys(d.origin for d in decisions if d.origin and os.path.isfile(d.origin))
    tables = [{"path": o, "sha256": hashlib.sha256(Path(o).read_bytes()).hexdigest()} for o in origins]
    triton = installed_triton_version()
    return {
        "policy": None
        if policy is None
        else {
            "mode": policy.mode,
            "on_miss": policy.on_miss,
            "tables": list(policy.tables),
            "scope": list(policy.scope),
        },
        "configs": [
            {
                "kernel": d.kernel,
                "key": d.key,
                "signature": d.signature,
                "source": d.source,
                "origin": d.origin,
                "source_hash": d.source_hash,
                "matched_by": d.matched_by,
                "entry_kernel": d.entry_kernel,
                "nearest_key": d.nearest_key,
                "stale": _stale(d, triton) if d.origin in origins else None,
                "in_measure": i >= first_new,
            }
            for i, d in enumerate(decisions)
        ],
        "tables": tables,
    }


def stale_flags(pinned: dict[str, Any]) -> list[Flag]:
    """``stale_entry``, once per stale entry a decision launched."""
    stale = {(c["kernel"], c["key"], c["origin"], c["stale"]) for c in pinned["configs"] if c["stale"]}
    return [
        flag(
            "stale_entry",
            f"{kernel} at key {key} launched a stale entry of {origin} ({why}): the config timed was "
            "not tuned for the code that ran; tune it again (docs/score.md, 'Tune, then score')",
        )
        for kernel, key, origin, why in sorted(stale)
    ]


def _stale(decision: Decision, triton: str | None) -> str | None:
    """Why the entry ``decision`` launched is stale for the code that ran (``tables.search``'s test)."""
    if decision.source not in FROM_TABLES or decision.origin is None:
        return None
    try:
        stat = os.stat(decision.origin)
        table = _table(decision.origin, stat.st_mtime_ns, stat.st_size)
    except (OSError, MegatronTuningError):  # replaced by something else since: the score goes on
        return None
    kernel = decision.entry_kernel or decision.kernel
    entry = table.get(decision.arch, kernel, decision.nearest_key or decision.key)
    return None if entry is None else staleness(entry, decision.source_hash, triton)


@functools.lru_cache(maxsize=4)
def _table(path: str, mtime_ns: int, size: int) -> Table:
    """``path`` as loaded, once per version of the file: every ``measure`` call of a process reads it."""
    return load_table(path)
