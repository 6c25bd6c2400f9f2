"""How ``selftest`` judges its chaos run: only a divergence is proof; a run that could not differ is
inconclusive, not "blind" and not a pass. (The real torchrun runs are in tests_distributed.)"""

from __future__ import annotations

from typing import Any

from megatron_tuning.commands.selftest import _judge

KERNEL = "megatron_tuning.kernels:add_one_kernel"


def _outcome(errors: bool, chaos: str | None) -> dict[str, Any]:
    decisions = [
        [KERNEL, "n=64 | x_ptr:torch.float32", "BLOCK=64, num_warps=4, num_stages=3", "chaos", chaos]
    ]
    ranks: dict[int, dict[str, Any]] = {}
    for rank in (0, 1):
        ranks[rank] = {"decisions": decisions, "error": None}
        if errors:
            ranks[rank].update(
                error="DivergenceError", message="m", kernel=KERNEL, key="n=64", signature_ranks=[0, 1]
            )
    return {"returncode": 0, "ranks": ranks, "seconds": 1.0}


def test_a_divergence_passes_and_counts_the_keys_that_could_differ():
    ok, summary = _judge("chaos", _outcome(errors=True, chaos="differs"), 2)
    assert ok and "DivergenceError on ranks [0, 1]" in summary and "1 chaos key(s) could differ" in summary


def test_no_divergence_where_keys_could_differ_is_blind():
    ok, summary = _judge("chaos", _outcome(errors=False, chaos="first"), 2)
    assert not ok and "the agreement check is blind" in summary


def test_no_divergence_where_no_key_could_differ_is_inconclusive_not_blind():
    ok, summary = _judge("chaos", _outcome(errors=False, chaos="no_other_config"), 2)
    assert not ok and "inconclusive" in summary and "proves nothing" in summary and "blind" not in summary
