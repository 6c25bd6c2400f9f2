"""What a benchmark leaves behind: the environment header, JSON and JSONL files, printed tables."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.processes import REPO


def environment() -> dict[str, Any]:
    """Date, machine, GPU and versions: the header of every results file."""
    info: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ"),
        "python": platform.python_version(),
        "host": platform.node(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    try:
        import torch
        import triton

        info["torch"] = torch.__version__
        info["triton"] = triton.__version__
        if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
    except ImportError:
        pass
    return info


def git_commit(checkout: Path = REPO) -> str | None:
    """The short commit of ``checkout`` (``None`` outside git): which code a CPU run measured."""
    done = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or None


def write_json(path: str | None, payload: Mapping[str, Any]) -> None:
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"results written to {target}")


def write_results(path: str | None, benchmark: str, **fields: Any) -> None:
    """A results file: the ``benchmark`` name, this run's ``environment()`` header, then ``fields``."""
    write_json(path, {"benchmark": benchmark, "environment": environment(), **fields})


def append_jsonl(path: str, record: Mapping[str, Any]) -> None:
    """Append one JSON line (a process's raw result) to ``path``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain, aligned text table (what RESULTS.md quotes)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if n and _numeric(c) else c.ljust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def _numeric(text: str) -> bool:
    try:
        float(text.rstrip("x%"))
    except ValueError:
        return False
    return True


def dash(value: Any, suffix: str = "") -> Any:
    """A table cell: ``-`` for a missing value, 4 significant digits (and ``suffix``) for a float."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}{suffix}"
    return value
