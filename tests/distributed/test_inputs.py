"""What a rank claims as its inputs (``distributed/inputs.py``): equal where its choices are equal, and
different where they could differ, whatever form the table takes."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from megatron_tuning.core.key import Key
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.distributed.inputs import describe_inputs

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
