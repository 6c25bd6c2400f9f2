"""One result's records from several processes pooled into one record (docs/score.md, "The pooled
record"). Every field is pooled over the processes, or agreed by all of them, or null where they
differ; each process's own values stay in its record, which ``per_process`` locates. None is one
process's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import clocks as clk
from . import stats
from .integrity import Flag, demoted_verdict, flag

# (process index, record index in that process's list, the record)
Member = tuple[int, int, dict[str, Any]]
# Differing between processes, these change what was timed: a pooled result over them is demoted.
TIMED_ENVIRONMENT = ("gpu", "driver", "torch", "triton")
NVML_FIELDS = ("sm_mhz", "mem_mhz", "temperature_c", "power_w")


def pool_result(
    members: list[Member], *, name: str, requested: int | None, notes: list[Flag]
) -> dict[str, Any]:
    """The pooled record of one result (one name and inputs) measured in ``len(members)`` processes
    of ``requested``; ``notes`` are the pooling's own flags (e.g. a renamed result)."""
    records = [r for _, _, r in members]
    flags = [{**f, "message": f"process {p}: {f['message']}"} for p, _, r in members for f in r["flags"]]
    summary = [
        {
            "process": p,
            "record": j,
            "name": r["name"],
            "status": r["status"],
            "median_ms": r["latency"]["median"],
            "ratio": r["ratio"]["estimate"] if r["ratio"] else None,
            "outcome": r["verdict"]["outcome"] if r["verdict"] else None,
            "stopped_by": r["rounds"]["stopped_by"],
            "aa_p95": r["noise_floor"]["aa_p95"],
        }
        for p, j, r in members
    ]
    medians = [r["latency"]["median"] for r in records]
    processes = {
        "count": len(records),
        "requested": requested,
        "medians_ms": medians,
        "between_cv": float(np.std(medians, ddof=1) / np.mean(medians)) if len(records) > 1 else None,
    }
    if len(records) == 1:  # nothing to pool: the process's own numbers and sequential verdict
        (record,) = records
        pooled = dict(record)
        if record["verdict"]:
            pooled["verdict"] = {**record["verdict"], "processes_to_decide": None}
    else:
        pooled = _pool_many(members, flags)
    if requested is not None and len(records) < requested:  # a partial series, or a result some skipped
        scope = "its rounds only" if len(records) == 1 else f"{len(records)} processes"
        notes = [
            *notes,
            {
                "name": "fewer_processes",
                "message": f"measured in {len(records)} of the {requested} processes requested: "
                f"its interval covers {scope}",
                "demotes": False,
            },
        ]
    pooled.update(name=name, processes=processes, flags=flags + notes, samples=None, per_process=summary)
    demoted = "demoted" if any(f["demotes"] for f in pooled["flags"]) else "ok"
    incorrect = "fail" in (pooled["correctness"]["before"], pooled["correctness"]["after"])
    pooled["status"] = "incorrect" if incorrect else demoted
    return {key: pooled[key] for key in (*records[0], "per_process")}  # a record's order of fields


def _pool_many(members: list[Member], flags: list[Flag]) -> dict[str, Any]:
    """Fields of two or more processes' records; ``flags`` gains the pooling's own findings."""
    records = [r for _, _, r in members]
    count = len(records)
    candidate = [_kept(r, "candidate_ms") for r in records]
    found = stats.pooled_interval(candidate)
    latency = {
        "unit": "ms",
        **_fields(found),
        "min": min(r["latency"]["min"] for r in records),
        "iqr": [float(q) for q in np.quantile(np.concatenate(candidate), [0.25, 0.75])],
    }
    environment = _environment(members, flags)
    pinning = _pinning(members, flags)
    ratio, verdict = None, None
    if all(r["ratio"] is not None for r in records):
        ratios = stats.pooled_interval([c / _kept(r, "reference_ms") for c, r in zip(candidate, records)])
        ratio = {
            "estimate": float(ratios.estimate),
            **{k: v for k, v in _fields(ratios).items() if k != "median"},
        }
        verdict = _verdict(records, ratios, flags)
    low, high = ratio["ci95"] if ratio else [v / latency["median"] for v in latency["ci95"]]
    aa = ratio is not None and all(r["noise_floor"]["aa_p95"] is not None for r in records)
    rounds = [r["rounds"] for r in records]
    return {
        "format": records[0]["format"],
        "shape": records[0]["shape"],  # part of the result's identity: the same in every process
        "latency": latency,
        "throughput": _throughput(records, latency["median"]),
        "ratio": ratio,
        "verdict": verdict,
        "noise_floor": {
            "aa_p95": _aa_p95(records) if aa else None,
            "mde": stats.minimum_detectable(low, high, df=count - 1),
            "of": "ratio" if ratio else "latency",
        },
        "rounds": {
            **_agreed(rounds),
            **{key: sum(r[key] for r in rounds) for key in ("used", "discarded", "seconds")},
        },
        "timing": _agreed([r["timing"] for r in records]),
        "clocks": _clocks(records),
        "environment": environment,
        "pinning": pinning,
        "correctness": _correctness(members),
    }


def _kept(record: dict[str, Any], key: str) -> np.ndarray:
    return np.asarray(record["samples"][key], dtype=float)[np.asarray(record["samples"]["kept"], dtype=bool)]


def _fields(found: stats.Interval) -> dict[str, Any]:
    return {
        "median": float(found.estimate),
        "ci95": [float(found.low), float(found.high)],
        "half_width": float(stats.half_width(found)),
    }


def _agreed(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Each key's value where every process has the same, else null."""
    return {
        key: value if all(d.get(key) == value for d in dicts) else None for key, value in dicts[0].items()
    }


def _verdict(records: list[dict[str, Any]], ratios: stats.Interval, flags: list[Flag]) -> dict[str, Any]:
    """The verdict on the pooled ratio at 95%, against the widest margin and noise floor any process
    used; in SM cycles too where every process read the in-band clock of every kept round."""
    delta = max(r["verdict"]["delta"] for r in records)
    low, high, estimate = float(ratios.low), float(ratios.high), float(ratios.estimate)
    outcome = str(stats.verdict(np.asarray(low), np.asarray(high), delta))
    cycle = _cycle_outcome(records, delta)
    if cycle is not None and cycle != outcome:
        flags.append(
            flag("cycles_disagree", f"pooled: in time the candidate is {outcome}, in SM cycles {cycle}")
        )
    margin = max(r["verdict"]["margin"] for r in records)
    return {
        **decide(low, high, delta, margin, flags, cycle_outcome=cycle),
        # A pooled interval narrows with processes: more rounds of each leave the spread between them.
        "processes_to_decide": stats.processes_to_decide(len(records), estimate, low, high, delta)
        if outcome == "inconclusive"
        else None,
    }


def decide(
    low: float,
    high: float,
    delta: float,
    margin: float,
    flags: list[Flag],
    what: str = "pooled ratio",
    cycle_outcome: str | None = None,
) -> dict[str, Any]:
    """A verdict at 95% on an interval, demoted to inconclusive by any demoting flag."""
    outcome = str(stats.verdict(np.asarray(low), np.asarray(high), delta))
    reason = f"{what} interval [{float(low):.4f}, {float(high):.4f}] at 95% against 1 +/- {delta:.2%}"
    return demoted_verdict(
        outcome,
        reason,
        sorted({f["name"] for f in flags if f["demotes"]}),  # pooled: one name per flag, not per process
        margin=margin,
        delta=delta,
        level=0.95,
        cycle_outcome=cycle_outcome,
        rounds_to_decide=None,  # an interval of processes or of two results: not a count of rounds
    )


def _cycle_outcome(records: list[dict[str, Any]], delta: float) -> str | None:
    groups = []
    for r in records:
        mhz = [r["samples"][k] for k in ("candidate_mhz", "reference_mhz")]
        if any(m is None for m in mhz):
            return None
        kept = np.asarray(r["samples"]["kept"], dtype=bool)
        cand, ref = (np.array([np.nan if v is None else v for v in m], dtype=float)[kept] for m in mhz)
        if not (np.isfinite(cand).all() and np.isfinite(ref).all()):
            return None
        groups.append(_kept(r, "candidate_ms") / _kept(r, "reference_ms") * cand / ref)
    found = stats.pooled_interval(groups)
    return str(stats.verdict(np.asarray(found.low), np.asarray(found.high), delta))


def _aa_p95(records: list[dict[str, Any]]) -> float:
    """The A/A floor across processes: how far one more process's A/A ratio lies from 1, at 95%
    (``stats.aa_reach`` of the process medians): the difference between two instances that a
    later verdict must clear. Its own rounds' noise is in its own interval."""
    return stats.aa_reach(np.log([r["ratio"]["estimate"] for r in records]))


def _throughput(records: list[dict[str, Any]], median_ms: float) -> dict[str, float | None]:
    """At the pooled median, from the work per call each process's figure implies (null unless all
    processes give one and agree on it)."""
    found: dict[str, float | None] = {}
    for key in ("tflops", "gbps"):
        rates = [r["throughput"][key] for r in records]
        work = [rate * r["latency"]["median"] for rate, r in zip(rates, records) if rate]
        same = len(work) == len(records) and max(work) <= min(work) * (1 + 1e-9)
        found[key] = work[0] / median_ms if same else None
    return found


def _clocks(records: list[dict[str, Any]]) -> dict[str, Any]:
    """In-band: over every process's kept rounds. NVML: per field the median of the processes'
    medians, the lowest minimum and the highest maximum, every throttle reason seen. A source only
    where every process read it."""
    clocks = [r["clocks"] for r in records]
    inband = None
    if all(c["inband"] for c in clocks):
        arms = [arm for arm in ("candidate", "reference") if all(arm in c["inband"] for c in clocks)]
        inband = {arm: clk.summary([v for r in records for v in _kept_list(r, f"{arm}_mhz")]) for arm in arms}
    nvml = None
    if all(c["nvml"] for c in clocks):
        arms = [arm for arm in ("candidate", "reference") if all(arm in c["nvml"] for c in clocks)]
        nvml = {arm: _nvml_arm([c["nvml"][arm] for c in clocks]) for arm in arms}
    centre = {arm: summary["median"] for arm, summary in (inband or {}).items() if summary}
    seen = [c["processes_on_gpu"] for c in clocks if c["processes_on_gpu"] is not None]
    others = [c["other_processes"] for c in clocks if c["other_processes"] is not None]
    return {
        "locked": _agreed([{"locked": c["locked"]} for c in clocks])["locked"],
        "inband": inband,
        "nvml": nvml,
        "arm_offset": centre["candidate"] / centre["reference"] - 1 if len(centre) == 2 else None,
        "discard_below_mhz": _agreed([{"d": c["discard_below_mhz"]} for c in clocks])["d"],  # each its own
        "processes_on_gpu": max(seen) if seen else None,  # the most any process saw
        "other_processes": max(others) if others else None,
    }


def _kept_list(record: dict[str, Any], key: str) -> list[Any]:
    return [v for v, k in zip(record["samples"][key] or [], record["samples"]["kept"]) if k]


def _nvml_arm(arms: list[dict[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key in NVML_FIELDS:
        parts = [a[key] for a in arms]
        found[key] = (
            None
            if None in parts
            else {
                "median": float(np.median([p["median"] for p in parts])),
                "min": min(p["min"] for p in parts),
                "max": max(p["max"] for p in parts),
            }
        )
    reasons = [a["throttle_reasons"] for a in arms if a["throttle_reasons"] is not None]
    found["throttle_reasons"] = list(dict.fromkeys(n for r in reasons for n in r)) if reasons else None
    return found


def _environment(members: list[Member], flags: list[Flag]) -> dict[str, Any]:
    environments = [r["environment"] for _, _, r in members]
    agreed = _agreed(environments)
    # not all equal: a value one process could not read (None) differs from another's too
    differ = [
        k
        for k in TIMED_ENVIRONMENT
        if k in agreed and any(e.get(k) != environments[0][k] for e in environments)
    ]
    if differ:
        values = "; ".join(
            f"{k}: " + ", ".join(f"process {p} {r['environment'][k]}" for p, _, r in members) for k in differ
        )
        flags.append(flag("environment_differs", f"the processes pooled ran on different {values}"))
    return agreed


def _pinning(members: list[Member], flags: list[Flag]) -> dict[str, Any]:
    """Every decision any process made (``in_measure`` if any made it during the call), every table;
    a (kernel, key) launched in different configs by different processes is flagged."""
    configs: dict[tuple[Any, ...], dict[str, Any]] = {}
    signatures: dict[tuple[str, str], dict[str, list[int]]] = {}
    tables: dict[tuple[str, str], dict[str, Any]] = {}
    for p, _, r in members:
        for c in r["pinning"]["configs"]:
            ident = tuple(c[k] for k in ("kernel", "key", "signature", "source", "origin"))
            seen = configs.setdefault(ident, dict(c))
            seen["in_measure"] = seen["in_measure"] or c["in_measure"]
            signatures.setdefault((c["kernel"], c["key"]), {}).setdefault(c["signature"], []).append(p)
        for t in r["pinning"]["tables"]:
            tables.setdefault((t["path"], t["sha256"]), t)
    for (kernel, key), seen_in in signatures.items():
        if len(seen_in) > 1:
            which = "; ".join(f"{s} in process(es) {', '.join(map(str, ps))}" for s, ps in seen_in.items())
            flags.append(flag("configs_differ", f"{kernel} at key {key} launched {which}"))
    policy = _agreed([{"policy": r["pinning"]["policy"]} for _, _, r in members])["policy"]
    return {"policy": policy, "configs": list(configs.values()), "tables": list(tables.values())}


def _correctness(members: list[Member]) -> dict[str, Any]:
    checks = [r["correctness"] for _, _, r in members]
    worst = {"checked": _agreed([{"c": c["checked"]} for c in checks])["c"]}
    for key in ("before", "after"):
        values = [c[key] for c in checks]
        worst[key] = "fail" if "fail" in values else "pass" if "pass" in values else None
    messages = [
        f"process {p}: {r['correctness']['message']}" for p, _, r in members if r["correctness"]["message"]
    ]
    worst["message"] = messages[0] if messages else None
    return worst
