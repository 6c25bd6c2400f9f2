"""Shared setup for multi-process tests: real ``torchrun`` jobs (gloo, CPU) with hard timeouts.

Every test here is marked ``distributed``. Workers live in ``workers/``; they write one JSON
result file per rank, and the tests assert on those files, not on log text. Helpers are in
``_launch.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported in this process

from _launch import gloo_available, run_torchrun

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.distributed)


@pytest.fixture
def torchrun(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``torchrun(nproc, script, args, timeout_s=120)`` in this test's tmp dir."""
    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not available")

    def launch(nproc: int, script: Path, args: Sequence[str], timeout_s: float = 120.0) -> Any:
        return run_torchrun(nproc, script, args, tmp_path, timeout_s)

    yield launch
