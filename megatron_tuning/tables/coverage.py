"""Coverage of a run: which (kernel, key) launches were table hits, fallbacks or out of scope.

Reads the per-rank decision logs written by ``decisions.write_decisions`` and lines the
ranks up per (kernel, key). Two things matter to a user: how much of the run the table
pinned (hits) versus the static fallback, and whether any ranks launched different
configs for the same (kernel, key), which the coverage report also shows.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.decisions import Decision
from ..core.warn import printable
from .decision_files import read_decisions

# Decision source -> coverage status.
STATUS = {
    "table": "hit",
    "override": "override",
    "single": "single",
    "tuned": "tuned",
    "adopted": "adopted",
    "recorded": "recorded",
    "nearest": "nearest",
    "cheapest": "fallback",
    "chaos": "chaos",
    "out_of_scope": "out_of_scope",
}
STATUS_ORDER = (
    "hit",
    "override",
    "single",
    "tuned",
    "adopted",
    "recorded",
    "nearest",
    "fallback",
    "chaos",
    "out_of_scope",
    "other",
)


# Statuses that pin a key without a table entry of its own: what ``--require-table`` accepts
# besides a hit (an explicit override, or a kernel with one live config: nothing to choose).
PINNED_WITHOUT_TABLE = ("override", "single")


@dataclass(frozen=True, slots=True)
class Cell:
    """What one rank did for one (kernel, key)."""

    status: str
    signature: str
    origin: str | None
    entry_kernel: str | None = None
    """Set when the table entry was matched by content: the kernel id it was tuned under."""
    nearest_key: str | None = None
    """For ``nearest``: the key of the table entry (the neighbour) whose config was launched."""

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"status": self.status, "signature": self.signature, "origin": self.origin}
        if self.entry_kernel is not None:  # only content matches carry these keys
            data.update(matched_by="content", entry_kernel=self.entry_kernel)
        if self.nearest_key is not None:  # only nearest-shape launches carry the neighbour's key
            data["nearest_key"] = self.nearest_key
        return data


@dataclass(slots=True)
class Row:
    kernel: str
    key: str
    cells: dict[str, Cell] = field(default_factory=dict)
    """Rank label -> what that rank did."""

    @property
    def diverged(self) -> bool:
        """Ranks launched different configs (out-of-scope launches have no signature to compare)."""
        return len({c.signature for c in self.cells.values() if c.status != "out_of_scope"}) > 1


@dataclass(slots=True)
class Coverage:
    ranks: list[str]
    rows: list[Row]
    files: list[str]

    def counts(self) -> Counter[str]:
        """Status counts over every (kernel, key, rank) cell."""
        return Counter(cell.status for row in self.rows for cell in row.cells.values())

    def diverged(self) -> list[Row]:
        return [row for row in self.rows if row.diverged]

    def not_in_table(self) -> list[Row]:
        """Rows where some rank launched something other than its own table entry.

        What CI means by "every shape is in the table": a nearest-shape entry, the cheapest
        fallback, a tuned or adopted config (``auto``) all count; an override or a kernel with a
        single config pins without an entry and does not; out-of-scope kernels are not pinned.
        """
        allowed = ("hit", "out_of_scope", *PINNED_WITHOUT_TABLE)
        return [row for row in self.rows if any(c.status not in allowed for c in row.cells.values())]

    def to_json(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "ranks": self.ranks,
            "counts": dict(sorted(self.counts().items())),
            "entries": [
                {
                    "kernel": row.kernel,
                    "key": row.key,
                    "diverged": row.diverged,
                    "ranks": {label: c.to_json() for label, c in row.cells.items()},
                }
                for row in self.rows
            ],
        }

    def report(self) -> str:
        """Human-readable report; every line's data is escaped (``core.warn.printable``)."""
        lines = [f"Coverage of {len(self.files)} decision log(s), ranks: {', '.join(self.ranks) or '-'}"]
        for row in self.rows:
            lines.append(f"{row.kernel}  [{row.key}]  {self._describe(row)}")
        counts = self.counts()
        summary = ", ".join(f"{s} {counts[s]}" for s in STATUS_ORDER if counts.get(s))
        lines.append(f"Summary (kernel/key x rank): {summary or 'no decisions'}")
        for row in self.diverged():
            lines.append(f"DIVERGED: {row.kernel} [{row.key}]")
            for label, cell in row.cells.items():
                lines.append(f"  rank {label}: {cell.signature or '-'} ({cell.status})")
        return "\n".join(map(printable, lines))

    def _describe(self, row: Row) -> str:
        by_status: dict[str, list[str]] = {}
        for label in self.ranks:
            cell = row.cells.get(label)
            by_status.setdefault(cell.status if cell else "absent", []).append(label)
        origins = sorted({c.origin for c in row.cells.values() if c.origin})
        twins = sorted({c.entry_kernel for c in row.cells.values() if c.entry_kernel})
        neighbours = sorted({c.nearest_key for c in row.cells.values() if c.nearest_key})
        parts = []
        for status, labels in by_status.items():
            who = "all ranks" if len(labels) == len(self.ranks) else "rank(s) " + ",".join(labels)
            parts.append(f"{status}: {who}")
        suffix = f"  from {', '.join(origins)}" if origins else ""
        if twins:
            suffix += f"  (matched by content: tuned as {', '.join(twins)})"
        if neighbours:  # which neighbour's config ran: what a reviewer checks before trusting it
            suffix += "  using the entry for " + "; ".join(f"[{k}]" for k in neighbours)
        return "; ".join(parts) + suffix


def read_decision_files(paths: Sequence[str | os.PathLike[str]]) -> list[tuple[str, list[Decision]]]:
    """Read decision logs; any problem raises one ``TableError`` naming the file."""
    out = []
    for raw in paths:
        path = os.fspath(raw)
        out.append((path, read_decisions(path)))  # field types are checked there
    return out


def coverage_of(logs: Sequence[tuple[str, Iterable[Decision]]]) -> Coverage:
    """Line up decisions per (kernel, key) and rank.

    A rank label is the decision's rank; when two files claim the same rank (e.g. logs of
    separate single-process runs, all rank 0) the label gets the file name appended.
    """
    materialised = [(path, list(decisions)) for path, decisions in logs]
    # How many files contain each rank: more than one means the labels must say which file.
    per_file_ranks = Counter(r for _, ds in materialised for r in {d.rank for d in ds})
    rows: dict[tuple[str, str], Row] = {}
    labels: list[str] = []
    for path, decisions in materialised:
        for decision in decisions:
            label = str(decision.rank)
            if per_file_ranks[decision.rank] > 1:
                label = f"{decision.rank}@{os.path.basename(path)}"
            if label not in labels:
                labels.append(label)
            row = rows.setdefault((decision.kernel, decision.key), Row(decision.kernel, decision.key))
            # The first decision per (kernel, key) in a process is the one that launched.
            twin = decision.entry_kernel if decision.matched_by == "content" else None
            row.cells.setdefault(
                label,
                Cell(
                    STATUS.get(decision.source, "other"),
                    decision.signature,
                    decision.origin,
                    entry_kernel=twin,
                    nearest_key=decision.nearest_key,
                ),
            )
    labels.sort(key=_label_order)
    for row in rows.values():
        row.cells = {label: row.cells[label] for label in labels if label in row.cells}
    return Coverage(ranks=labels, rows=[rows[k] for k in sorted(rows)], files=[p for p, _ in materialised])


def _label_order(label: str) -> tuple[int, str]:
    head = label.split("@", 1)[0]
    return (int(head) if head.lstrip("-").isdigit() else 0, label)


def coverage_json_text(coverage: Coverage) -> str:
    return json.dumps(coverage.to_json(), indent=1, sort_keys=True)


__all__ = ["Coverage", "Row", "coverage_of", "coverage_json_text", "read_decision_files"]
