"""What a rank's choices depend on, compared across ranks at each session's start (``agreement``):
the policy field by field, the versions, the contents of the tables, and the GPU arch where keys
are compared."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core import __version__
from ..core.errors import TableError
from ..core.identity import arch_tag, config_signature, group_exists, node_arch
from ..core.policy import TuningPolicy
from ..tables.search import TableSet, expand_table_paths, installed_triton_version, shipped_tables_dir

CHECKED_MODES = ("deterministic", "chaos", "auto")  # the policy modes whose ranks must agree per key


def compares_keys(policy: TuningPolicy) -> bool:
    """Whether ranks of ``policy`` compare their decisions key by key (agreement not ``off``)."""
    return policy.mode in CHECKED_MODES and policy.agreement != "off"


def describe_inputs(policy: TuningPolicy, table: Any = None, *, arch: str | None = None) -> dict[str, str]:
    """What this rank's choices depend on, as short comparable text per input. ``table``: what the
    session searches (a ``TableSet``, a mapping); ``None``: the policy's tables. Table files are
    compared by content, so the same tables at different paths on different nodes agree. ``arch``
    (default: this node's GPUs', read only with a process group) only where the policy compares
    keys: a key's check pairs ranks of one arch, so ranks of two would launch their own entries unseen."""
    inputs = {f"policy.{name}": value for name, value in policy.summary_fields().items()}
    if compares_keys(policy) and (arch or group_exists()):
        # Read only where ranks compare (one process reads no GPU at init), and maybe before this
        # rank picked its device: the current device's only where this node's GPUs differ.
        inputs["arch"] = arch or node_arch() or arch_tag()
    inputs |= {
        "megatron_tuning": __version__,
        "triton": installed_triton_version() or "not installed",
        "torch": str(torch.__version__),
    }
    shipped = shipped_tables_dir() if policy.use_shipped_tables else None
    if isinstance(table, TableSet):  # what the session searches: the policy's tables or others
        inputs["tables"] = _digest_of([Path(name) for name in table.named_files])
        shipped = table.shipped_dir
    elif table is None:
        try:
            inputs["tables"] = _digest_of([Path(name) for name in expand_table_paths(policy.tables)])
        except TableError as exc:  # the table search path reports it too, naming the file
            inputs["tables"] = f"unreadable ({exc})"
    elif isinstance(table, Mapping):
        rows = sorted(json.dumps([list(k), _launch_text(v)], default=str) for k, v in table.items())
        inputs["tables"] = (
            f"{len(rows)} in-memory entries@{hashlib.sha256(chr(10).join(rows).encode()).hexdigest()[:12]}"
        )
    else:
        inputs["tables"] = f"a {type(table).__name__} object (not compared)"
    if shipped is not None:
        files = sorted(p for p in shipped.rglob("*.msgpack") if p.is_file()) if shipped.is_dir() else []
        inputs["shipped tables"] = _digest_of(files, shipped)
    return inputs


def _launch_text(config: Any) -> str:
    """What an in-memory entry launches, as the lookup matches it: its config signature (a
    ``triton.Config``'s repr holds its address), else, for a mapping that is no config, its JSON."""
    if isinstance(config, Mapping) and "kwargs" not in config:
        return json.dumps(dict(config), sort_keys=True, default=str)
    return config_signature(config)


def _digest_of(files: Sequence[Path], root: Path | None = None) -> str:
    hasher = hashlib.sha256()
    for path in files:
        name = str(path.relative_to(root)) if root is not None else path.name
        try:
            hasher.update(name.encode() + b"\0" + path.read_bytes())
        except OSError as exc:
            return f"{path} unreadable ({exc.strerror or exc})"
    return f"{len(files)} files@{hasher.hexdigest()[:12]}" if files else "(none)"
