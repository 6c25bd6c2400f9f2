"""Cost of the cross-rank agreement check, at several CPU world sizes (a benchmark, not a test).

    PYTHONPATH=. python benchmarks/bench_agreement.py              # 2, 4 and 8 ranks
    PYTHONPATH=. python benchmarks/bench_agreement.py --nproc 2 4 --keys 100 --launches 2000
    PYTHONPATH=. python benchmarks/bench_agreement.py --nproc 8 --gpu --backend nccl --out a.json

For each world size it starts one ``torchrun --standalone`` job (gloo on CPU, Triton interpreter)
and measures on every rank, all ranks running at once:

* ``store RT``: one raw ``compare_set`` on the default store (the unit of the store protocol);
* ``store check``: a new (kernel, key) through the ``store`` checker (claim + divergence flag);
* ``allgather check``: a new (kernel, key) through the ``allgather`` checker (store barrier with a
  deadline, then a 64-byte all-gather);
* ``verify``: ``verify_agreement()`` over ``--keys`` shared entries;
* per launch, checks on (``store``) vs off: the interception's hit path for an already-seen key,
  with the kernel body stubbed out so only host work is timed (the check runs at first use only,
  so on and off should match), and the same for a real launch: interpreted (noisy, ~ms), or on
  GPUs with ``--gpu`` (rank r on GPU r mod count; no interpreter).

Latencies are medians (p90 in brackets) over all ranks' samples. The machine's core count bounds
what 8 ranks on a 2-core box can show: read the numbers as upper bounds. ``--out`` writes the
medians, p90s and the printed rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import common

KERNEL = "bench.kernels:matmul"
SIGNATURE = "BLOCK_K=32, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3"


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _time_checks(checker: Any, keys: int, tag: str) -> list[float]:
    from megatron_tuning.core.decisions import Decision

    samples = []
    for n in range(keys):
        decision = Decision(kernel=KERNEL, key=f"{tag} M={n}", signature=SIGNATURE, source="table")
        start = time.perf_counter()
        checker.check(decision)
        samples.append(time.perf_counter() - start)
    return samples


def _time_launches(agreement_mode: str, launches: int, stub: bool, device: str = "cpu") -> float:
    """Mean seconds per launch of an already-seen key under ``agreement_mode``."""
    import torch
    import torch.distributed as dist

    import megatron_tuning
    from megatron_tuning.core.policy import TuningPolicy

    policy = TuningPolicy(
        mode="deterministic",
        scope=("megatron_tuning.kernels",),
        agreement=agreement_mode,
        use_shipped_tables=False,
    )
    handle = megatron_tuning.init_deterministic_tuning(policy)  # starts the store check unless "off"
    from megatron_tuning import kernels as tiny

    fn = tiny.add_one_kernel.fn
    if stub:
        fn.run = lambda *args, **kwargs: None  # instance attribute shadows the launch: host path only
    try:
        x = torch.arange(64, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        tiny.add_one(x, y)  # first use: decision + agreement check, not timed
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(launches):
            tiny.add_one(x, y)
        _sync(device)
        return (time.perf_counter() - start) / launches
    finally:
        if stub:
            del fn.run
        handle.close()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    import megatron_tuning
    from megatron_tuning.core.decisions import decision_log
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.distributed import agreement
    from megatron_tuning.distributed import store as kv

    if args.backend == "nccl":  # NCCL needs each rank's device chosen before the group exists
        import torch

        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group(args.backend, timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    out: dict[str, Any] = {}

    store = kv.default_store()
    dist.barrier()
    samples = []
    for n in range(args.keys):
        start = time.perf_counter()
        store.compare_set(f"bench/raw/{rank}/{n}", "", "x")
        samples.append(time.perf_counter() - start)
    out["store_rt"] = samples

    for mode in ("store", "allgather"):
        dist.barrier()
        checker = agreement.AgreementChecker(TuningPolicy(agreement=mode), mode=mode)
        out[f"{mode}_check"] = _time_checks(checker, args.keys, mode)

    from megatron_tuning.core.decisions import Decision

    decision_log().clear()
    for n in range(args.keys):
        decision_log().record(
            Decision(kernel=KERNEL, key=f"verify M={n}", signature=SIGNATURE, source="table")
        )
    verify = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        megatron_tuning.verify_agreement()
        verify.append(time.perf_counter() - start)
    out["verify"] = verify
    decision_log().clear()

    # Alternate on/off so drift (other load on the machine) hits both alike.
    real_launches = args.launches if args.gpu else args.launches // 20
    device = "cpu"
    if args.gpu:
        import torch

        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    for stub, launches, label in ((True, args.launches, "hit"), (False, real_launches, "launch")):
        for mode in ("off", "store") * 3:
            out.setdefault(f"{label}_{mode}", []).append(_time_launches(mode, launches, stub, device))
    with open(os.path.join(args.folder, f"rank{rank}.json"), "w") as handle:
        json.dump(out, handle)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _run_job(nproc: int, args: argparse.Namespace, folder: str) -> dict[str, list[float]]:
    env = common.child_env(
        False,
        TRITON_INTERPRET="0" if args.gpu else "1",
        OMP_NUM_THREADS="1",
        NCCL_NVLS_ENABLE="0",  # NVLink multicast stays off (shared GPU hosts)
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        __file__,
        "--_worker",
        "--folder",
        folder,
        "--keys",
        str(args.keys),
        "--launches",
        str(args.launches),
        "--backend",
        args.backend,
    ] + (["--gpu"] if args.gpu else [])
    # Its own session, so a timeout kills torchrun and every rank, not only the launcher.
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired as expired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            raise SystemExit(
                f"{nproc}-rank job exceeded {args.timeout}s:\n{stdout[-3000:]}\n{stderr[-3000:]}"
            ) from expired
    if process.returncode != 0:
        raise SystemExit(f"{nproc}-rank job failed:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    merged: dict[str, list[float]] = {}
    for rank in range(nproc):
        with open(os.path.join(folder, f"rank{rank}.json")) as handle:
            for name, values in json.load(handle).items():
                merged.setdefault(name, []).extend(values)
    return merged


def main() -> int:
    parser = argparse.ArgumentParser(description="Benchmark the agreement check's cost.")
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--keys", type=int, default=200, help="new (kernel, key) checks per rank and mode")
    parser.add_argument("--launches", type=int, default=5000, help="timed launches per on/off batch")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per torchrun job")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="real launches on GPUs (rank r on GPU r mod count) instead of the interpreter",
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="process-group backend (nccl needs --gpu and one GPU per rank)",
    )
    parser.add_argument("--out", default=None, help="write the JSON results here")
    parser.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", default="", help=argparse.SUPPRESS)  # the workers' result files
    args = parser.parse_args()
    if args.backend == "nccl" and not args.gpu:
        parser.error("--backend nccl needs --gpu")
    if args._worker:
        return _worker(args)

    def us(samples: list[float]) -> str:
        p50, p90 = _percentiles(samples)
        return f"{p50 * 1e6:7.1f} [{p90 * 1e6:7.1f}]"

    real = "GPU" if args.gpu else "interpreted"
    print(
        f"agreement cost on {os.cpu_count()} CPU cores, {args.backend}, {args.keys} keys, "
        f"{args.launches} launches "
        f"per batch (hit path) / {args.launches if args.gpu else args.launches // 20} ({real})"
    )
    header = (
        f"{'ranks':>5} | {'store RT us':>17} | {'store check us':>17} | {'allgather check us':>18} | "
        f"{'verify ms':>9} | {'hit path us off/on':>18} | {real + ' launch us off/on':>23}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for nproc in args.nproc:
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as folder:
            data = _run_job(nproc, args, folder)
        hit = "/".join(f"{statistics.median(data[f'hit_{m}']) * 1e6:.2f}" for m in ("off", "store"))
        launch = "/".join(f"{statistics.median(data[f'launch_{m}']) * 1e6:.1f}" for m in ("off", "store"))
        line = (
            f"{nproc:>5} | {us(data['store_rt'])} | {us(data['store_check'])} | "
            f"{us(data['allgather_check']):>18} | {statistics.median(data['verify']) * 1e3:9.2f} | "
            f"{hit:>18} | {launch:>23}   ({time.monotonic() - started:.0f}s)"
        )
        print(line, flush=True)
        row: dict[str, Any] = {"nproc": nproc, "job_s": time.monotonic() - started, "printed": line}
        for name, values in sorted(data.items()):
            p50, p90 = _percentiles(values)
            row[name] = {"median_s": p50, "p90_s": p90, "n": len(values)}
        rows.append(row)
    common.write_json(args.out, {"environment": common.environment(), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
