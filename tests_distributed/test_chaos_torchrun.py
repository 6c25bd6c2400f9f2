"""Chaos and kernel identity across real torchrun ranks (gloo, CPU, Triton interpreter).

4 ranks with pipeline stage ``rank % 2`` (strided stages of two ranks) and 4 configs: the chaos
run must raise on every rank, the same message everywhere. (8 ranks with stage ``rank % 4``, where
chaos's old rank formula picked the same config for both ranks of every stage, is among the layouts
of tests/core/test_chaos.py and tests/distributed/test_store.py; 2-rank chaos runs in the demo and
the agreement jobs.) Two autotuners over one function launched in opposite orders are two kernels,
so no (false) DivergenceError.
"""

from __future__ import annotations

from typing import Any

import pytest
from _launch import WORKERS, gloo_available, read_results, run_torchrun

Results = dict[int, dict[str, dict[str, Any]]]


NPROC, STAGES = 4, 2


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, int, Results]:
    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    tmp = tmp_path_factory.mktemp("chaos")
    args = ["--out", str(tmp), "--stages", str(STAGES)]
    done = run_torchrun(NPROC, WORKERS / "chaos_worker.py", args, tmp, timeout_s=300)
    results = read_results(tmp, NPROC)
    assert done.returncode == 0 and len(results) == NPROC, done.stdout[-3000:] + done.stderr[-3000:]
    return NPROC, STAGES, results


def _rows(job: tuple[int, int, Results], name: str) -> list[dict[str, Any]]:
    nproc, _, results = job
    return [results[rank][name] for rank in range(nproc)]


def test_chaos_raises_divergence_on_every_rank_in_a_strided_layout(job: tuple[int, int, Results]) -> None:
    rows = _rows(job, "stage_chaos")
    assert [row["error"] for row in rows] == ["DivergenceError"] * len(rows), rows
    assert len({row["message"] for row in rows}) == 1  # one diagnosis, the same on every rank
    assert rows[0]["kernel"] == "tests.support_kernels:add_kernel" and rows[0]["key"] in rows[0]["message"]
    # Every rank's pick could differ (4 distinct configs); within a stage, exactly one rank was first.
    for stage in range(job[1]):
        outcomes = sorted(row["decisions"][0]["chaos"] for row in rows if row["stage"] == stage)
        assert outcomes == ["differs"] * (len(outcomes) - 1) + ["first"], (stage, outcomes)
        signatures = {row["decisions"][0]["signature"] for row in rows if row["stage"] == stage}
        assert len(signatures) == len(outcomes)  # 2 ranks per stage, 4 configs: both differ


def test_a_rank_already_in_verify_raises_the_same_error_as_those_the_store_check_caught(
    job: tuple[int, int, Results],
) -> None:
    """Rank 0 reaches ``verify_agreement`` before the others launch: the store check fires on them,
    and rank 0's verify must raise that same recorded divergence, not a message of its own."""
    rows = _rows(job, "late_chaos")
    assert [row["error"] for row in rows] == ["DivergenceError"] * len(rows), rows
    assert len({row["message"] for row in rows}) == 1, [row["message"] for row in rows]


def test_the_same_layout_under_deterministic_stays_quiet(job: tuple[int, int, Results]) -> None:
    rows = _rows(job, "stage_deterministic")
    assert [row["error"] for row in rows] == [None] * len(rows), rows[0].get("message")
    nproc, stages, _ = job
    assert [row["shared"] for row in rows] == [stages] * nproc  # each stage's key, seen by 2+ ranks


def test_two_autotuners_over_one_function_in_opposite_orders_raise_nothing(
    job: tuple[int, int, Results],
) -> None:
    rows = _rows(job, "twins_deterministic")
    assert [row["error"] for row in rows] == [None] * len(rows), rows[0].get("message")
    for row in rows:
        kernels = sorted({d["kernel"] for d in row["decisions"]})
        twins = [k for k in kernels if k.startswith("tests.support_kernels:twin_body@")]
        assert len(kernels) == 2 and twins == kernels, kernels
        assert row["shared"] == 2
    by_kernel = [{d["kernel"]: d["signature"] for d in row["decisions"]} for row in rows]
    assert all(b == by_kernel[0] for b in by_kernel)  # every rank launched the same per kernel
    assert len(set(by_kernel[0].values())) == 2  # and the two kernels their own configs
