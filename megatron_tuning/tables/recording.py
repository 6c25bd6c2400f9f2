"""Record mode output: measured decisions become table entries, one recording file per rank.

In record mode Triton autotunes as usual and the interception logs each winner as a
``Decision(source="recorded", timings=...)``. At exit every rank writes its winners to
its own file (``recording-rank00003.msgpack``), so ranks never contend for a lock.
``merge.merge_tables`` then combines recordings into one voted table.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..core.decisions import Decision
from .search import installed_triton_version
from .table import Entry, Table, Timing, update_table

logger = logging.getLogger(__name__)

RECORDING_PREFIX = "recording-rank"
_RECORDED_SOURCES = {"recorded": "recorded", "tuned": "tuned", "adopted": "tuned"}


def recording_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where ``rank`` writes its recording inside ``directory``."""
    return Path(directory) / f"{RECORDING_PREFIX}{int(rank):05d}.msgpack"


def entry_from_decision(decision: Decision, *, triton_version: str | None = None) -> Entry | None:
    """The table entry for a ``recorded``/``tuned``/``adopted`` decision; ``None`` for other sources."""
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
    ``core.identity.current_rank()``. An existing recording for the rank (an earlier run of
    the job) is updated: new winners replace old ones for the same (arch, kernel, key),
    entries only the earlier run saw are kept. The file is only ever touched by this
    rank, so the lock it takes is uncontended.
    """
    if decisions is None:
        from ..core.decisions import get_decisions

        decisions = get_decisions()
    if rank is None:
        from ..core.identity import current_rank

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


__all__ = [
    "entry_from_decision",
    "recording_path",
    "recording_table",
    "timing_from_decision",
    "write_recording",
]
