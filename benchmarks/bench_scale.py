"""What agreement and ``auto`` cost at scale (a benchmark, not a test).

    PYTHONPATH=. python benchmarks/bench_scale.py                        # 1,024 ranks x 2,000 keys
    PYTHONPATH=. python benchmarks/bench_scale.py --ranks 256 --keys 200 --designs auto auto-warm
    PYTHONPATH=. python benchmarks/bench_scale.py --verify 2 4 8 16      # verify_agreement, real ranks
    PYTHONPATH=. python benchmarks/bench_scale.py --smoke                # CI: seconds

**Store designs.** One real libuv ``TCPStore`` server runs in a process of its own; ``--procs``
worker processes hold ``--ranks`` client connections between them (one thread and one connection
per simulated rank) and drive the library's public objects against it: ``AgreementChecker`` in
``store`` mode (a claim per key at first use), ``StoreConsensus`` for ``auto`` (``auto``: a cold
first step, lookup, simulated tuning, publish; ``auto-warm``: every rank's cache holds every key,
so each hit is proposed with one publish). ``idle`` holds the connections open and sends nothing.
Every rank starts at once (a burst, the worst case: a job's first step). Workloads:

* ``tp``: every rank decides the same keys (tensor/data parallel);
* ``pp``: 4 pipeline stages (stage = rank % 4), each deciding keys of its own;
* ``varlen``: every rank decides ``keys - own`` shared keys plus ``own`` keys of its own.

Measured per (design, workload): requests (per store method), store-server CPU seconds (from
/proc), server CPU per request, burst wall time, p50/max latency per key and the server's RSS
growth. A 10,000-rank line extrapolates requests linearly per rank (the designs' request count per
rank does not depend on the world size) at the measured server cost per request.

**verify** (``--verify N ...``): real gloo ranks under torchrun (one job per world size) record
each workload's decisions in turn and call ``verify_agreement()``; each reports the bytes its
collectives sent and the call's time.
``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

# One warning line per connection ("hostname of the client socket cannot be retrieved") times a
# thousand connections buries the results; torch reads this before its first import.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# torch names each new TCPStore connection in its log by a reverse lookup of the socket's address,
# which for 127.0.0.1 as an IPv6-mapped address goes to DNS. Where DNS does not answer (a closed
# network) every second burst of connections sat in glibc's 5 s resolver timeout (strace: PTR
# 1.0.0.127.in-addr.arpa; the smoke run took 34 s, 7 s with this). Only the setup was slowed, never
# a burst. glibc reads this at its first lookup.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

import common  # noqa: E402

ARCH = "sm90"
KERNEL = "bench.scale:matmul"
SIGNATURE = "BLOCK_K=32, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3"
CONFIG = {"kwargs": {"BLOCK_K": 32, "BLOCK_M": 64, "BLOCK_N": 64}, "num_warps": 4, "num_stages": 3}
SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=600), use_libuv=True)
print("ready", flush=True)
sys.stdin.read()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """The store server process, and its CPU time and memory read from /proc."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(self.port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def cpu_times(self) -> tuple[float, float]:
        """User and system CPU seconds of the server process so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick

    def cpu_s(self) -> float:
        return sum(self.cpu_times())

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def counting_store(inner: Any) -> Any:
    """``inner`` as a c10d store that counts the requests made through it, per method; handed to a
    checker or consensus object as its store (its PrefixStore wraps this one)."""
    import torch.distributed as dist

    class Counting(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.requests = 0
            self.kinds: dict[str, int] = {}  # requests per store method (compare_set, add, wait, ...)

        def _forward(self, name: str, *args: Any) -> Any:
            self.requests += 1
            self.kinds[name] = self.kinds.get(name, 0) + 1
            return getattr(inner, name)(*args)

        def set(self, *args: Any) -> Any:
            return self._forward("set", *args)

        def get(self, *args: Any) -> Any:
            return self._forward("get", *args)

        def add(self, *args: Any) -> Any:
            return self._forward("add", *args)

        def compare_set(self, *args: Any) -> Any:
            return self._forward("compare_set", *args)

        def check(self, *args: Any) -> Any:
            return self._forward("check", *args)

        def wait(self, *args: Any) -> Any:
            return self._forward("wait", *args)

        def delete_key(self, *args: Any) -> Any:
            return self._forward("delete_key", *args)

    return Counting()


def plan(workload: str, rank: int, keys: int, own: int) -> list[str]:
    if workload == "tp":
        return [f"M={n}, N=4096, K=4096" for n in range(keys)]
    if workload == "pp":
        return [f"stage={rank % 4}, M={n}" for n in range(keys)]
    shared = [f"M={n}, N=4096, K=4096" for n in range(keys - own)]
    return shared + [f"seqlen={rank * own + n}" for n in range(own)]


_SETUP_LOCK = threading.Lock()


def _rank_thread(
    args: argparse.Namespace,
    port: int,
    rank: int,
    design: str,
    workload: str,
    ready: Any,
    go: Any,
    out: list,
) -> None:
    import torch.distributed as dist

    from megatron_tuning.core.decisions import Decision
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.distributed.agreement import AgreementChecker
    from megatron_tuning.distributed.store import StoreConsensus

    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600), use_libuv=True)
    keys = plan(workload, rank, args.keys, args.own)
    base = dist.PrefixStore(f"{design}-{workload}", client)
    latencies: list[float] = []
    tunes = 0
    counting = counting_store(base)
    if design == "store":
        checker = AgreementChecker(
            TuningPolicy(agreement="store"), store=counting, rank=rank, ranks=range(args.ranks)
        )
    elif design in ("auto", "auto-warm"):
        consensus = StoreConsensus(store=counting, rank=rank, world=args.ranks)
    decisions = [
        Decision(kernel=KERNEL, key=key, signature=SIGNATURE, source="table", arch=ARCH) for key in keys
    ]
    ready.release()
    go.wait()
    start = time.perf_counter()
    if design == "store":
        for decision in decisions:
            t0 = time.perf_counter()
            checker.check(decision)
            latencies.append(time.perf_counter() - t0)
    elif design == "auto":
        for key in keys:  # latency: the store time of a key (lookup, and publish after tuning)
            t0 = time.perf_counter()
            found = consensus.lookup(KERNEL, key, ARCH)
            spent = time.perf_counter() - t0
            if found is None:
                tunes += 1
                time.sleep(args.tune_ms / 1000)  # the rank tunes (its peers do not wait for it)
                t1 = time.perf_counter()
                consensus.publish(KERNEL, key, ARCH, CONFIG, SIGNATURE)
                spent += time.perf_counter() - t1
            latencies.append(spent)
    elif design == "auto-warm":
        for key in keys:  # a cache hit in a job: proposed to the job, the winner launched
            t0 = time.perf_counter()
            consensus.publish(KERNEL, key, ARCH, CONFIG, SIGNATURE)
            latencies.append(time.perf_counter() - t0)
    else:  # idle: connections open, no request (what merely holding them costs the server)
        time.sleep(args.idle_s)
    out.append(
        {
            "rank": rank,
            "requests": counting.requests,
            "kinds": counting.kinds,
            "latencies": latencies,
            "tunes": tunes,
            "end": time.perf_counter() - start,
        }
    )


def _guarded_thread(*args: Any) -> None:
    ready, out = args[-3], args[-1]
    try:
        _rank_thread(*args)
    except BaseException as exc:  # a benchmark that hides a failing rank measures nothing
        out.append({"error": f"rank {args[2]}: {type(exc).__name__}: {exc}"})
        ready.release()


def _worker(
    args: argparse.Namespace,
    port: int,
    ranks: list[int],
    design: str,
    workload: str,
    barrier: Any,
    queue: Any,
) -> None:
    import megatron_tuning.distributed.agreement  # noqa: F401  (imports once, before the threads)

    go, ready = threading.Event(), threading.Semaphore(0)
    out: list[dict[str, Any]] = []
    threads = [
        threading.Thread(
            target=_guarded_thread, args=(args, port, r, design, workload, ready, go, out), daemon=True
        )
        for r in ranks
    ]
    for t in threads:
        t.start()
    for _ in threads:
        ready.acquire()
    barrier.wait()  # every process connected its ranks
    go.set()
    for t in threads:
        t.join()
    queue.put(out)


def measure(args: argparse.Namespace, server: Server, design: str, workload: str) -> dict[str, Any]:
    # Imported before forking, so each worker inherits torch instead of importing it again.
    import megatron_tuning.distributed.agreement  # noqa: F401

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    chunks = [list(range(p, args.ranks, args.procs)) for p in range(args.procs)]
    barrier = ctx.Barrier(len(chunks) + 1)
    procs = [
        ctx.Process(target=_worker, args=(args, server.port, chunk, design, workload, barrier, queue))
        for chunk in chunks
    ]
    for p in procs:
        p.start()
    barrier.wait()
    cpu0, rss0, t0 = server.cpu_s(), server.rss_mb(), time.perf_counter()
    results = [r for _ in procs for r in queue.get(timeout=3600)]
    wall = time.perf_counter() - t0
    cpu1, rss1 = server.cpu_s(), server.rss_mb()
    for p in procs:
        p.join()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{len(errors)} simulated ranks failed, first: {errors[0]}")
    requests = sum(r["requests"] for r in results)
    kinds: dict[str, int] = {}
    for r in results:
        for kind, count in r["kinds"].items():
            kinds[kind] = kinds.get(kind, 0) + count
    latencies = sorted(x for r in results for x in r["latencies"])
    server_s = cpu1 - cpu0
    return {
        "design": design,
        "workload": workload,
        "ranks": args.ranks,
        "keys": args.keys,
        "requests": requests,
        "requests_per_rank": requests / args.ranks,
        "requests_by_kind": dict(sorted(kinds.items())),
        "tunes_per_rank": sum(r["tunes"] for r in results) / args.ranks,  # auto: keys a rank measured
        "server_cpu_s": server_s,
        "server_us_per_request": server_s / requests * 1e6 if requests else 0.0,
        "server_cpu_per_wall_s": server_s / wall if wall else 0.0,
        "burst_wall_s": wall,
        "p50_ms": statistics.median(latencies) * 1e3 if latencies else 0.0,
        "max_ms": latencies[-1] * 1e3 if latencies else 0.0,
        "server_rss_growth_mb": rss1 - rss0,
    }


NO_REPLY = frozenset({"set", "append"})
"""Store methods whose requests get no reply: the client pipelines them, the server reads several
per wake-up, so they cost it a fraction of a request that is answered."""


def model_10k(
    row: dict[str, Any],
    ranks: int = 10_000,
    us_per_request: float | None = None,
    us_per_no_reply: float | None = None,
) -> float:
    """Server seconds at ``ranks``: requests scale with ranks. At the burst's own cost per request
    when no cost is given; else answered requests at ``us_per_request`` and pipelined ones (``set``,
    ``append``) at ``us_per_no_reply`` (default: the same)."""
    if us_per_request is None:
        return row["requests_per_rank"] * ranks * row["server_us_per_request"] / 1e6
    reply = answered_per_rank(row)
    no_reply = row["requests_per_rank"] - reply
    per_no_reply = us_per_request if us_per_no_reply is None else us_per_no_reply
    return (reply * us_per_request + no_reply * per_no_reply) * ranks / 1e6


def answered_per_rank(row: dict[str, Any]) -> float:
    """Requests per rank that the server answers (all but ``set`` and ``append``)."""
    return (
        sum(n for kind, n in row.get("requests_by_kind", {}).items() if kind not in NO_REPLY) / row["ranks"]
    )


def calibrate(server: Server, requests: int, blocks: int = 5) -> tuple[float, float]:
    """Server CPU µs per answered request and per pipelined one, with one client sending
    ``requests`` of each one after another: the cost on a server core of its own (the bursts
    share 2 cores with 16 client processes). The answered mix is the designs': ``add`` on a
    counter, ``compare_set`` on a missing key and on a 200-byte value; the pipelined mix is
    ``append`` of a 3 KB log record (a residual of 100 rows with its texts) and ``set`` of a
    64-byte value, ended by one answered ``check`` (the server has read them all by its reply).
    Each the median of ``blocks`` blocks, since one block of a shared machine can read 2x (the
    CPU clock ticks at 10 ms and a neighbour's burst lands in some blocks)."""
    import torch.distributed as dist

    client = dist.TCPStore(
        "127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60), use_libuv=True
    )
    client.set("calibrate/value", "x" * 200)
    record = os.urandom(3000)
    third = max(1, requests // (3 * blocks))
    answered, pipelined = [], []
    for block in range(blocks):
        before = server.cpu_s()
        for i in range(third):
            client.add("calibrate/count", 1)
            client.compare_set(f"calibrate/missing/{block}/{i}", "", "")
            client.compare_set("calibrate/value", "", "")
        answered.append((server.cpu_s() - before) / (3 * third) * 1e6)
        before = server.cpu_s()
        for i in range(third):
            client.append(f"calibrate/log/{block}", record)
            client.set(f"calibrate/set/{block}/{i}", "y" * 64)
        client.check(["calibrate/value"])
        pipelined.append((server.cpu_s() - before) / (2 * third) * 1e6)
        client.delete_key(f"calibrate/log/{block}")
    return statistics.median(answered), statistics.median(pipelined)


VERIFY_WORKER = """
import json, os, sys, time
import torch.distributed as dist
import megatron_tuning
from megatron_tuning.core.decisions import Decision, decision_log
from megatron_tuning.distributed import verify
sys.path.insert(0, sys.argv[1])
import bench_scale
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
keys, own = int(sys.argv[3]), int(sys.argv[4])
sent = [0]
gather, to_all = verify.all_gather_bytes, verify.all_to_all_bytes
def counted_gather(data, group):
    sent[0] += len(data)
    return gather(data, group)
def counted_to_all(chunks, group):
    sent[0] += sum(len(c) for c in chunks)
    return to_all(chunks, group)
verify.all_gather_bytes, verify.all_to_all_bytes = counted_gather, counted_to_all
results = {}
for workload in sys.argv[5:]:
    decision_log().clear()
    for key in bench_scale.plan(workload, rank, keys, own):
        decision_log().record(Decision(kernel=bench_scale.KERNEL, key=key, signature=bench_scale.SIGNATURE,
                                       source="table", arch=bench_scale.ARCH))
    sent[0] = 0
    dist.barrier()
    t0 = time.perf_counter()
    shared = megatron_tuning.verify_agreement(timeout_s=120)
    elapsed = time.perf_counter() - t0
    results[workload] = {"sent_bytes": sent[0], "seconds": elapsed, "shared": shared}
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
"""


def measure_verify(world: int, workloads: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``verify_agreement`` across ``world`` real gloo ranks (one torchrun job for every workload):
    bytes sent per rank, and the call's time."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "verify_worker.py")
        with open(script, "w") as f:
            f.write(VERIFY_WORKER)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={world}",
            script,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(
            [*command, os.path.dirname(os.path.abspath(__file__)), folder, str(args.keys), str(args.own)]
            + workloads,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if done.returncode:
            raise RuntimeError(f"verify job x{world} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        ranks = []
        for r in range(world):
            with open(os.path.join(folder, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    rows = []
    for workload in workloads:
        sent = [r[workload]["sent_bytes"] for r in ranks]
        rows.append(
            {
                "design": "verify",
                "workload": workload,
                "ranks": world,
                "keys": args.keys,
                "sent_bytes_per_rank_max": max(sent),
                "sent_bytes_per_rank_mean": statistics.mean(sent),
                "received_header_bytes_per_rank": 32 * world,
                "seconds_max": max(r[workload]["seconds"] for r in ranks),
                "shared": ranks[0][workload]["shared"],
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument("--own", type=int, default=100, help="varlen: keys of each rank's own")
    parser.add_argument("--procs", type=int, default=16, help="worker processes holding the connections")
    parser.add_argument("--tune-ms", type=float, default=2.0, help="auto: simulated tuning time per miss")
    parser.add_argument("--idle-s", type=float, default=5.0, help="idle: how long the connections sit unused")
    designs = ["idle", "store", "auto", "auto-warm"]
    parser.add_argument("--designs", nargs="+", default=designs, choices=designs)
    parser.add_argument("--workloads", nargs="+", default=["tp", "pp", "varlen"])
    parser.add_argument(
        "--verify", nargs="*", type=int, default=None, metavar="RANKS", help="world sizes for verify"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="16 ranks x 40 keys, verify at 2 ranks: a CI check"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.ranks, args.keys, args.own, args.procs, args.idle_s = 16, 40, 4, 2, 0.5
        args.verify = [2] if args.verify is None else args.verify
    rows: list[dict[str, Any]] = []
    server = Server()
    try:
        # Smoke: one block, since 5 blocks of 120 requests each fall under the 10 ms CPU clock tick.
        dedicated_us, no_reply_us = (
            calibrate(server, 600, blocks=1) if args.smoke else calibrate(server, 30_000)
        )
        print(
            f"server CPU per request, one client at a time: {dedicated_us:.1f} us answered, "
            f"{no_reply_us:.1f} us pipelined (set, append)",
            flush=True,
        )
        for design in args.designs:
            for workload in args.workloads if design != "idle" else ["tp"]:
                row = measure(args, server, design, workload)
                row["model_10k_server_s"] = model_10k(row)
                row["model_10k_dedicated_server_s"] = model_10k(
                    row, us_per_request=dedicated_us, us_per_no_reply=no_reply_us
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        server.stop()
    headers = [
        "design",
        "workload",
        "requests",
        "req/rank",
        "server s",
        "us/req",
        "wall s",
        "p50 ms",
        "max ms",
        "rss MB",
        "10k model s",
        "10k, own core",
    ]
    table = [
        [
            r["design"],
            r["workload"],
            r["requests"],
            f"{r['requests_per_rank']:.1f}",
            f"{r['server_cpu_s']:.3f}",
            f"{r['server_us_per_request']:.1f}",
            f"{r['burst_wall_s']:.2f}",
            f"{r['p50_ms']:.2f}",
            f"{r['max_ms']:.1f}",
            f"{r['server_rss_growth_mb']:.1f}",
            f"{r['model_10k_server_s']:.2f}",
            f"{r['model_10k_dedicated_server_s']:.2f}",
        ]
        for r in rows
    ]
    print(
        f"\n{args.ranks} simulated ranks x {args.keys} new keys ({args.procs} processes, one TCPStore server)"
    )
    common.print_table(headers, table)
    verify_rows = []
    for world in args.verify or []:
        for row in measure_verify(world, args.workloads, args):
            verify_rows.append(row)
            print(json.dumps(row), flush=True)
    if verify_rows:
        print(f"\nverify_agreement over real gloo ranks, {args.keys} keys each")
        common.print_table(
            ["ranks", "workload", "sent B/rank (max)", "header B received/rank", "s (max)", "shared"],
            [
                [
                    r["ranks"],
                    r["workload"],
                    r["sent_bytes_per_rank_max"],
                    r["received_header_bytes_per_rank"],
                    f"{r['seconds_max']:.3f}",
                    r["shared"],
                ]
                for r in verify_rows
            ],
        )
    common.write_json(
        args.out,
        {
            "environment": common.environment(),
            "args": vars(args),
            "dedicated_server_us_per_request": dedicated_us,
            "dedicated_server_us_per_no_reply_request": no_reply_us,
            "rows": rows + verify_rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
