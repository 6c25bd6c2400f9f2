"""Every GPU benchmark's ``--smoke`` path runs on CPU, so a broken script is caught before a GPU call.

The smoke numbers are meaningless (Triton interpreter, tiny shapes); these tests check plumbing:
exit code, the JSON written, and the end-to-end facts a smoke run can still prove (record ->
merge -> pin gives table hits only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _smoke(script: str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--smoke", "--out", str(out), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_record_merge_pin_end_to_end(tmp_path: Path) -> None:
    result = _smoke("record_merge_e2e.py", tmp_path)
    assert result["processes"] == 2 and len(result["recorded"]) == 2
    assert result["rows"] and all(row["pinned_source"] == "table" for row in result["rows"])
    assert result["merge"]["entries"] == len(result["rows"])


@pytest.mark.parametrize(
    "script", ["bench_launch_overhead.py", "bench_quality.py", "bench_reproducibility.py"]
)
def test_benchmark_smoke_paths(script: str, tmp_path: Path) -> None:
    result = _smoke(script, tmp_path)
    assert result["environment"]["python"]


@pytest.mark.slow
def test_workloads_smoke_agrees_catches_chaos_and_tunes_once(tmp_path: Path) -> None:
    """bench_workloads.py --smoke: 4 torchrun jobs of 2 gloo ranks (~30-45 s on 2 cores)."""
    result = _smoke("bench_workloads.py", tmp_path)
    jobs = {job["run"]: job["summary"] for job in result["jobs"]}
    assert set(jobs) == {"deterministic", "chaos", "auto1", "auto2"}
    assert all(s["verdict"] == "ok" for s in jobs.values()), {r: s["verdict"] for r, s in jobs.items()}
    assert jobs["chaos"]["errors"] == {"DivergenceError": 2}
    assert jobs["deterministic"]["errors"] == {} and jobs["deterministic"]["keys_with_several_configs"] == 0
    assert sum(jobs["auto1"]["measured_per_rank"]) > 0 and jobs["auto2"]["measured_per_rank"] == [0, 0]
    assert set(jobs["auto2"]["sources"]) == {"table"}


def test_table_stress_loses_nothing_and_reads_nothing_corrupt(tmp_path: Path) -> None:
    # CPU-only script: concurrent writers (one through a symlink) SIGKILLed at random, and readers.
    result = _smoke("stress_tables.py", tmp_path)
    assert result["writers_via_symlink"] == 1 and result["kills"] == 6
    assert result["entries_committed"] > 0
    assert result["entries_lost"] == 0 and result["corrupt_reads"] == 0


def test_cache_table_stress_through_auto_persist_loses_nothing(tmp_path: Path) -> None:
    result = _smoke("stress_tables.py", tmp_path, "--cache")
    assert result["through"] == "AutoCache.persist" and result["kills"] == 6
    assert result["entries_committed"] > 0
    assert result["entries_lost"] == 0 and result["corrupt_reads"] == 0


def test_cache_benchmark_smoke(tmp_path: Path) -> None:
    # CPU-only script: init/persist costs, concurrent persisters, and a cache grown over several runs.
    run = _smoke("bench_cache.py", tmp_path)["runs"]["this"]
    assert run["init"]["entries"] == 2000
    assert run["persist"]["written"] == [1, 1, 0] and not run["persist"]["rewrote_on_nothing_new"]
    assert run["concurrent"]["lost"] == 0 and run["concurrent"]["persisted"] == [20, 20, 20]
    assert [step["readable_at_open"] for step in run["growth"]["rounds"]] == [True, True]
    assert all(check["exit"] == 0 for check in run["growth"]["cli"].values())


def test_compile_benchmark_smoke(tmp_path: Path) -> None:
    # On CPU the "compiled" calls are plain calls (plumbing only); the GPU run checks the real thing.
    result = _smoke("bench_compile.py", tmp_path, "--kinds", "static")
    assert {(run["variant"], run["kind"]) for run in result["runs"]} == {
        ("stock", "static"),
        ("pinned", "static"),
    }
    assert result["goals"] and all(goal["met"] for goal in result["goals"])
    pinned = [s for s in result["summary"] if s["variant"] == "pinned"]
    assert len(pinned) == 4 and all(s["decisions_per_process"] == [1] for s in pinned)


def test_auto_benchmark_nearest_part_smoke(tmp_path: Path) -> None:
    # CPU plumbing of bench_auto's nearest part: auto tunes the M sweep, then the rule is judged.
    result = _smoke("bench_auto.py", tmp_path, "--parts", "nearest")
    rows = result["nearest"]["rows"]
    assert [r["nearest_source"] for r in rows] == ["nearest", "nearest"]
    assert all(r["nearest_entry"].startswith("M=") for r in rows)
