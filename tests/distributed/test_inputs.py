"""What a rank claims as its inputs (``distributed/inputs.py``): equal where its choices are equal, and
different where they could differ, whatever form the table takes."""

from __future__ import annotations

from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
dist = pytest.importorskip("torch.distributed")

from megatron_tuning.core.errors import InputMismatchError
from megatron_tuning.core.identity import config_data
from megatron_tuning.core.key import Key
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.distributed.agreement import AgreementChecker
from megatron_tuning.distributed.inputs import describe_inputs
from megatron_tuning.tables.entry import Entry
from megatron_tuning.tables.search import TableSet
from megatron_tuning.tables.table import Table, save_table

KEY = Key({"n": 100}, {"out_ptr": "torch.int32"})


def test_an_in_memory_table_of_configs_is_compared_by_their_launch_options() -> None:
    """Before, the digest read ``repr(Config)``, which holds a memory address on Triton 3.9: every
    job that passed ``table={(kernel, key): triton.Config(...)}`` failed at init on a false mismatch."""
    policy = TuningPolicy()

    def inputs(block: int, **options: int) -> str:
        table = {("pkg:kernel", KEY): triton.Config({"BLOCK": block}, num_warps=4, **options)}
        return describe_inputs(policy, table)["tables"]

    assert inputs(64) == inputs(64)  # two Config objects, one launch: each rank builds its own
    assert (
        inputs(64)
        == describe_inputs(
            policy,
            {
                ("pkg:kernel", KEY): {
                    "kwargs": {"BLOCK": 64},
                    "num_warps": 4,
                    "num_stages": 3,
                    "num_ctas": 1,
                    "maxnreg": None,
                }
            },
        )["tables"]
    )
    assert inputs(64) != inputs(32)
    assert inputs(64) != inputs(64, num_stages=2)
    assert inputs(64).startswith("1 in-memory entries@")


def _table_file(path: Path, block: int) -> Path:
    entry = Entry(
        arch="unknown", kernel="pkg:kernel", key=KEY, config=config_data(triton.Config({"BLOCK": block}))
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    save_table(Table([entry]), path)
    return path


def test_a_table_set_is_compared_by_the_files_it_searches_not_the_policys(tmp_path: Path) -> None:
    """Before, ``table=TableSet(paths)`` was described by ``policy.tables`` (here none): ranks whose
    table files differed passed the inputs check, and a key only they hold was never compared."""
    policy = TuningPolicy()
    here = _table_file(tmp_path / "here" / "t.msgpack", 64)
    there = _table_file(tmp_path / "there" / "t.msgpack", 64)  # the same table on another node
    drifted = _table_file(tmp_path / "drifted" / "t.msgpack", 32)
    mine = describe_inputs(policy, TableSet([here]))
    assert mine["tables"] == describe_inputs(policy, TableSet([there]))["tables"] != "(none)"
    assert describe_inputs(policy, TableSet([drifted]))["tables"] != mine["tables"]
    assert describe_inputs(policy, TableSet([]))["tables"] == "(none)"
    # Its own shipped folder, not the policy's setting, is what it searches.
    assert "shipped tables" not in describe_inputs(TuningPolicy(use_shipped_tables=True), TableSet([here]))
    shipped = _table_file(tmp_path / "shipped" / "unknown" / "t.msgpack", 64).parent.parent
    with_shipped = describe_inputs(TuningPolicy(use_shipped_tables=False), TableSet([], shipped_dir=shipped))
    assert with_shipped["shipped tables"].startswith("1 files@")


def _claim_both(policy: TuningPolicy, archs: tuple[str, str]) -> None:
    """Rank 0, then rank 1, claim the inputs ``policy`` gives on a GPU of each of ``archs``."""
    claims = dist.HashStore()
    for rank, arch in enumerate(archs):
        checker = AgreementChecker(policy, store=claims, rank=rank, ranks=[0, 1])
        checker.compare_inputs(describe_inputs(policy, arch=arch))


def test_ranks_on_different_archs_fail_at_init_naming_the_arch_and_the_way_out() -> None:
    """Before, the arch was no input: ranks on two archs launched each its arch's entry (or chaos
    picks), were never paired by a per-key check, and nothing was raised."""
    with pytest.raises(InputMismatchError) as raised:
        _claim_both(TuningPolicy(mode="deterministic"), ("sm90", "sm80"))
    assert raised.value.differences == {"arch": {0: "sm90", 1: "sm80"}}
    assert "arch: rank 0: sm90; rank 1: sm80" in str(raised.value)
    assert "one GPU arch per job" in str(raised.value) and "MEGATRON_TUNING_AGREEMENT=off" in str(
        raised.value
    )
    for mode in ("chaos", "auto"):
        with pytest.raises(InputMismatchError, match="arch: rank 0: sm90; rank 1: sm80"):
            _claim_both(TuningPolicy(mode=mode), ("sm90", "sm80"))


@pytest.mark.parametrize(
    "policy",
    [
        TuningPolicy(agreement="off"),
        TuningPolicy(mode="auto", agreement="off"),
        TuningPolicy(mode="tune"),
        TuningPolicy(mode="off"),
    ],
)
def test_a_policy_that_compares_no_key_runs_on_mixed_archs(policy: TuningPolicy) -> None:
    _claim_both(policy, ("sm90", "sm80"))  # each arch launches its own entries, compared with none


def test_the_arch_of_a_cpu_or_interpreter_run_is_unknown_and_one_process_reads_none() -> None:
    assert "arch" not in describe_inputs(TuningPolicy())  # no process group: nothing to compare
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert describe_inputs(TuningPolicy())["arch"] == "unknown"  # TRITON_INTERPRET=1 here
    finally:
        dist.destroy_process_group()
    _claim_both(TuningPolicy(), ("unknown", "unknown"))
