"""The score's JSON: its schema against a golden file, records pooled over processes, compared, loaded.

After a deliberate format change: bump ``report.FORMAT`` and rewrite the golden file with
``PYTHONPATH=. python -m tests.score.test_pooling``.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron_tuning import commands as cli
from megatron_tuning.core.decisions import Decision, decision_log
from megatron_tuning.score import compare, load, measure, pooling, stats
from megatron_tuning.score.report import FORMAT, line
from tests.score.fakes import FakeDevice, FakeNvml, seams

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


def test_one_process_pools_to_its_own_numbers_without_samples() -> None:
    """The docs promise a pooled record's ``samples`` null (they are in ``per_process``); one
    process's record came back whole, samples and all."""
    (record,) = _records(1)
    (pooled,) = pooling.pool([[record]])
    assert pooled["samples"] is None and record["samples"] is not None
    assert pooled["per_process"] == [
        {
            "process": 0,
            "record": 0,
            "name": "k",
            "status": record["status"],
            "median_ms": record["latency"]["median"],
            "ratio": record["ratio"]["estimate"],
            "outcome": record["verdict"]["outcome"],
            "stopped_by": record["rounds"]["stopped_by"],
            "aa_p95": None,
        }
    ]
    assert pooled["processes"] == {**record["processes"], "requested": None}
    assert pooled["verdict"] == {**record["verdict"], "processes_to_decide": None}
    same = set(record) - {"samples", "processes", "verdict"}
    assert {k: pooled[k] for k in same} == {k: record[k] for k in same}


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Any:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    else:
        yield path, value


def _at(record: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        record = record[key]
    return record


def test_no_field_of_a_pooled_record_is_process_0_s() -> None:
    """It started from process 0's record and recomputed a few fields: its noise floor, mde, margin,
    looks, stopping reason, settle phase, clocks and pinning were process 0's alone. Now every
    field a process differs on is pooled (a min the lowest, a max the highest, a median over all
    rounds) or null, each process's own value one lookup away (``per_process``)."""
    records = []
    for seed, (margin, target_ci, others) in enumerate([(0.01, 0.002, 0), (0.03, 0.01, 2), (0.02, 0.05, 1)]):
        dev = FakeDevice(seed=seed, noise=0.004 * (1 + seed), mhz_at=lambda t, s=seed: 1980 - 7 * s)
        sources = seams(dev, nvml=FakeNvml(dev, others=others))
        sources["nvml"] = sources["backend"].clock_sources()[0]
        score = measure(
            dev.kernel(0.5),
            reference=dev.kernel(0.515),
            name="k",
            margin=margin,
            target_ci=target_ci,
            **sources,
        )
        records.append(score.record)
    (pooled,) = pooling.pool([[r] for r in records])
    extremes = {
        ("latency", "min"): min,
        ("clocks", "other_processes"): max,
        ("clocks", "processes_on_gpu"): max,
    }
    extremes |= {("verdict", "margin"): max, ("verdict", "delta"): max}
    for path, value in _leaves({k: v for k, v in pooled.items() if k not in ("pinning", "per_process")}):
        try:
            values = [_at(r, path) for r in records]
        except (KeyError, TypeError):
            continue  # a field of pooled records only (processes.requested, verdict.processes_to_decide)
        if value is None or all(v == values[0] for v in values) or path[0] in ("name", "samples", "flags"):
            continue
        pick = extremes.get(path, min if path[-1] == "min" else max if path[-1] == "max" else None)
        if pick is not None:
            assert value == pick(values), path
        else:
            assert value != values[0], f"{'.'.join(map(str, path))} is process 0's: {value}"
    assert pooled["verdict"]["margin"] == 0.03 and pooled["clocks"]["other_processes"] == 2
    assert pooled["timing"]["target_ci"] is None and pooled["timing"]["settle"] is None
    assert pooled["noise_floor"]["mde"] == pytest.approx(
        stats.minimum_detectable(*pooled["ratio"]["ci95"], df=2)
    )
    kept = [v for r in records for v, k in zip(r["samples"]["candidate_mhz"], r["samples"]["kept"]) if k]
    assert pooled["clocks"]["inband"]["candidate"]["median"] == pytest.approx(float(np.median(kept)))
    assert pooled["verdict"]["cycle_outcome"] == pooled["verdict"]["outcome"]  # every process read in-band
    assert [e["stopped_by"] for e in pooled["per_process"]] == [r["rounds"]["stopped_by"] for r in records]
    assert pooled["rounds"]["stopped_by"] is None and " rounds (stopped per process) x 3 processes" in line(
        pooled
    )


def test_a_pooled_inconclusive_verdict_says_how_many_processes_would_decide_it() -> None:
    records = _records(3, offset=0.006)  # 0.53 ms against 0.5: 6% apart, within 0.6% of each other
    for r in records:
        r["samples"]["reference_ms"] = [v * 1.009 for v in r["samples"]["candidate_ms"]]  # 0.9%: near 1%
    (pooled,) = pooling.pool([[r] for r in records])
    verdict = pooled["verdict"]
    assert verdict["rounds_to_decide"] is None  # a pooled interval narrows with processes, not rounds
    if verdict["outcome"] == "inconclusive":
        assert verdict["processes_to_decide"] >= 3
    low, high = pooled["ratio"]["ci95"]
    needed = stats.processes_to_decide(3, pooled["ratio"]["estimate"], low, high, verdict["delta"])
    assert verdict["processes_to_decide"] == (needed if verdict["outcome"] == "inconclusive" else None)


def test_pooled_pinning_and_environment_name_each_process_s_difference() -> None:
    records = _records(3)
    decision = {"kernel": "m:k", "key": "8", "source": "table", "origin": None, "in_measure": False}
    for p, r in enumerate(records):
        r["pinning"]["configs"] = [{**decision, "signature": "w8" if p == 1 else "w4"}]
    records[2]["environment"]["gpu"] = {"name": "another GPU", "capability": "9.0"}
    (pooled,) = pooling.pool([[r] for r in records])
    assert [c["signature"] for c in pooled["pinning"]["configs"]] == ["w4", "w8"]
    found = {f["name"]: f["message"] for f in pooled["flags"]}
    assert found["configs_differ"] == "m:k at key 8 launched w4 in process(es) 0, 2; w8 in process(es) 1"
    assert found["environment_differs"].startswith("the processes pooled ran on different gpu: process 0 {")
    assert (
        pooled["environment"]["gpu"] is None
        and pooled["environment"]["host"] == records[0]["environment"]["host"]
    )
    assert pooled["status"] == "demoted" and pooled["verdict"]["outcome"] == "inconclusive"


def test_an_environment_value_process_0_could_not_read_differs_from_another_s() -> None:
    # None in process 0 against "H100" elsewhere went unflagged: only a value of process 0's was.
    records = _records(2)
    records[0]["environment"]["gpu"] = None
    (pooled,) = pooling.pool([[r] for r in records])
    found = {f["name"]: f["message"] for f in pooled["flags"]}
    assert found["environment_differs"].startswith(
        "the processes pooled ran on different gpu: process 0 None, "
    )
    assert pooled["environment"]["gpu"] is None
    (same,) = pooling.pool([[r] for r in _records(2)])
    assert "environment_differs" not in {f["name"] for f in same["flags"]}


def _shapes_harness(seed: int, sizes: tuple[int, ...] = (4096, 16384)) -> list[dict[str, Any]]:
    """One process of /tmp/eval1/eval_shapes.py: ``measure(add, ...)`` in a loop over sizes, the
    default name (``add``) for every size; 0.1 ms per 4096 elements."""
    dev = FakeDevice(seed=seed, noise=0.002)
    found = []
    for n in sizes:

        def add(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            dev.kernel(0.1 * x.numel() / 4096)()
            return torch.add(x, y, out=out)

        add.__qualname__ = "add"  # as the review's module-level function
        make_inputs = lambda n=n: (torch.ones(n), torch.ones(n), torch.empty(n))
        found.append(measure(add, make_inputs=make_inputs, **seams(dev)).record)
    return found


def test_one_name_on_two_shapes_in_one_process_is_two_results_never_two_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pooled by name alone, the review's loop over two sizes came out as one result "measured in 2
    processes" from one process, medians 17 and 64 ms, the shape of the first. A result is now a name
    and its inputs: the two stay apart, named by their shapes alike in every run, so that ``score
    compare`` matches them up file to file."""
    small = "add[4096 float32, 4096 float32, 4096 float32]"
    large = "add[16384 float32, 16384 float32, 16384 float32]"
    with pytest.warns(UserWarning) as warned:
        one = pooling.pool([_shapes_harness(0)])
    assert [str(w.message) for w in warned] == [
        f"megatron_tuning: results named 'add' kept apart as {small!r}, {large!r}: "
        "pass measure(..., name=...) to name each"
    ]
    assert [r["name"] for r in one] == [small, large]
    assert [r["processes"]["count"] for r in one] == [1, 1]
    assert one[0]["latency"]["median"] == pytest.approx(0.1, rel=0.01)
    assert one[1]["latency"]["median"] == pytest.approx(0.4, rel=0.01)
    assert [r["shape"][0]["shape"] for r in one] == [[4096], [16384]]
    (renamed,) = one[1]["flags"][-1:]
    assert renamed == {
        "name": "renamed",
        "message": f"more than one result was named 'add' (on other inputs): this one is {large!r}, kept "
        "apart; pass measure(..., name=...) to name each",
        "demotes": False,
    }
    assert [r["status"] for r in one] == [
        r["per_process"][0]["status"] for r in one
    ]  # renamed demotes nothing
    two = pooling.pool([_shapes_harness(1), _shapes_harness(2)])
    assert [(r["name"], r["processes"]["count"]) for r in two] == [(small, 2), (large, 2)]
    assert [e["record"] for e in two[1]["per_process"]] == [1, 1]
    for name, records in (("new.json", one), ("old.json", two)):
        (tmp_path / name).write_text(json.dumps({"format": pooling.RUN_FORMAT, "results": records}))
    assert cli.main(["score", "compare", str(tmp_path / "new.json"), str(tmp_path / "old.json")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [p.split(": ")[0] for p in printed] == [small, large] and all(" of add[" in p for p in printed)


def test_one_name_twice_on_one_shape_pools_first_with_first_and_a_shape_change_stays_apart() -> None:
    records = [_records(2), _records(2)]  # two processes, each measuring "k" twice on no inputs
    with pytest.warns(UserWarning, match="results named 'k' kept apart as 'k#2': pass measure"):
        first, second = pooling.pool(records)
    assert second["flags"][-1]["message"].startswith("more than one result was named 'k' (more than once in")
    assert (first["name"], second["name"]) == ("k", "k#2")
    assert [(e["process"], e["record"]) for e in second["per_process"]] == [(0, 1), (1, 1)]
    assert [f["name"] for f in first["flags"]] == [] and first["processes"]["count"] == 2
    moved = [_shapes_harness(0, (4096,)), _shapes_harness(1, (8192,))]  # the size changed between processes
    with pytest.warns(UserWarning, match="results named 'add' kept apart"):
        assert [r["processes"]["count"] for r in pooling.pool(moved)] == [1, 1]


def _aa_record(dev: FakeDevice, bias: float, seed: int) -> dict[str, Any]:
    """An A/A run whose two instances differ by ``bias`` in this process (their buffers, say)."""
    made = []

    def make_inputs() -> torch.Tensor:
        made.append(len(made))
        return torch.full((1,), float(len(made)))

    def copy(x: torch.Tensor) -> None:  # the first instance (candidate) 0.5 ms, the second off by bias
        dev.kernel(0.5 * (1 + bias * (float(x[0]) == 2.0)))()

    return measure(copy, reference=copy, make_inputs=make_inputs, check=None, name="aa", **seams(dev)).record


def test_the_pooled_noise_floor_is_the_a_a_spread_between_processes_and_compare_clears_it() -> None:
    """Pooled, an A/A run's ``aa_p95`` was process 0's (0.0108 where process 1 gave 0.0046), and
    ``compare`` widened later verdicts by that one process's floor. Now it is how far one more
    process's A/A ratio lies from 1, at 95%, from the spread of the processes' (``stats.aa_reach``)."""
    biases = [0.008, -0.006, 0.0, 0.012, -0.002]
    records = [_aa_record(FakeDevice(seed=s, noise=0.002), b, s) for s, b in enumerate(biases)]
    (pooled,) = pooling.pool([[r] for r in records])
    floor = pooled["noise_floor"]["aa_p95"]
    assert floor == pytest.approx(stats.aa_reach(np.log([r["ratio"]["estimate"] for r in records])))
    assert floor > max(r["noise_floor"]["aa_p95"] for r in records) > 0.006  # the spread is not one process's
    assert pooled["per_process"][1]["aa_p95"] == records[1]["noise_floor"]["aa_p95"]
    dev = FakeDevice(seed=9, noise=0.002)  # two results apart by more than the margin, less than the floor
    gap = (0.01 + floor) / 2
    a, b = (measure(dev.kernel(ms), name=f"{ms}", **seams(dev)).record for ms in (0.5, 0.5 * (1 + gap)))
    assert compare(a, b)["outcome"] == "faster"
    assert compare(a, {**b, "noise_floor": pooled["noise_floor"]})["outcome"] != "faster"


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


def test_a_job_s_processes_are_read_in_the_order_they_ran_not_by_pid(tmp_path: Path) -> None:
    """Sorted by file name, pid 10001 (run second) came before pid 9999 (run first)."""
    first, second = _records(2)
    for pid, record, when in ((9999, first, 1_000), (10001, second, 2_000)):
        path = tmp_path / f"{pooling.PREFIX}host-{pid}.json"
        path.write_text(json.dumps([record]))
        os.utime(path, ns=(when * 10**9, when * 10**9))
    assert pooling.read_job(tmp_path) == [[first], [second]]


def test_a_job_s_processes_are_read_in_their_series_order_whatever_the_file_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a file system with 1-2 s timestamps (NFS, FAT), or under concurrent writers, the processes'
    files tied on time and were read by name: pid 10001 (run second) before pid 9999 (run first)."""
    records = _records(3)
    for index, pid in ((1, 10001), (0, 9999), (2, 10000)):
        job = {"dir": str(tmp_path), "index": index}
        monkeypatch.setattr(os, "getpid", lambda pid=pid: pid)
        pooling.publish(records[index], job)
        pooling.publish(records[index], job)  # appended, the place kept
        os.utime(tmp_path / f"{pooling.PREFIX}{socket.gethostname()}-{pid}.json", ns=(10**9, 10**9))
    assert pooling.read_job(tmp_path) == [[r, r] for r in records]


def test_a_result_measured_in_fewer_processes_than_requested_says_so() -> None:
    """A series stopped in process 2 of 3 recorded 'processes: 2' and the 3 asked for nowhere."""
    records = _records(2)
    (pooled,) = pooling.pool([[r] for r in records], requested=3)
    assert pooled["processes"]["count"] == 2 and pooled["processes"]["requested"] == 3
    assert pooled["flags"][-1] == {
        "name": "fewer_processes",
        "message": "measured in 2 of the 3 processes requested: its interval covers 2 processes",
        "demotes": False,
    }
    assert pooled["status"] == "ok" and pooling.pool([[r] for r in records], requested=2)[0]["flags"] == []


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
