"""What one libuv ``TCPStore`` server spends per request type and per byte (a benchmark, not a test).

    PYTHONPATH=. python benchmarks/bench_store_requests.py

One client, one server process (``bench_scale.Server``); server CPU (user and system, from /proc)
per request for each kind the agreement and ``auto`` protocols send, then the cost of bytes: a
log grown by appends, 64 KB replies, and reads of a 5 MB value. Requests without a reply
(``set``, ``append``) are pipelined by the client, so the server handles several per wake-up.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_scale  # noqa: E402


def main() -> int:
    import torch.distributed as dist

    server = bench_scale.Server()
    client = dist.TCPStore(
        "127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60), use_libuv=True
    )
    client.set("v200", "x" * 200)
    count = 20_000
    kinds = {
        "add": lambda i: client.add("count", 1),
        "compare_set, absent key, 0 B": lambda i: client.compare_set(f"m0/{i}", "", ""),
        "compare_set, absent key, 200 B": lambda i: client.compare_set(f"m200/{i}", "", "y" * 200),
        "compare_set, 200 B value (a read)": lambda i: client.compare_set("v200", "", ""),
        "check": lambda i: client.check(["v200"]),
        "get (a wait and a get)": lambda i: client.get("v200"),
        "append 20 B (no reply)": lambda i: client.append("app", "y" * 20),
        "set 20 B (no reply)": lambda i: client.set(f"s/{i}", "y" * 20),
    }
    print(f"{'request':36s} {'user us':>8s} {'sys us':>8s} {'client wall us':>15s}")
    for name, send in kinds.items():
        user0, sys0 = server.cpu_times()
        start = time.perf_counter()
        for i in range(count):
            send(i)
        client.check(["app"])  # the pipelined ones are done once a request with a reply returns
        user1, sys1 = server.cpu_times()
        wall = time.perf_counter() - start
        print(
            f"{name:36s} {(user1 - user0) / count * 1e6:8.1f} {(sys1 - sys0) / count * 1e6:8.1f}"
            f" {wall / count * 1e6:15.1f}"
        )

    value = os.urandom(5000)
    for name, key in (("one key", lambda i: "log"), ("a key each", lambda i: f"log/{i}")):
        before = server.cpu_s()
        for i in range(1000):
            client.append(key(i), value)
        client.check(["log"])
        print(f"1,000 appends of 5 KB, {name}: {server.cpu_s() - before:.3f} s of server CPU")
    client.set("ref", os.urandom(64_000))
    for name, key in (("64 KB", "ref"), ("0 B", "empty")):
        before = server.cpu_s()
        for _ in range(1000):
            client.compare_set(key, "", "")
        print(f"1,000 reads of {name}: {server.cpu_s() - before:.3f} s")
    before = server.cpu_s()
    for _ in range(5):
        client.compare_set("log", "", "")
    print(f"5 reads of the 5 MB log: {server.cpu_s() - before:.3f} s")
    server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
