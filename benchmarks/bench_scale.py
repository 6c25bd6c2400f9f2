"""Store-server cost of agreement and ``auto`` at 1,024+ simulated ranks (a benchmark, not a test).

    PYTHONPATH=. python benchmarks/bench_scale.py                       # 1,024 ranks x 2,000 keys
    PYTHONPATH=. python benchmarks/bench_scale.py --ranks 256 --keys 200 --designs digest auto
    PYTHONPATH=. python benchmarks/bench_scale.py --smoke               # CI: 16 ranks, seconds

One real libuv ``TCPStore`` server runs in a process of its own; ``--procs`` worker processes hold
``--ranks`` client connections between them (one thread and one connection per simulated rank) and
drive the library's own code against it: ``AgreementChecker`` in ``store`` (per key, at first use)
and ``digest`` (batched) modes, and ``StoreConsensus`` for ``auto`` (lookup, simulated tuning,
publish), alone and with the node tier (``auto-tier``: ``--node-size`` consecutive ranks share a
node folder in /dev/shm, as one node's ranks do under torchrun; its lookups read the folder, its
publishes are made once per node; ``auto-stores``: the tier, with each decision in one of
``--auto-stores`` hosted stores, servers in processes of their own as the job's store is, found
through the library's announcements in the job's store and routed by its digest as in a job).
``idle`` holds the connections
open and sends nothing: the server's baseline. Every rank starts at once (a burst, the worst
case: a job's first step). Workloads:

* ``tp``: every rank decides the same keys (tensor/data parallel);
* ``pp``: 4 pipeline stages (stage = rank % 4), each deciding keys of its own;
* ``varlen``: every rank decides ``keys - own`` shared keys plus ``own`` keys of its own.

Measured per (design, workload): requests (counted at the client, replies or not, and per store
method: ``requests_by_kind``), store-server
CPU seconds (from /proc), server CPU per request, burst wall time, p50/max latency per check (per
key in ``store``, per flush in ``digest``, per key in ``auto``) and the server's RSS growth. A
10,000-rank line extrapolates requests linearly per rank (the designs' request count per rank does
not depend on the world size) at the measured server cost per request. ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
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


class Counting:
    """Counts requests on the (prefix) store a checker or consensus object already built."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.requests = 0
        self.kinds: dict[str, int] = {}  # requests per store method (compare_set, add, append, ...)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if not callable(method):  # host, port: what error messages name
            return method

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            self.kinds[name] = self.kinds.get(name, 0) + 1
            return method(*args, **kwargs)

        return counted


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
    from megatron_tuning.distributed.auto_stores import AutoStores, close_rank
    from megatron_tuning.distributed.consensus import StoreConsensus
    from megatron_tuning.distributed.tier import NodeTier, node_folder

    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600), use_libuv=True)
    store_counts: dict[str, Counting] = {}  # auto-stores: this rank's client of each hosted store
    keys = plan(workload, rank, args.keys, args.own)
    namespace = f"{design}-{workload}"
    latencies: list[float] = []
    tunes = 0
    if design in ("store", "digest"):
        policy = TuningPolicy(agreement=design)
        checker = AgreementChecker(
            policy, store=client, rank=rank, ranks=range(args.ranks), namespace=namespace
        )
        counting = checker._store = Counting(checker._store)
        if checker.ledger is not None:
            checker.ledger.store = counting
    elif design in ("auto", "auto-tier", "auto-stores"):
        consensus = StoreConsensus(client, rank=rank, namespace=namespace, world=args.ranks)
        counting = consensus._store = Counting(consensus._store)
        if design != "auto":  # ranks // node_size share a node folder, as one node's ranks do
            folder = node_folder(f"bench-scale-{os.getppid()}\n{namespace}\n{rank // args.node_size}")
            assert folder is not None
            consensus.tier = NodeTier(folder, rank=rank, owner=rank % args.node_size == 0)
        if design == "auto-stores":  # the library's own discovery, routing and lazy connections
            count = len(args.store_ports)
            consensus.stores = AutoStores(
                counting,
                count,
                tier=consensus.tier,
                connect=lambda address, timeout: _counted_client(address, timeout, store_counts),
            )
    else:
        counting = Counting(client)
    decisions = [
        Decision(kernel=KERNEL, key=key, signature=SIGNATURE, source="table", arch=ARCH) for key in keys
    ]
    if design == "digest":
        # First use records and launches: no store request (checked). One simulated rank records
        # at a time: 64 threads recording at once thrash the GIL and the flush lock for many
        # minutes, which real ranks (a process each) never do. Only the burst is measured.
        with _SETUP_LOCK:
            for decision in decisions:
                checker.check(decision)
        if counting.requests:
            raise AssertionError(f"digest mode sent {counting.requests} requests before its flush")
    ready.release()
    go.wait()
    start = time.perf_counter()
    if design == "store":
        for decision in decisions:
            t0 = time.perf_counter()
            checker.check(decision)
            latencies.append(time.perf_counter() - t0)
    elif design == "digest":
        t0 = time.perf_counter()
        checker.flush()  # what the first repeated launch after the new keys does
        latencies.append(time.perf_counter() - t0)
        checker.stop()  # close: the last flush, and the last rank reads every shard
    elif design in ("auto", "auto-tier", "auto-stores"):
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
        if design == "auto-stores":
            close_rank(counting, args.ranks)  # what each rank does at exit, so the hosts can stop
    else:  # idle: connections open, no request (what merely holding them costs the server)
        time.sleep(args.idle_s)
    out.append(
        {
            "rank": rank,
            "requests": counting.requests,
            "kinds": counting.kinds,
            "store_requests": {a: c.requests for a, c in store_counts.items()},
            "store_kinds": [c.kinds for c in store_counts.values()],
            "latencies": latencies,
            "tunes": tunes,
            "end": time.perf_counter() - start,
        }
    )


def _counted_client(address: str, timeout: timedelta, counts: dict[str, Counting]) -> Any:
    from megatron_tuning.distributed.auto_stores import connect

    counts[address] = Counting(connect(address, timeout))
    return counts[address]


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
    import megatron_tuning.distributed.consensus  # noqa: F401

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
    import megatron_tuning.distributed.consensus  # noqa: F401

    hosted: list[Server] = []
    if design == "auto-stores":  # the hosted stores, announced as their host ranks would
        import torch.distributed as dist

        from megatron_tuning.distributed import consensus as consensus_module
        from megatron_tuning.distributed.auto_stores import announce

        hosted = [Server() for _ in range(args.auto_stores)]
        setup = dist.PrefixStore(
            f"{consensus_module._PREFIX}/{design}-{workload}",
            dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True),
        )
        for index, store in enumerate(hosted):  # as the first node leaders to start would
            announce(setup, index, index * args.node_size, f"127.0.0.1:{store.port}")
    args.store_ports = [store.port for store in hosted]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    nodes = [
        list(range(n, min(n + args.node_size, args.ranks))) for n in range(0, args.ranks, args.node_size)
    ]
    chunks = [[r for node in nodes[p :: args.procs] for r in node] for p in range(args.procs)]
    barrier = ctx.Barrier(len(chunks) + 1)
    procs = [
        ctx.Process(target=_worker, args=(args, server.port, chunk, design, workload, barrier, queue))
        for chunk in chunks
    ]
    for p in procs:
        p.start()
    barrier.wait()
    cpu0, rss0, t0 = server.cpu_s(), server.rss_mb(), time.perf_counter()
    hosted0 = [store.cpu_s() for store in hosted]
    results = [r for _ in procs for r in queue.get(timeout=3600)]
    wall = time.perf_counter() - t0
    cpu1, rss1 = server.cpu_s(), server.rss_mb()
    hosted_cpu = [store.cpu_s() - before for store, before in zip(hosted, hosted0)]
    for store in hosted:
        store.stop()
    for p in procs:
        p.join()
    if design in ("auto-tier", "auto-stores"):  # the node folders the simulated nodes shared
        from megatron_tuning.distributed.tier import node_folder

        for n in range(len(nodes)):
            folder = node_folder(f"bench-scale-{os.getpid()}\n{design}-{workload}\n{n}")
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
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
    per_store = {f"127.0.0.1:{store.port}": 0 for store in hosted}
    store_kinds: dict[str, int] = {}
    for r in results:
        for address, count in r["store_requests"].items():
            per_store[address] += count
        for kinds_of_one in r["store_kinds"]:
            for kind, count in kinds_of_one.items():
                store_kinds[kind] = store_kinds.get(kind, 0) + count
    hosted_row = {}
    if hosted:  # the job's store (``requests``, ``server_cpu_s``) and each hosted store apart
        hosted_row = {
            "hosted_stores": len(hosted),
            "hosted_requests": list(per_store.values()),
            "hosted_requests_by_kind": dict(sorted(store_kinds.items())),
            "hosted_cpu_s": hosted_cpu,
            "hosted_us_per_request": [
                cpu / count * 1e6 if count else 0.0 for cpu, count in zip(hosted_cpu, per_store.values())
            ],
        }
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
        **hosted_row,
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


def busiest_share(args: argparse.Namespace, workload: str, ranks: int, count: int) -> float:
    """The share of the floor's requests (one per node and key) that the busiest of ``count``
    hosted stores takes at ``ranks``, routing this workload's keys as the library does: 1/count
    only if the keys spread evenly, which 200 keys over 10 stores do not quite."""
    from megatron_tuning.distributed.auto_stores import shard_of
    from megatron_tuning.distributed.consensus import _store_key

    nodes_per_key: dict[str, set[int]] = {}
    for rank in range(ranks):
        for key in plan(workload, rank, args.keys, args.own):
            nodes_per_key.setdefault(key, set()).add(rank // args.node_size)
    load = [0] * count
    for key, nodes in nodes_per_key.items():
        load[shard_of(_store_key(KERNEL, key, ARCH), count)] += len(nodes)
    return max(load) / sum(load)


def model_10k_hosted(
    row: dict[str, Any], args: argparse.Namespace, us_per_request: float, ranks: int = 10_000
) -> dict[str, Any]:
    """``auto-stores`` at ``ranks``: the library's default number of hosted stores there (unset
    ``MEGATRON_TUNING_AUTO_STORES``) and the server seconds of the busiest: the run's hosted
    requests per rank x ``ranks`` x its share (``busiest_share``), at the one-client cost and at
    the run's own."""
    from megatron_tuning.core.env import scoped_environ
    from megatron_tuning.distributed.auto_stores import ENV_STORES, store_count

    with scoped_environ({ENV_STORES: None}):
        count = store_count(ranks, args.node_size)
    per_rank = sum(row["hosted_requests"]) / row["ranks"]
    burst_us = sum(row["hosted_cpu_s"]) / sum(row["hosted_requests"]) * 1e6 if per_rank else 0.0
    share = busiest_share(args, row["workload"], ranks, count)
    busiest = per_rank * ranks * share
    return {
        "model_10k_hosted_stores": count,
        "model_10k_busiest_store_share": share,
        "model_10k_requests_busiest_store": busiest,
        "model_10k_busiest_store_s": busiest * us_per_request / 1e6,
        "model_10k_busiest_store_burst_cost_s": busiest * burst_us / 1e6,
    }


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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument("--own", type=int, default=100, help="varlen: keys of each rank's own")
    parser.add_argument("--procs", type=int, default=16, help="worker processes holding the connections")
    parser.add_argument("--tune-ms", type=float, default=2.0, help="auto: simulated tuning time per miss")
    parser.add_argument("--node-size", type=int, default=8, help="auto-tier: simulated ranks per node")
    parser.add_argument("--idle-s", type=float, default=5.0, help="idle: how long the connections sit unused")
    parser.add_argument("--auto-stores", type=int, default=4, help="auto-stores: hosted stores in the run")
    parser.add_argument(
        "--designs",
        nargs="+",
        default=["idle", "store", "digest", "auto", "auto-tier", "auto-stores"],
        choices=["idle", "store", "digest", "auto", "auto-tier", "auto-stores"],
    )
    parser.add_argument("--workloads", nargs="+", default=["tp", "pp", "varlen"])
    parser.add_argument(
        "--smoke", action="store_true", help="16 ranks x 40 keys: a CI check of the code path"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.ranks, args.keys, args.own, args.procs, args.idle_s = 16, 40, 4, 2, 0.5
    server = Server()
    rows = []
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
                if "hosted_stores" in row:
                    row.update(model_10k_hosted(row, args, dedicated_us))
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        server.stop()
    headers = [
        "design",
        "workload",
        "requests",
        "req/rank",
        "answered/rank",
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
            f"{answered_per_rank(r):.2f}",
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
    for r in rows:
        if "hosted_stores" in r:
            print(
                f"{r['design']} {r['workload']}: {r['hosted_stores']} hosted stores took "
                f"{r['hosted_requests']} requests, {[round(c, 3) for c in r['hosted_cpu_s']]} server s; "
                f"at 10,000 ranks {r['model_10k_hosted_stores']} stores, the busiest "
                f"{r['model_10k_busiest_store_share']:.1%} of the requests "
                f"({r['model_10k_requests_busiest_store']:,.0f}): "
                f"{r['model_10k_busiest_store_s']:.2f} s at the one-client cost, "
                f"{r['model_10k_busiest_store_burst_cost_s']:.2f} s at this burst's"
            )
    print(
        f"10k model s: requests per rank x 10,000 x the burst's server us per request; 10k, own core: "
        f"x {dedicated_us:.1f} us per answered request and {no_reply_us:.1f} us per pipelined one "
        "(one client at a time)"
    )
    common.write_json(
        args.out,
        {
            "environment": common.environment(),
            "args": vars(args),
            "dedicated_server_us_per_request": dedicated_us,
            "dedicated_server_us_per_no_reply_request": no_reply_us,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
