"""Reading tables as a person does: entry listings and table diffs (used by ``show``/``diff``)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from typing import Any

from ..core.identity import config_signature
from ..core.warn import printable
from .entry import Entry, same_config
from .table import Table

_PROVENANCE = ("how", "source_hash", "triton_version", "timing", "votes", "note")


def kernel_matches(kernel: str, pattern: str | None) -> bool:
    """``pattern`` as a glob when it has glob characters, else as a substring."""
    if not pattern:
        return True
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(kernel, pattern)
    return pattern in kernel


def describe_entry(entry: Entry) -> str:
    """The config signature, then provenance in parentheses."""
    facts = [entry.how]
    timing = entry.timing
    if timing is not None and timing.median_ms is not None:
        text = f"median {timing.median_ms:.4g} ms"
        if timing.spread_ms is not None:
            text += f" ±{timing.spread_ms / 2:.2g}"
        facts.append(text)
        if timing.runner_up_ms is not None and timing.median_ms > 0:
            facts.append(_runner_up(timing.runner_up_ms, timing.median_ms))
    if timing is not None and timing.candidates is not None:
        facts.append(f"{timing.candidates} candidates")
    if entry.votes is not None:
        facts.append(f"{entry.votes[0]}/{entry.votes[1]} votes")
    if entry.source_hash:
        facts.append(f"src {entry.source_hash[:12]}")
    if entry.triton_version:
        facts.append(f"triton {entry.triton_version}")
    note = f"  # {entry.note}" if entry.note else ""
    return printable(f"{config_signature(entry.config)}  ({', '.join(facts)}){note}")


def _runner_up(runner_up_ms: float, median_ms: float) -> str:
    # The winner is not always the fastest median (a tie broken by static cost, or
    # Triton's own pick): say "faster" rather than print a signed "+-0.5%".
    delta = 100 * (runner_up_ms / median_ms - 1)
    if runner_up_ms < median_ms:
        return f"runner-up {-delta:.1f}% faster"
    return f"runner-up +{delta:.1f}%"


# A number in key text: after "=", a bracket, a space, a comma or at the start (not "float16").
_NUMBER = re.compile(r"(?:(?<=[=\[(,\s])|^)(-?\d+(?:\.\d+)?)")


def natural_key(text: str) -> tuple[Any, ...]:
    """Sort key that orders the numbers in ``text`` as numbers: ``M=32`` before ``M=100``.

    Text and numbers alternate (``re.split`` with a group), so two keys compare text with text
    and number with number at each position.
    """
    parts: list[Any] = _NUMBER.split(text)
    for i in range(1, len(parts), 2):
        parts[i] = float(parts[i]) if "." in parts[i] else int(parts[i])
    return tuple(parts)


def entry_order(entry: Entry) -> tuple[Any, ...]:
    """How people read a table: by arch, kernel, then key with its numbers in numeric order."""
    return (entry.arch, entry.kernel, natural_key(entry.key), entry.key)


def review_view(table: Table) -> Table:
    """The table without provenance (how, hashes, versions, timing, votes, note): configs only.

    What ``export --no-provenance`` writes for a pull request, where a re-tune would otherwise
    show every timing and vote that moved; one config change is then a few-line diff. Loading
    it gives ``how='hand'`` entries without timings: a view for review, not a replacement table.
    """
    entries = [Entry(arch=e.arch, kernel=e.kernel, key=e.key, config=e.config) for e in table.entries()]
    return Table(entries, library_version=table.library_version, meta=table.meta)


def entry_lines(entries: Iterable[Entry]) -> list[str]:
    """Entries grouped under an ``arch  kernel`` heading, one indented line per key, numbers in order."""
    lines: list[str] = []
    heading: tuple[str, str] | None = None
    for entry in sorted(entries, key=entry_order):
        if (entry.arch, entry.kernel) != heading:
            heading = (entry.arch, entry.kernel)
            lines.append(printable(f"{entry.arch}  {entry.kernel}"))
        lines.append(f"    [{printable(entry.key)}]  {describe_entry(entry)}")
    return lines


def _ident(entry: Entry) -> dict[str, str]:
    return {"arch": entry.arch, "kernel": entry.kernel, "key": entry.key}


def _field(entry: Entry, name: str) -> Any:
    data = entry.to_data()
    return data.get(name)


def diff_tables(a: Table, b: Table, *, ignore_provenance: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Entries only in ``a`` (removed), only in ``b`` (added), and in both but different (changed).

    A changed entry lists each differing field as ``[old, new]``; ``config`` is shown by
    signature. Header fields (library version, meta) are not compared: they describe the
    file, not what runs.
    """
    removed = [dict(_ident(e), config=config_signature(e.config)) for e in a.entries() if e.ident not in b]
    added = [dict(_ident(e), config=config_signature(e.config)) for e in b.entries() if e.ident not in a]
    changed = []
    for old in a.entries():
        new = b.get(*old.ident)
        if new is None or new == old:
            continue
        fields: dict[str, list[Any]] = {}
        old_sig, new_sig = config_signature(old.config), config_signature(new.config)
        if not same_config(old.config, new.config):
            # Same signature but different data (e.g. an explicit default): show the data.
            fields["config"] = [old_sig, new_sig] if old_sig != new_sig else [old.config, new.config]
        if not ignore_provenance:
            for name in _PROVENANCE:
                before, after = _field(old, name), _field(new, name)
                if before != after:
                    fields[name] = [before, after]
        if fields:
            changed.append(dict(_ident(old), fields=fields))
    return {"added": added, "removed": removed, "changed": changed}


def format_diff(changes: dict[str, list[dict[str, Any]]], name_a: str, name_b: str) -> list[str]:
    """``diff``-style text: ``-`` removed, ``+`` added, ``~`` changed, then a count line."""
    lines = [printable(f"--- {name_a}"), printable(f"+++ {name_b}")]
    for item in changes["removed"]:
        lines.append(printable(f"- {item['arch']}  {item['kernel']}  [{item['key']}]  {item['config']}"))
    for item in changes["added"]:
        lines.append(printable(f"+ {item['arch']}  {item['kernel']}  [{item['key']}]  {item['config']}"))
    for item in changes["changed"]:
        lines.append(printable(f"~ {item['arch']}  {item['kernel']}  [{item['key']}]"))
        for name, (before, after) in item["fields"].items():
            lines.append(printable(f"    {name}: {_show(before)} -> {_show(after)}"))
    counts = {k: len(v) for k, v in changes.items()}
    if not any(counts.values()):
        lines.append("no differences")
    else:
        lines.append(f"{counts['added']} added, {counts['removed']} removed, {counts['changed']} changed")
    return lines


def _show(value: Any) -> str:
    return "-" if value is None else str(value)


__all__ = [
    "describe_entry",
    "diff_tables",
    "entry_lines",
    "entry_order",
    "format_diff",
    "kernel_matches",
    "natural_key",
    "review_view",
]
