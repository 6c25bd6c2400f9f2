"""The summary of ``bench_mamba_ssd.py``'s runs: per mode and per kernel, and its printed tables.

``summarize`` reads only the JSON lines the workers wrote, so recorded runs (``--summarize``)
give the published summary again.
"""

from __future__ import annotations

import collections
import statistics
from typing import Any

import common


def _round(run: dict[str, Any]) -> int | None:
    """The driver's round of a run: recorded, or read from its tag (``run2``; older JSONL files)."""
    if run.get("round") is not None:
        return int(run["round"])
    tag = str(run.get("tag", ""))
    return int(tag[3:]) if tag.startswith("run") and tag[3:].isdigit() else None


def summarize(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per mode: config spread, output hashes, benchmark calls, first-step and steady-state times."""
    counted = [r for r in runs if r.get("tag") != "prewarm"]
    ok = [r for r in counted if r.get("ok")]
    median = common.median_or_none
    stock_steady = median([r["steady_ms"]["median"] for r in ok if r["mode"] == "stock"])
    per_mode: dict[str, Any] = {}
    per_kernel: dict[str, dict[str, collections.Counter[str]]] = collections.defaultdict(dict)
    for mode in modes:
        mine = [r for r in ok if r["mode"] == mode]
        failed = [r for r in counted if r["mode"] == mode and not r.get("ok")]
        configs: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        for r in mine:
            for kernel, keys in r.get("launched", {}).items():
                for key, sig in keys.items():
                    configs[(kernel, key)][sig] += 1
        for (kernel, _key), counter in configs.items():
            per_kernel[kernel][mode] = per_kernel[kernel].get(mode, collections.Counter()) + counter
        steady = [r["steady_ms"]["median"] for r in mine]
        per_mode[mode] = {
            "processes": len(mine),
            "failed": len(failed),
            "errors": sorted({str(r.get("error"))[:200] for r in failed}),
            "kernel_keys": len(configs),
            "max_distinct_configs": max((len(c) for c in configs.values()), default=0),
            "keys_with_several_configs": sum(1 for c in configs.values() if len(c) > 1),
            "distinct_output_hashes": len({r["out"]["all"] for r in mine}),
            "distinct_out_hashes_per_tensor": {
                t: len({r["out"].get(t) for r in mine})
                for t in ("out", "states", "conv_out")
                if mine and t in mine[0]["out"]
            },
            "bench_calls": median([r["triton_bench_calls"] for r in mine]),
            "do_bench_calls": median([r["do_bench_calls"] for r in mine]),
            "first_step_launches": median([r["first_step_launches"] for r in mine]),
            "first_step_s": median([r["first_step_s"] for r in mine]),
            "first_step_s_run1": next((r["first_step_s"] for r in mine if _round(r) == 1), None),
            "first_step_s_later": median([r["first_step_s"] for r in mine if (_round(r) or 1) > 1]),
            "steady_ms": median(steady),
            "steady_spread": common.spread(steady)["rel_range"] if steady else None,
            "ratio_to_stock": (median(steady) / stock_steady) if steady and stock_steady else None,
            "kernel_ms": _kernel_medians(mine),
            "ref_rel_err_max": max((r.get("reference", {}).get("rel_err", 0.0) for r in mine), default=None),
            "first_matches_steady": all(r.get("first_matches_steady") for r in mine) if mine else None,
            "decision_sources": dict(
                collections.Counter(d.get("source", "?") for r in mine for d in r.get("decisions", []))
            ),
            "import_s": median([r.get("import_s", 0.0) for r in mine]),
        }
    prewarm = [r for r in runs if r.get("tag") == "prewarm"]
    return {
        "modes": per_mode,
        "kernels": {k: {m: dict(c) for m, c in v.items()} for k, v in sorted(per_kernel.items())},
        "output_hashes": {m: sorted({r["out"]["all"] for r in ok if r["mode"] == m}) for m in modes},
        "prewarm": [{k: r.get(k) for k in ("mode", "ok", "first_step_s", "error")} for r in prewarm],
    }


def _kernel_medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    pooled: dict[str, list[float]] = collections.defaultdict(list)
    for r in runs:
        for kernel, ms in r.get("kernel_ms", {}).items():
            pooled[kernel].append(ms)
    return {k: statistics.median(v) for k, v in sorted(pooled.items())}


# (header, summary field, suffix) of the per-mode table.
MODE_COLUMNS = (
    ("procs", "processes", ""),
    ("fail", "failed", ""),
    ("keys>1cfg", "keys_with_several_configs", ""),
    ("max cfgs/key", "max_distinct_configs", ""),
    ("out hashes", "distinct_output_hashes", ""),
    ("bench calls", "bench_calls", ""),
    ("launches 1st", "first_step_launches", ""),
    ("1st step s (run1)", "first_step_s_run1", ""),
    ("1st step s (later)", "first_step_s_later", ""),
    ("steady ms", "steady_ms", ""),
    ("vs stock", "ratio_to_stock", "x"),
    ("ref rel err", "ref_rel_err_max", ""),
)


def print_summary(summary: dict[str, Any]) -> None:
    modes = summary["modes"]
    print("\n== per mode (counted processes; prewarm excluded)")
    rows = [
        [mode] + [common.dash(r[field], suffix) for _, field, suffix in MODE_COLUMNS]
        for mode, r in modes.items()
    ]
    common.print_table(["mode"] + [header for header, _, _ in MODE_COLUMNS], rows)
    for mode, r in modes.items():
        for error in r["errors"]:
            print(f"  {mode} error: {error}")
    if summary["kernels"]:
        print("\n== configs launched per kernel (count of processes)")
        rows = []
        for kernel, by_mode in summary["kernels"].items():
            for mode, counter in by_mode.items():
                ms = modes.get(mode, {}).get("kernel_ms", {}).get(kernel)
                for sig, n in sorted(counter.items(), key=lambda kv: -kv[1]):
                    rows.append([kernel.rsplit(":", 1)[-1].strip("_"), mode, n, sig, common.dash(ms)])
        common.print_table(["kernel", "mode", "procs", "config", "kernel ms (mode median)"], rows)
    for p in summary.get("prewarm", []):
        print(
            f"prewarm {p['mode']}: first step {p['first_step_s']} s (cold compile cache) "
            f"ok={p['ok']} {p['error'] or ''}"
        )
