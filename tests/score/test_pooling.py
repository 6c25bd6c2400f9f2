"""The score's JSON: its schema against a golden file, records pooled over processes, compared, loaded.

After a deliberate format change: bump ``report.FORMAT`` and rewrite the golden file with
``PYTHONPATH=. python -m tests.score.test_pooling``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron_tuning.core.decisions import Decision, decision_log
from megatron_tuning.score import compare, load, measure, pooling, stats
from megatron_tuning.score.report import FORMAT, line
from tests.score.fakes import FakeDevice, seams

GOLDEN = Path(__file__).with_name("score_schema.json")


def skeleton(value: Any) -> Any:
    """The shape of a JSON value: objects by key, a list by its first item, leaves by type name."""
    if isinstance(value, dict):
        return {key: skeleton(item) for key, item in sorted(value.items())}
    if isinstance(value, list):
        return [skeleton(value[0])] if value else []
    if isinstance(value, bool) or value is None:
        return {True: "boolean", False: "boolean", None: "null"}[value]
    return "number" if isinstance(value, (int, float)) else type(value).__name__


def _full_record(tmp_path: Path) -> dict[str, Any]:
    """A record with every optional part present: reference, inputs, clocks, a pinned decision, a flag."""
    table = tmp_path / "t.msgpack"
    table.write_bytes(b"\x80")
    decision_log().record(Decision(kernel="m:k", key="8", signature="w4", source="table", origin=str(table)))
    dev = FakeDevice(noise=0.002)  # an A/A decided "same" at the first look, then demoted by the flag

    def double(x: torch.Tensor) -> torch.Tensor:
        dev.kernel(0.4)()
        return x * 2

    tampered = seams(dev, tamper="torch.cuda.Event.elapsed_time is not torch's")
    score = measure(
        double, reference=double, make_inputs=lambda: torch.ones(4), flops=1e9, bytes=1e6, **tampered
    )
    return score.record


def test_the_record_matches_the_golden_schema(tmp_path: Path) -> None:
    record = _full_record(tmp_path)
    assert record["format"] == FORMAT
    assert skeleton(json.loads(json.dumps(record))) == json.loads(GOLDEN.read_text())
    assert record["pinning"]["configs"][0]["source"] == "table" and len(record["pinning"]["tables"]) == 1


def _records(count: int, offset: float = 0.0) -> list[dict[str, Any]]:
    found = []
    for seed in range(count):
        dev = FakeDevice(seed=seed)
        slow = 0.53 * (1 + offset * seed)
        found.append(measure(dev.kernel(0.5), reference=dev.kernel(slow), name="k", **seams(dev)).record)
    return found


def test_processes_pool_by_name_with_their_spread() -> None:
    records = _records(3, offset=0.01)
    records[1]["flags"] = [{"name": "clock_offset", "message": "7% apart", "demotes": True}]
    (pooled,) = pooling.pool([[r] for r in records])
    assert pooled["processes"]["count"] == 3 and len(pooled["processes"]["medians_ms"]) == 3
    assert pooled["processes"]["between_cv"] >= 0 and pooled["samples"] is None
    assert pooled["rounds"]["used"] == sum(r["rounds"]["used"] for r in records)
    assert pooled["flags"] == [{"name": "clock_offset", "message": "process 1: 7% apart", "demotes": True}]
    assert pooled["verdict"]["outcome"] == "inconclusive" and pooled["verdict"]["demoted_from"] == "faster"
    assert pooled["status"] == "demoted" and pooled["ratio"]["ci95"][0] < pooled["ratio"]["estimate"]
    low, high = pooled["latency"]["ci95"]
    assert low < pooled["latency"]["median"] < high


def test_one_process_pools_to_itself() -> None:
    (record,) = _records(1)
    assert pooling.pool([[record]]) == [record]


def test_compare_gives_faster_slower_same() -> None:
    def score(ms: float, seed: int) -> Any:
        dev = FakeDevice(seed=seed, noise=0.002)
        return measure(dev.kernel(ms), name=f"{ms}", **seams(dev))

    fast, slow, fast_again = score(0.50, 1), score(0.53, 2), score(0.50, 3)
    assert compare(fast, slow)["outcome"] == "faster" and compare(slow, fast)["outcome"] == "slower"
    assert compare(fast, fast_again)["outcome"] == "same"
    assert compare(fast, slow, margin=0.1)["outcome"] == "same"
    fast.record["flags"] = [{"name": "host_clock", "message": "host", "demotes": True}]
    demoted = compare(fast, slow)
    assert demoted["outcome"] == "inconclusive" and demoted["demoted_from"] == "faster"
    assert "demoted by host_clock" in demoted["reason"]


def test_compare_demotes_results_taken_at_different_clocks() -> None:
    def score(mhz: float, seed: int) -> Any:  # the same kernel time, measured at another clock
        dev = FakeDevice(seed=seed, noise=0.002, mhz_at=lambda t: mhz)
        return measure(dev.kernel(0.50), name=f"at {mhz:g}", **seams(dev))

    cold, hot, hot_again = score(1980, 1), score(1890, 2), score(1890, 3)
    demoted = compare(cold, hot)
    assert demoted["outcome"] == "inconclusive" and "demoted by clock_offset" in demoted["reason"]
    assert [f["name"] for f in demoted["flags"]] == ["clock_offset"]
    assert demoted["flags"][0]["message"].endswith("at 1890 MHz (nvml SM clock)")
    assert compare(hot, hot_again)["outcome"] == "same"


def test_compare_reads_the_clock_both_results_have_nvml_s_first() -> None:
    """The in-band reading moved 2% between a cold and a hot process where NVML's clock moved 0.8%
    and the latency 0.3% (RESULTS §31): it demoted a right "same". NVML's clock decides when both
    results have it; one side's in-band against the other's NVML is never compared."""
    dev = FakeDevice(seed=1, noise=0.002)
    a, b = (measure(dev.kernel(0.50), name="k", **seams(dev)).record for _ in range(2))
    offset = lambda: [f["message"].rsplit("(", 1)[1] for f in compare(a, b)["flags"]]
    b["clocks"]["inband"]["candidate"]["median"] *= 0.98
    assert compare(a, b)["outcome"] == "same" and offset() == []
    b["clocks"]["nvml"]["candidate"]["sm_mhz"]["median"] *= 0.98
    assert compare(a, b)["outcome"] == "inconclusive" and offset() == ["nvml SM clock)"]
    b["clocks"]["nvml"] = None  # NVML on one side only: both in-band readings
    assert offset() == ["inband SM clock)"]
    b["clocks"]["inband"] = None  # no source in common: no clock judged
    a["clocks"]["nvml"] = None
    assert compare(a, b)["outcome"] == "same" and offset() == []


def test_the_result_line_names_the_clock_it_shows_nvml_s_first() -> None:
    """The line a log shows reads the clock ``compare`` judges: NVML's, else the in-band reading
    (0.87 of NVML's under a GEMM, RESULTS §31), each named; none when neither was read."""
    dev = FakeDevice(seed=1, noise=0.002)
    record = measure(dev.kernel(0.50), name="k", **seams(dev)).record
    record["clocks"]["nvml"]["candidate"]["sm_mhz"]["median"] = 1965.0
    record["clocks"]["inband"]["candidate"]["median"] = 1712.4
    assert "; SM 1965 MHz (nvml); " in line(record)
    record["clocks"]["nvml"] = None
    assert "; SM 1712 MHz (inband); " in line(record)
    record["clocks"]["inband"] = None
    assert "MHz" not in line(record)
    record["flags"] = [{"name": n, "message": "", "demotes": True} for n in ("host_clock", "x", "host_clock")]
    assert line(record).endswith("; ok [host_clock, x]")  # a pooled record's flags, each named once


def _pooled(rng: np.random.Generator, processes: int) -> dict[str, Any]:
    """A pooled result of one kernel: each process off by 0.35% (RESULTS §32's spread between fresh
    processes on an H100), 8 rounds of 0.1% noise each."""
    groups = [np.exp(rng.normal(0, 0.0035) + 0.001 * rng.normal(size=8)) for _ in range(processes)]
    found = stats.pooled_interval(groups, seed=int(rng.integers(1 << 30)), draws=400)
    return {
        "name": "k",
        "latency": {"median": float(found.estimate), "ci95": [float(found.low), float(found.high)]},
        "processes": {"count": processes},
        "noise_floor": {"aa_p95": None},
        "flags": [],
        "clocks": {"nvml": None, "inband": None},
    }


@pytest.mark.parametrize("processes", [3, 5])
def test_compare_of_pooled_results_covers_at_95_percent_and_says_same_at_five_processes(
    processes: int,
) -> None:
    """Pooled intervals are t_{P-1} wide; ``compare`` reads each one's error back with that t and
    combines them with Welch's degrees of freedom. Read with the normal quantile instead, the
    interval of two 3-process results covered 99.2% and said "same" in 18% of 2,000 runs (41%
    now); at 5 processes, the default, it says "same" at a 1% margin in at least 90%."""
    rng = np.random.default_rng(7)
    found = [compare(_pooled(rng, processes), _pooled(rng, processes)) for _ in range(2000)]
    coverage = np.mean([r["ci95"][0] <= 1.0 <= r["ci95"][1] for r in found])
    assert 0.93 <= coverage <= 0.975, coverage
    if processes == 5:
        assert np.mean([r["outcome"] == "same" for r in found]) >= 0.9


def test_compare_reads_files_and_refuses_ambiguous_ones(tmp_path: Path) -> None:
    one, two = _records(2)
    (tmp_path / "a.json").write_text(json.dumps(one))
    (tmp_path / "b.json").write_text(json.dumps({"format": pooling.RUN_FORMAT, "results": [two]}))
    assert compare(tmp_path / "a.json", tmp_path / "b.json")["outcome"] in ("same", "inconclusive")
    (tmp_path / "both.json").write_text(json.dumps([one, {**two, "name": "other"}]))
    with pytest.raises(
        ValueError, match="holds 2 results \\(k, other\\): compare files with `score compare`"
    ):
        compare(tmp_path / "both.json", tmp_path / "a.json")
    (tmp_path / "table.json").write_text(json.dumps({"format": "megatron_tuning.table/1"}))
    with pytest.raises(ValueError, match="not a score result"):
        load(tmp_path / "table.json")


def test_each_process_record_is_appended_to_its_own_file(tmp_path: Path) -> None:
    first, second = _records(2)
    pooling.publish(first, {"dir": str(tmp_path)})
    pooling.publish(second, {"dir": str(tmp_path)})
    pooling.publish(first, {})  # not a score job: nothing written
    assert pooling.read_job(tmp_path) == [[first, second]]


@pytest.mark.parametrize("raw", ["{", '{"budget_s": "10"}', '{"dirs": "x"}', "[1]"])
def test_a_bad_score_setting_names_the_variable(raw: str) -> None:
    with pytest.raises(
        ValueError, match="Unable to use _MEGATRON_TUNING_SCORE=.*: expected a JSON object with dir"
    ):
        pooling.join_job(raw, "_MEGATRON_TUNING_SCORE")
    assert pooling.job_settings() == {}  # a refused setting joins nothing


if __name__ == "__main__":  # rewrite the golden file after a deliberate format change
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        GOLDEN.write_text(
            json.dumps(skeleton(json.loads(json.dumps(_full_record(Path(folder))))), indent=1) + "\n"
        )
    print(f"wrote {GOLDEN}")
