"""The zero-edit route: ``triton.testing.do_bench`` scored by ``measure`` in a job that asks for it,
its records in the run's shared file; Triton's own callers keep the original."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import triton.testing

from megatron_tuning.score import dobench, pooling


@pytest.fixture
def stock_do_bench(monkeypatch: pytest.MonkeyPatch) -> list:
    """A stand-in for Triton's do_bench (CPU has no driver) that records its calls; restored after."""
    seen: list = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, *a, **k: seen.append(fn) or 1.0)
    return seen


def _ask(out: Path, run: str) -> str:
    """The settings a `run --score-do-bench` launcher passes its processes."""
    return json.dumps({"do_bench": True, "out": str(out), "run": run, "budget_s": 0.3})


@pytest.fixture(autouse=True)
def _leave_the_job() -> Any:
    yield
    pooling.join_job("{}", "the test's job")


def test_do_bench_calls_are_scored_into_the_runs_file(tmp_path: Path, monkeypatch, stock_do_bench) -> None:
    out = tmp_path / "bench.json"
    dobench.activate(_ask(out, "run-1"), "the test's job")
    work = lambda: sum(range(3000))
    median = triton.testing.do_bench(work, warmup=10, rep=100)
    every = triton.testing.do_bench(work, return_mode="all")
    low, mid, high = triton.testing.do_bench(work, quantiles=[0.2, 0.5, 0.8])
    assert stock_do_bench == [] and isinstance(median, float) and low <= mid <= high and len(every) >= 8
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["results"]]
    lines = [int(name.split(":")[1].split("#")[0]) for name in names]
    assert all(n.startswith("do_bench@test_dobench.py:") and n.endswith("#1") for n in names)
    assert lines == [lines[0], lines[0] + 1, lines[0] + 2]  # one record per call site, in call order
    assert report["results"][0]["latency"]["median"] == median and report["processes"] == 1
    assert report["results"][0]["flags"][0]["name"] == "host_clock"  # CPU: the host clock timed it


def test_a_new_run_starts_the_file_afresh_and_triton_keeps_its_own(
    tmp_path: Path, monkeypatch, stock_do_bench
):
    out = tmp_path / "bench.json"
    out.write_text(json.dumps({"format": "megatron_tuning.score-run/1", "run": "old", "per_process": [[{}]]}))
    dobench.activate(_ask(out, "run-2"), "the test's job")
    triton.testing.do_bench(lambda: sum(range(3000)))
    assert json.loads(out.read_text())["run"] == "run-2" and len(json.loads(out.read_text())["results"]) == 1
    namespace = {"__name__": "triton.runtime.autotuner", "bench": triton.testing.do_bench}
    exec("result = bench(lambda: None, quantiles=(0.5, 0.2, 0.8))", namespace)
    assert namespace["result"] == 1.0 and len(stock_do_bench) == 1  # the autotuner's call: Triton's own


def test_nothing_is_routed_unless_the_job_asks(monkeypatch, stock_do_bench) -> None:
    before = triton.testing.do_bench
    dobench.activate("{}", "the test's job")
    assert triton.testing.do_bench is before
