"""The package's layers point down: the import-linter contracts in pyproject.toml hold, and they fire.

``lint-imports`` reads the contracts from ``pyproject.toml``. The firing test copies the package
into a temp folder, plants one upward import (``core`` importing ``tables``), and expects the
same contracts to reject it, so a contract that silently checks nothing would fail here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")

pytestmark = pytest.mark.skipif(
    LINT is None, reason="import-linter is not installed (pip install -e .[test])"
)


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run(
        [str(LINT), "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_layer_contracts_hold_for_the_package():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


def _copy_package(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copytree(
        REPO / "megatron_tuning", root / "megatron_tuning", ignore=shutil.ignore_patterns("__pycache__")
    )
    return root


def _lint_with_planted_import(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess[str]:
    """Lint a copy of the package in which ``module`` (a path under it) ends with ``line``."""
    root = _copy_package(tmp_path)
    with open(root / "megatron_tuning" / module, "a", encoding="utf-8") as handle:
        handle.write(f"\n{line}  # planted by the test\n")
    return _lint(root)


def test_an_upward_import_breaks_the_layer_contract(tmp_path):
    result = _lint_with_planted_import(tmp_path, "core/policy.py", "from ..tables import table as _upward")
    assert result.returncode != 0
    assert "megatron_tuning layers point down BROKEN" in result.stdout
    assert "megatron_tuning.core.policy -> megatron_tuning.tables.table" in result.stdout


def test_a_new_top_level_module_must_declare_its_layer(tmp_path):
    root = _copy_package(tmp_path)
    (root / "megatron_tuning" / "stray.py").write_text('"""Nobody said where this sits."""\n')
    result = _lint(root)
    assert result.returncode != 0
    assert "stray" in result.stdout


def test_an_import_cycle_inside_a_layer_breaks_the_acyclic_contract(tmp_path):
    # inductor imports pinning: pinning importing inductor closes a cycle.
    result = _lint_with_planted_import(tmp_path, "runtime/pinning.py", "from . import inductor as _cycle")
    assert result.returncode != 0
    assert "no import cycles between modules of one package BROKEN" in result.stdout
