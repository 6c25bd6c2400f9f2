"""Fresh child processes: a clean environment, the ``--child`` command, its ``RESULT`` line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent.parent
REPO = BENCHMARKS.parent
RESULT_MARK = "RESULT "


def child_env(smoke: bool, **extra: str | None) -> dict[str, str]:
    """A clean environment for a fresh child: repo importable, no inherited tuning state."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MEGATRON_TUNING_")
        and k not in ("TRITON_CACHE_AUTOTUNING", "TRITON_PRINT_AUTOTUNING")
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    if smoke:
        env["TRITON_INTERPRET"] = "1"
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def start_child(script: str, argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[str]:
    """Start ``benchmarks/<script> argv...`` in a fresh interpreter (children that run at once)."""
    cmd = [sys.executable, str(BENCHMARKS / script), *argv]
    return subprocess.Popen(cmd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def child_result(proc: subprocess.Popen[str], timeout: float = 600.0) -> dict[str, Any]:
    """Wait for a started child (killed past ``timeout``, as ``subprocess.run`` does); its ``RESULT``."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])  # type: ignore[no-any-return]
    cmd = proc.args if isinstance(proc.args, str) else " ".join(map(str, proc.args))  # type: ignore[union-attr]
    raise RuntimeError(
        f"child {cmd} exited {proc.returncode} without a result:\n{stdout[-3000:]}\n{stderr[-5000:]}"
    )


def run_child(
    script: str, argv: Sequence[str], env: Mapping[str, str], timeout: float = 600.0
) -> dict[str, Any]:
    """Run ``script --child ...`` in a fresh interpreter; return its ``RESULT`` JSON."""
    return child_result(start_child(script, argv, env), timeout)


def emit(result: Mapping[str, Any]) -> None:
    """The child's answer to its parent: one line, last on stdout."""
    sys.stdout.flush()
    print(RESULT_MARK + json.dumps(result, sort_keys=True), flush=True)
