"""A tensor-parallel-like and a pipeline-like workload under deterministic, chaos and auto, per world size.

    PYTHONPATH=. python benchmarks/bench_workloads.py --nproc 2 4 8 --out w.json   # CPU: gloo, interpreter
    PYTHONPATH=. python benchmarks/bench_workloads.py --smoke --out w.json         # CI check: 2 ranks, tp
    PYTHONPATH=. python benchmarks/bench_workloads.py --backend nccl --gpu --nproc 8 --out w.json

For each world size and workload, four ``torchrun --standalone`` jobs, one process per rank (gloo
and the Triton interpreter on CPU; with ``--gpu`` rank r on GPU r, no interpreter, NVLink
multicast off in the child environment):

* ``deterministic``: no tables, so every rank applies the miss rule (all must agree);
* ``chaos``: every rank picks its own config on purpose (the divergence must be caught);
* ``auto1``: ``auto`` with an empty cache file for this world size and workload;
* ``auto2``: a fresh job that reads the cache ``auto1`` wrote (must measure nothing).

Workloads, on the reference kernels ``kernels.matmul`` and ``kernels.tiny``:

* ``tp``: every rank runs the same kernels on the same shapes; the last rank starts
  ``--straggler-s`` late (it must cost the others nothing; under auto it adopts what they tuned);
* ``pipeline``: stages of two ranks (stage = rank // 2); each stage runs its own kernels and
  shapes and starts ``stage * --stage-delay-s`` late, like a pipeline filling up. Nothing
  collective runs in the kernel phase, so a stage can wait on another only if the library makes it.

Every rank runs ``--steps`` steps, then ``verify_agreement()`` over the job (the step boundary),
and reports: its error (and whether a launch or verify raised it), its decision per (kernel, key),
the kernel phase's wall time, Triton ``Autotuner._bench`` calls, and auto's measurements (count
and seconds). ``--measure fake`` (the default on CPU) hands ``init_deterministic_tuning`` a
``measure`` that sleeps ``--tune-s`` and picks ``candidates[rank % n]``, a
different config on every rank, so ranks agree only if the consensus works; ``--measure real``
(the default with ``--gpu``) is the noise-aware tuner. Agreement is ``store`` (the default).
Each job has a hard timeout: a hang shows up as ``timeout``, its whole process group killed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import common

RUNS = ("deterministic", "chaos", "auto1", "auto2")
WORKLOADS = ("tp", "pipeline")
SCOPE = ("megatron_tuning.kernels",)
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# --------------------------------------------------------------------------- one rank


def _plan(args: argparse.Namespace, rank: int, world: int) -> tuple[float, list[tuple[str, Any]]]:
    """(seconds this rank starts late, its kernels per step as (kernel, shape)) for ``args.workload``."""
    if args.workload == "tp":
        late = args.straggler_s if rank == world - 1 and world > 1 else 0.0
        return late, [
            ("matmul", (32, 32, 32)),
            ("matmul", (48, 32, 64)),
            ("add_one", 1000),
            ("add_one", 4096),
        ]
    stage = rank // 2
    if stage % 2 == 0:  # even stages: a GEMM and an elementwise kernel, shapes of their own
        kernels: list[tuple[str, Any]] = [
            ("matmul", (16 * (stage + 2), 32, 32)),
            ("add_one", 100 * (stage + 1)),
        ]
    else:  # odd stages: only elementwise kernels
        kernels = [("add_one", 100 * (stage + 1)), ("add_one", 300 * (stage + 1))]
    return stage * args.stage_delay_s, kernels


def _launchers(kernels: list[tuple[str, Any]], gpu: bool) -> list[Callable[[], None]]:
    """Operands made up front, so the timed phase is launches (and first-use decisions) only."""
    import torch

    from megatron_tuning import kernels as matmul

    tiny = matmul  # after the interception is installed

    device = f"cuda:{torch.cuda.current_device()}" if gpu else "cpu"
    out: list[Callable[[], None]] = []
    for name, shape in kernels:
        if name == "matmul":
            m, n, k = (d * 128 for d in shape) if gpu else shape  # GPU: 4096-class GEMMs
            dtype = torch.bfloat16 if gpu else torch.float32
            a = torch.randn((m, k), device=device, dtype=dtype)
            b = torch.randn((k, n), device=device, dtype=dtype)
            out.append(lambda a=a, b=b: matmul.matmul(a, b))
        else:
            x = torch.arange(shape * (4096 if gpu else 1), dtype=torch.float32, device=device)
            y = torch.empty_like(x)
            out.append(lambda x=x, y=y: tiny.add_one(x, y))
    return out


def _count_measurements(args: argparse.Namespace, rank: int, counts: dict[str, Any], policy: Any) -> Any:
    """auto's measurement (fake or the real tuner), each call counted and timed."""
    from megatron_tuning.tuning.tuner import make_measure

    real = make_measure(policy) if args.measure == "real" else None

    def measure(autotuner, candidates, call_args, kwargs, kernel, key):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        try:
            if real is not None:
                return real(autotuner, candidates, call_args, kwargs, kernel, key)
            time.sleep(args.tune_s)
            return candidates[rank % len(candidates)], {"format": "fake", "median_ms": 1.0 + rank}
        finally:
            counts["calls"] += 1
            counts["seconds"] += time.perf_counter() - start
            counts["keys"].append(key)

    return measure


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    if args.gpu:  # NCCL needs each rank's device chosen before the group exists
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bench_calls = common.count_triton_benchmarks()
    measured: dict[str, Any] = {"calls": 0, "seconds": 0.0, "keys": []}

    import megatron_tuning
    from megatron_tuning.core.errors import MegatronTuningError

    mode = "auto" if args.job_run.startswith("auto") else args.job_run
    policy = megatron_tuning.TuningPolicy(
        mode=mode, scope=SCOPE, use_shipped_tables=False, cache=args.cache if mode == "auto" else None
    )
    measure = _count_measurements(args, rank, measured, policy)
    handle = megatron_tuning.init_deterministic_tuning(policy, measure=measure)
    late, kernels = _plan(args, rank, world)
    launches = _launchers(kernels, args.gpu)
    sync = torch.cuda.synchronize if args.gpu else (lambda: None)
    result: dict[str, Any] = {"rank": rank, "late_s": late, "error": None, "raised_at": None}
    dist.barrier()
    time.sleep(late)
    start = time.perf_counter()
    try:
        for _ in range(args.steps):
            for launch in launches:
                launch()
        sync()
    except MegatronTuningError as error:
        result.update(error=type(error).__name__, raised_at="launch", message=str(error)[:600])
    result["kernel_s"] = time.perf_counter() - start
    try:  # the step boundary: a collective every rank reaches, also one whose launch raised
        result["shared"] = megatron_tuning.verify_agreement()
    except MegatronTuningError as error:
        if result["error"] is None:
            result.update(error=type(error).__name__, raised_at="verify", message=str(error)[:600])
    result["decisions"] = [
        {"kernel": d.kernel.rsplit(":", 1)[-1], "key": d.key, "signature": d.signature, "source": d.source}
        for d in megatron_tuning.get_decisions()
        if d.source != "out_of_scope"
    ]
    handle.close()  # auto: persists the cache
    result.update(
        triton_bench_calls=sum(bench_calls.values()),
        measured=measured["calls"],
        measure_s=measured["seconds"],
        measured_keys=measured["keys"],
    )
    Path(args.folder, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- the launcher


def _run_job(
    args: argparse.Namespace, nproc: int, workload: str, run: str, cache: str, folder: Path
) -> dict[str, Any]:
    """One torchrun job under a hard timeout; its ranks' results and what the launcher saw."""
    folder.mkdir(parents=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        __file__, "--_worker", "--workload", workload, "--job-run", run, "--folder", str(folder),
        "--cache", cache, "--backend", args.backend, "--measure", args.measure, "--tune-s", str(args.tune_s),
        "--steps", str(args.steps), "--straggler-s", str(args.straggler_s),
        "--stage-delay-s", str(args.stage_delay_s), "--pg-timeout", str(args.pg_timeout),
    ] + (["--gpu"] if args.gpu else [])  # fmt: skip
    env = common.child_env(
        False, TRITON_INTERPRET="0" if args.gpu else "1", OMP_NUM_THREADS="1", **MULTICAST_OFF
    )
    start = time.perf_counter()
    # Its own session, so a timeout kills torchrun and every rank, not only the launcher.
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as process:
        try:
            log, _ = process.communicate(timeout=args.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            log, _ = process.communicate()
            timed_out = True
    wall = time.perf_counter() - start
    if args.log_dir:
        Path(args.log_dir, f"{workload}-{nproc}ranks-{run}.log").write_text(log)
    ranks = {}
    for rank in range(nproc):
        path = folder / f"rank{rank}.json"
        if path.exists():
            ranks[rank] = json.loads(path.read_text())
    job = {"nproc": nproc, "workload": workload, "run": run, "rc": process.returncode}
    job.update(timed_out=timed_out, job_s=wall, ranks=ranks)
    if process.returncode != 0 or timed_out:
        job["log_tail"] = log[-3000:]
    job["summary"] = _summarize(job)
    return job


def _summarize(job: dict[str, Any]) -> dict[str, Any]:
    """The facts a table row shows, and whether they are what this run must show."""
    ranks = [job["ranks"][r] for r in sorted(job["ranks"])]
    by_key: dict[tuple[str, str], set[str]] = {}
    sources: Counter[str] = Counter()
    for r in ranks:
        for d in r["decisions"]:
            by_key.setdefault((d["kernel"], d["key"]), set()).add(d["signature"])
            sources[d["source"]] += 1
    errors = Counter(r["error"] for r in ranks if r["error"])
    summary: dict[str, Any] = {
        "ranks_reported": len(ranks),
        "errors": dict(errors),
        "raised_at": dict(Counter(r["raised_at"] for r in ranks if r["raised_at"])),
        "keys": len(by_key),
        "keys_with_several_configs": sum(len(s) > 1 for s in by_key.values()),
        "sources": dict(sources),
        "measured_per_rank": [r["measured"] for r in ranks],
        "triton_bench_calls": sum(r["triton_bench_calls"] for r in ranks),
        "kernel_s_max": max((r["kernel_s"] for r in ranks), default=float("nan")),
        # What a rank spent in the kernel phase besides its own tuning: waiting would show here.
        "untuned_s_max": max((r["kernel_s"] - r["measure_s"] for r in ranks), default=float("nan")),
        "job_s": job["job_s"],
    }
    problems = []
    if job["timed_out"]:
        problems.append("timeout")
    elif job["rc"] != 0 or len(ranks) != job["nproc"]:
        problems.append(f"rc {job['rc']}, {len(ranks)}/{job['nproc']} ranks reported")
    if job["run"] == "chaos":
        if errors != Counter({"DivergenceError": job["nproc"]}):
            problems.append(f"not every rank raised DivergenceError: {dict(errors)}")
        if not summary["keys_with_several_configs"]:
            problems.append("chaos gave every rank the same configs")
    else:
        if errors:
            problems.append(f"errors {dict(errors)}")
        if summary["keys_with_several_configs"]:
            problems.append(f"{summary['keys_with_several_configs']} keys launched with several configs")
    if summary["triton_bench_calls"]:
        problems.append("Triton benchmarked")
    measured = sum(summary["measured_per_rank"])
    if job["run"] in ("deterministic", "chaos", "auto2") and measured:
        problems.append(f"{measured} measurements")
    if job["run"] == "auto1" and not measured:
        problems.append("auto run 1 measured nothing")
    if job["run"] == "auto2" and set(sources) != {"table"}:
        problems.append(f"auto run 2 sources {dict(sources)}")
    summary["verdict"] = "ok" if not problems else "FAIL: " + "; ".join(problems)
    return summary


def _print_table(jobs: list[dict[str, Any]]) -> None:
    rows = []
    for job in jobs:
        s = job["summary"]
        errors = ", ".join(f"{n}x {e}" for e, n in s["errors"].items()) or "-"
        where = ", ".join(f"{n} {w}" for w, n in s["raised_at"].items())
        sources = ", ".join(f"{k} {v}" for k, v in sorted(s["sources"].items()))
        rows.append(
            [
                job["nproc"],
                job["workload"],
                job["run"],
                s["verdict"],
                errors + (f" ({where})" if where else ""),
                f"{s['keys']}/{s['keys_with_several_configs']}",
                sources,
                ",".join(str(m) for m in s["measured_per_rank"]),
                s["triton_bench_calls"],
                round(s["kernel_s_max"], 3),
                round(s["untuned_s_max"], 3),
                round(s["job_s"], 1),
            ]
        )
    common.print_table(
        [
            "ranks",
            "workload",
            "run",
            "verdict",
            "errors (raised at)",
            "keys/split",
            "decisions by source (all ranks)",
            "measured per rank",
            "_bench",
            "kernel s max",
            "untuned s max",
            "job s",
        ],
        rows,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description="TP-like and pipeline-like workloads per mode and world size."
    )
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="2 ranks, the tp workload, the chaos and auto1 jobs, 2 steps, 0.5 s straggler: a CPU check",
    )
    parser.add_argument("--gpu", action="store_true", help="one GPU per rank, real launches (no interpreter)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--measure", choices=("fake", "real"), default=None, help="default: real with --gpu")
    parser.add_argument("--tune-s", type=float, default=0.2, help="how long a fake measurement takes")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--straggler-s", type=float, default=1.5, help="tp: how late the last rank starts")
    parser.add_argument(
        "--stage-delay-s", type=float, default=0.3, help="pipeline: each stage starts this late"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="hard limit per torchrun job (s)")
    parser.add_argument("--pg-timeout", type=float, default=120.0, help="process-group timeout (s)")
    parser.add_argument("--out", default=None, help="write the JSON results here")
    parser.add_argument("--log-dir", default=None, help="write each job's torchrun output here")
    parser.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="tp", help=argparse.SUPPRESS)
    parser.add_argument("--job-run", default="deterministic", help=argparse.SUPPRESS)
    parser.add_argument("--folder", default="", help=argparse.SUPPRESS)
    parser.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backend == "nccl" and not args.gpu:
        parser.error("--backend nccl needs --gpu")
    args.measure = args.measure or ("real" if args.gpu else "fake")
    if args._worker:
        return _worker(args)
    if args.smoke:
        # The plumbing of every job: deterministic is chaos's without the planted difference, and auto2
        # is auto1's with the cache auto1 wrote (tests_distributed/test_auto_torchrun.py runs that).
        args.nproc, args.workloads, args.steps, args.straggler_s = [2], ["tp"], 2, 0.5
        args.runs = [run for run in args.runs if run in ("chaos", "auto1")]
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    print(
        f"workloads on {os.cpu_count()} CPU cores, {args.backend}, {'GPU' if args.gpu else 'interpreter'}, "
        f"measure={args.measure} (fake: {args.tune_s}s each), {args.steps} steps, "
        f"straggler {args.straggler_s}s, stage delay {args.stage_delay_s}s, timeout {args.timeout}s",
        flush=True,
    )
    jobs = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nproc:
            for workload in args.workloads:
                cache = str(Path(tmp, f"cache-{workload}-{nproc}", "auto.msgpack"))  # fresh per world size
                for run in args.runs:
                    folder = Path(tmp, f"{workload}-{nproc}-{run}")
                    job = _run_job(args, nproc, workload, run, cache, folder)
                    jobs.append(job)
                    s = job["summary"]
                    print(
                        f"{nproc} ranks {workload:8} {run:13} {s['verdict']}  ({s['job_s']:.1f}s)", flush=True
                    )
    print()
    _print_table(jobs)
    failed = [j for j in jobs if j["summary"]["verdict"] != "ok"]
    payload = {"environment": common.environment(), "args": vars(args), "jobs": jobs}
    common.write_json(args.out, payload)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
