"""The inputs every choice is a pure function of, compared once per session instead of per key.

A deterministic decision (table entry, nearest shape, cheapest config) depends only on the policy,
the table contents and the library/Triton/torch versions (and the GPU arch, which is part of every
identity). Ranks whose inputs differ would launch different configs, so they are told at
``init_deterministic_tuning`` with one ``compare_set`` per rank (the first rank's inputs are the
session's), naming what differs, instead of one divergence per key later. Table files are compared
by content (sha256), so the same tables at different paths on different nodes agree.

``auto`` mode's per-node cache is not an input here: it is reconciled through the job's store
(``job_cache.py``), so nodes with different caches still launch one config per key.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core import env
from ..core.errors import InputMismatchError, TableError
from ..core.version import __version__
from ..tables.search import ENV_TABLE, expand_table_paths, installed_triton_version
from ..tables.shipped import shipped_tables_dir
from .storeops import BadRecord, decode_record, record_field, record_rank

INPUTS_KIND = "inputs"
"""``kind`` of an input mismatch recorded in a session's divergence flag."""


def describe_inputs(policy: Any, table: Any = None) -> dict[str, str]:
    """What this rank's choices depend on, as short comparable text per input."""
    inputs = {
        "megatron_tuning": __version__,
        "triton": installed_triton_version() or "not installed",
        "torch": _torch_version(),
    }
    explicit = tuple(getattr(policy, "tables", ()) or ()) + tuple(env.env_list(ENV_TABLE, ":") or ())
    if table is not None and not hasattr(table, "files"):
        inputs["tables"] = _mapping_digest(table)
    else:
        inputs["tables"] = _files_digest(explicit)
    if getattr(policy, "use_shipped_tables", True):
        inputs["shipped tables"] = _folder_digest(shipped_tables_dir())
    return inputs


def _torch_version() -> str:
    try:
        import torch
    except ImportError:
        return "not installed"
    return str(torch.__version__)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def _files_digest(paths: tuple[str, ...]) -> str:
    try:
        files = expand_table_paths(paths)
    except TableError as exc:  # the table search path reports this itself, naming the file
        return f"unreadable ({exc.problem})"
    parts = []
    for name in files:
        try:
            digest = _sha(Path(name).read_bytes())
        except OSError as exc:
            digest = f"unreadable ({exc.strerror or exc})"
        parts.append(f"{os.path.basename(name)}@{digest}")
    return ", ".join(parts) or "(none)"


def _folder_digest(folder: Path) -> str:
    if not folder.is_dir():
        return "(none)"
    hasher = hashlib.sha256()
    count = 0
    for path in sorted(p for p in folder.rglob("*.msgpack") if p.is_file()):
        hasher.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
        count += 1
    return f"{count} files@{hasher.hexdigest()[:12]}"


def _mapping_digest(table: Any) -> str:
    if isinstance(table, Mapping):
        try:
            rows = sorted(
                json.dumps([list(k), dict(v)], sort_keys=True, default=str) for k, v in table.items()
            )
        except (TypeError, ValueError):
            rows = sorted(repr(item) for item in table.items())
        return f"{len(rows)} in-memory entries@{_sha(chr(10).join(rows).encode())}"
    return f"a {type(table).__name__} object (not compared)"


def inputs_record(rank: int, inputs: Mapping[str, str]) -> str:
    return json.dumps({"rank": rank, "inputs": dict(inputs)}, sort_keys=True)


def compare_inputs(
    session: str, rank: int, mine: Mapping[str, str], first_raw: Any, world: int | None
) -> InputMismatchError | None:
    """The mismatch between ``mine`` and the session's first record, or ``None`` when they agree."""
    what = f"the inputs recorded for {session}"
    try:
        data = decode_record(first_raw, what)
        first_rank = record_rank(data, what, world)
        theirs = record_field(data, "inputs", dict, what)
    except BadRecord as bad:
        return InputMismatchError(session, [rank], {"store record": {rank: bad.problem}})
    differences = {
        name: {first_rank: str(theirs.get(name, "-")), rank: str(mine.get(name, "-"))}
        for name in sorted(set(theirs) | set(mine))
        if str(theirs.get(name, "-")) != str(mine.get(name, "-"))
    }
    if not differences:
        return None
    return InputMismatchError(session, sorted({first_rank, rank}), differences)


def mismatch_record(error: InputMismatchError) -> str:
    return json.dumps(
        {
            "kind": INPUTS_KIND,
            "session": error.session,
            "ranks": error.ranks,
            "differences": error.differences,
        },
        sort_keys=True,
    )


def mismatch_from_record(data: dict[str, Any]) -> InputMismatchError:
    return InputMismatchError(str(data["session"]), list(data["ranks"]), dict(data["differences"]))


__all__ = ["INPUTS_KIND", "compare_inputs", "describe_inputs", "inputs_record"]
