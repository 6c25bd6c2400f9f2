"""Helpers for the torchrun tests: child-job environment, launcher with a hard timeout, results.

A plain module (not conftest) so test files can import it without clashing with tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
# NVLink multicast stays off in every child job: on shared GPU hosts a program that uses it can
# take the GPUs out of service (NCCL NVLS, PyTorch symmetric memory, NVSHMEM).
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def gloo_available() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_available() and dist.is_gloo_available())


def gpu_count() -> int:
    """GPUs usable for an NCCL job (0 without CUDA or without NCCL)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return 0
    if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
        return 0
    return int(torch.cuda.device_count())


def job_env(tmp: Path, *, interpret: bool = True) -> dict[str, str]:
    """Environment for a child job: this checkout first on the path, interpreter, own caches."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["TRITON_INTERPRET"] = "1" if interpret else "0"
    env["TRITON_CACHE_DIR"] = str(tmp / "triton_cache")
    env["XDG_CACHE_HOME"] = str(tmp / "xdg_cache")  # auto's default cache: never the user's
    env["OMP_NUM_THREADS"] = "1"
    env.update(MULTICAST_OFF)
    return env


def run_torchrun(
    nproc: int, script: Path, args: Sequence[str], tmp: Path, timeout_s: float, *, interpret: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under ``torchrun --standalone``; fail the test (not hang) past ``timeout_s``."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]
    return run_bounded(command, tmp, timeout_s, f"torchrun job {script.name} x{nproc}", interpret=interpret)


def run_bounded(
    command: Sequence[str],
    tmp: Path,
    timeout_s: float,
    what: str,
    *,
    interpret: bool = True,
    merge_stderr: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in ``job_env``; past ``timeout_s`` kill its whole session and fail the test.

    Its own session, so a timeout kills torchrun *and* its workers, not only the launcher (a
    killed torchrun can leave orphaned ranks spinning in a collective).
    """
    with subprocess.Popen(
        list(command),
        env=job_env(tmp, interpret=interpret),
        cwd=str(tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"{what} exceeded {timeout_s}s:\n{stdout[-4000:]}\n{(stderr or '')[-4000:]}")
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr or "")


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (Linux; a zombie nobody reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def read_results(folder: Path, nproc: int) -> dict[int, dict[str, Any]]:
    """Per-rank result files written by a worker."""
    results = {}
    for rank in range(nproc):
        path = folder / f"rank{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text())
    return results
