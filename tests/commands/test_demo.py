"""How the demo judges a rank's chaos phase (``chaos_verdict``); the 2-rank run is in tests_distributed."""

from __future__ import annotations

from megatron_tuning.commands.demo import chaos_verdict
from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.errors import DivergenceError


def _chaos(outcome: str) -> Decision:
    return Decision(kernel="k:f", key="n=1", signature="BLOCK=1", source="chaos", chaos=outcome)


def test_a_divergence_is_proof():
    error = DivergenceError("k:f", "n=1", {0: "A", 1: "B"})
    code, lines = chaos_verdict([_chaos("first")], error, 0, 2)
    assert code == 0 and "fired, as it must (DivergenceError)" in lines[0]


def test_silence_where_keys_could_differ_is_blind():
    code, lines = chaos_verdict([_chaos("no_other_config"), _chaos("differs")], None, 1, 2)
    assert code == 4 and lines == [
        "rank 1: chaos ran and no divergence was detected: the agreement check is blind"
    ]


def test_silence_where_no_key_could_differ_proves_nothing():
    code, lines = chaos_verdict([_chaos("no_other_config")], None, 1, 2)
    assert code == 4 and "could not make ranks differ" in lines[0] and "proves nothing" in lines[0]


def test_one_process_has_nothing_to_compare():
    code, lines = chaos_verdict([_chaos("rank_formula")], None, 0, 1)
    assert code == 0 and "nothing to compare" in lines[0]
