"""Reviewing a table's changes: the diff between two tables, and the review view (configs only)."""

from __future__ import annotations

from typing import Any

from ..core.identity import config_signature
from .entry import same_config
from .records import content_ident
from .table import Entry, Table

# What ``diff --ignore-provenance`` skips; ``kernel``: the module name of a content match.
_PROVENANCE = ("kernel", "how", "source_hash", "triton_version", "timing", "votes", "note", "numerics")


def diff_tables(a: Table, b: Table, *, ignore_provenance: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Entries only in ``a`` (removed), only in ``b`` (added), in both but different (changed: each
    differing field as ``[old, new]``, and a config change's ``numerics`` verdict); an entry of the
    same source under another module name is the same kernel."""

    def brief(entry: Entry) -> dict[str, str]:
        return {"arch": entry.arch, "kernel": entry.kernel, "key": entry.key}

    only_b = {content_ident(e): e for e in b.entries() if e.ident not in a}
    pairs = [(old, b.get(*old.ident) or only_b.pop(content_ident(old), None)) for old in a.entries()]
    removed = [dict(brief(old), config=config_signature(old.config)) for old, new in pairs if new is None]
    added = [dict(brief(e), config=config_signature(e.config)) for e in only_b.values()]
    changed = []
    for old, new in pairs:
        if new is None or new == old:
            continue
        fields: dict[str, list[Any]] = {}
        verdict: dict[str, str] = {}
        old_sig, new_sig = config_signature(old.config), config_signature(new.config)
        if not same_config(old.config, new.config):
            fields["config"] = [old_sig, new_sig] if old_sig != new_sig else [old.config, new.config]
            verdict = {"numerics": _numerics_verdict(old, new)}
        if not ignore_provenance:
            before, after = old.to_data(), new.to_data()
            fields.update(
                {n: [before.get(n), after.get(n)] for n in _PROVENANCE if before.get(n) != after.get(n)}
            )
        if fields:
            changed.append(dict(brief(old), fields=fields, **verdict))
    return {"added": added, "removed": removed, "changed": changed}


def _numerics_verdict(old: Entry, new: Entry) -> str:
    a, b = old.numerics, new.numerics
    if a is None or b is None or a.inputs != b.inputs:
        return "numerics unknown (not audited on the same inputs)"
    if a.class_id != b.class_id or not (a.deterministic and b.deterministic):
        return "changes numerics"
    return "same numerics class"


def review_view(table: Table) -> Table:
    """Configs, how each was chosen, and what content matches need only (``export --no-provenance``):
    a re-tune's pull request does not show every timing that moved. No header meta."""
    keep = ("arch", "kernel", "key", "config", "how", "source_hash", "config_list_digest")
    return Table(
        [Entry(**{n: getattr(e, n) for n in keep}) for e in table.entries()],
        library_version=table.library_version,
    )
