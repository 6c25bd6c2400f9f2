"""Tune mode end to end in the Triton interpreter: interception + measure on real kernels.

Timings come from the host clock here, so only the plumbing is checked (every candidate timed
with the real arguments, hooks honoured, results correct, decision recorded), not the choice.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from megatron_tuning.core.decisions import get_decisions
from megatron_tuning.core.identity import config_signature
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.runtime import interception
from megatron_tuning.tuning.stats import TuneSettings
from megatron_tuning.tuning.tuner import ClockTimer, make_measure

FAST = TuneSettings(rounds=2, warmup_rounds=0, sample_ms=0.001, max_launches=1)


@pytest.fixture
def kernels(import_kernel: Callable[[str], ModuleType]) -> ModuleType:
    module = import_kernel("tests.support_kernels")
    # The module's call logs are process-wide: start from none, whatever ran before in this worker.
    module.BENCH_CALLS.clear()
    module.PRE_HOOK_CALLS.clear()
    return module


def _install(scope: tuple[str, ...] = ("tests",)) -> None:
    interception.install(
        TuningPolicy(mode="tune", scope=scope), measure=make_measure(FAST, timer=ClockTimer(), progress=False)
    )


def test_tune_mode_times_all_candidates_and_records_a_tuned_decision(kernels: ModuleType) -> None:
    _install()
    n = 40
    x, y, out = torch.arange(n, dtype=torch.float32), torch.ones(n), torch.empty(n)
    kernels.scale_add[kernels.grid(n)](x, y, out, n, 2.0)
    torch.testing.assert_close(out, 2.0 * x + y)
    (decision,) = get_decisions()
    assert decision.source == "tuned"
    timings = decision.timings
    assert timings["winner"] == decision.signature
    assert set(timings["candidates"]) == {config_signature(c) for c in kernels.ADD_CONFIGS}
    assert all(len(v) == 2 for v in timings["samples"].values())
    assert not kernels.BENCH_CALLS  # Triton's own benchmark never ran
    # Second launch of the same key: pinned, no new decision, still correct.
    kernels.scale_add[kernels.grid(n)](x, y, out, n, 3.0)
    torch.testing.assert_close(out, 3.0 * x + y)
    assert len(get_decisions()) == 1


def test_tune_mode_honours_pruning_hooks_and_reset_to_zero(kernels: ModuleType) -> None:
    _install()
    kernels.PRE_HOOK_CALLS.clear()
    n = 64
    x = torch.arange(n, dtype=torch.float32)
    out = torch.full((n,), 123.0)
    kernels.copy_hooked[kernels.grid(n)](x, out, n)
    torch.testing.assert_close(out, x)
    (decision,) = get_decisions()
    # Only the pruned candidates (BLOCK_SIZE >= 32) were timed, each with its Config.pre_hook.
    timed = {int(s.split("BLOCK_SIZE=")[1].split(",")[0]) for s in decision.timings["candidates"]}
    assert timed == {32, 64, 128}
    assert set(kernels.PRE_HOOK_CALLS) >= {32, 64, 128}


def test_single_live_candidate_is_not_measured(kernels: ModuleType) -> None:
    _install()
    n = 16
    x, out = torch.arange(n, dtype=torch.float32), torch.empty(n)
    kernels.single_config_copy[kernels.grid(n)](x, out, n)
    torch.testing.assert_close(out, x)
    assert all(d.source != "tuned" for d in get_decisions())
