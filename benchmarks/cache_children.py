"""The child side of ``bench_cache.py``: cache entries like a real job's, and one measurement each.

Each ``child_*`` runs in a fresh process (``bench_cache.py --_child NAME ARGS``) and returns the
JSON its parent reads. ``megatron_tuning`` is imported inside the functions, from the checkout
the parent named (``--repo``), which is first on ``sys.path`` by then.
"""

from __future__ import annotations

import hashlib
import os
import time
from types import SimpleNamespace
from typing import Any

import common

ARCH = "sm90"


_MATMUL_KEY = ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn")


def make_decisions(start: int, count: int, *, writer: int | None = None) -> list[Any]:
    """``count`` decisions with keys numbered from ``start``; ``writer`` makes keys distinct per writer.
    Keys are built by ``tuning_key`` (the seed API: an older ``--repo`` checkout has it too)."""
    from megatron_tuning import Decision, tuning_key

    pad = "x" * int(os.environ.get("BENCH_CACHE_KEY_PAD", "0"))  # --key-pad: longer keys
    extra = {**({"w": writer} if writer is not None else {}), **({"pad": pad} if pad else {})}
    names = [*_MATMUL_KEY, *extra]
    matmul = SimpleNamespace(arg_names=["a_ptr", "b_ptr", "c_ptr", *names], keys=names)
    operand = SimpleNamespace(dtype="torch.bfloat16")  # what a key reads of a tensor: its dtype
    out = []
    for index in range(start, start + count):
        kernel = f"pkg.ops.kernels_{index % 4}:kernel_{index % 40}"
        m = 16 * (index // 40 + 1)
        block_n = (64, 128, 256)[index % 3]
        args = [operand] * 3 + [m, 4096, 4096, 4096, 1, 4096, 1, 4096, 1, *extra.values()]
        config = {
            "kwargs": {"BLOCK_M": 128, "BLOCK_N": block_n, "BLOCK_K": 64, "GROUP_M": 8},
            "num_warps": 4 if index % 2 else 8,
            "num_stages": 3 + index % 3,
            "num_ctas": 1,
            "maxnreg": None,
        }
        adopted = index % 4 == 3
        out.append(
            Decision(
                kernel=kernel,
                key=tuning_key(matmul, args, {}),
                signature=f"BLOCK_N={block_n}",
                source="adopted" if adopted else "tuned",
                config=config,
                arch=ARCH,
                origin=f"rank {index % 8}" if adopted else None,
                source_hash=hashlib.sha256(kernel.encode()).hexdigest(),
                timings=None
                if adopted
                else {
                    "median_ms": 0.5 + (index % 97) / 100,
                    "spread_ms": 0.01,
                    "samples": 50,
                    "candidates": 16,
                },
            )
        )
    return out


def _policy(path: str) -> Any:
    from megatron_tuning.core.policy import TuningPolicy

    return TuningPolicy.from_env(mode="auto", cache=path, use_shipped_tables=False)  # the cap: the env's


def _open(path: str) -> Any:
    from megatron_tuning.tables.cache import open_cache

    return open_cache(_policy(path), ARCH)


def child_build(path: str, count: int) -> dict[str, Any]:
    cache = _open(path)
    start = time.perf_counter()
    written = cache.persist(make_decisions(0, count))
    return {"persisted": written, "seconds": time.perf_counter() - start, "bytes": os.path.getsize(path)}


def _timed(fn: Any, *args: Any) -> tuple[Any, float, float]:
    """``fn(*args)``, its wall time and this process's CPU time: on a shared machine the CPU time
    is what the call costs, the wall time what it cost here and now."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def child_init(path: str) -> dict[str, Any]:
    from megatron_tuning.tables.search import TableSet

    def init() -> Any:
        cache = _open(path)
        TableSet.from_policy(_policy(path), cache=(cache.path, cache.table))
        return cache

    cache, wall, cpu = _timed(init)
    return {"init_s": wall, "init_cpu_s": cpu, "entries": len(cache.table)}


def child_persist(path: str, existing: int, new: int) -> dict[str, Any]:
    cache = _open(path)
    fresh = make_decisions(existing + 1_000_000, 2)
    first, first_s, first_cpu = _timed(cache.persist, fresh[:1])
    second, second_s, second_cpu = _timed(cache.persist, fresh)
    before = os.stat(path).st_mtime_ns
    other = _open(path)  # a second rank: every decision it made is already in the file
    held = make_decisions(existing - new, new)  # the newest: a cap at --entries evicts the oldest
    again, nothing_s, nothing_cpu = _timed(other.persist, held)
    return {
        "first_new_s": first_s,
        "first_new_cpu_s": first_cpu,
        "second_new_s": second_s,
        "second_new_cpu_s": second_cpu,
        "nothing_new_s": nothing_s,
        "nothing_new_cpu_s": nothing_cpu,
        "written": [first, second, again],
        "rewrote_on_nothing_new": os.stat(path).st_mtime_ns != before,
    }


def child_concurrent(path: str, writer: int, new: int, start_at: float) -> dict[str, Any]:
    warnings = common.collect_log_warnings()
    cache = _open(path)
    decisions = make_decisions(0, new, writer=writer)
    while time.time() < start_at:
        time.sleep(0.001)
    written, wall, cpu = _timed(cache.persist, decisions)
    return {
        "writer": writer,
        "seconds": wall,
        "cpu_s": cpu,
        "persisted": written,
        "keys": [d.key for d in decisions] if written else [],
        "warnings": warnings[:3],
    }


def child_growth(path: str, round_: int, count: int) -> dict[str, Any]:
    warnings = common.collect_log_warnings()
    start = time.perf_counter()
    cache = _open(path)
    open_s = time.perf_counter() - start
    readable = cache is not None
    entries_seen = len(cache.table) if cache is not None else None
    written = 0
    persist_s = 0.0
    if cache is not None:
        start = time.perf_counter()
        written = cache.persist(make_decisions(round_ * count, count))
        persist_s = time.perf_counter() - start
    return {
        "round": round_,
        "readable_at_open": readable,
        "entries_at_open": entries_seen,
        "open_s": open_s,
        "persisted": written,
        "persist_s": persist_s,
        "bytes_after": os.path.getsize(path) if os.path.exists(path) else 0,
        "warnings": [m[:600] for m in warnings[:4]],
    }


CHILDREN = {
    "build": (child_build, (str, int)),
    "init": (child_init, (str,)),
    "persist": (child_persist, (str, int, int)),
    "concurrent": (child_concurrent, (str, int, int, float)),
    "growth": (child_growth, (str, int, int)),
}
