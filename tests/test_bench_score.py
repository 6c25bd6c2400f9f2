"""benchmarks/bench_score.py --smoke: every stage's code path on CPU (host clock; numbers meaningless)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_stage_runs_and_writes_one_json_each(tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MEGATRON_TUNING_") and k != "TRITON_INTERPRET"
    }
    env["PYTHONPATH"] = str(REPO)
    # One torch thread, as scripts/test.sh sets: on a busy 2-core host, OpenMP's spinning threads
    # stalled one interpreted launch for seconds, past the smoke's 0.3 s budgets.
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "bench_score.py"),
            "--smoke",
            "--processes",
            "1",
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stages = ["gemm", "aa", "slower", "graph", "integrity", "overhead", "processes", "soak", "thermal"]
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == sorted(stages)
    integrity = json.loads((tmp_path / "integrity.json").read_text())
    assert [r["name"] for r in integrity["records"]] == ["side stream", "pointer cache", "patched timer"]
    assert "stale_output" in [f["name"] for f in integrity["records"][1]["flags"]]  # caught on CPU too
    soak = json.loads((tmp_path / "soak.json").read_text())
    assert soak["cold"]["pinning"]["configs"][0]["source"] == "table"  # the `score` job pinned from the table
    assert [len(soak["pooled"][s]["per_process"]) for s in ("cold", "hot")] == [1, 1]  # smoke: 1 a side
    assert soak["pooled"]["hot"]["results"][0]["processes"]["count"] == 1
    processes = json.loads((tmp_path / "processes.json").read_text())
    assert [sorted(r["clocks"]) for r in processes["records"]] == [sorted(soak["cold"]["clocks"])]  # counted
    assert "hot/cold, pooled (1 per state)" in done.stdout
    table = done.stdout[done.stdout.index("bench_score on") :]
    assert all(stage in table for stage in stages) and "records with in-band and NVML clocks" in table
