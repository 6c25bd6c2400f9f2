"""benchmarks/bench_clocks.py's arithmetic on synthetic probes and blocks (its kernel needs a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_clocks  # noqa: E402


def _probe(c0: int, t0: int, mhz: float, spin_ns: int) -> list[int]:
    return [c0, t0, c0 + int(mhz * spin_ns / 1e3), t0 + spin_ns]


def test_probe_clock_is_read_inside_the_probe_and_the_window_between_probes() -> None:
    sms = 4
    pair = np.zeros((2, 8, 4), dtype=np.int64)  # SMs 4..7 ran no probe: left out
    for sm in range(sms):
        pair[0, sm] = _probe(1_000, 5_000, 1980.0, 100_000)
        # 1 ms between the probes in which the SM counted cycles at 990 MHz on average (idle half)
        end_c, end_t = pair[0, sm, 2], pair[0, sm, 3]
        pair[1, sm] = _probe(int(end_c + 990_000), int(end_t + 1_000_000), 1800.0, 100_000)
    found = bench_clocks.readings(pair)
    assert found["sms"] == sms
    assert found["probe_before"] == pytest.approx(1980.0, rel=1e-6)
    assert found["probe_after"] == pytest.approx(1800.0, rel=1e-6)
    assert found["windowed"] == pytest.approx(990.0, rel=1e-6)


def test_summary_recovers_the_slope_of_time_on_the_probe_clock() -> None:
    rng = np.random.default_rng(0)
    t = np.arange(0.0, 10.0, 0.0025)
    mhz = 1750.0 * (1 + 0.02 * np.sin(t / 1.7))
    ms = 0.2 * (mhz / 1750.0) ** -0.6 * np.exp(rng.normal(0, 1e-4, t.size))
    blocks = np.column_stack([t, ms, mhz, mhz, 0.9 * mhz]).tolist()
    nvml = [{"t": float(x), "sm_mhz": 1900, "power_w": 690.0} for x in t[::80]]
    result = {"blocks": blocks, "nvml": nvml}
    data = bench_clocks.past_start(result)
    found = bench_clocks.summary(result, data, bench_clocks.binned(data))
    assert found["beta_probe"] == pytest.approx(0.6, abs=0.01) and found["r_probe"] < -0.99
    assert found["probe_mhz"] == pytest.approx(1750.0, rel=0.01)
    assert found["windowed_mhz"] == pytest.approx(0.9 * found["probe_mhz"], rel=0.01)
    assert found["nvml_mhz"] == 1900 and found["power_w"] == 690.0


@pytest.mark.slow
def test_smoke_runs_every_process_and_writes_their_json(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_clocks.py"), "--smoke", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["processes"]) == [label for label, _, _ in bench_clocks.PHASES]
    cold = json.loads((tmp_path / "cold.json").read_text())
    assert len(cold["gaps"]) == 25 and all(g["sms"] == 4 for g in cold["gaps"])
    assert all(row["blocks"] > 0 for row in summary["processes"].values())
