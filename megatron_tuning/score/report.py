"""A score's numbers and its JSON record: rounds analysed into latency, ratio and verdict, the
clock and integrity flags that demote it, and the ``Score`` a caller gets. Field by field: docs/score.md.
"""

from __future__ import annotations

import json
import platform
import socket
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import numpy as np

from ..core import __version__
from ..core.decisions import Decision
from . import clocks as clk
from . import stats
from .integrity import demoted_verdict, flag
from .pinned import pinning, stale_flags

FORMAT = "megatron_tuning.score/1"


class Score:
    """What ``measure`` returns: the JSON record (``record``), with its headline numbers as attributes."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    @property
    def median_ms(self) -> float:
        return float(self.record["latency"]["median"])

    @property
    def ci95_ms(self) -> tuple[float, float]:
        low, high = self.record["latency"]["ci95"]
        return float(low), float(high)

    @property
    def ratio(self) -> float | None:
        ratio = self.record["ratio"]
        return None if ratio is None else float(ratio["estimate"])

    @property
    def verdict(self) -> str | None:
        verdict = self.record["verdict"]
        return None if verdict is None else str(verdict["outcome"])

    @property
    def status(self) -> str:
        return str(self.record["status"])

    def to_json(self) -> str:
        return json.dumps(self.record, indent=1, sort_keys=True)

    def line(self) -> str:
        return line(self.record)

    def __repr__(self) -> str:
        return f"Score({self.line()})"


def analyse(samples: dict[str, Any], *, delta: float, level: float, ib: bool) -> dict[str, Any]:
    """Latency, ratio and verdict from the rounds so far: rounds whose clock fell under
    ``clocks.DISCARD_BELOW`` of the run's highest are left out; the verdict is decided at ``level``
    (the look's share of alpha), the reported intervals are 95%."""
    a = np.asarray(samples["values"][0], dtype=float)
    b = np.asarray(samples["values"][1], dtype=float) if len(samples["values"]) > 1 else None
    mhz = np.array([[np.nan if v is None else v for v in arm] for arm in samples["mhz"]], dtype=float)
    sm = np.array([np.nan if r.get("sm_mhz") is None else r["sm_mhz"] for r in samples["nvml"]], dtype=float)
    round_clock = np.nanmin(mhz, axis=0) if ib and np.isfinite(mhz).any() else sm
    kept = clk.kept_rounds(round_clock)
    lag1, factor = stats.dependence(a[kept])
    latency = _interval(a[kept], 0.95)
    analysis: dict[str, Any] = {
        "latency": {
            **latency,
            "min": float(a[kept].min()),
            "iqr": [float(q) for q in np.quantile(a[kept], [0.25, 0.75])],
        },
        "ratio": None,
        "verdict": None,
        "kept": kept.tolist(),
        "autocorrelation": {"lag1": float(lag1), "factor": float(factor)},
        "arm_offset": None,
        "max_clock_mhz": None if not np.isfinite(round_clock).any() else float(np.nanmax(round_clock)),
    }
    if b is None:
        return analysis
    ratios = a[kept] / b[kept]
    analysis["ratio"] = _interval(ratios, 0.95)
    decided = stats.median_interval(ratios, level)
    outcome = str(stats.verdict(decided.low, decided.high, delta))
    cycle = None
    if ib and np.isfinite(mhz[:, kept]).all():
        cycles = stats.median_interval(ratios * mhz[0, kept] / mhz[1, kept], level)
        cycle = str(stats.verdict(cycles.low, cycles.high, delta))
        analysis["arm_offset"] = float(np.median(mhz[0, kept]) / np.median(mhz[1, kept]) - 1)
    low, high = float(decided.low), float(decided.high)
    analysis["verdict"] = {
        "outcome": outcome,
        "level": level,
        "interval": [low, high],
        "cycle_outcome": cycle,
        "rounds_to_decide": stats.rounds_to_decide(int(kept.sum()), float(decided.estimate), low, high, delta)
        if outcome == "inconclusive"
        else None,
    }
    return analysis


def _interval(values: np.ndarray, level: float) -> dict[str, Any]:
    found = stats.median_interval(values, level)
    estimate, low, high = float(found.estimate), float(found.low), float(found.high)
    return {"median": estimate, "ci95": [low, high], "half_width": float(stats.half_width(found))}


def clock_flags(analysis: dict[str, Any]) -> list[dict[str, Any]]:
    """Clock evidence that demotes: arms at clocks more than 1% apart, time and cycles disagreeing,
    too few rounds left once the throttled ones are out."""
    found = []
    offset = analysis["arm_offset"]
    if offset is not None and abs(offset) > clk.ARM_OFFSET:
        found.append(
            flag("clock_offset", f"the candidate's blocks ran at {offset:+.1%} the reference's SM clock")
        )
    verdict = analysis["verdict"]
    if verdict and verdict["cycle_outcome"] and verdict["cycle_outcome"] != verdict["outcome"]:
        message = f"in time the candidate is {verdict['outcome']}, in SM cycles {verdict['cycle_outcome']}"
        found.append(flag("cycles_disagree", message))
    used = sum(analysis["kept"])
    if used < stats.FIRST_LOOK:
        found.append(
            flag(
                "few_rounds",
                f"{used} rounds kept (of {len(analysis['kept'])}); a verdict needs "
                f"{stats.FIRST_LOOK}: raise budget_s, or find what throttles the GPU",
            )
        )
    return found


def build(
    *,
    name: str,
    analysis: dict[str, Any] | None,
    samples: dict[str, Any],
    settings: dict[str, Any],
    rounds: dict[str, Any],
    timing: dict[str, Any],
    delta: float,
    aa: bool,
    nvml: Any,
    device: dict[str, Any],
    correctness: dict[str, Any],
    flags: list[dict[str, Any]],
    shapes: Any,
    flops: float | None,
    bytes: float | None,
    decisions: Sequence[Decision],
    new_decisions: int,
) -> dict[str, Any]:
    """The JSON record of one process's measurement (``analysis`` of at least one round)."""
    assert analysis is not None
    pinned = pinning(decisions, new_decisions)
    flags = flags + clock_flags(analysis) + stale_flags(pinned)
    latency = {"unit": "ms", **analysis["latency"]}
    median_s = latency["median"] * 1e-3
    ratio = analysis["ratio"]
    record: dict[str, Any] = {
        "format": FORMAT,
        "name": name,
        "shape": shapes,
        "latency": latency,
        "throughput": {
            "tflops": flops / median_s / 1e12 if flops else None,
            "gbps": bytes / median_s / 1e9 if bytes else None,
        },
        "ratio": None
        if ratio is None
        else {
            "estimate": ratio["median"],
            "ci95": ratio["ci95"],
            "half_width": ratio["half_width"],
        },
        "verdict": _verdict(analysis["verdict"], delta, settings["margin"], flags),
        "noise_floor": _noise(ratio, latency, aa),
        "rounds": {
            "used": int(sum(analysis["kept"])),
            "discarded": len(analysis["kept"]) - int(sum(analysis["kept"])),
            **rounds,
            "autocorrelation": analysis["autocorrelation"],
        },
        "processes": {"count": 1, "medians_ms": [latency["median"]], "between_cv": None},
        "timing": {
            **timing,
            "l2": settings["l2"],
            "launch": settings["launch"],
            "target_ci": settings["target_ci"],
            "budget_s": settings["budget_s"],
        },
        "clocks": _clocks(analysis, samples, nvml),
        "environment": environment(device, nvml),
        "pinning": pinned,
        "correctness": correctness,
        "flags": flags,
        "status": "incorrect"
        if "fail" in (correctness["before"], correctness["after"])
        else "demoted"
        if any(f["demotes"] for f in flags)
        else "ok",
        "samples": {
            "candidate_ms": samples["values"][0],
            "reference_ms": samples["values"][1] if len(samples["values"]) > 1 else None,
            "candidate_mhz": samples["mhz"][0],
            "reference_mhz": samples["mhz"][1] if len(samples["mhz"]) > 1 else None,
            "nvml_sm_mhz": [r.get("sm_mhz") for r in samples["nvml"]],
            "kept": analysis["kept"],
        },
    }
    return record


def _verdict(decided: Any, delta: float, margin: float, flags: list[dict[str, Any]]) -> dict[str, Any] | None:
    if decided is None:
        return None
    low, high = decided["interval"]
    reason = f"ratio interval [{low:.4f}, {high:.4f}] at {decided['level']:.2%} against 1 +/- {delta:.2%}"
    return demoted_verdict(
        decided["outcome"],
        reason,
        [f["name"] for f in flags if f["demotes"]],
        margin=margin,
        delta=delta,
        level=decided["level"],
        cycle_outcome=decided["cycle_outcome"],
        rounds_to_decide=decided["rounds_to_decide"],
    )


def _noise(ratio: Any, latency: dict[str, Any], aa: bool) -> dict[str, Any]:
    low, high = (
        ratio or {"ci95": [latency["ci95"][0] / latency["median"], latency["ci95"][1] / latency["median"]]}
    )["ci95"]
    return {
        "aa_p95": max(abs(low - 1), abs(high - 1)) if aa else None,
        "mde": stats.minimum_detectable(low, high),
        "of": "ratio" if ratio is not None else "latency",
    }


def aa_p95(noise_floor: Any) -> float | None:
    """The A/A p95 of a ``noise_floor`` result, its record, or a number."""
    if noise_floor is None or isinstance(noise_floor, (int, float)):
        return noise_floor
    record = noise_floor.record if isinstance(noise_floor, Score) else noise_floor
    value = record["noise_floor"]["aa_p95"]
    if value is None:
        raise ValueError(f"{record['name']} is not an A/A result: make one with noise_floor(fn)")
    return float(value)


def _clocks(analysis: dict[str, Any], samples: dict[str, Any], nvml: Any) -> dict[str, Any]:
    kept = analysis["kept"]
    arms = ("candidate", "reference")[: len(samples["mhz"])]
    inband = {
        arm: clk.summary([v for v, k in zip(samples["mhz"][i], kept) if k]) for i, arm in enumerate(arms)
    }
    nv: dict[str, Any] | None = None
    if nvml is not None:
        nv = {}
        for i, arm in enumerate(arms):
            mine = [r for r, k in zip(samples["nvml"], kept) if k and r["arm"] == i]
            nv[arm] = {
                key: clk.summary([r.get(key) for r in mine])
                for key in ("sm_mhz", "mem_mhz", "temperature_c", "power_w")
            }
            nv[arm]["throttle_reasons"] = clk.throttle_names([r.get("throttle") for r in mine])
    processes = nvml.processes() if nvml is not None else {"on_gpu": None, "others": None}
    top = analysis["max_clock_mhz"]
    return {
        "locked": nvml.locked() if nvml is not None else None,
        "inband": inband if any(v is not None for v in inband.values()) else None,
        "nvml": nv,
        "arm_offset": analysis["arm_offset"],
        "discard_below_mhz": None if top is None else clk.DISCARD_BELOW * top,
        "processes_on_gpu": processes["on_gpu"],
        "other_processes": processes["others"],
    }


def environment(device: dict[str, Any], nvml: Any) -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for module in ("torch", "triton", "numpy"):
        try:
            versions[module] = metadata.version(module)
        except metadata.PackageNotFoundError:
            versions[module] = None
    nv = nvml.device() if nvml is not None else {}
    return {
        "gpu": device,
        "driver": nv.get("driver"),
        "python": platform.python_version(),
        "megatron_tuning": __version__,
        "host": socket.gethostname(),
        **versions,
    }


def shapes(inputs: Any) -> list[dict[str, Any]] | None:
    """Shape and dtype of each tensor-like input (``None`` without inputs)."""
    if inputs is None:
        return None
    items = (
        inputs.values()
        if isinstance(inputs, dict)
        else inputs
        if isinstance(inputs, (tuple, list))
        else [inputs]
    )
    return [
        {"shape": list(x.shape), "dtype": str(x.dtype)}
        for x in items
        if hasattr(x, "shape") and hasattr(x, "dtype")
    ]


def look_line(analysis: dict[str, Any]) -> str:
    lat = analysis["latency"]
    text = f"median {lat['median']:.4f} ms (+/-{lat['half_width']:.2%})"
    if analysis["ratio"]:
        text += f", ratio {analysis['ratio']['median']:.4f} (+/-{analysis['ratio']['half_width']:.2%})"
        text += f", {analysis['verdict']['outcome']}"
    return text


def line(record: dict[str, Any]) -> str:
    """One line per result, for logs: name, latency, ratio and verdict, rounds, clocks, flags."""
    lat, rounds = record["latency"], record["rounds"]
    parts = [f"{record['name']}: {lat['median']:.4f} ms [{lat['ci95'][0]:.4f}, {lat['ci95'][1]:.4f}]"]
    if record["ratio"]:
        r, v = record["ratio"], record["verdict"]
        parts.append(
            f"ratio {r['estimate']:.4f} [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] -> {v['outcome']} "
            f"(delta {v['delta']:.1%})"
        )
    processes = record["processes"]["count"]
    parts.append(  # a pooled record's stopped_by is null where its processes stopped differently
        f"{rounds['used']} rounds ({rounds['stopped_by'] or 'stopped per process'})"
        + (f" x {processes} processes" if processes > 1 else "")
    )
    clock = clk.candidate_clock(record)
    if clock:
        parts.append(f"SM {clock[1][0]:.0f} MHz ({clock[0]})")
    parts.append(
        record["status"]  # each flag named once: a pooled record holds every process's
        + (f" [{', '.join(dict.fromkeys(f['name'] for f in record['flags']))}]" if record["flags"] else "")
    )
    return "; ".join(parts)
