"""How long tuning tables take to encode, write, load and query (CPU only).

    python benchmarks/bench_table_load.py [--entries 100000] [--repeat 5]

Prints the best of ``--repeat`` runs for each step. The target: loading 100k fully
validated entries takes well under a second, and a lookup is O(1).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Callable

from megatron_tuning.core.key import Key
from megatron_tuning.tables.entry import Entry, Timing
from megatron_tuning.tables.search import TableSet
from megatron_tuning.tables.table import Table, load_table, save_table


def make_table(count: int, seed: int = 0) -> Table:
    """``count`` realistic entries: 20 kernels, matmul-like keys, full provenance and timings."""
    rng = random.Random(seed)
    kernels = [f"pkg.ops.kernels_{i % 4}:kernel_{i}" for i in range(20)]
    table = Table()
    for index in range(count):
        m, n, k = 64 * (index // 20 + 1), 128 * rng.randint(1, 64), 64 * rng.randint(1, 64)
        table.add(
            Entry(
                arch="sm90",
                kernel=kernels[index % 20],
                key=Key({"M": m, "N": n, "K": k}, {"a_ptr": "torch.bfloat16", "b_ptr": "torch.bfloat16"}),
                config={
                    "kwargs": {
                        "BLOCK_M": rng.choice([64, 128]),
                        "BLOCK_N": rng.choice([64, 128, 256]),
                        "BLOCK_K": rng.choice([32, 64]),
                        "GROUP_M": 8,
                    },
                    "num_warps": rng.choice([4, 8]),
                    "num_stages": rng.choice([3, 4, 5]),
                    "num_ctas": 1,
                    "maxnreg": None,
                },
                how="tuned",
                source_hash=f"{rng.getrandbits(256):064x}",
                triton_version="3.6.0",
                timing=Timing(median_ms=rng.uniform(0.01, 5.0), spread_ms=0.002, samples=100, candidates=16),
            )
        )
    return table


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    start = time.perf_counter()
    table = make_table(args.entries)
    build_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "bench.msgpack")
        encode_s = best_of(args.repeat, table.to_bytes)
        save_s = best_of(args.repeat, lambda: save_table(table, path))
        size = os.path.getsize(path)
        load_s = best_of(args.repeat, lambda: load_table(path))
        tableset = TableSet([path], shipped_dir=None)
        idents = [e.ident for e in table.entries()][:: max(1, args.entries // 10_000)]

        def lookups() -> None:
            for arch, kernel, key in idents:
                tableset.lookup(kernel, key, arch=arch)

        lookup_s = best_of(args.repeat, lookups) / len(idents)
        json_s = best_of(args.repeat, table.to_json)
    print(f"entries:            {args.entries}")
    print(f"file size:          {size / 1e6:.2f} MB")
    print(f"build (validated):  {build_s * 1e3:8.1f} ms")
    print(f"encode msgpack:     {encode_s * 1e3:8.1f} ms")
    print(f"save (atomic):      {save_s * 1e3:8.1f} ms")
    print(f"load + validate:    {load_s * 1e3:8.1f} ms   (target: well under 1000 ms)")
    print(f"lookup:             {lookup_s * 1e6:8.2f} us per call (TableSet.lookup, hit)")
    print(f"export JSON:        {json_s * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
