"""The shipped sm90 tables stay valid for the reference kernels they pin.

They were tuned on an H200 (see benchmarks/RESULTS.md). Editing a reference kernel's source or
its config list without re-tuning (``benchmarks/make_sm90_tables.py`` on a GPU) fails here, so a
stale table can never ship silently.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_tuning.core.identity import config_signature, kernel_id, kernel_source_hash
from megatron_tuning.tables.table import load_table

REPO = Path(__file__).resolve().parents[2]
TABLES = sorted((REPO / "configs" / "sm90").glob("*.msgpack"))
REQUIRED_MATMUL_SHAPES = (
    "M=8192, N=8192, K=8192",
    "M=16384, N=8192, K=4096",
    "M=4096, N=14336, K=4096",
    "M=512, N=512, K=512",
)


def _autotuner(kernel: str, import_kernel):  # noqa: ANN001, ANN202
    module_name, _, qualname = kernel.partition(":")
    assert module_name == "megatron_tuning.kernels", f"{kernel}: not a reference kernel"
    return getattr(import_kernel(module_name), qualname)


def test_sm90_tables_exist_and_cover_the_issue_shapes():
    assert [p.name for p in TABLES] == ["matmul.msgpack", "splitk.msgpack", "tiny.msgpack"]
    keys = [entry.key for entry in load_table(REPO / "configs" / "sm90" / "matmul.msgpack")]
    for shape in REQUIRED_MATMUL_SHAPES:
        assert any(key.startswith(shape + " |") and "bfloat16" in key for key in keys), shape


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.name)
def test_entries_match_current_kernel_source_and_configs(path, import_kernel):  # noqa: ANN001
    table = load_table(path)
    assert len(table) > 0
    for entry in table:
        assert entry.arch == "sm90" and entry.how == "tuned"
        autotuner = _autotuner(entry.kernel, import_kernel)
        assert kernel_id(autotuner) == entry.kernel
        assert entry.source_hash == kernel_source_hash(autotuner), (
            f"{entry.kernel} changed since {path.name} was tuned: re-run benchmarks/make_sm90_tables.py"
        )
        live = {config_signature(c) for c in autotuner.configs}
        assert config_signature(entry.config) in live, (
            f"{path.name}: {entry.key} pins a config the kernel lost"
        )
        assert entry.timing is not None and entry.timing.median_ms > 0
