"""The torch.compile adapter: compiled graphs get the eager pin; a bypass is never silent.

CPU torch cannot run Inductor on Triton kernels, so the compiled-path tests run Dynamo for real
in a child process (``compile_scenarios``: real kernels decorated without the interpreter,
``has_triton`` forced, a backend that records which configs each kernel node carries, or
``aot_eager``, whose eager kernel node launches through ``Autotuner.run``). Without the hook every
node carries all four configs (``test_without_the_hook_every_config_reaches_the_compiler``), so
each pin assertion below fails when the hook is removed. The GPU behaviour (Inductor launches,
CUDA graphs, zero benchmarks) is ``benchmarks/bench_compile.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from torch._higher_order_ops.triton_kernel_wrap import TritonHOPifier, kernel_side_table
from torch._inductor.runtime.triton_heuristics import CachingAutotuner

from megatron_tuning.core.decisions import get_decisions
from megatron_tuning.core.errors import CompiledLaunchNotPinnedError
from megatron_tuning.core.identity import config_signature, kernel_id
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.runtime import inductor, interception, pinning

from .. import support_kernels as sk

REPO = Path(__file__).resolve().parents[2]
WB = "tests.runtime.compile_kernels:write_block"
EVEN = "tests.runtime.compile_kernels:add_one_even"
WB_1000 = "n=1000 | y_ptr:torch.float32"
WB_2000 = "n=2000 | y_ptr:torch.float32"
SIG = {
    block: f"BLOCK={block}, num_warps={warps}, num_stages={{}}"
    for block, warps in ((128, 4), (32, 1), (64, 2))
}
ALL_CONFIGS = [[[256, 128, 64, 32]]]  # one graph, one kernel node, every config: what stock compiles


def _sig(block: int, stages: int) -> str:
    return SIG[block].format(stages)


def _run_scenarios(env: dict[str, str], *names: str) -> dict[str, Any]:
    """Run ``tests.runtime.compile_scenarios`` in a fresh process; its last ``RESULT`` line, parsed."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.runtime.compile_scenarios", *names],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scenario of ``compile_scenarios``, run once in a child without the Triton interpreter."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MEGATRON_TUNING_") and k != "TRITON_INTERPRET"
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("compile_triton_cache"))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("compile_inductor_cache"))
    return _run_scenarios(env)


def _result(scenarios: dict[str, Any], name: str) -> dict[str, Any]:
    result = scenarios[name]
    assert "error" not in result, result.get("error")
    return result


def _stages(result: dict[str, Any]) -> int:
    """The default num_stages of this Triton release, read from a decision signature."""
    return int(result["decisions"][0][2].rsplit("num_stages=", 1)[1])


# --------------------------------------------------------------------------- the compiled path


@pytest.mark.slow
def test_without_the_hook_every_config_reaches_the_compiler(scenarios):
    # The control: what Inductor would compile and benchmark when nothing pins the kernel.
    assert _result(scenarios, "not_installed")["graphs"] == ALL_CONFIGS


def test_static_shapes_compile_the_eager_config_per_key(scenarios):
    result = _result(scenarios, "static")
    stages = _stages(result)
    assert result["eager"] == [128, 32]  # table hit for n=1000, cheapest for n=2000
    assert result["graphs"] == [[[128]], [[32]]]  # 1000, 2000 (the second 1000 reuses graph 1)
    assert result["decisions"] == [
        [WB, WB_1000, _sig(128, stages), "table"],
        [WB, WB_2000, _sig(32, stages), "cheapest"],
    ]  # one decision per key, shared by eager and compiled launches, same kernel id and key
    assert result["bench_calls"] == 0


def test_dynamic_shapes_specialize_each_key_value(scenarios):
    result = _result(scenarios, "dynamic")
    assert result["graphs"] == [[[128]], [[32]]]  # 4 calls, one graph per key value, reused
    assert result["eager"] == [128, 32]
    assert [d[1] for d in result["decisions"]] == [WB_1000, WB_2000]


def test_automatic_dynamic_shapes_stay_pinned_after_the_recompile(scenarios):
    result = _result(scenarios, "automatic_dynamic")
    assert result["graphs"] == [[[128]], [[32]], [[32]]]  # 1000, 2000 (now dynamic), 3000
    assert [d[3] for d in result["decisions"]] == ["table", "cheapest", "cheapest"]


def test_aot_eager_launches_the_eager_config_with_pruning_and_heuristics(scenarios):
    result = _result(scenarios, "aot_eager_heuristics")
    # n=48: pruning leaves BLOCK 32 only (EVEN false); n=64: the table picks 64 (EVEN true).
    assert result["eager"] == [
        [{"kernel": "add_one_even", "BLOCK": 32, "EVEN": False}],
        [{"kernel": "add_one_even", "BLOCK": 64, "EVEN": True}],
    ]
    assert result["compiled"] == [result["eager"][0], result["eager"][1], result["eager"][0]]
    assert [(d[0], d[3]) for d in result["decisions"]] == [(EVEN, "single"), (EVEN, "table")]
    assert result["bench_calls"] == 0


def test_wrap_triton_tracing_is_pinned_and_guards_the_key(scenarios):
    result = _result(scenarios, "wrap_triton_make_fx")
    assert result["graphs"] == [[[128]]]
    assert any(g.startswith("Eq(") and g.endswith(", 1000)") for g in result["guards"]), result["guards"]
    assert [d[1] for d in result["decisions"]] == [WB_1000]


def test_triton_op_is_pinned_and_decided_once_per_key(scenarios):
    result = _result(scenarios, "triton_op_compiled")
    assert result["graphs"] == [[[128]], [[32]]]  # what AOTAutograd hands the compiler, per key
    assert result["compiled"] == [[128], [32], [128]]  # traced several times per compile
    assert [d[1] for d in result["decisions"]] == [WB_1000, WB_2000]


def test_chaos_mode_compiles_the_same_per_rank_pick_as_eager(scenarios):
    result = _result(scenarios, "chaos")
    assert result["graphs"] == [[[result["eager"][0]]], [[result["eager"][1]]]]
    assert [d[3] for d in result["decisions"]] == ["chaos", "chaos"]


def test_tune_mode_never_measures_at_trace_time(scenarios):
    result = _result(scenarios, "tune_at_trace_time")
    assert result["measured"] == []
    assert result["graphs"] == [[[32]]] and result["eager"] == [32]
    assert [d[3] for d in result["decisions"]] == ["cheapest"]


def test_a_decision_error_in_compiled_code_names_kernel_and_key(scenarios):
    outcome = _result(scenarios, "miss_error")["outcome"]
    # Graph break, then the eager launch raises the library's own error, unwrapped.
    error, message = outcome["False"]
    assert error == "TableMissError" and WB in message and WB_1000 in message
    # fullgraph=True cannot break the graph: Dynamo's Unsupported carries the same text.
    error, message = outcome["True"]
    assert error == "Unsupported" and "TableMissError" in message and WB in message and WB_1000 in message


def test_the_agreement_check_sees_compiled_decisions_and_its_error_surfaces(scenarios):
    result = _result(scenarios, "agreement_listener")
    assert result["graphs"] == [[[128]]]
    # n=2000 is checked at trace time (raises: graph break; Dynamo may trace it again), then at
    # the eager launch, which raises the error itself.
    assert result["seen"][0] == WB_1000 and set(result["seen"][1:]) == {WB_2000}
    error, message = result["outcome"]
    assert error == "DivergenceError" and WB in message and WB_2000 in message
    assert result["launches"] == 0  # nothing launched for the diverging key


def test_out_of_scope_kernels_and_mode_off_keep_inductors_behaviour(scenarios):
    out_of_scope = _result(scenarios, "out_of_scope")
    assert out_of_scope["graphs"] == ALL_CONFIGS
    assert out_of_scope["decisions"] == [[WB, "*", "", "out_of_scope"]]
    off = _result(scenarios, "mode_off")
    assert off["graphs"] == ALL_CONFIGS and off["decisions"] == []


def test_a_recompile_after_dynamo_reset_launches_the_current_pin(scenarios):
    result = _result(scenarios, "dynamo_reset")
    assert result["first"] == [128, [128], 128]  # eager, compiled (aot_eager), eager hit path
    assert result["recompiled"] == [[128], 128]  # the same installation: its pin, no new decision
    assert result["decisions_before"] == 1
    assert result["reinstalled"] == [[64], 64, 64]  # another table: never the old 128 record
    assert result["graphs"] == [[[64]]]
    assert [d[3] for d in result["decisions"]] == ["table", "table"]


def test_compiled_decision_is_filed_in_tritons_cache(scenarios):
    result = _result(scenarios, "static")
    stages = _stages(result)
    assert result["triton_cache"] == {
        "(1000, 'torch.float32')": _sig(128, stages),
        "(2000, 'torch.float32')": _sig(32, stages),
    }


# --------------------------------------------------------------------------- install, uninstall, warnings


def test_install_imports_neither_dynamo_nor_inductor_and_the_first_trace_sets_the_tripwire(scenarios):
    result = _result(scenarios, "deferred_tripwire")
    assert result["dynamo_loaded"] is False and result["inductor_loaded"] is False
    assert result["at_install"] == ["call_triton_kernel"]
    assert result["after_trace"] == ["benchmark_all_configs", "call_triton_kernel"] and result["wrapped"]


def test_install_patches_and_uninstall_restores_torch_exactly():
    hook = TritonHOPifier.__dict__["call_triton_kernel"]
    tripwire = CachingAutotuner.__dict__["benchmark_all_configs"]
    interception.install(TuningPolicy(mode="deterministic"))
    interception.install(TuningPolicy(mode="chaos"))  # patched once
    assert inductor.supported()
    assert TritonHOPifier.__dict__["call_triton_kernel"].__wrapped__ is hook
    assert CachingAutotuner.__dict__["benchmark_all_configs"].__wrapped__ is tripwire
    interception.uninstall()
    assert TritonHOPifier.__dict__["call_triton_kernel"] is hook
    assert CachingAutotuner.__dict__["benchmark_all_configs"] is tripwire
    assert not inductor.supported()


def test_a_torch_that_cannot_be_intercepted_is_named_in_one_warning(monkeypatch, notices):
    import torch

    monkeypatch.setattr(
        inductor, "_hopifier_class", lambda: (None, "TritonHOPifier.call_triton_kernel is missing")
    )
    interception.install(TuningPolicy(mode="deterministic"))
    inductor.warn_if_unsupported(TuningPolicy(mode="deterministic"))  # the same policy: said once
    warnings = notices.matching("cannot be intercepted")
    assert len(warnings) == 1
    interception.install(TuningPolicy(mode="deterministic"))  # a new policy reports again, once
    assert len(notices.matching("cannot be intercepted")) == 2
    assert f"torch {torch.__version__}" in warnings[0] and "call_triton_kernel is missing" in warnings[0]
    assert "NOT pinned" in warnings[0] and "MEGATRON_TUNING_STRICT" in warnings[0]
    assert not inductor.supported()  # the hook is not installed; the tripwire is
    assert not hasattr(TritonHOPifier.__dict__["call_triton_kernel"], "__wrapped__")
    assert CachingAutotuner.__dict__["benchmark_all_configs"].__wrapped__ is not None


def test_no_warning_when_supported_or_when_nothing_is_pinned(monkeypatch, notices):
    interception.install(TuningPolicy(mode="deterministic"))
    interception.uninstall()
    monkeypatch.setattr(inductor, "_hopifier_class", lambda: (None, "missing"))
    interception.install(TuningPolicy(mode="off"))
    interception.install(TuningPolicy(mode="record"))
    assert "cannot be intercepted" not in notices.text


# --------------------------------------------------------------------------- the tripwire


def _generated_copy(kernel: Any, n: int, launchers: int = 4, custom: bool = True) -> types.SimpleNamespace:
    """What Inductor's CachingAutotuner holds for a user kernel: a renamed copy of its source."""
    import inspect

    source = inspect.getsource(kernel.base_fn)
    source = source[source.index("def ") :].replace(
        f"def {kernel.base_fn.__name__}", f"def {kernel.base_fn.__name__}_0"
    )
    fn = types.SimpleNamespace(src=source, fn=types.SimpleNamespace(__name__=f"{kernel.base_fn.__name__}_0"))
    launcher = types.SimpleNamespace(def_args=["x_ptr", "y_ptr", "out_ptr", "n", "alpha"])
    return types.SimpleNamespace(custom_kernel=custom, launchers=[launcher] * launchers, fn=fn)


@pytest.fixture
def traced_scale_add() -> Any:
    import torch

    kernel_side_table.add_kernel(sk.scale_add)  # what Dynamo does when it traces a call
    x = torch.zeros(64)
    return (x, x, x, 64, 1.0)


def test_strict_mode_raises_when_compiled_code_benchmarks_an_in_scope_kernel(traced_scale_add):
    interception.install(TuningPolicy(mode="deterministic", strict=True))
    with pytest.raises(CompiledLaunchNotPinnedError) as info:
        CachingAutotuner.benchmark_all_configs(_generated_copy(sk.scale_add, 64), *traced_scale_add)
    error = info.value
    assert error.kernel == kernel_id(sk.scale_add) and error.candidates == 4
    assert error.key == "n=64 | x_ptr:torch.float32, y_ptr:torch.float32, out_ptr:torch.float32"
    assert error.kernel in str(error) and error.key in str(error)
    # A launcher without def_args: the key comes from the signature's non-constexpr arguments.
    copy = _generated_copy(sk.scale_add, 64)
    copy.launchers = [types.SimpleNamespace()] * 4
    names = ["x_ptr", "y_ptr", "out_ptr", "n", "alpha"]
    copy.triton_meta = {"signature": {**dict.fromkeys(names, "*fp32"), "BLOCK_SIZE": "constexpr"}}
    with pytest.raises(CompiledLaunchNotPinnedError) as info:
        CachingAutotuner.benchmark_all_configs(copy, *traced_scale_add)
    assert info.value.key == error.key


def test_tripwire_warns_on_a_rank_other_than_0(traced_scale_add, notices, monkeypatch):
    """Which compiled kernels run is this rank's own (a pipeline stage): rank 0 may run none."""
    monkeypatch.setenv("RANK", "1")
    tripwire = inductor._make_benchmark_all_configs(lambda self, *args, **kwargs: None)
    interception.install(TuningPolicy(mode="deterministic"))
    tripwire(_generated_copy(sk.scale_add, 64), *traced_scale_add)
    assert "benchmarks 4 configs of kernel " + kernel_id(sk.scale_add) in notices.text


def test_tripwire_warns_without_strict_and_stays_quiet_for_what_it_does_not_own(traced_scale_add, notices):
    calls: list[Any] = []
    tripwire = inductor._make_benchmark_all_configs(lambda self, *args, **kwargs: calls.append(self))
    interception.install(TuningPolicy(mode="deterministic"))
    tripwire(_generated_copy(sk.scale_add, 64), *traced_scale_add)
    assert "benchmarks 4 configs of kernel " + kernel_id(sk.scale_add) in notices.text
    assert "n=64 | x_ptr:torch.float32" in notices.text
    notices.clear()
    quiet = [
        _generated_copy(sk.scale_add, 64, launchers=1),  # pinned: one config, nothing to benchmark
        _generated_copy(sk.scale_add, 64, custom=False),  # Inductor's own kernel
    ]
    for copy in quiet:
        tripwire(copy, *traced_scale_add)
    interception.install(TuningPolicy(mode="deterministic", strict=True, scope=("elsewhere",)))
    tripwire(_generated_copy(sk.scale_add, 64), *traced_scale_add)  # out of scope
    interception.install(TuningPolicy(mode="off", strict=True))
    tripwire(_generated_copy(sk.scale_add, 64), *traced_scale_add)
    assert "benchmarks" not in notices.text
    assert len(calls) == 5  # Inductor's own benchmark always runs after the check
    assert [d.source for d in get_decisions()] == ["out_of_scope"]


# --------------------------------------------------------------------------- auto: tuned at the first run


def _run_auto_first_run(cache: Path, tmp_path: Path) -> dict[str, Any]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MEGATRON_TUNING_") and k != "TRITON_INTERPRET"
    }
    env.update(
        PYTHONPATH=str(REPO),
        MEGATRON_TUNING_CACHE=str(cache),
        MEGATRON_TUNING_TUNE_ROUNDS="1",
        TRITON_CACHE_DIR=str(tmp_path / "triton"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    return _result(_run_scenarios(env, "auto_first_run"), "auto_first_run")


@pytest.mark.slow
def test_auto_tunes_a_key_first_reached_in_compiled_code_once_and_later_runs_launch_it(tmp_path):
    """Two fresh processes sharing one cache; the key is first reached under torch.compile."""
    cache = tmp_path / "auto.msgpack"
    first, later = (_run_auto_first_run(cache, tmp_path) for _ in range(2))
    stages = _stages(first)
    # Run 1: nothing decided at trace time; Inductor gets every config, and its first run tunes
    # (BLOCK 128 is the one fast launcher): one decision, "tuned", launched and persisted.
    assert first["at_trace"] == [] and first["graphs"] == ALL_CONFIGS
    assert first["decisions"] == [[WB, WB_1000, _sig(128, stages), "tuned"]]
    assert first["launched"] == [128] and first["again"] == [[[128]]]
    # Run 2: the cache answers at trace time; Inductor compiles that one config.
    assert later["decisions"] == [[WB, WB_1000, _sig(128, stages), "table"]]
    assert later["graphs"] == [[[128]]] and later["launched"] == [128]


def _first_run_of(kernel: Any, args: tuple[Any, ...]) -> Any:
    """A GPU-less Inductor autotuner of ``kernel`` whose key ``auto`` deferred at trace time."""
    from . import compile_kernels as ck

    installation = pinning.active
    state = pinning.state_for(kernel, installation)
    inductor._deferred[kernel] = {state.key(args, {})}  # what the trace hook records
    return ck.first_run(
        kernel, ["x_ptr", "y_ptr", "out_ptr", "n", "alpha"], kernel.configs, mutated=["out_ptr"]
    )


class _PeerWon:
    """A job store where rank 1 claimed BLOCK_SIZE 16 first."""

    rank = 0

    def __init__(self) -> None:
        self.published: list[str] = []

    def lookup(self, kernel: str, key: str, arch: str, *, identity: str | None = None) -> Any:
        return None

    def publish(
        self,
        kernel: str,
        key: str,
        arch: str,
        config: Any,
        signature: str,
        timings: Any = None,
        *,
        identity: str | None = None,
    ) -> Any:
        self.published.append(signature)
        peer = next(c for c in sk.scale_add.configs if c.kwargs["BLOCK_SIZE"] == 16)
        return types.SimpleNamespace(config=config, signature=config_signature(peer), rank=1, timings=None)


def test_the_first_run_tunes_inductors_launchers_with_the_tuner_on_copies_of_the_outputs():
    import torch

    from megatron_tuning.tuning.stats import TuneSettings
    from megatron_tuning.tuning.tuner import ClockTimer, make_measure

    settings = TuneSettings(rounds=1, warmup_rounds=0, warmup_ms=0, max_launches=2)
    measure = make_measure(settings, timer=ClockTimer(), progress=False)
    interception.install(TuningPolicy(mode="auto", use_shipped_tables=False), measure=measure)
    x, out = torch.ones(64), torch.full((64,), float("nan"))
    caching = _first_run_of(sk.scale_add, (x, x, out, 64, 1.0))
    caching.autotune_to_one_config(x, x, out, 64, 1.0)
    (decision,) = [d for d in get_decisions() if d.kernel == kernel_id(sk.scale_add)]
    assert decision.source == "tuned" and decision.timings is not None
    (launcher,) = caching.launchers  # Inductor keeps the decided launcher, and only it
    assert config_signature(launcher.config) == decision.signature
    assert torch.isnan(out).all()  # the tuner launched on copies: the graph's output is untouched


def test_a_key_a_peer_claimed_first_launches_the_peers_config_and_capture_measures_nothing(monkeypatch):
    import torch

    measured: list[str] = []

    def measure(autotuner: Any, candidates: list[Any], args: Any, kwargs: Any, kernel: str, key: str) -> Any:
        measured.append(key)
        return candidates[-1], {"median_ms": 1.0}

    consensus = _PeerWon()
    policy = TuningPolicy(mode="auto", use_shipped_tables=False)
    interception.install(policy, measure=measure, consensus=consensus)
    x = torch.ones(64)
    caching = _first_run_of(sk.scale_add, (x, x, x, 64, 1.0))
    caching.autotune_to_one_config(x, x, x, 64, 1.0)
    (decision,) = [d for d in get_decisions() if d.kernel == kernel_id(sk.scale_add)]
    assert decision.source == "adopted" and decision.origin == "rank 1" and len(measured) == 1
    assert consensus.published == [config_signature(sk.scale_add.configs[-1])]  # ours, claimed
    (launcher,) = caching.launchers
    assert launcher.config.kwargs == {"BLOCK_SIZE": 16}
    assert config_signature(launcher.config) == decision.signature  # the peer's, on this rank too

    interception.install(policy, measure=measure)  # a new installation: the key is new again
    monkeypatch.setattr(pinning, "is_capturing", lambda: True)
    caching = _first_run_of(sk.scale_add, (x, x, x, 64, 1.0))
    caching.autotune_to_one_config(x, x, x, 64, 1.0)
    assert len(measured) == 1  # a CUDA-graph capture: the miss rule, nothing timed
    assert get_decisions()[-1].source in ("cheapest", "nearest")
