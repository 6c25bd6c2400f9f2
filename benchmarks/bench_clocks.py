"""What the in-band clock reads, and whether latency at one SM clock agrees between processes.

    PYTHONPATH=. python benchmarks/bench_clocks.py --out $OUT/clocks          # GPU, about 2.5 min

Issue 34's soak check asks a process on a cold GPU and one right after a 30 s soak to score alike.
RESULTS §28 found the pinned GEMM's time following the windowed in-band clock within one trace
(r = 0.99), but two processes whose windowed clocks were 6% apart scoring in the other order. This
script tells the clock apart from what the window takes in. Fresh processes in sequence, each timing
the pinned 4096^3 bf16 GEMM in blocks of 8 cold-L2 launches:

    cold 10 s (idle GPU) | soak 30 s | hot 10 s | idle 30 s | again 10 s | next 10 s

Per block: the median ms; the *windowed* clock (``clocks.InbandClock``'s reading: cycles over
nanoseconds from a stamp before the block to one after, idle gaps included); the *probe* clock (a
one-warp-per-SM kernel that spins about 100 us and reads cycles over nanoseconds inside itself, so
it sees only a running SM) before and after; NVML every 0.2 s. The first process also reads both
across idle host gaps, a one-SM spin and back-to-back GEMMs. Raw JSON per process under --out; the
table compares process medians raw and adjusted to one probe clock.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import triton
import triton.language as tl

HERE = Path(__file__).resolve()
SHAPE = (4096, 4096, 4096)
# (process, seconds of blocks, seconds idle before it)
PHASES = [
    ("cold", 10.0, 0.0),
    ("soak", 30.0, 0.0),
    ("hot", 10.0, 0.0),
    ("again", 10.0, 30.0),
    ("next", 10.0, 0.0),
]
SPIN_CYCLES = 200_000  # about 100 us at 2 GHz: globaltimer's update step is well under 1% of it
MAX_SM = 1024


@triton.jit
def clock_probe(out_ptr, spin, max_sm):
    """Each program's SM writes (clock64, globaltimer) at its start and after ``spin`` cycles."""
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    c0 = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    t0 = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    c1 = c0
    while c1 - c0 < spin:
        c1 = tl.inline_asm_elementwise(
            "mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    t1 = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    if sm < max_sm:
        tl.store(out_ptr + 4 * sm, c0)
        tl.store(out_ptr + 4 * sm + 1, t0)
        tl.store(out_ptr + 4 * sm + 2, c1)
        tl.store(out_ptr + 4 * sm + 3, t1)


def readings(pair: np.ndarray) -> dict[str, Any]:
    """From a (2, SMs, 4) pair of probes: the probe clock before and after (mean over SMs, MHz), and
    the windowed clock between the first's end and the second's start (median over SMs)."""
    before, after = pair
    seen = (before[:, 3] > 0) & (after[:, 1] > before[:, 3])
    inside = lambda p: float(np.mean((p[seen, 2] - p[seen, 0]) / (p[seen, 3] - p[seen, 1]))) * 1e3
    windowed = (after[seen, 0] - before[seen, 2]) / (after[seen, 1] - before[seen, 3]) * 1e3
    return {
        "probe_before": inside(before),
        "probe_after": inside(after),
        "windowed": float(np.median(windowed)),
        "sms": int(seen.sum()),
    }


def child(label: str, seconds: float, out: Path) -> None:
    import torch

    import megatron_tuning
    from megatron_tuning.kernels import matmul_grid, matmul_kernel
    from megatron_tuning.score.timers import CudaBackend

    table = HERE.parent.parent / "configs" / "sm90" / "matmul.msgpack"
    megatron_tuning.init_deterministic_tuning(
        megatron_tuning.TuningPolicy(mode="deterministic", agreement="off", tables=(str(table),))
    )
    m, n, k = SHAPE
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn((m, k), device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn((k, n), device="cuda", dtype=torch.bfloat16, generator=gen)
    c = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    grid = matmul_grid(m, n)
    call = lambda: matmul_kernel[grid](a, b, c)
    backend = CudaBackend(torch)
    nv, _ = backend.clock_sources()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.zeros((2, MAX_SM, 4), dtype=torch.int64, device="cuda")

    def probe(i: int) -> None:
        clock_probe[(sms,)](buf[i], SPIN_CYCLES, MAX_SM, num_warps=1)

    def read() -> dict[str, Any]:
        return readings(buf.cpu().numpy())

    call()
    probe(0)
    backend.time_block(call, 2, True)  # loads the timer's kernels
    torch.cuda.synchronize()
    result: dict[str, Any] = {"label": label, "seconds": seconds, "gaps": []}
    if label == "cold":  # what each clock reads across gaps of known content
        cycles_per_ms = 1.98e6
        gaps = [
            ("host sleep", 1),
            ("host sleep", 5),
            ("host sleep", 20),
            ("one-SM spin", 5),
            ("8 GEMMs", None),
        ]
        for what, gap_ms in gaps:
            for _ in range(5):
                buf.zero_()
                probe(0)
                if what == "host sleep":
                    torch.cuda.synchronize()
                    time.sleep(gap_ms * 1e-3)
                elif what == "one-SM spin":
                    torch.cuda._sleep(int(gap_ms * cycles_per_ms))
                else:
                    for _ in range(8):
                        call()
                probe(1)
                nvml_mhz = nv and nv.sample()["sm_mhz"]
                result["gaps"].append({"what": what, "ms": gap_ms, **read(), "nvml_sm_mhz": nvml_mhz})
        ends = np.sort(buf.cpu().numpy()[0, :sms, 3])
        result["globaltimer_steps_ns"] = sorted({int(v) for v in np.diff(ends)})[:20]
    blocks: list[list[float]] = []
    nvml: list[dict[str, Any]] = []
    started = time.monotonic()
    while (now := time.monotonic() - started) < seconds:
        probe(0)
        times = backend.time_block(call, 8, True)
        probe(1)
        r = read()
        blocks.append([now, float(np.median(times)), r["probe_before"], r["probe_after"], r["windowed"]])
        if nv is not None and (not nvml or now - nvml[-1]["t"] >= 0.2):
            nvml.append({"t": now, **nv.sample()})
    columns = ["t", "ms", "probe_before", "probe_after", "windowed"]
    result.update(blocks=blocks, nvml=nvml, block_columns=columns)
    (out / f"{label}.json").write_text(json.dumps(result))


def summary(result: dict[str, Any]) -> dict[str, float]:
    data = np.array(result["blocks"], dtype=float)
    data = data[data[:, 0] >= 0.5]  # past the first half second: the process's own start
    probe = (data[:, 2] + data[:, 3]) / 2
    nvml = [s["sm_mhz"] for s in result["nvml"] if s.get("sm_mhz")]
    power = [s["power_w"] for s in result["nvml"] if s.get("power_w")]
    bins = (data[:, 0] // 0.25).astype(int)
    groups = [data[bins == i] for i in np.unique(bins)]
    log_ms = np.log([np.median(g[:, 1]) for g in groups])
    log_probe = np.log([np.median((g[:, 2] + g[:, 3]) / 2) for g in groups])
    log_win = np.log([np.median(g[:, 4]) for g in groups])
    fit = lambda x: float(-np.polyfit(x, log_ms, 1)[0]) if np.ptp(x) > 0 else float("nan")
    corr = lambda x: float(np.corrcoef(x, log_ms)[0, 1]) if np.ptp(x) > 0 else float("nan")
    return {
        "blocks": len(data),
        "median_ms": float(np.median(data[:, 1])),
        "probe_mhz": float(np.median(probe)),
        "windowed_mhz": float(np.median(data[:, 4])),
        "nvml_mhz": float(np.median(nvml)) if nvml else float("nan"),
        "power_w": float(np.median(power)) if power else float("nan"),
        "beta_probe": fit(log_probe),
        "r_probe": corr(log_probe),
        "beta_windowed": fit(log_win),
        "r_windowed": corr(log_win),
        "cv_250ms_bins": float(np.std(log_ms)),
    }


def parent(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for label, seconds, idle_before in PHASES:
        time.sleep(idle_before)
        done = subprocess.run(
            [sys.executable, str(HERE), "--child", label, "--seconds", str(seconds), "--out", str(out)],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
            return done.returncode
    results = {label: json.loads((out / f"{label}.json").read_text()) for label, _, _ in PHASES}
    rows = {label: summary(r) for label, r in results.items()}
    # One slope for every process: pooled within processes (each process's bins centred on its own mean).
    xs, ys = [], []
    for r in results.values():
        d = np.array(r["blocks"], dtype=float)
        d = d[d[:, 0] >= 0.5]
        bins = (d[:, 0] // 0.25).astype(int)
        g = [d[bins == i] for i in np.unique(bins)]
        x = np.log([np.median((b[:, 2] + b[:, 3]) / 2) for b in g])
        y = np.log([np.median(b[:, 1]) for b in g])
        xs.append(x - x.mean())
        ys.append(y - y.mean())
    x, y = np.concatenate(xs), np.concatenate(ys)
    beta = float(-np.polyfit(x, y, 1)[0])
    ref = rows["cold"]["probe_mhz"]
    for row in rows.values():
        row["adjusted_ms"] = row["median_ms"] * (row["probe_mhz"] / ref) ** beta
    print(f"pooled within-process beta (d log ms / d log probe MHz): {beta:.3f}; adjusted to {ref:.0f} MHz")
    keys = list(next(iter(rows.values())))
    print("process  " + "  ".join(f"{k:>14}" for k in keys))
    for label, row in rows.items():
        print(f"{label:8} " + "  ".join(f"{row[k]:14.5g}" for k in keys))
    gaps = results["cold"]["gaps"]
    print("\ngap content        ms   probe before  probe after  windowed  nvml (median of 5)")
    for what, ms in dict.fromkeys((g["what"], g["ms"]) for g in gaps):
        sel = [g for g in gaps if g["what"] == what and g["ms"] == ms]
        med = [
            float(np.median([g[key] for g in sel if g[key] is not None] or [np.nan]))
            for key in ("probe_before", "probe_after", "windowed", "nvml_sm_mhz")
        ]
        print(f"{what:16} {ms!s:>4} {med[0]:13.1f} {med[1]:12.1f} {med[2]:9.1f} {med[3]:6.0f}")
    print("globaltimer steps between SMs' probe ends (ns):", results["cold"].get("globaltimer_steps_ns"))
    found = {"beta": beta, "reference_mhz": ref, "processes": rows}
    (out / "summary.json").write_text(json.dumps(found, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for the raw JSON per process and summary.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.seconds, Path(args.out))
        return 0
    return parent(Path(args.out))


if __name__ == "__main__":
    sys.exit(main())
