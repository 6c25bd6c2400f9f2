"""The scoring kit's acceptance checks on one GPU (issue 34), stage by stage.

    PYTHONPATH=. python benchmarks/bench_score.py --stages gemm,aa,slower,graph,integrity,overhead --out $OUT
    PYTHONPATH=. python benchmarks/bench_score.py --stages processes,soak --out $OUT
    PYTHONPATH=. python benchmarks/bench_score.py --smoke --out /tmp/score-smoke   # CPU: code paths only

Stages (expected minutes on an H100/H200; each stops starting runs at its budget in STAGES):
  gemm       ~0.5  4096^3 bf16 GEMM pinned from configs/sm90, cold L2: latency CI95 half-width <= 1.0%
                   and A/A paired-ratio half-width <= 0.5%, each in <= 10 s excluding compile
  aa         ~1.5  40 A/A runs of that GEMM: "faster" or "slower" in <= 2
  slower     ~1.5  the reference is the same GEMM with K 4.7% larger (4288): its true ratio measured
                   once (20 s), then 20 runs of <= 10 s must say "faster" in >= 18
  graph      ~0.2  a 1M-element add in CUDA-graph mode: CI95 half-width <= 2% in <= 10 s
  integrity  ~0.5  side stream, result cached by pointer, patched Event.elapsed_time: each flagged
  overhead   ~0.2  wall per timed launch of measure's rounds <= 1.15x do_bench's
  processes  ~4    `score --processes 10` on one pinned GEMM: max/min of process medians <= 1.02, each
                   process's CI95 covers the pooled median in >= 8 of 10; stock @triton.autotune in 10
                   fresh processes for contrast
  soak       ~3    a process on an idle GPU and one right after a 30 s GEMM soak: each median inside
                   the other's CI95 (and the requester's do_bench(warmup=10, rep=100) for contrast);
                   each is the first of 5 processes, whose pooled results are compared too
  thermal    ~3    the pinned GEMM's blocks back to back for 120 s from the GPU's state at the start
                   (idle on a fresh machine), 20 s idle, 30 s again; per block its time and in-band
                   clock, NVML every 0.2 s. Reports how much windows of 1, 5, 10 s vary past the
                   first 20 s, how closely that follows the clock (and what is left once adjusted
                   to one clock), and how much faster the first 20 s ran
Every record must carry in-band and NVML clocks per arm (checked over all stages). One JSON per stage
under --out (a folder); a table last. The per-round noise it prints (per_round_cv) is the number the
CPU tests' PER_ROUND_CV (tests/score/test_stats.py) stands in for.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import numpy as np

STAGES = {
    "gemm": 90,
    "aa": 150,
    "slower": 150,
    "graph": 40,
    "integrity": 60,
    "overhead": 40,
    "processes": 300,
    "soak": 240,
    "thermal": 200,
}
SHAPE, SMOKE_SHAPE = (4096, 4096, 4096), (64, 48, 40)
SOAK_PROCESSES = 5  # per state in the soak stage, as `score` runs by default; the first is the check's
TABLE = common.REPO / "configs" / "sm90" / "matmul.msgpack"


def _operands(shape: tuple[int, int, int], smoke: bool) -> Any:
    """A GEMM on fresh random operands: ``(fn, make_inputs, flops)``. The pinned Triton matmul on a
    GPU; in smoke, ``torch.matmul`` (an interpreted launch takes 0.2 s: too slow to time rounds of)."""
    import torch

    from megatron_tuning.kernels import matmul_grid, matmul_kernel

    m, n, k = shape
    grid = matmul_grid(m, n)
    seeds = iter(range(1 << 30))

    def make() -> tuple:
        return common.matmul_operands(shape, smoke, seed=next(seeds))[3]

    def gemm(*args: Any) -> Any:
        if smoke:
            return torch.matmul(args[0], args[1], out=args[2])
        matmul_kernel[grid](*args)
        return args[2]

    if smoke:  # one launch of the Triton kernel all the same: its decision (pinned or stock) is recorded
        matmul_kernel[grid](*make())
    return gemm, make, 2.0 * m * n * k


def _bound(shape: tuple[int, int, int], smoke: bool) -> Any:
    gemm, make, _ = _operands(shape, smoke)
    args = make()
    return lambda: gemm(*args)


def _pin(args: argparse.Namespace) -> None:
    import megatron_tuning

    tables = () if args.smoke else (str(TABLE),)
    policy = megatron_tuning.TuningPolicy(mode="deterministic", agreement="off", tables=tables)
    megatron_tuning.init_deterministic_tuning(policy)


def _short(record: dict[str, Any]) -> dict[str, Any]:
    """The numbers of a record a table needs (the full record stays in the stage's JSON)."""
    verdict, ratio = record["verdict"], record["ratio"]
    return {
        "median_ms": record["latency"]["median"],
        "half_width": record["latency"]["half_width"],
        "ratio": ratio and ratio["estimate"],
        "ratio_half_width": ratio and ratio["half_width"],
        "outcome": verdict and verdict["outcome"],
        "rounds": record["rounds"]["used"],
        "stopped_by": record["rounds"]["stopped_by"],
        "seconds": record["rounds"]["seconds"],
        "flags": [f["name"] for f in record["flags"]],
    }


def per_round_cv(record: dict[str, Any]) -> float:
    """Robust noise of one arm's round value: 1.4826 MAD of the log round values (kept rounds)."""
    kept = np.asarray(record["samples"]["kept"], dtype=bool)
    logs = np.log(np.asarray(record["samples"]["candidate_ms"], dtype=float)[kept])
    return float(1.4826 * np.median(np.abs(logs - np.median(logs))))


def row(name: str, value: Any, limit: str = "report", ok: bool | None = None) -> list[Any]:
    """One line of the table: a check, its value, its limit, and whether it passed (``-``: a report)."""
    return [name, value, limit, "-" if ok is None else "yes" if ok else "NO"]


def stage_gemm(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    from megatron_tuning.score import measure, noise_floor

    gemm, make, flops = _operands(args.shape, args.smoke)
    walls = [time.perf_counter()]  # the warm-up compiles the GEMM and the in-band clock: outside the walls
    warm = measure(gemm, make_inputs=make, budget_s=min(args.budget_s, 1.0), name="warm-up").record
    walls.append(time.perf_counter())
    latency = measure(gemm, make_inputs=make, flops=flops, budget_s=args.budget_s, name="gemm").record
    walls.append(time.perf_counter())
    # margin 0: no "same" to stop at, so the A/A run goes on until its interval is 0.5% (or the budget ends)
    aa = noise_floor(gemm, make_inputs=make, budget_s=args.budget_s, target_ci=0.005, margin=0.0, name="A/A")
    walls.append(time.perf_counter())
    compile_s, latency_s, aa_s = np.diff(walls).tolist()
    half, ratio_half = latency["latency"]["half_width"], aa.record["ratio"]["half_width"]
    checks = [
        row("latency CI95 half-width", half, "<= 1.0%", half <= 0.01),
        row("latency wall s", latency_s, "<= 10", latency_s <= 10),
        row("of which settling the clock, s", latency["timing"]["settle"]["seconds"]),
        row("A/A ratio CI95 half-width", ratio_half, "<= 0.5%", ratio_half <= 0.005),
        row("A/A wall s", aa_s, "<= 10", aa_s <= 10),
        row("per-round CV", per_round_cv(latency)),
        row("TFLOP/s", latency["throughput"]["tflops"]),
        row("compile and warm-up s", compile_s),
    ]
    return {"checks": checks, "records": [latency, aa.record, warm], "walls_s": [latency_s, aa_s]}


def stage_aa(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    from megatron_tuning.score import noise_floor

    gemm, make, _ = _operands(args.shape, args.smoke)
    gemm(*make())
    runs = []
    while len(runs) < args.aa_runs and time.monotonic() < deadline:
        runs.append(
            noise_floor(gemm, make_inputs=make, budget_s=args.budget_s, name=f"A/A {len(runs)}").record
        )
    false = sum(r["verdict"]["outcome"] in ("faster", "slower") for r in runs)
    checks = [
        row(
            f"A/A faster|slower of {len(runs)}",
            false,
            f"<= 2 of {args.aa_runs}",
            false <= 2 and len(runs) == args.aa_runs,
        ),
        row("A/A median s per run", float(np.median([r["rounds"]["seconds"] for r in runs]))),
        row("per-round CV (median)", float(np.median([per_round_cv(r) for r in runs]))),
    ]
    return {"checks": checks, "runs": [_short(r) for r in runs], "first": runs[0] if runs else None}


def stage_slower(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """The reference is the same GEMM with K 4.7% larger; its true ratio is all the runs pooled."""
    from megatron_tuning.score import measure, pool

    m, n, k = args.shape
    longer = (m, n, k + (192 if not args.smoke else 8))  # 4096 -> 4288
    candidate, reference = _bound(args.shape, args.smoke), _bound(longer, args.smoke)
    candidate(), reference()
    runs = []
    while len(runs) < args.slower_runs and time.monotonic() < deadline:
        runs.append(
            measure(candidate, reference=reference, check=None, budget_s=args.budget_s, name="slower").record
        )
    (truth,) = pool([[r] for r in runs])
    right = sum(r["verdict"]["outcome"] == "faster" for r in runs)
    (low, high), done = truth["ratio"]["ci95"], len(runs) == args.slower_runs
    checks = [
        row(
            "true ratio, runs pooled",
            f"{truth['ratio']['estimate']:.4f} [{low:.4f}, {high:.4f}]",
            "<= 1/1.03",
            high <= 1 / 1.03,
        ),
        row(f"right verdict of {len(runs)}", right, f">= 18 of {args.slower_runs}", right >= 18 and done),
        row("max s per run", max(r["rounds"]["seconds"] for r in runs), "<= 10"),
    ]
    return {"reference_shape": longer, "truth": truth, "checks": checks, "runs": [_short(r) for r in runs]}


def stage_graph(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    import torch

    from megatron_tuning.kernels import add_one
    from megatron_tuning.score import measure

    x = (
        torch.randn(3072, device="cpu") if args.smoke else torch.randn(1 << 20, device="cuda")
    )  # smoke: the table's n
    y = torch.empty_like(x)
    add_one(x, out=y)
    started = time.perf_counter()
    record = measure(
        lambda: add_one(x, out=y),
        launch="eager" if args.smoke else "graph",
        l2="warm",
        target_ci=0.02,
        budget_s=args.budget_s,
        bytes=8.0 * x.numel(),
        name="add 1M graph",
    ).record
    wall, half = time.perf_counter() - started, record["latency"]["half_width"]
    checks = [row("CI95 half-width", half, "<= 2%", half <= 0.02), row("wall s", wall, "<= 10", wall <= 10)]
    return {"checks": checks, "records": [record]}


def stage_integrity(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    import torch

    from megatron_tuning.score import measure

    gemm, make, _ = _operands(args.shape, args.smoke)
    gemm(*make())
    budget = min(args.budget_s, 3.0)
    side = torch.cuda.Stream() if not args.smoke else None
    cache: dict[int, Any] = {}

    def on_side_stream(*xs: Any) -> Any:  # launches on another stream and never joins it
        if side is None:
            return gemm(*xs)
        with torch.cuda.stream(side):
            return gemm(*xs)

    def cached(*xs: Any) -> Any:  # the first answer for these addresses, whatever they now hold
        if xs[0].data_ptr() not in cache:
            cache[xs[0].data_ptr()] = gemm(*xs).clone()
        return cache[xs[0].data_ptr()]

    records = {
        "work_escapes_stream": measure(
            on_side_stream, make_inputs=make, check=None, budget_s=budget, name="side stream"
        ),
        "stale_output": measure(
            cached, reference=gemm, make_inputs=make, budget_s=budget, name="pointer cache"
        ),
    }
    original = torch.cuda.Event.elapsed_time
    torch.cuda.Event.elapsed_time = lambda self, end: 0.001  # a harness that cheats its timer
    try:
        records["timer_patched"] = measure(gemm, make_inputs=make, budget_s=budget, name="patched timer")
    finally:
        torch.cuda.Event.elapsed_time = original
    checks = []
    for flag, score in records.items():
        found = flag in [f["name"] for f in score.record["flags"]]
        checks.append(
            row(f"{score.record['name']}: flagged {flag}", found, "True", None if args.smoke else found)
        )
    checks.append(row("patched timer median ms (the real time)", records["timer_patched"].median_ms))
    return {"checks": checks, "records": [r.record for r in records.values()]}


def stage_overhead(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """Wall time per timed launch of measure's rounds (the settle phase left out) against do_bench's."""
    from megatron_tuning.score import measure

    gemm, make, _ = _operands(args.shape, args.smoke)
    inputs = make()
    gemm(*inputs)
    record = measure(
        gemm, make_inputs=make, target_ci=1e-6, budget_s=min(args.budget_s, 3.0), name="overhead"
    ).record
    rounds = record["rounds"]
    launches = (rounds["used"] + rounds["discarded"]) * 2 * record["timing"]["launches_per_block"][0]
    ours, theirs = (rounds["seconds"] - record["timing"]["settle"]["seconds"]) / launches, None
    if not args.smoke:  # do_bench needs a GPU driver
        import triton.testing

        started = time.perf_counter()
        rep_ms = launches * record["latency"]["median"]
        times = triton.testing.do_bench(lambda: gemm(*inputs), warmup=25, rep=rep_ms, return_mode="all")
        theirs = (time.perf_counter() - started) / len(times)
    ratio = None if theirs is None else ours / theirs
    checks = [
        row("wall per timed launch vs do_bench", ratio, "<= 1.15", None if ratio is None else ratio <= 1.15)
    ]
    return {"checks": checks, "launches": launches, "ours_s": ours, "do_bench_s": theirs, "record": record}


def _score_cli(
    args: argparse.Namespace, processes: int, budget_s: float, out: Path, *extra: str
) -> dict[str, Any]:
    """``python -m megatron_tuning score`` on this script's ``--child score``: its JSON, and the
    ``do_bench`` times its processes printed."""
    table = [] if args.smoke else ["--table", str(TABLE)]
    child = [str(Path(__file__).resolve()), "--child", "score", *(["--smoke"] if args.smoke else []), *extra]
    command = [
        sys.executable,
        "-m",
        "megatron_tuning",
        "score",
        "--processes",
        str(processes),
        "--budget-s",
        str(budget_s),
        "--out",
        str(out),
        *table,
        "--",
        *child,
    ]
    done = subprocess.run(
        command, env=common.child_env(args.smoke), capture_output=True, text=True, timeout=900
    )
    if not out.exists():
        raise RuntimeError(
            f"score exited {done.returncode} without {out}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    marked = [
        line[len(common.RESULT_MARK) :]
        for line in done.stdout.splitlines()
        if line.startswith(common.RESULT_MARK)
    ]
    return {**json.loads(out.read_text()), "do_bench_ms": [json.loads(m)["do_bench_ms"] for m in marked]}


def stage_processes(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    count, budget = args.processes, min(args.budget_s, 3.0)
    with tempfile.TemporaryDirectory() as folder:
        pinned = _score_cli(args, count, budget, Path(folder) / "pinned.json")
    (pooled,) = pinned["results"]
    per = [p[0]["latency"] for p in pinned["per_process"]]
    medians = [p["median"] for p in per]
    covered = sum(p["ci95"][0] <= pooled["latency"]["median"] <= p["ci95"][1] for p in per)
    stock = []
    while len(stock) < count and time.monotonic() < deadline:
        argv = ["--child", "stock", "--budget-s", str(budget), *(["--smoke"] if args.smoke else [])]
        stock.append(common.run_child("bench_score.py", argv, common.child_env(args.smoke)))
    spread = max(medians) / min(medians)
    checks = [
        row(
            f"pinned max/min of {len(medians)} medians",
            spread,
            "<= 1.02",
            spread <= 1.02 and len(medians) == count,
        ),
        row("process CI95 covers pooled median", covered, f">= 8 of {count}", covered >= 0.8 * count),
        row("pinned between-process CV", pooled["processes"]["between_cv"]),
    ]
    if stock:
        stock_medians = [s["median_ms"] for s in stock]
        checks.append(row(f"stock max/min of {len(stock)} medians", max(stock_medians) / min(stock_medians)))
        checks.append(row("stock distinct configs", len({s["config"] for s in stock})))
    pinned_summary = {k: v for k, v in pinned.items() if k != "per_process"}
    return {
        "checks": checks,
        "pinned": pinned_summary,
        "pinned_processes": [_short(p[0]) for p in pinned["per_process"]],
        "records": [p[0] for p in pinned["per_process"]],  # whole, for the clocks check over all stages
        "stock": stock,
    }


def stage_soak(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """Five processes on a GPU idle for 20 s, then five right after a 30 s GEMM soak (each
    process's start, a few seconds, lies between): the first of each side is the issue's pair of
    single processes; the five pooled are what `score` (five processes by default) says of each
    state."""
    from megatron_tuning.score import compare

    budget, smoke = min(args.budget_s, 5.0), ["--smoke"] if args.smoke else []
    count = 1 if args.smoke else SOAK_PROCESSES  # smoke: the code paths (a pool of one), at CI's time
    with tempfile.TemporaryDirectory() as folder:
        time.sleep(0 if args.smoke else 20)
        cold = _score_cli(args, count, budget, Path(folder) / "cold.json", "--do-bench-first")
        soak = ["--child", "soak", "--soak-s", str(0.5 if args.smoke else 30.0), *smoke]
        common.run_child("bench_score.py", soak, common.child_env(args.smoke))
        hot = _score_cli(args, count, budget, Path(folder) / "hot.json", "--do-bench-first")
    inside = lambda x, r: r["latency"]["ci95"][0] <= x["latency"]["median"] <= r["latency"]["ci95"][1]
    covered = lambda x, y: inside(x, y) and inside(y, x)
    ratio = lambda x, y: y["latency"]["median"] / x["latency"]["median"]
    a, b = cold["per_process"][0][0], hot["per_process"][0][0]
    pooled_a, pooled_b = cold["results"][0], hot["results"][0]
    checks = [  # and the verdict a user of `score compare` gets on each pair
        row("hot/cold median, first process", ratio(a, b), "each in the other's CI95", covered(a, b)),
        row("  score compare hot cold", compare(b, a)["outcome"]),
        row(f"hot/cold, pooled ({count} per state)", ratio(pooled_a, pooled_b)),
        row("  each in the other's CI95", "yes" if covered(pooled_a, pooled_b) else "no"),
        row("  score compare hot cold", compare(pooled_b, pooled_a)["outcome"]),
    ]
    if cold["do_bench_ms"] and hot["do_bench_ms"]:
        checks.append(row("do_bench(10, 100) hot/cold", hot["do_bench_ms"][0] / cold["do_bench_ms"][0]))
    for name, result in (("cold", a), ("hot", b)):
        settle = result["timing"]["settle"]
        unit = "ms" if settle["signal"] == "time" else "MHz"
        checks.append(
            row(
                f"{name} settle s (before -> after)",
                f"{settle['seconds']:.2f} ({settle['before']:.4g} -> {settle['after']:.4g} {unit})",
            )
        )
        power = ((result["clocks"]["nvml"] or {}).get("candidate") or {}).get("power_w")
        blocks = result["timing"]["launches_per_block"][0]
        checks.append(row(f"{name} launches per block, NVML W", f"{blocks}, {power and power['median']}"))
    return {
        "checks": checks,
        "cold": a,
        "hot": b,
        "pooled": {"cold": cold, "hot": hot},
        "do_bench_ms": {"cold": cold["do_bench_ms"], "hot": hot["do_bench_ms"]},
    }


def stage_thermal(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """The clock and block time of the pinned GEMM under sustained load, from the state the GPU
    starts in: how the clock wanders at the power cap (benchmarks/RESULTS.md §28)."""
    from megatron_tuning.score.timers import default_backend

    backend = default_backend()
    nv, ib = backend.clock_sources()
    call = _bound(args.shape, args.smoke)
    call()  # compiles
    backend.synchronize()
    scale = 0.002 if args.smoke else 1.0
    started = time.monotonic()
    blocks: list[list[float | None]] = []  # seconds since start, ms per launch (median), in-band MHz
    nvml: list[dict[str, Any]] = []

    def sample(now: float) -> None:
        if nv is not None and (not nvml or now - nvml[-1]["t"] >= 0.2):
            nvml.append({"t": now, **nv.sample()})

    phases = []
    for load_s, idle_s in ((120.0 * scale, 20.0 * scale), (30.0 * scale, 0.0)):
        phases.append({"load_from": time.monotonic() - started, "load_s": load_s, "idle_s": idle_s})
        until = time.monotonic() + load_s
        while time.monotonic() < until and time.monotonic() < deadline:
            start = ib.stamp() if ib is not None else None
            times = backend.time_block(call, 8, True)
            end = ib.stamp() if ib is not None else None
            mhz = ib.mhz(start, end) if ib is not None else None
            now = time.monotonic() - started
            blocks.append([now, float(np.median(times)), mhz])
            sample(now)
        until = time.monotonic() + idle_s
        while time.monotonic() < until:
            sample(time.monotonic() - started)
            time.sleep(0.05)
    checks = [row(name, value) for name, value in _wander(blocks, phases[0]["load_s"], scale).items()]
    return {"checks": checks, "phases": phases, "blocks": blocks, "nvml": nvml}


def _wander(blocks: list[list[Any]], load_s: float, scale: float) -> dict[str, Any]:
    """What the first load shows, in 1 s bins (medians): how much a window of the same pinned GEMM
    varies once past the first 20 s, as windows grow; how closely that follows the in-band clock
    (beta: d log ms / d log MHz over the bins) and what is left once the bins are adjusted to one
    clock; and how much faster the first 20 s ran (a cold GPU), raw and adjusted."""
    data = np.array([[t, ms, np.nan if mhz is None else mhz] for t, ms, mhz in blocks if t < load_s], float)
    index = (data[:, 0] // scale).astype(int)
    groups = [data[index == i] for i in np.unique(index)]  # the non-empty bins, in time order
    log_ms = np.log([np.median(g[:, 1]) for g in groups])
    clocks = [g[np.isfinite(g[:, 2]), 2] for g in groups]
    log_mhz = np.log([np.median(c) if len(c) else np.nan for c in clocks])
    mhz = np.exp(log_mhz)
    warm = slice(min(20, len(log_ms) // 2), None)
    found: dict[str, Any] = {}
    for width in (1, 5, 10):
        tail = log_ms[warm]
        whole = len(tail) // width
        if whole >= 2:
            found[f"CV of {width} s windows past 20 s"] = float(
                np.std(tail[: whole * width].reshape(whole, width).mean(axis=1))
            )
    found["cold: first 20 s vs the rest, log ms"] = float(log_ms[: warm.start].mean() - log_ms[warm].mean())
    if np.isfinite(log_mhz).all() and np.ptp(log_mhz) > 0:
        beta = float(-np.polyfit(log_mhz, log_ms, 1)[0])
        adjusted = log_ms + beta * (log_mhz - np.median(log_mhz))
        found["beta (d log ms / d log MHz)"] = beta
        found["CV of 1 s windows past 20 s, clock-adjusted"] = float(np.std(adjusted[warm]))
        found["cold: first 20 s vs the rest, clock-adjusted"] = float(
            adjusted[: warm.start].mean() - adjusted[warm].mean()
        )
        found["SM MHz (in-band), first 1 s -> last 5 s"] = f"{mhz[0]:.0f} -> {np.median(mhz[-5:]):.0f}"
    return found


def child(args: argparse.Namespace) -> None:
    from megatron_tuning.score import measure

    shape = args.shape
    if args.child == "soak":  # back-to-back pinned GEMMs for --soak-s seconds: heat the GPU
        _pin(args)
        call = _bound(shape, args.smoke)
        until = time.monotonic() + args.soak_s
        while time.monotonic() < until:
            call()
            common.synchronize(args.smoke)
        common.emit({"soaked_s": args.soak_s})
        return
    if args.child == "stock":  # stock @triton.autotune: nothing pinned, Triton tunes in this process
        from megatron_tuning.kernels import matmul_kernel

        if args.smoke:
            common.allow_stock_autotune_on_cpu(matmul_kernel)
        gemm, make, flops = _operands(shape, args.smoke)
        record = measure(
            gemm, make_inputs=make, flops=flops, budget_s=args.budget_s, name="stock gemm"
        ).record
        common.emit({**_short(record), "config": str(matmul_kernel.best_config)})
        return
    gemm, make, flops = _operands(shape, args.smoke)
    if args.do_bench_first and not args.smoke:  # the requester's timing, in the state the process starts in
        import triton.testing

        call = _bound(shape, args.smoke)
        common.emit({"do_bench_ms": float(triton.testing.do_bench(call, warmup=10, rep=100))})
    measure(gemm, make_inputs=make, flops=flops, name=f"gemm {'x'.join(map(str, shape))}")  # under `score`


def parent(args: argparse.Namespace) -> int:
    stages = list(STAGES) if args.stages == "all" else args.stages.split(",")
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        print(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_score_"))
    out.mkdir(parents=True, exist_ok=True)
    in_process = {"gemm", "aa", "slower", "graph", "integrity", "overhead", "thermal"}
    if in_process & set(stages):
        _pin(args)
    rows, clocks = [], [0, 0]
    for stage in stages:
        started = time.monotonic()
        result = globals()[f"stage_{stage}"](args, started + STAGES[stage] * (0.05 if args.smoke else 1))
        result["stage_s"] = time.monotonic() - started
        for record in _records(result):
            clocks[0] += 1
            arms = ("candidate", "reference") if record.get("ratio") else ("candidate",)
            both = all((record["clocks"][s] or {}).get(arm) for s in ("inband", "nvml") for arm in arms)
            clocks[1] += bool(both)
        common.write_results(str(out / f"{stage}.json"), f"bench_score.{stage}", **result)
        rows += [[stage, *check] for check in result["checks"]]
        rows.append([stage, "stage seconds", round(result["stage_s"], 1), f"<= {STAGES[stage]}", None])
    rows.append(
        [
            "all",
            "records with in-band and NVML clocks per arm",
            f"{clocks[1]}/{clocks[0]}",
            "all",
            "-" if args.smoke or not clocks[0] else "yes" if clocks[0] == clocks[1] else "NO",
        ]
    )
    print(f"\nbench_score on {common.environment().get('gpu', 'CPU (smoke)')}; JSON in {out}")
    if args.smoke:  # the host clock on CPU: the limits are for a GPU
        rows = [[*row[:4], "-"] for row in rows]
    common.print_table(
        ["stage", "check", "value", "limit", "pass"], [[common.dash(c) for c in row] for row in rows]
    )
    return 0


def _records(result: dict[str, Any]) -> list[dict[str, Any]]:
    found = [*result.get("records", [])]
    for key in ("first", "truth", "record", "cold", "hot"):
        if isinstance(result.get(key), dict):
            found.append(result[key])
    return [r for r in found if isinstance(r, dict) and "clocks" in r]


def main() -> int:
    parser = common.script_parser(__doc__)
    parser.add_argument(
        "--stages", default="all", help=f"comma-separated, from: {', '.join(STAGES)} (default all)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help="measure's budget per run (default 10; smoke 0.3)"
    )
    parser.add_argument(
        "--processes", type=int, default=None, help="processes stage: fresh processes (default 10)"
    )
    parser.add_argument("--soak-s", type=float, default=30.0, help=argparse.SUPPRESS)
    parser.add_argument("--do-bench-first", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not common.require_device(args, "bench_score"):
        return 2
    args.shape = SMOKE_SHAPE if args.smoke else SHAPE
    args.budget_s = args.budget_s or (0.3 if args.smoke else 10.0)
    args.processes = args.processes or (2 if args.smoke else 10)
    args.aa_runs, args.slower_runs = (3, 2) if args.smoke else (40, 20)
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
