"""Reference kernels: results match torch, with explicit configs and through the pinned autotuner.

Runs in Triton's interpreter on CPU (conftest sets ``TRITON_INTERPRET=1``); shapes are small and
odd so that every mask matters. bf16 is exercised only on a GPU: the interpreter mishandles it on
every supported release (3.3 cannot build bf16 constants, 3.9 computes on the raw uint16 bits).
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import ModuleType

import pytest
import torch

MATMUL = "megatron_tuning.kernels"
SPLITK = "megatron_tuning.kernels"
TINY = "megatron_tuning.kernels"

M, N, K = 37, 29, 45

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(INTERPRETED, reason="Triton's interpreter mishandles bf16 (3.3 and 3.9)"),
    ),
]


def _operands(dtype: torch.dtype, m: int = M, n: int = N, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    a = torch.randn((m, k), generator=gen).to(dtype)
    b = torch.randn((k, n), generator=gen).to(dtype)
    return a, b


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [s for t in tensors for s in t.stride()]


def _check_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    ref = a.float() @ b.float()
    # Low-precision outputs are rounded once from the fp32 accumulator.
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[a.dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol * 10, rtol=tol)


@pytest.fixture
def deterministic(import_kernel):  # type: ignore[no-untyped-def]
    """Install the interception under the deterministic policy for the reference kernels."""
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.runtime.interception import install

    install(TuningPolicy(mode="deterministic", scope=("megatron_tuning.kernels",)))
    return import_kernel


def _decisions_for(kernel_suffix: str) -> list:  # type: ignore[type-arg]
    from megatron_tuning.core.decisions import decision_log

    return [d for d in decision_log().decisions() if d.kernel.endswith(kernel_suffix)]


# --- the package ---------------------------------------------------------------------------


def test_importing_the_package_decorates_no_kernel() -> None:
    # Decoration reads TRITON_INTERPRET and, on 3.3, needs the interception: importing the library
    # must not import the reference kernels. Checked in a fresh interpreter.
    code = "import sys, megatron_tuning\nassert 'megatron_tuning.kernels' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_matmul_config_list_is_realistic(import_kernel) -> None:  # type: ignore[no-untyped-def]
    mm = import_kernel(MATMUL)
    configs = mm.MATMUL_CONFIGS
    assert len(configs) >= 16
    described = {(tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) for c in configs}
    assert len(described) == len(configs), "duplicate configs"
    assert any(c.kwargs["BLOCK_SIZE_M"] * c.kwargs["BLOCK_SIZE_N"] >= 128 * 256 for c in configs)
    assert any(c.kwargs["BLOCK_SIZE_M"] <= 32 for c in configs)
    assert mm.matmul_kernel.configs is configs


# --- explicit configs, launched on the jitted function (no autotuner choice involved) -------


def _launch_matmul_config(mm: ModuleType, a: torch.Tensor, b: torch.Tensor, config) -> torch.Tensor:  # type: ignore[no-untyped-def]
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype)
    mm.matmul_kernel.fn[mm.matmul_grid(m, n)](a, b, c, m, n, k, *_strides(a, b, c), **config.all_kwargs())
    return c


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["smallest", "largest"])
def test_matmul_explicit_config_matches_torch(import_kernel, dtype: torch.dtype, which: str) -> None:  # type: ignore[no-untyped-def]
    mm = import_kernel(MATMUL)
    area = lambda c: c.kwargs["BLOCK_SIZE_M"] * c.kwargs["BLOCK_SIZE_N"] * c.kwargs["BLOCK_SIZE_K"]
    pick = min if which == "smallest" else max
    a, b = _operands(dtype)
    _check_matmul(_launch_matmul_config(mm, a, b, pick(mm.MATMUL_CONFIGS, key=area)), a, b)


def test_matmul_handles_transposed_strides(import_kernel) -> None:  # type: ignore[no-untyped-def]
    mm = import_kernel(MATMUL)
    a, b = _operands(torch.float32)
    a_t = a.t().contiguous().t()  # same values, column-major strides
    _check_matmul(_launch_matmul_config(mm, a_t, b, mm.MATMUL_CONFIGS[-1]), a, b)


@pytest.mark.parametrize("k", [K, 64])  # 45: masked K tail (EVEN_K False); 64: EVEN_K True
def test_splitk_explicit_config_matches_torch(import_kernel, k: int) -> None:  # type: ignore[no-untyped-def]
    sk = import_kernel(SPLITK)
    a, b = _operands(torch.float32, k=k)
    config = sk.SPLITK_CONFIGS[-1]
    out = torch.zeros((M, N))
    # .fn is the Heuristics wrapper: it must derive EVEN_K from the config's BLOCK_K and SPLIT_K.
    launch = sk.splitk_matmul_kernel.fn[sk.splitk_grid(M, N)]
    launch(a, b, out, M, N, k, *_strides(a, b, out), **config.all_kwargs())
    _check_matmul(out, a, b)


# --- the split-K pruning hooks are pure and behave as documented ----------------------------


def test_splitk_early_prune_drops_oversized_tiles(import_kernel) -> None:  # type: ignore[no-untyped-def]
    sk = import_kernel(SPLITK)
    kept = sk.early_config_prune(sk.SPLITK_CONFIGS, {"M": M, "N": N, "K": K})
    assert 0 < len(kept) < len(sk.SPLITK_CONFIGS)
    for c in kept:
        assert c.kwargs["BLOCK_M"] <= 64 and c.kwargs["BLOCK_N"] <= 32
        assert c.kwargs["BLOCK_K"] * c.kwargs["SPLIT_K"] <= 64


def test_splitk_early_prune_never_returns_empty(import_kernel) -> None:  # type: ignore[no-untyped-def]
    sk = import_kernel(SPLITK)
    kept = sk.early_config_prune(sk.SPLITK_CONFIGS, {"M": 1, "N": 1, "K": 1})
    assert len(kept) == 1
    assert kept[0].kwargs == {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 2}


def test_splitk_perf_model_is_deterministic_and_cuts_to_top_k(import_kernel) -> None:  # type: ignore[no-untyped-def]
    sk = import_kernel(SPLITK)
    shape = {"M": 64, "N": 64, "K": 128}
    survivors = sk.early_config_prune(sk.SPLITK_CONFIGS, shape)
    assert len(survivors) > sk.SPLITK_TOP_K  # so top_k really prunes at this shape
    scores = [sk.perf_model(**shape, **c.all_kwargs()) for c in survivors]
    assert scores == [sk.perf_model(**shape, **c.all_kwargs()) for c in survivors]
    assert all(isinstance(s, float) and s > 0 for s in scores)


# --- through the autotuner, pinned by the interception (0 benchmark calls) -------------------
# The interception makes any benchmark attempt under the deterministic policy an error, so a
# passing launch here is a launch that timed nothing.


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_autotuned_deterministic_matches_torch(deterministic, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    mm = deterministic(MATMUL)
    a, b = _operands(dtype)
    _check_matmul(mm.matmul(a, b), a, b)
    (decision,) = _decisions_for(":matmul_kernel")
    assert decision.source in ("cheapest", "table")
    assert f"M={M}, N={N}, K={K}" in decision.key
    assert not hasattr(mm.matmul_kernel, "configs_timings") or mm.matmul_kernel.configs_timings is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_splitk_autotuned_config_pre_hook_zeroes_output(deterministic, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    sk = deterministic(SPLITK)
    a, b = _operands(dtype)
    # Garbage in the output buffer: only the per-config pre_hook (run at every launch) zeroes it;
    # the autotuner-level reset_to_zero does not run when nothing is benchmarked.
    out = torch.full((M, N), 1.0e4)
    result = sk.splitk_matmul(a, b, out=out)
    _check_matmul(result, a, b)
    assert result.dtype == dtype
    # Reusing the same buffer: the second launch must not add onto the first result.
    _check_matmul(sk.splitk_matmul(a, b, out=out), a, b)
    assert len(_decisions_for(":splitk_matmul_kernel")) == 1


def test_splitk_autotuned_choice_honours_pruning(deterministic) -> None:  # type: ignore[no-untyped-def]
    sk = deterministic(SPLITK)
    from megatron_tuning.core.identity import config_signature

    shape = {"M": 64, "N": 64, "K": 128}
    survivors = sk.early_config_prune(sk.SPLITK_CONFIGS, shape)
    top = sorted(survivors, key=lambda c: sk.perf_model(**shape, **c.all_kwargs()))[: sk.SPLITK_TOP_K]
    a, b = _operands(torch.float32, m=64, n=64, k=128)
    _check_matmul(sk.splitk_matmul(a, b), a, b)
    (decision,) = _decisions_for(":splitk_matmul_kernel")
    assert decision.signature in {config_signature(c) for c in top}


def test_tiny_autotuned_deterministic_matches_torch(deterministic) -> None:  # type: ignore[no-untyped-def]
    tiny = deterministic(TINY)
    assert len(tiny.ADD_ONE_CONFIGS) >= 4
    x = torch.randn(301)
    torch.testing.assert_close(tiny.add_one(x), x + 1)
    torch.testing.assert_close(tiny.add_one(x), x + 1)  # second launch: pinned path
    assert len(_decisions_for(":add_one_kernel")) == 1


# --- the selftest's workload (one process; the 2-rank run is what scripts/demo.sh starts) -----


def test_the_selftest_workload_runs_every_kernel_pinned_by_the_shipped_table(import_kernel) -> None:  # type: ignore[no-untyped-def]
    import_kernel(MATMUL)  # decorated already, whatever the Triton release
    from megatron_tuning import init_deterministic_tuning
    from megatron_tuning.commands.selftest import CPU_SHAPES, reference_workload
    from megatron_tuning.core.decisions import get_decisions
    from megatron_tuning.core.policy import TuningPolicy

    with init_deterministic_tuning(TuningPolicy(scope=("megatron_tuning.kernels",))):
        assert reference_workload(torch.device("cpu"), CPU_SHAPES, torch.float32) == []
    decisions = [d for d in get_decisions() if d.source != "out_of_scope"]
    assert {d.kernel.rsplit(":", 1)[1] for d in decisions} == {
        "matmul_kernel",
        "splitk_matmul_kernel",
        "add_one_kernel",
    }
    assert len(decisions) == 6 and {d.source for d in decisions} == {"table"}
    assert all(d.origin.endswith("configs/unknown/interpreter_demo.msgpack") for d in decisions)
