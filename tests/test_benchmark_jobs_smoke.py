"""The benchmarks that start jobs of their own (torchrun, one TCPStore server, run_gpu.sh stages)
on CPU: a plumbing check, like ``test_benchmarks_smoke.py``, kept in a file of their own so the
test workers can run them beside the single-process smoke runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_benchmarks_smoke import REPO, _smoke

pytestmark = pytest.mark.slow


def test_workloads_smoke_catches_chaos_and_shares_auto_decisions(tmp_path: Path) -> None:
    """bench_workloads.py --smoke: 2 torchrun jobs of 2 gloo ranks (chaos, auto1)."""
    result = _smoke("bench_workloads.py", tmp_path)
    jobs = {job["run"]: job["summary"] for job in result["jobs"]}
    assert set(jobs) == {"chaos", "auto1"}
    assert all(s["verdict"] == "ok" for s in jobs.values()), {r: s["verdict"] for r, s in jobs.items()}
    assert jobs["chaos"]["errors"] == {"DivergenceError": 2} and jobs["chaos"]["keys_with_several_configs"]
    assert jobs["auto1"]["errors"] == {} and jobs["auto1"]["keys_with_several_configs"] == 0
    # Each key tuned by one rank and adopted by the other: one config per key on both.
    assert sum(jobs["auto1"]["measured_per_rank"]) > 0 and set(jobs["auto1"]["sources"]) == {
        "tuned",
        "adopted",
    }


def test_run_gpu_stages_in_one_call(tmp_path: Path) -> None:
    """``run_gpu.sh overhead nearest`` end to end, every script in its CPU mode (the overhead stage's
    two scripts have no other smoke test; tuner_judge has its own in test_benchmarks_smoke.py).

    ``PYTHON`` is a wrapper that adds ``--smoke`` (and shrinks the host-only CPU mode), so the
    stages, their arguments and the files they write under ``$OUT`` are what a GPU call runs.
    """
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" --cpu "*) exec "$REAL_PY" "$@" --calls 500 --repeats 2 ;; esac\n'
        'exec "$REAL_PY" "$@" --smoke\n'
    )
    wrapper.chmod(0o755)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env.update(OUT=str(out), PYTHON=str(wrapper), REAL_PY=sys.executable, MT_BUDGET_S="600")
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "run_gpu.sh"), "overhead", "nearest"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for stage in ("overhead", "nearest"):
        assert f"== {stage}: exit 0" in summary, summary
    overhead = json.loads((out / "overhead.json").read_text())
    assert overhead["summary"]["pinned"]["vs_bare"] > 0
    assert overhead["goal"]["pinned_vs_own_fn_same_config_paired"]["median"] > 0  # the wrapper alone
    # The host-only CPU mode: the four launch paths (the pinned one with and without the generated
    # hit path), each timed once per repeat.
    cpu = json.loads((out / "overhead_cpu.json").read_text())
    paths = {"direct", "triton_hit", "pinned", "pinned_class_path"}
    assert cpu["benchmark"] == "launch_overhead_cpu" and set(cpu["best_us"]) == paths
    assert set(cpu["samples_us"]) == paths and all(len(v) == 2 for v in cpu["samples_us"].values())
    assert set(cpu["added_over_direct_us"]) == paths - {"direct"}
    # The held-out nearest-shape part: auto tunes the M sweep, then the rule is judged.
    rows = json.loads((out / "nearest.json").read_text())["nearest"]["rows"]
    assert [r["nearest_source"] for r in rows] == ["nearest", "nearest"]
    assert all(
        r["nearest_entry"].startswith("M=") and r["single_nearest_entry"].startswith("M=") for r in rows
    )


def test_scale_smoke_drives_every_design_against_one_store(tmp_path: Path) -> None:
    """bench_scale.py --smoke: 16 simulated ranks x 40 keys on one TCPStore server, verify at 2 ranks."""
    result = _smoke("bench_scale.py", tmp_path)
    rows = {(r["design"], r["workload"]): r for r in result["rows"]}
    assert {design for design, _ in rows} == {"idle", "store", "auto", "auto-warm", "verify"}
    assert rows["idle", "tp"]["requests"] == 0
    assert result["dedicated_server_us_per_no_reply_request"] >= 0  # under the 10 ms CPU tick at smoke size
    for workload in ("tp", "pp", "varlen"):
        assert rows["store", workload]["requests_per_rank"] == 80  # a claim and a flag poll per key
        assert rows["auto-warm", workload]["requests_per_rank"] == 40  # one proposal per cached key
        assert rows["auto", workload]["requests_per_rank"] <= 80  # a lookup, and a publish after tuning
    assert rows["verify", "tp"]["sent_bytes_per_rank_max"] == 32  # identical logs: the header alone
    assert rows["verify", "tp"]["shared"] == 40
    assert rows["verify", "pp"]["sent_bytes_per_rank_max"] > 32  # stages differ: rows where they do
