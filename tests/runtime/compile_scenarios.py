"""Child process of ``test_inductor.py``: torch.compile scenarios on a CPU, one JSON result line.

    python -m tests.runtime.compile_scenarios SCENARIO [SCENARIO ...]

Run with no ``TRITON_INTERPRET`` in the environment (see ``compile_kernels``). Dynamo builds its
Triton kernel node only when ``torch.utils._triton.has_triton()`` is true, so it is forced here.
A capture backend records, for each kernel node, the configs of the kernel the node points at
(what Inductor would compile and benchmark), then erases the node. ``aot_eager`` runs the node
through its eager implementation, which launches that kernel via ``Autotuner.run`` (stubbed in
``compile_kernels``: it records the launched constexprs).
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._triton
import triton

torch.utils._triton.has_triton = lambda: True  # Dynamo reads it at call time (builder.py)

from torch._higher_order_ops.triton_kernel_wrap import (  # noqa: E402
    kernel_side_table,
    triton_kernel_wrapper_functional,
    triton_kernel_wrapper_mutation,
)

from megatron_tuning.core.decisions import decision_log, get_decisions  # noqa: E402
from megatron_tuning.core.identity import config_signature, kernel_id  # noqa: E402
from megatron_tuning.core.policy import TuningPolicy  # noqa: E402
from megatron_tuning.runtime import interception  # noqa: E402
from megatron_tuning.runtime.interception import lazy_benchmarker  # noqa: E402

with lazy_benchmarker():  # Triton 3.3 resolves its benchmarker at decoration
    from tests.runtime import compile_kernels as ck

ck.stub_launches()
HOPS = (triton_kernel_wrapper_mutation, triton_kernel_wrapper_functional)
WB = kernel_id(ck.write_block)
EVEN = kernel_id(ck.add_one_even)
BY_BLOCK = {c.kwargs["BLOCK"]: c for c in ck.CONFIGS}
# A key-dependent table: n=1000 -> BLOCK 128 (a table hit); any other key misses -> cheapest (32).
TABLE = {
    (WB, "n=1000 | y_ptr:torch.float32"): BY_BLOCK[128],
    (EVEN, "n=64 | x_ptr:torch.float32, y_ptr:torch.float32"): BY_BLOCK[64],
}


class Capture:
    """A backend that records each kernel node's configs, then erases the node (no launch on CPU)."""

    def __init__(self) -> None:
        self.graphs: list[list[list[int]]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.graphs.append(hop_configs(gm, erase=True))
        return gm.forward


def hop_configs(gm: torch.fx.GraphModule, *, erase: bool = False) -> list[list[int]]:
    found = []
    for node in list(gm.graph.nodes):
        if node.target in HOPS:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            found.append([c.kwargs["BLOCK"] for c in getattr(kernel, "configs", [])])
            if erase:
                gm.graph.erase_node(node)
    if erase:
        gm.recompile()
    return found


def write_block(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    ck.write_block[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](y, n)
    return y


def add_one_even(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    ck.add_one_even[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
    return y


def eager_block(fn: Callable[[torch.Tensor], Any], n: int) -> int:
    """The BLOCK the eager (pinned) path launches for size ``n``."""
    ck.LAUNCHES.clear()
    fn(torch.zeros(n))
    (launch,) = ck.LAUNCHES
    return int(launch["BLOCK"])


def decisions() -> list[list[str]]:
    return [[d.kernel, d.key, d.signature, d.source] for d in get_decisions()]


def compiled(fn: Callable[..., Any], sizes: tuple[int, ...], **options: Any) -> list[list[list[int]]]:
    capture = Capture()
    compiled_fn = torch.compile(fn, backend=capture, **options)
    for n in sizes:
        compiled_fn(torch.zeros(n))
    return capture.graphs


def start(policy: TuningPolicy | None, **install: Any) -> None:
    torch._dynamo.reset()
    decision_log().clear()
    ck.LAUNCHES.clear()
    ck.BENCH_CALLS.clear()
    for kernel in (ck.write_block, ck.add_one_even):
        kernel.cache.clear()
    if policy is not None:
        interception.install(policy, **install)


def deterministic(**changes: Any) -> TuningPolicy:
    # min_cost, not the default nearest: a key without an entry must get a decision of its own
    # (the cheapest), so that the two keys of a scenario launch different configs.
    changes.setdefault("on_miss", "min_cost")
    return TuningPolicy(mode="deterministic", agreement="off", use_shipped_tables=False, **changes)


# --------------------------------------------------------------------------- scenarios


def deferred_tripwire() -> dict[str, Any]:
    """First scenario: nothing has imported Inductor's runtime yet when the library installs."""
    from megatron_tuning.runtime import inductor

    heuristics = "torch._inductor.runtime.triton_heuristics"
    before = {"dynamo_loaded": "torch._dynamo" in sys.modules, "inductor_loaded": heuristics in sys.modules}
    start(deterministic())
    at_install = sorted(inductor._originals)
    compiled(write_block, (1000,), fullgraph=True)
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    wrapped = hasattr(CachingAutotuner.__dict__["benchmark_all_configs"], "__wrapped__")
    return {
        **before,
        "at_install": at_install,
        "after_trace": sorted(inductor._originals),
        "wrapped": wrapped,
    }


def static() -> dict[str, Any]:
    start(deterministic(), table=TABLE)
    eager_first = eager_block(write_block, 1000)
    graphs = compiled(write_block, (1000, 2000, 1000), dynamic=False, fullgraph=True)
    cache = {repr(k): config_signature(v) for k, v in ck.write_block.cache.items()}
    return {
        "eager": [eager_first, eager_block(write_block, 2000)],
        "graphs": graphs,
        "decisions": decisions(),
        "triton_cache": cache,
        "best_config": config_signature(ck.write_block.best_config),
        "bench_calls": len(ck.BENCH_CALLS),
    }


def dynamic() -> dict[str, Any]:
    start(deterministic(), table=TABLE)
    graphs = compiled(write_block, (1000, 2000, 1000, 2000), dynamic=True, fullgraph=True)
    return {
        "graphs": graphs,
        "eager": [eager_block(write_block, 1000), eager_block(write_block, 2000)],
        "decisions": decisions(),
    }


def automatic_dynamic() -> dict[str, Any]:
    start(deterministic(), table=TABLE)
    graphs = compiled(write_block, (1000, 2000, 3000, 1000), fullgraph=True)  # dynamic=None
    return {"graphs": graphs, "decisions": decisions()}


def aot_eager_heuristics() -> dict[str, Any]:
    start(deterministic(), table=TABLE)
    compiled_fn = torch.compile(add_one_even, backend="aot_eager", fullgraph=True)
    launched = []
    for n in (48, 64, 48):
        ck.LAUNCHES.clear()
        compiled_fn(torch.zeros(n))
        launched.append(list(ck.LAUNCHES))
    eager = []
    for n in (48, 64):
        ck.LAUNCHES.clear()
        add_one_even(torch.zeros(n))
        eager.append(list(ck.LAUNCHES))
    return {
        "compiled": launched,
        "eager": eager,
        "decisions": decisions(),
        "bench_calls": len(ck.BENCH_CALLS),
    }


def wrap_triton_make_fx() -> dict[str, Any]:
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.library import wrap_triton

    def traced(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        n = x.numel()
        wrap_triton(ck.write_block)[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](y, n)
        return y

    start(deterministic(), table=TABLE)
    gm = make_fx(traced, tracing_mode="symbolic")(torch.zeros(1000))
    shape_env = getattr(gm, "shape_env", None)
    guards = [str(g.expr) for g in shape_env.guards] if shape_env is not None else None
    return {"graphs": [hop_configs(gm)], "guards": guards, "decisions": decisions()}


def triton_op_compiled() -> dict[str, Any]:
    from torch.library import triton_op, wrap_triton

    @triton_op("mt_compile_test::write_block", mutates_args={})
    def op(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        n = x.numel()
        wrap_triton(ck.write_block)[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](y, n)
        return y

    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def forward_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        graphs.append(hop_configs(gm))  # the kernel node AOTAutograd hands the compiler
        return gm.forward  # runs the node eagerly: Autotuner.run of the kernel it points at

    start(deterministic(), table=TABLE)
    backend = aot_autograd(fw_compiler=forward_compiler)
    compiled_fn = torch.compile(lambda x: op(x), backend=backend, dynamic=True, fullgraph=True)
    launched = []
    for n in (1000, 2000, 1000):
        ck.LAUNCHES.clear()
        compiled_fn(torch.zeros(n))
        launched.append([launch["BLOCK"] for launch in ck.LAUNCHES])
    return {"graphs": graphs, "compiled": launched, "decisions": decisions()}


def chaos() -> dict[str, Any]:
    start(TuningPolicy(mode="chaos", agreement="off", use_shipped_tables=False))
    eager_first = eager_block(write_block, 1000)
    graphs = compiled(write_block, (1000, 2000), fullgraph=True)
    return {
        "eager": [eager_first, eager_block(write_block, 2000)],
        "graphs": graphs,
        "decisions": decisions(),
    }


def tune_at_trace_time() -> dict[str, Any]:
    measured: list[str] = []

    def measure(autotuner: Any, candidates: list[Any], *rest: Any) -> Any:
        measured.append(kernel_id(autotuner))
        raise AssertionError("measure called at trace time")

    start(TuningPolicy(mode="tune", agreement="off"), measure=measure)
    graphs = compiled(write_block, (1000,), fullgraph=True)
    return {
        "graphs": graphs,
        "eager": [eager_block(write_block, 1000)],
        "measured": measured,
        "decisions": decisions(),
    }


def miss_error() -> dict[str, Any]:
    start(deterministic(on_miss="error"))
    outcome = {}
    for fullgraph in (False, True):
        torch._dynamo.reset()
        try:
            compiled(write_block, (1000,), fullgraph=fullgraph)
            outcome[str(fullgraph)] = ["no error", ""]
        except Exception as e:
            outcome[str(fullgraph)] = [type(e).__name__, str(e)]
    return {"outcome": outcome, "decisions": decisions()}


def agreement_listener() -> dict[str, Any]:
    """The agreement check is a decision-log listener: it sees compiled decisions, and can stop them."""
    from megatron_tuning.core.errors import DivergenceError

    seen: list[str] = []

    def check(decision: Any) -> None:
        seen.append(decision.key)
        if decision.key.startswith("n=2000"):
            raise DivergenceError(decision.kernel, decision.key, {0: decision.signature, 1: "other"})

    start(deterministic(), table=TABLE)
    decision_log().add_listener(check)
    try:
        graphs = compiled(write_block, (1000,), fullgraph=True)
        try:
            compiled(write_block, (2000,))  # not fullgraph: the graph breaks, the eager launch raises
            outcome = ["no error", ""]
        except Exception as e:
            outcome = [type(e).__name__, str(e)]
    finally:
        decision_log().remove_listener(check)
    return {"graphs": graphs, "seen": seen, "outcome": outcome, "launches": len(ck.LAUNCHES)}


def dynamo_reset() -> dict[str, Any]:
    """After ``torch._dynamo.reset()`` a recompile launches the current pin, never an old record."""

    def compiled_blocks(n: int) -> list[int]:
        ck.LAUNCHES.clear()
        torch.compile(write_block, backend="aot_eager", fullgraph=True)(torch.zeros(n))
        return [launch["BLOCK"] for launch in ck.LAUNCHES]

    start(deterministic(), table=TABLE)
    first = [eager_block(write_block, 1000), compiled_blocks(1000), eager_block(write_block, 1000)]
    torch._dynamo.reset()
    recompiled = [compiled_blocks(1000), eager_block(write_block, 1000)]
    decisions_before = len(get_decisions())
    torch._dynamo.reset()
    interception.install(deterministic(), table={(WB, "n=1000 | y_ptr:torch.float32"): BY_BLOCK[64]})
    reinstalled = [compiled_blocks(1000), eager_block(write_block, 1000), eager_block(write_block, 1000)]
    return {
        "first": first,
        "recompiled": recompiled,
        "decisions_before": decisions_before,
        "reinstalled": reinstalled,
        "graphs": compiled(write_block, (1000,), fullgraph=True),
        "decisions": decisions(),
    }


def out_of_scope() -> dict[str, Any]:
    start(deterministic(scope=("some_other_package",)), table=TABLE)
    return {"graphs": compiled(write_block, (1000,), fullgraph=True), "decisions": decisions()}


def mode_off() -> dict[str, Any]:
    start(TuningPolicy(mode="off", agreement="off"))
    return {"graphs": compiled(write_block, (1000,), fullgraph=True), "decisions": decisions()}


def not_installed() -> dict[str, Any]:
    start(None)
    return {"graphs": compiled(write_block, (1000,), fullgraph=True), "decisions": decisions()}


def auto_first_run() -> dict[str, Any]:
    """``auto``, a key first reached in compiled code: nothing decided at trace time; Inductor's first
    run (its real ``autotune_to_one_config`` over a GPU-less ``CachingAutotuner``) tunes it."""
    import megatron_tuning

    torch._dynamo.reset()
    handle = megatron_tuning.init_deterministic_tuning(
        TuningPolicy.from_env(mode="auto", use_shipped_tables=False)
    )
    graphs = compiled(write_block, (1000,), fullgraph=True)
    at_trace = decisions()
    (((*blocks,),),) = graphs  # the configs the kernel node carries: what Inductor compiles
    caching = ck.first_run(ck.write_block, ["y_ptr", "n"], [BY_BLOCK[b] for b in blocks], slow_unless=128)
    if len(caching.launchers) > 1:  # as Inductor's run: one launcher is launched, never benchmarked
        caching.autotune_to_one_config(torch.zeros(1000), 1000)
    ck.LAUNCHES.clear()
    (launcher,) = caching.launchers
    launcher(torch.zeros(1000), 1000, stream=0)
    again = compiled(write_block, (1000,), fullgraph=True)  # a recompile: the decision, one config
    handle.close()
    return {
        "graphs": graphs,
        "at_trace": at_trace,
        "launched": [launch["BLOCK"] for launch in ck.LAUNCHES],
        "again": again,
        "decisions": decisions(),
    }


SCENARIOS = {
    fn.__name__: fn
    for fn in (
        deferred_tripwire,  # first: it needs a process where Inductor is not imported yet
        static,
        dynamic,
        automatic_dynamic,
        aot_eager_heuristics,
        wrap_triton_make_fx,
        triton_op_compiled,
        chaos,
        tune_at_trace_time,
        miss_error,
        agreement_listener,
        dynamo_reset,
        out_of_scope,
        mode_off,
        not_installed,
        auto_first_run,
    )
}


def main(names: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    results: dict[str, Any] = {}
    for name in names or list(SCENARIOS):
        try:
            results[name] = SCENARIOS[name]()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        finally:
            interception.uninstall()
    print("RESULT " + json.dumps(results, sort_keys=True), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
