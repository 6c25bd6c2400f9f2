"""Score records across processes: what a ``score`` job asks of each process, each process's records
written as they come (kill-safe), pooled by result (name and inputs, hierarchically over
processes), and compared.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

from ..core.errors import PolicyError
from ..core.notices import warn_once
from ..tables.files import locked, write_atomic
from . import pooled, stats
from .clocks import ARM_OFFSET, candidate_clock
from .integrity import Flag, flag
from .report import FORMAT, Score

RUN_FORMAT = "megatron_tuning.score-run/1"  # the `score` command's file: pooled results, every process's
PREFIX = "score-"  # per-process record files: score-<host>-<pid>.json
_JOB_KEYS: dict[str, type | tuple[type, ...]] = {
    "dir": str,
    "index": int,  # the process's place in the series (0 first): how its records are ordered
    "budget_s": (int, float),
    "target_ci": (int, float),
    "noise_floor": bool,
    "do_bench": bool,
    "out": str,
    "run": str,
}


_job: dict[str, Any] = {}  # this process's part in a `score` job; empty outside one


def join_job(raw: str, name: str) -> dict[str, Any]:
    """Take part in the ``score`` job (or ``run --score-do-bench``) the launcher started this process
    for: ``raw`` is the JSON it passed in variable ``name``. Options given on the command line
    override the harness's own; ``"{}"`` leaves the job."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    allowed = "a JSON object with " + ", ".join(_JOB_KEYS) + " (set by the score command)"
    if not isinstance(data, dict) or any(
        k not in _JOB_KEYS or not isinstance(v, _JOB_KEYS[k]) for k, v in data.items()
    ):
        raise PolicyError(name, raw, allowed)
    _job.clear()
    _job.update(data)
    return dict(_job)


def job_settings() -> dict[str, Any]:
    """What the job this process takes part in asked of it: ``{}`` outside a ``score`` job."""
    return dict(_job)


def publish(record: dict[str, Any], job: dict[str, Any]) -> None:
    """Write ``record`` at once (a killed process keeps what it measured): appended to this process's
    file in the ``score`` job's folder (``dir``), or, under ``run --score-do-bench``, to the run's
    file (``out``), which every process of the job shares, re-pooled on each write."""
    me = f"{socket.gethostname()}-{os.getpid()}"
    if job.get("dir"):
        path = Path(job["dir"]) / f"{PREFIX}{me}.json"
        records = _read_process(path)[1] if path.exists() else []
        doc: Any = [*records, record]
        if "index" in job:
            doc = {"index": job["index"], "records": doc}
        write_atomic(path, json.dumps(doc).encode())
    if job.get("out"):
        with locked(job["out"]):
            report = json.loads(Path(job["out"]).read_text()) if os.path.exists(job["out"]) else {}
            if report.get("format") != RUN_FORMAT or report.get("run") != job.get("run"):
                report = {
                    "format": RUN_FORMAT,
                    "run": job.get("run"),
                    "command": sys.argv,
                    "exit_codes": [],
                    "noise_floor": False,
                    "process_ids": [],
                    "per_process": [],
                }
            if me not in report["process_ids"]:
                report["process_ids"].append(me)
                report["per_process"].append([])
            report["per_process"][report["process_ids"].index(me)].append(record)
            report.update(processes=len(report["per_process"]), results=pool(report["per_process"]))
            write_atomic(job["out"], json.dumps(report, indent=1).encode())


def read_job(folder: Path) -> list[list[dict[str, Any]]]:
    """Every process's records in a job's folder, one list per process that measured, in the order
    they ran: the place in the series each file records (file times tie on a coarse file system or
    under concurrent writers; pids say nothing); a file that records none, by its last write."""
    files = [(path, *_read_process(path)) for path in folder.glob(f"{PREFIX}*.json")]
    files.sort(key=lambda f: (f[1] is None, f[1] or 0, f[0].stat().st_mtime_ns, f[0].name))
    return [records for _, _, records in files]


def _read_process(path: Path) -> tuple[int | None, list[dict[str, Any]]]:
    """A per-process file: its place in the series (``None``: not recorded) and its records."""
    data = json.loads(path.read_text())
    return (data["index"], data["records"]) if isinstance(data, dict) else (None, data)


def pool(processes: list[list[dict[str, Any]]], requested: int | None = None) -> list[dict[str, Any]]:
    """One pooled record per result (``pooled.pool_result``): ``processes`` holds each process's
    records; ``requested`` is how many processes the series asked for, when known.

    A result is a name and the inputs' shapes: the k-th record of that name and shape in a process
    pools with the k-th of every other process. Records of one name, measured on other shapes or
    more than once in a process (a default name such as ``add`` or ``<lambda>`` in a loop), are kept
    apart, never pooled as if they were processes: each gets a name of its own, the shapes in
    brackets and ``#k`` for the k-th, the same in every run of the harness (``score compare`` matches
    files by name), with a ``renamed`` flag that says so."""
    groups: dict[tuple[str, str, int], list[pooled.Member]] = {}
    for p, records in enumerate(processes):
        seen: dict[tuple[str, str], int] = {}
        for j, record in enumerate(records):
            key = (record["name"], _inputs(record["shape"]))
            seen[key] = seen.get(key, 0) + 1
            groups.setdefault((*key, seen[key]), []).append((p, j, record))
    shapes: dict[str, set[str]] = {}
    for name, inputs, _ in groups:
        shapes.setdefault(name, set()).add(inputs)
    taken = {name for name, _, _ in groups}
    results: list[dict[str, Any]] = []
    renamed: dict[str, list[str]] = {}
    for (name, inputs, k), members in groups.items():
        unique = name + (f"[{inputs}]" if len(shapes[name]) > 1 else "") + (f"#{k}" if k > 1 else "")
        notes = []
        if unique != name:
            while unique in taken:  # a name given that reads like one made here
                unique += "'"
            taken.add(unique)
            notes.append(_renamed(name, unique, len(shapes[name]) > 1, k))
            renamed.setdefault(name, []).append(unique)
        results.append(pooled.pool_result(members, name=unique, requested=requested, notes=notes))
    for name, names in renamed.items():
        kept = ", ".join(map(repr, names))
        warn_once(("score-renamed", name), "results named %r kept apart as %s: %s", name, kept, _FIX)
    return results


def _inputs(shape: list[dict[str, Any]] | None) -> str:
    """A result's inputs as text: each tensor's shape and dtype (``4096x512 bfloat16``)."""
    if shape is None:
        return "no inputs"
    parts = [
        f"{'x'.join(map(str, s['shape'])) or 'scalar'} {s['dtype'].removeprefix('torch.')}" for s in shape
    ]
    return ", ".join(parts) or "no tensors"


_FIX = "pass measure(..., name=...) to name each"


def _renamed(name: str, unique: str, shapes: bool, k: int) -> Flag:
    why = " and ".join(w for w in ("on other inputs" * shapes, "more than once in a process" * (k > 1)) if w)
    message = f"more than one result was named {name!r} ({why}): this one is {unique!r}, kept apart; {_FIX}"
    return {"name": "renamed", "message": message, "demotes": False}


def load(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The results in a file: a record, a list of records, or the ``score`` command's file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc}); give a file that score or measure() wrote") from None
    records = data["results"] if isinstance(data, dict) and data.get("format") == RUN_FORMAT else data
    records = records if isinstance(records, list) else [records]
    if not records or not all(isinstance(r, dict) and r.get("format") == FORMAT for r in records):
        raise ValueError(f"{path}: not a score result (expected format {FORMAT} or {RUN_FORMAT})")
    return records


def compare(a: Any, b: Any, margin: float = 0.01) -> dict[str, Any]:
    """The verdict on ``a``'s latency against ``b``'s, from two results (``Score``, record or a file
    holding one): unpaired, so the interval of the log ratio adds both intervals' variances, each
    read off its 95% half-width (``t_{P-1}`` errors wide for P pooled processes, normal for one),
    and is Welch's t wide; the margin is widened to either's A/A noise floor. Results taken at SM
    clocks more than ``ARM_OFFSET`` apart (a cold GPU against a hot one) are demoted."""
    ra, rb = _one(a), _one(b)
    errors, dfs = zip(*(_error(r) for r in (ra, rb)))
    centre = math.log(ra["latency"]["median"] / rb["latency"]["median"])
    error = math.hypot(*errors)
    weight = sum(e**4 / d for e, d in zip(errors, dfs))  # Welch-Satterthwaite; one process adds 0
    df = error**4 / weight if weight > 0 else math.inf
    half = stats.t_quantile(0.975, df) * error  # the normal quantile at infinite df
    floors = [r["noise_floor"]["aa_p95"] for r in (ra, rb) if r["noise_floor"]["aa_p95"] is not None]
    delta = max([margin, *floors])
    flags = [{**f, "message": f"{r['name']}: {f['message']}"} for r in (ra, rb) for f in r["flags"]]
    clocks = candidate_clock(ra, rb)
    if clocks and abs(clocks[1][0] / clocks[1][1] - 1) > ARM_OFFSET:  # e.g. a cold GPU and a hot one
        source, (mhz_a, mhz_b) = clocks
        message = f"{ra['name']} ran at {mhz_a:.0f} MHz, {rb['name']} at {mhz_b:.0f} MHz ({source} SM clock)"
        flags.append(flag("clock_offset", message))
    verdict = pooled.decide(
        math.exp(centre - half), math.exp(centre + half), delta, margin, flags, "latency ratio"
    )
    return {
        **verdict,
        "a": ra["name"],
        "b": rb["name"],
        "ratio": math.exp(centre),
        "ci95": [math.exp(centre - half), math.exp(centre + half)],
        "flags": flags,  # both results' flags, each naming its result, and the comparison's own
    }


def _error(record: dict[str, Any]) -> tuple[float, float]:
    """A result's standard error of log latency and its degrees of freedom (infinite for one
    process, whose interval is a bootstrap over rounds)."""
    count = record["processes"]["count"]
    df = count - 1 if count > 1 else math.inf
    low, high = record["latency"]["ci95"]
    return math.log(high / low) / (2 * stats.t_quantile(0.975, df)), df  # normal at infinite df


def _one(value: Any) -> dict[str, Any]:
    if isinstance(value, Score):
        return value.record
    if isinstance(value, dict):
        return value
    records = load(value)
    if len(records) != 1:
        names = ", ".join(r["name"] for r in records)
        raise ValueError(
            f"{value} holds {len(records)} results ({names}): compare files with `score compare`"
        )
    return records[0]
