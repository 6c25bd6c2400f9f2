"""decide(): kernel identity (two autotuners over one function; the same code under another module
name) and chaos picks, through real interpreted launches."""

from __future__ import annotations

import importlib.util
import logging
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
import triton

from megatron_tuning.commands.validate import coverage_of
from megatron_tuning.core.chaos import ChaosClaim
from megatron_tuning.core.decisions import decision_log, get_decisions
from megatron_tuning.core.identity import (
    base_kernel_id,
    config_data,
    config_signature,
    kernel_id,
    kernel_source_hash,
    tuning_key,
)
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.core.warn import reset_warnings
from megatron_tuning.runtime import interception
from megatron_tuning.runtime.triton_compat import lazy_benchmarker
from megatron_tuning.tables.entry import Entry
from megatron_tuning.tables.merge import recording_table
from megatron_tuning.tables.search import TableSet
from megatron_tuning.tables.table import Table, load_table, save_table

from .. import support_kernels as sk
from ..support_kernels import grid


@pytest.fixture(autouse=True)
def _clean_state():
    decision_log().clear()
    reset_warnings()
    for kernel in (sk.twin_small, sk.twin_large, sk.scale_add):
        kernel.cache.clear()
    yield
    interception.uninstall()
    decision_log().clear()


def _run_twin(kernel, n: int) -> int:  # noqa: ANN001
    x = torch.arange(n, dtype=torch.float32)
    out = torch.full((n,), float("nan"))
    kernel[grid(n)](x, out, n)
    torch.testing.assert_close(out, x * 3)
    return int(kernel.best_config.kwargs["BLOCK_SIZE"])


def _largest(autotuner, candidates, args, kwargs, kernel, key):  # noqa: ANN001, ANN202
    return candidates[-1], {"median_ms": {config_signature(c): 1.0 for c in candidates}}


def test_two_autotuners_over_one_function_get_two_decisions_two_entries_and_their_own_pins(tmp_path):
    # "Tune": each autotuner's winner is its largest config (32 for small, 128 for large).
    interception.install(TuningPolicy(mode="tune"), measure=_largest)
    assert (_run_twin(sk.twin_small, 40), _run_twin(sk.twin_large, 40)) == (32, 128)
    decisions = get_decisions()
    assert len(decisions) == 2 and decisions[0].key == decisions[1].key
    assert [d.kernel for d in decisions] == [kernel_id(sk.twin_small), kernel_id(sk.twin_large)]
    assert decisions[0].kernel != decisions[1].kernel
    table = recording_table(decisions)
    assert len(table) == 2  # one table holds both: they no longer share an ident
    path = tmp_path / "twins.msgpack"
    save_table(table, path)
    interception.uninstall()
    decision_log().clear()

    # Pinned run in the other launch order: each launches its own entry, not the other's.
    interception.install(TuningPolicy(mode="deterministic"), table=TableSet([path]))
    assert (_run_twin(sk.twin_large, 40), _run_twin(sk.twin_small, 40)) == (128, 32)
    assert [(d.kernel, d.source) for d in get_decisions()] == [
        (kernel_id(sk.twin_large), "table"),
        (kernel_id(sk.twin_small), "table"),
    ]


def test_a_plain_id_entry_for_a_function_with_two_autotuners_is_named_ambiguous_not_used(tmp_path, notices):
    key = tuning_key(sk.twin_small, (torch.zeros(40), torch.zeros(40), 40), {})
    base = base_kernel_id(sk.twin_small)
    entry = Entry(arch="unknown", kernel=base, key=key, config=config_data(sk.ADD_CONFIGS[1]))
    path = tmp_path / "old.msgpack"
    save_table(Table([entry]), path)
    interception.install(TuningPolicy(mode="deterministic", on_miss="min_cost"), table=TableSet([path]))
    assert _run_twin(sk.twin_small, 40) == 8  # the cheapest, not the ambiguous entry's 16
    assert get_decisions()[0].source == "cheapest"
    message = " ".join(notices.messages)
    assert f"entry for kernel {base}" in message and kernel_id(sk.twin_small) in message
    assert "cannot say which autotuner it was tuned for" in message and "Re-tune" in message


def test_a_plain_entry_of_a_one_autotuner_kernel_still_hits_with_no_warning(tmp_path, caplog, notices):
    key = tuning_key(sk.scale_add, (torch.zeros(40),) * 3 + (40, 0.5), {})
    entry = Entry(
        arch="unknown", kernel=kernel_id(sk.scale_add), key=key, config=config_data(sk.ADD_CONFIGS[3])
    )
    path = tmp_path / "plain.msgpack"
    save_table(Table([entry]), path)
    interception.install(TuningPolicy(mode="deterministic"), table=TableSet([path]))
    x = torch.randn(40)
    with caplog.at_level(logging.WARNING, logger="megatron_tuning"):
        sk.scale_add[grid(40)](x, x, torch.empty(40), 40, 0.5)
    assert sk.scale_add.best_config is sk.ADD_CONFIGS[3]
    (decision,) = get_decisions()
    assert (decision.source, decision.matched_by, decision.entry_kernel) == ("table", None, None)
    assert caplog.records == [] and notices.messages == []


# --------------------------------------------------------------------------- content matches

_KERNEL_FILE = """
import triton
import triton.language as tl

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((8, 1), (16, 2), (32, 4), (64, 4))]


@triton.autotune(configs=CONFIGS, key=["n"])
@triton.jit
def add_two(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + AMOUNT, mask=mask)
"""


def _load(path: Path, name: str) -> ModuleType:
    """What an eval pipeline does: load a file under a name of its choosing, outside sys.modules."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with lazy_benchmarker():
        spec.loader.exec_module(module)
    assert name not in sys.modules
    return module


def _run_add_two(module: ModuleType, n: int, amount: float = 2.0) -> int:
    x = torch.arange(n, dtype=torch.float32)
    out = torch.full((n,), float("nan"))
    module.add_two[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, out, n)
    torch.testing.assert_close(out, x + amount)
    return int(module.add_two.best_config.kwargs["BLOCK"])


@pytest.fixture
def tuned_as_mykernels(tmp_path: Path) -> tuple[Path, Path]:
    """A kernel file loaded as ``mykernels``, its entry for n=40 pinning BLOCK=32 (not the cheapest 8)."""
    source = tmp_path / "kernel_file.py"
    source.write_text(textwrap.dedent(_KERNEL_FILE.replace("AMOUNT", "2.0")))
    mine = _load(source, "mykernels")
    key = tuning_key(mine.add_two, (torch.zeros(40), torch.zeros(40), 40), {})
    entry = Entry(
        arch="unknown",
        kernel=kernel_id(mine.add_two),
        key=key,
        config=config_data(mine.CONFIGS[2]),
        how="tuned",
        source_hash=kernel_source_hash(mine.add_two),
    )
    table = tmp_path / "mykernels.msgpack"
    save_table(Table([entry]), table)
    return source, table


def test_the_same_file_under_another_module_name_hits_by_content_and_says_so(tuned_as_mykernels, caplog):
    source, table = tuned_as_mykernels
    candidate = _load(source, "candidate")
    interception.install(TuningPolicy(mode="deterministic", on_miss="min_cost"), table=TableSet([table]))
    with caplog.at_level(logging.INFO, logger="megatron_tuning"):
        assert _run_add_two(candidate, 40) == 32
    (decision,) = get_decisions()
    assert decision.kernel == "candidate:add_two" and decision.source == "table"
    assert (decision.matched_by, decision.entry_kernel) == ("content", "mykernels:add_two")
    assert decision.origin == str(table)
    assert "matched by content: tuned as mykernels:add_two" in caplog.text
    labels, rows = coverage_of([("rank0.json", get_decisions())])
    cell = rows[0].cells["0"]
    assert (labels, cell.status, cell.entry_kernel) == (["0"], "hit", "mykernels:add_two")
    assert cell.to_json()["matched_by"] == "content"
    assert load_table(table).entries()[0].kernel == "mykernels:add_two"  # nothing written back


def test_a_different_source_under_the_same_qualname_does_not_hit(tuned_as_mykernels, tmp_path):
    _, table = tuned_as_mykernels
    edited = tmp_path / "edited_kernel_file.py"
    edited.write_text(textwrap.dedent(_KERNEL_FILE.replace("AMOUNT", "5.0")))
    candidate = _load(edited, "candidate")
    interception.install(TuningPolicy(mode="deterministic", on_miss="min_cost"), table=TableSet([table]))
    assert _run_add_two(candidate, 40, amount=5.0) == 8  # the cheapest: same qualname is not enough
    (decision,) = get_decisions()
    assert (decision.source, decision.matched_by, decision.entry_kernel) == ("cheapest", None, None)


def test_a_content_match_also_serves_the_nearest_shape_rule(tuned_as_mykernels):
    source, table = tuned_as_mykernels
    candidate = _load(source, "candidate")
    interception.install(TuningPolicy(mode="deterministic", on_miss="nearest"), table=TableSet([table]))
    assert _run_add_two(candidate, 48) == 32
    (decision,) = get_decisions()
    assert (decision.source, decision.matched_by, decision.entry_kernel) == (
        "nearest",
        "content",
        "mykernels:add_two",
    )
    assert decision.nearest_key is not None and decision.nearest_key.startswith("n=40 |")


# --------------------------------------------------------------------------- chaos


class _Claims:
    """An in-memory coordinator: the first claim per (kernel, key, arch) wins, as the store's does."""

    def __init__(self, rank: int, claims: dict[tuple[str, str, str], ChaosClaim]) -> None:
        self.rank, self.claims = rank, claims

    def claim(self, kernel: str, key: str, arch: str, signature: str) -> ChaosClaim:
        return self.claims.setdefault((kernel, key, arch), ChaosClaim(self.rank, signature))

    def recall(self, kernel: str, key: str, arch: str) -> ChaosClaim | None:
        return self.claims.get((kernel, key, arch))


def test_chaos_through_the_coordinator_records_how_each_rank_picked(monkeypatch):
    claims: dict[tuple[str, str, str], ChaosClaim] = {}
    picks = []
    # Ranks 0 and 4 pick the same config by the rank formula (4 distinct configs in twin_large).
    for rank in (0, 4):
        monkeypatch.setenv("RANK", str(rank))
        interception.install(TuningPolicy(mode="chaos"), chaos=_Claims(rank, claims))
        picks.append(_run_twin(sk.twin_large, 40))
        interception.uninstall()
    first, second = get_decisions()
    assert picks[0] != picks[1]
    assert (first.source, first.chaos, first.origin) == ("chaos", "first", "first claim")
    assert (second.source, second.chaos, second.origin) == ("chaos", "differs", "moved off rank 0's claim")


def test_chaos_with_one_distinct_config_says_it_proves_nothing():
    interception.install(TuningPolicy(mode="chaos"), chaos=_Claims(0, {}))
    x = torch.arange(40, dtype=torch.float32)
    sk.single_config_copy[grid(40)](x, torch.empty(40), 40)
    (decision,) = get_decisions()
    assert (decision.source, decision.chaos) == ("chaos", "no_other_config")
    assert decision.origin is not None and "no other distinct config" in decision.origin


def test_inside_a_cuda_graph_capture_chaos_recalls_instead_of_claiming(monkeypatch):
    from megatron_tuning.runtime import pinning

    class RecallOnly(_Claims):
        def claim(self, kernel: str, key: str, arch: str, signature: str) -> ChaosClaim:
            raise AssertionError("no store traffic inside a CUDA graph capture")

    key = tuning_key(sk.twin_large, (torch.zeros(40), torch.zeros(40), 40), {})
    claims = {(kernel_id(sk.twin_large), key, "unknown"): ChaosClaim(7, config_signature(sk.ADD_CONFIGS[4]))}
    monkeypatch.setattr(pinning, "is_capturing", lambda: True)
    interception.install(TuningPolicy(mode="chaos"), chaos=RecallOnly(0, claims))
    block = _run_twin(sk.twin_large, 40)
    (decision,) = get_decisions()
    assert decision.chaos == "differs" and "rank 7's claim" in (decision.origin or "")
    assert block != 128  # rank 7 claimed BLOCK_SIZE=128: this rank launches another
