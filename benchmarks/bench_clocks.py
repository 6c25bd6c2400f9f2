"""What the in-band clock reads, and whether latency at one SM clock agrees between processes.

    PYTHONPATH=. python benchmarks/bench_clocks.py --out $OUT/clocks          # GPU, about 2.5 min
    PYTHONPATH=. python benchmarks/bench_clocks.py --smoke --out /tmp/clocks  # CPU: plumbing, 1/50 time

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import common
import numpy as np
import triton
import triton.language as tl

from megatron_tuning.score.inband import cycles, global_ns, sm_id

HERE = Path(__file__).resolve()
SHAPE, SMOKE_SHAPE = (4096, 4096, 4096), (64, 48, 40)
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
    sm = sm_id()
    c0 = cycles()
    t0 = global_ns()
    c1 = c0
    while c1 - c0 < spin:
        c1 = cycles()
    t1 = global_ns()
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


class _Rig(NamedTuple):
    call: Any  # one launch of the pinned GEMM
    backend: Any  # times blocks (score.timers)
    nvml: Any  # score.clocks.NvmlSource or None
    sms: int
    buf: Any  # (2, MAX_SM, 4) int64: the probes before and after a block
    probe: Any  # probe(i) writes buf[i]
    spin: Any  # spin(ms): one SM busy, the rest idle
    synchronize: Any


def _gpu_rig() -> _Rig:
    import torch

    from megatron_tuning.kernels import matmul_grid, matmul_kernel
    from megatron_tuning.score.timers import CudaBackend

    args = common.matmul_operands(SHAPE, False)[3]
    grid = matmul_grid(SHAPE[0], SHAPE[1])
    backend = CudaBackend(torch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.zeros((2, MAX_SM, 4), dtype=torch.int64, device="cuda")
    return _Rig(
        call=lambda: matmul_kernel[grid](*args),
        backend=backend,
        nvml=backend.clock_sources()[0],
        sms=sms,
        buf=buf,
        probe=lambda i: clock_probe[(sms,)](buf[i], SPIN_CYCLES, MAX_SM, num_warps=1),
        spin=lambda ms: torch.cuda._sleep(int(ms * 1.98e6)),
        synchronize=torch.cuda.synchronize,
    )


def _smoke_rig() -> _Rig:
    """The same plumbing on CPU: torch.matmul on the host clock, and a probe that writes the host's
    nanoseconds with a 2 GHz cycle count (numbers mean nothing)."""
    import torch

    from megatron_tuning.score.timers import HostBackend

    a, b, c, _ = common.matmul_operands(SMOKE_SHAPE, True)
    buf = torch.zeros((2, MAX_SM, 4), dtype=torch.int64)

    def probe(i: int) -> None:
        start = time.perf_counter_ns()
        while time.perf_counter_ns() - start < 20_000:
            pass
        end = time.perf_counter_ns()
        buf[i, :4] = torch.tensor([2 * start, start, 2 * end, end])

    return _Rig(
        call=lambda: torch.matmul(a, b, out=c),
        backend=HostBackend(),
        nvml=None,
        sms=4,
        buf=buf,
        probe=probe,
        spin=lambda ms: time.sleep(ms * 1e-3),
        synchronize=lambda: None,
    )


def child(label: str, seconds: float, out: Path, smoke: bool) -> None:
    import megatron_tuning

    tables = () if smoke else (str(common.REPO / "configs" / "sm90" / "matmul.msgpack"),)
    megatron_tuning.init_deterministic_tuning(
        megatron_tuning.TuningPolicy(mode="deterministic", agreement="off", tables=tables)
    )
    rig = _smoke_rig() if smoke else _gpu_rig()
    call, backend, nv, sms, buf, probe = rig.call, rig.backend, rig.nvml, rig.sms, rig.buf, rig.probe

    def read() -> dict[str, Any]:
        return readings(buf.cpu().numpy())

    call()
    probe(0)
    backend.time_block(call, 2, True)  # loads the timer's kernels
    rig.synchronize()
    result: dict[str, Any] = {"label": label, "seconds": seconds, "gaps": []}
    if label == "cold":  # what each clock reads across gaps of known content
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
                    rig.synchronize()
                    time.sleep(gap_ms * 1e-3)
                elif what == "one-SM spin":
                    rig.spin(gap_ms)
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


class Binned(NamedTuple):
    """One process past its first half second, in 0.25 s bins: the log of each bin's median."""

    ms: np.ndarray
    probe: np.ndarray  # the probe clock, the mean of the probes before and after each block
    windowed: np.ndarray


def past_start(result: dict[str, Any], scale: float = 1.0) -> np.ndarray:
    """The process's blocks past its first half second (its own start; ``scale``: smoke's time)."""
    data = np.array(result["blocks"], dtype=float)
    return data[data[:, 0] >= 0.5 * scale]


def binned(data: np.ndarray, scale: float = 1.0) -> Binned:
    index = (data[:, 0] // (0.25 * scale)).astype(int)
    groups = [data[index == i] for i in np.unique(index)]
    log_median = lambda values: np.log([np.median(v) for v in values])
    return Binned(
        ms=log_median(g[:, 1] for g in groups),
        probe=log_median((g[:, 2] + g[:, 3]) / 2 for g in groups),
        windowed=log_median(g[:, 4] for g in groups),
    )


def summary(result: dict[str, Any], data: np.ndarray, bins: Binned) -> dict[str, float]:
    """One process's numbers from its blocks past the start (``data``) and their bins."""
    nvml = [s["sm_mhz"] for s in result["nvml"] if s.get("sm_mhz")]
    power = [s["power_w"] for s in result["nvml"] if s.get("power_w")]
    fit = lambda x: float(-np.polyfit(x, bins.ms, 1)[0]) if np.ptp(x) > 0 else float("nan")
    corr = lambda x: float(np.corrcoef(x, bins.ms)[0, 1]) if np.ptp(x) > 0 else float("nan")
    return {
        "blocks": len(data),
        "median_ms": float(np.median(data[:, 1])),
        "probe_mhz": float(np.median((data[:, 2] + data[:, 3]) / 2)),
        "windowed_mhz": float(np.median(data[:, 4])),
        "nvml_mhz": float(np.median(nvml)) if nvml else float("nan"),
        "power_w": float(np.median(power)) if power else float("nan"),
        "beta_probe": fit(bins.probe),
        "r_probe": corr(bins.probe),
        "beta_windowed": fit(bins.windowed),
        "r_windowed": corr(bins.windowed),
        "cv_250ms_bins": float(np.std(bins.ms)),
    }


def parent(out: Path, smoke: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = common.child_env(smoke)
    scale = 0.02 if smoke else 1.0
    for label, seconds, idle_before in PHASES:
        time.sleep(idle_before * scale)
        command = [sys.executable, str(HERE), "--child", label, "--seconds", str(seconds * scale)]
        done = subprocess.run(
            [*command, "--out", str(out), *(["--smoke"] if smoke else [])],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
            return done.returncode
    results = {label: json.loads((out / f"{label}.json").read_text()) for label, _, _ in PHASES}
    data = {label: past_start(r, scale) for label, r in results.items()}
    bins = {label: binned(d, scale) for label, d in data.items()}
    rows = {label: summary(r, data[label], bins[label]) for label, r in results.items()}
    # One slope for every process: pooled within processes (each process's bins centred on its own mean).
    x = np.concatenate([b.probe - b.probe.mean() for b in bins.values()])
    y = np.concatenate([b.ms - b.ms.mean() for b in bins.values()])
    beta = float(-np.polyfit(x, y, 1)[0]) if np.ptp(x) > 0 else float("nan")
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
    parser = common.script_parser(__doc__)  # --out: a folder here (default: a new temporary one)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not common.require_device(args, "bench_clocks"):
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_clocks_"))
    if args.child:
        child(args.child, args.seconds, out, args.smoke)
        return 0
    return parent(out, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
