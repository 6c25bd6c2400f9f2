"""A kernel whose config holds a value no table can store (a jit function as a constexpr): the modes
that store or share decisions (``auto``, ``record``, ``tune``) refuse it at its first in-scope
launch, before measuring, with one error naming the kernel, the field, the type and the fix; the
modes that store nothing launch it as before (``auto`` and ``tune`` too where it is the only config),
and a decision log writes the value as its text. Real launches in the interpreter; measurements are
fakes that count their calls."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import triton

import megatron_tuning
from megatron_tuning.core import notices
from megatron_tuning.core.decisions import decision_log, get_decisions
from megatron_tuning.core.errors import UnstorableConfigError
from megatron_tuning.core.identity import config_signature, kernel_id
from megatron_tuning.core.key import render
from megatron_tuning.core.notices import reset_warnings
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.distributed.store import StoreConsensus
from megatron_tuning.runtime import interception
from megatron_tuning.tables.records import read_decisions, recording_path
from megatron_tuning.tables.table import load_table

from .. import support_kernels as sk
from ..support_kernels import grid

KERNEL = kernel_id(sk.activate)


@pytest.fixture(autouse=True)
def _clean_state():
    sk.BENCH_CALLS.clear()
    decision_log().clear()
    reset_warnings()
    for kernel in (sk.activate, sk.activate_one, sk.scale_add):
        kernel.cache.clear()
    yield
    interception.uninstall()
    decision_log().clear()


class CountingMeasure:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, autotuner: Any, candidates: list[Any], *rest: Any) -> tuple[Any, dict[str, Any]]:
        self.calls += 1
        return candidates[0], {"median_ms": {config_signature(c): 1.0 for c in candidates}}


def _activate() -> torch.Tensor:
    x = torch.arange(8, dtype=torch.float32)
    out = torch.full((8,), float("nan"))
    sk.activate[grid(8)](x, out, 8)
    return out


def _refused(mode: str) -> UnstorableConfigError:
    with pytest.raises(UnstorableConfigError) as info:
        _activate()
    error = info.value
    assert (error.kernel, error.mode) == (KERNEL, mode)
    message = str(error)
    assert f"Kernel {KERNEL} cannot run in mode {mode!r}" in message
    assert f"config field ACT holds a value of type {type(sk.negate).__name__}" in message
    assert "int, float, bool, str and None" in message
    assert "as a launch argument rather than as a config constexpr" in message
    assert "mode 'deterministic'" in message
    assert str(pickle.loads(pickle.dumps(error))) == message  # crosses processes whole
    assert sk.BENCH_CALLS == []  # refused before anything was measured
    assert [d for d in get_decisions() if d.kernel == KERNEL] == []
    return error


def test_auto_refuses_before_measuring_and_caches_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "auto.msgpack"
    measure = CountingMeasure()
    policy = TuningPolicy(mode="auto", cache=str(cache), use_shipped_tables=False)
    with megatron_tuning.init_deterministic_tuning(policy, measure=measure):
        error = _refused("auto")
        with pytest.raises(UnstorableConfigError):  # each launch, not the first only
            _activate()
    assert "cache table" in str(error) and "the job's store" in str(error)
    assert measure.calls == 0 and not cache.exists()


def test_auto_publishes_nothing_to_the_jobs_store() -> None:
    store = dist.HashStore()
    measure = CountingMeasure()
    consensus = StoreConsensus(store=store, rank=0, world=2)
    interception.install(TuningPolicy(mode="auto"), measure=measure, consensus=consensus)
    _refused("auto")
    assert measure.calls == 0 and store.num_keys() == 0


def test_record_refuses_before_triton_measures_and_keeps_what_it_recorded(tmp_path: Path) -> None:
    policy = TuningPolicy(mode="record", record_dir=str(tmp_path))
    with megatron_tuning.init_deterministic_tuning(policy):
        x = torch.randn(30)
        sk.scale_add[grid(30)](x, x, torch.empty(30), 30, 0.5)  # recorded before the refusal
        sk.BENCH_CALLS.clear()
        _refused("record")
    (entry,) = load_table(recording_path(tmp_path, 0))
    assert entry.kernel == kernel_id(sk.scale_add) and entry.how == "recorded"


def test_tune_refuses_before_measuring() -> None:
    measure = CountingMeasure()
    interception.install(TuningPolicy(mode="tune"), measure=measure)
    _refused("tune")
    assert measure.calls == 0


@pytest.mark.parametrize("mode", ["deterministic", "chaos", "off"])
def test_modes_that_store_nothing_launch_such_a_kernel(mode: str) -> None:
    interception.install(TuningPolicy(mode=mode))
    out = _activate()
    x = torch.arange(8, dtype=torch.float32)
    act = sk.activate.best_config.kwargs["ACT"]
    torch.testing.assert_close(out, x * 2 if act is sk.double else -x)


def test_deterministic_without_a_table_launches_the_cheapest_without_measuring(notices: Any) -> None:
    negate, double = sk.ACT_CONFIGS
    interception.install(TuningPolicy(mode="deterministic", use_shipped_tables=False))
    out = _activate()
    torch.testing.assert_close(out, torch.arange(8, dtype=torch.float32) * 2)
    assert sk.activate.best_config is double and sk.BENCH_CALLS == []
    (decision,) = get_decisions()
    assert (decision.source, decision.signature) == ("cheapest", config_signature(double))
    # Its notice advised auto, a table or tune: each refuses this kernel. It says what to change first.
    (message,) = notices.matching(f"kernel {KERNEL} has no tuned config")
    fix = "To be pinned and fast, first make its configs storable, since auto, record and tune refuse"
    assert f"{fix} this kernel as it is: config field ACT holds a value of type" in message
    assert (
        "as a launch argument rather than as a config constexpr, then use MEGATRON_TUNING_MODE=auto"
        in message
    )
    x = torch.randn(30)
    sk.scale_add[grid(30)](x, x, torch.empty(30), 30, 0.5)  # storable configs: the usual advice
    (usual,) = notices.matching(f"kernel {kernel_id(sk.scale_add)} has no tuned config")
    assert "To be pinned and fast, use MEGATRON_TUNING_MODE=auto" in usual and "storable" not in usual


def test_a_deterministic_decision_log_writes_such_a_value_as_its_text(tmp_path: Path) -> None:
    log = tmp_path / "decisions.json"
    policy = TuningPolicy(mode="deterministic", decision_log=str(log), use_shipped_tables=False)
    with megatron_tuning.init_deterministic_tuning(policy):
        _activate()
    (decision,) = read_decisions(log)
    assert decision.source == "cheapest" and decision.signature == config_signature(sk.ACT_CONFIGS[1])
    assert decision.config["kwargs"]["ACT"] == render(sk.double)


def _activate_one() -> torch.Tensor:
    x = torch.arange(8, dtype=torch.float32)
    out = torch.full((8,), float("nan"))
    sk.activate_one[grid(8)](x, out, 8)
    return out


@pytest.mark.parametrize("mode", ["auto", "tune"])
def test_the_only_config_launches_in_auto_and_tune_as_nothing_is_measured_or_stored(
    mode: str, tmp_path: Path
) -> None:
    cache, measure = tmp_path / "auto.msgpack", CountingMeasure()
    policy = TuningPolicy(mode=mode, cache=str(cache), use_shipped_tables=False)
    with megatron_tuning.init_deterministic_tuning(policy, measure=measure):
        torch.testing.assert_close(_activate_one(), -torch.arange(8, dtype=torch.float32))
    assert measure.calls == 0 and sk.BENCH_CALLS == [] and not cache.exists()
    (decision,) = [d for d in get_decisions() if d.kernel == kernel_id(sk.activate_one)]
    assert decision.source == "single"


def test_record_refuses_the_only_config_too_as_its_recording_would_keep_it(tmp_path: Path) -> None:
    policy = TuningPolicy(mode="record", record_dir=str(tmp_path))
    with megatron_tuning.init_deterministic_tuning(policy), pytest.raises(UnstorableConfigError) as info:
        _activate_one()
    assert info.value.kernel == kernel_id(sk.activate_one) and info.value.mode == "record"


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        (triton.Config({"BLOCK_SIZE": 2**70}, num_warps=1), "integer 1180591620717411303424 in config field"),
        (triton.Config({"BLOCK_SIZE": 16, "SCALE": float("nan")}, num_warps=1), "non-finite number nan"),
        (triton.Config({"BLOCK_SIZE": 16, "TAG": "\ud800"}, num_warps=1), "is not valid Unicode"),
        (triton.Config({"BLOCK_SIZE": 16}, num_warps=4096), "config.num_warps=4096 is outside"),
    ],
    ids=["int", "float", "text", "num-warps"],
)
def test_a_value_out_of_range_is_advised_to_change_not_to_move_to_a_launch_argument(config, problem):
    with interception.lazy_benchmarker():
        autotuner = triton.autotune(configs=[sk.ADD_CONFIGS[0], config], key=["n"])(sk.twin_body)
    measure = CountingMeasure()
    interception.install(TuningPolicy(mode="tune"), measure=measure)
    x = torch.zeros(8)
    with pytest.raises(UnstorableConfigError) as info:
        autotuner[grid(8)](x, x, 8)
    message = str(info.value)
    assert problem in message and "launch argument" not in message
    assert "Change it in the kernel's triton.Config(...) list to a value a table can hold" in message
    assert str(pickle.loads(pickle.dumps(info.value))) == message and measure.calls == 0
    fix = notices.fix_an_unstorable_miss(info.value.problem, wrong_type=False)
    assert "launch argument" not in fix and "triton.Config(...) list" in fix
