"""What ``auto`` mode's cache costs, and whether it stays bounded and readable (CPU only).

    python benchmarks/bench_cache.py [--entries 100000] [--procs 10] [--new 100] [--rounds 4]
    python benchmarks/bench_cache.py --repo /path/to/old/checkout ...   # the same, on other code
    python benchmarks/bench_cache.py --smoke --out r.json                # the CI check (seconds)

Every measurement runs in a fresh child process (a real job's init and close are a fresh
process's), timed inside the child, so interpreter start-up and imports are not counted.
Entries look like a real cache's: 40 kernels, matmul-like keys, one source hash per kernel, the
running Triton version, timings, one in four adopted from another rank.

Parts (``--parts``, default all):

* ``init``: ``open_cache`` plus the ``TableSet`` that ``init_deterministic_tuning`` builds over it,
  for a cache of ``--entries`` entries (best of ``--repeat`` processes).
* ``persist``: in one process, the first ``persist`` of 1 new entry after ``open_cache``, a second
  one, and a persist of ``--new`` decisions the file already holds (what every rank but the first
  does at close).
* ``concurrent``: ``--procs`` processes open the cache and, at one moment, persist ``--new`` new
  entries each: the slowest persist is what the lock timeout must cover; *lost* counts entries a
  process reported persisted that the file does not hold.
* ``growth``: ``--rounds`` runs, each opening the cache and persisting ``--entries`` new keys: file
  size and entry count after each, whether the next open could read it, and the warnings logged.
  Then ``cache``, ``show`` and ``export`` (this checkout's CLI) on the final file.

``--repo DIR`` imports ``megatron_tuning`` from another checkout (e.g. ``git archive`` of an older
commit) for a before/after comparison; the CLI checks always use this checkout's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULT_MARK = "RESULT "
ARCH = "sm90"


# -- entries ---------------------------------------------------------------------------------------
def make_decisions(start: int, count: int, *, tag: str = "") -> list[Any]:
    """``count`` decisions with keys numbered from ``start``; ``tag`` makes keys distinct per writer."""
    from megatron_tuning.core.decisions import Decision

    pad = "x" * int(os.environ.get("BENCH_CACHE_KEY_PAD", "0"))  # --key-pad: longer keys
    tag = f"{tag}, pad={pad}" if pad else tag
    out = []
    for index in range(start, start + count):
        kernel = f"pkg.ops.kernels_{index % 4}:kernel_{index % 40}"
        m = 16 * (index // 40 + 1)
        block_n = (64, 128, 256)[index % 3]
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
                key=f"M={m}, N=4096, K=4096, stride_am=4096, stride_ak=1, stride_bk=4096, stride_bn=1, "
                f"stride_cm=4096, stride_cn=1{tag} | a_ptr:torch.bfloat16, b_ptr:torch.bfloat16, "
                "c_ptr:torch.bfloat16",
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

    return TuningPolicy(mode="auto", cache=path, use_shipped_tables=False)


def _open(path: str) -> Any:
    from megatron_tuning.tables.cache import open_cache

    return open_cache(_policy(path), ARCH)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _capture() -> _Warnings:
    handler = _Warnings()
    logging.getLogger("megatron_tuning").addHandler(handler)
    return handler


# -- children (each prints one RESULT line) --------------------------------------------------------
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
    warnings = _capture()
    cache = _open(path)
    decisions = make_decisions(0, new, tag=f", w={writer}")
    while time.time() < start_at:
        time.sleep(0.001)
    written, wall, cpu = _timed(cache.persist, decisions)
    return {
        "writer": writer,
        "seconds": wall,
        "cpu_s": cpu,
        "persisted": written,
        "keys": [d.key for d in decisions] if written else [],
        "warnings": warnings.messages[:3],
    }


def child_growth(path: str, round_: int, count: int) -> dict[str, Any]:
    warnings = _capture()
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
        "warnings": [m[:600] for m in warnings.messages[:4]],
    }


_CHILDREN = {
    "build": (child_build, (str, int)),
    "init": (child_init, (str,)),
    "persist": (child_persist, (str, int, int)),
    "concurrent": (child_concurrent, (str, int, int, float)),
    "growth": (child_growth, (str, int, int)),
}


# -- parent ----------------------------------------------------------------------------------------
MAX_ENTRIES: int | None = None  # --max-entries, passed to every child
KEY_PAD = 0  # --key-pad


def _env(repo: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env["PYTHONPATH"] = str(repo)
    if MAX_ENTRIES is not None:
        env["MEGATRON_TUNING_CACHE_MAX_ENTRIES"] = str(MAX_ENTRIES)
    env["BENCH_CACHE_KEY_PAD"] = str(KEY_PAD)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _spawn(repo: Path, name: str, *args: Any) -> subprocess.Popen[str]:
    command = [sys.executable, __file__, "--repo", str(repo), "--_child", name, *map(str, args)]
    return subprocess.Popen(
        command, env=_env(repo), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _result(proc: subprocess.Popen[str], timeout: float = 900) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    for line in out.splitlines():
        if line.startswith(RESULT_MARK):
            return dict(json.loads(line[len(RESULT_MARK) :]))
    raise RuntimeError(f"child exited {proc.returncode} without a result:\n{out[-2000:]}\n{err[-3000:]}")


def _run(repo: Path, name: str, *args: Any) -> dict[str, Any]:
    return _result(_spawn(repo, name, *args))


def summarize_init(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "entries": runs[0]["entries"],
        "init_s_best": min(r["init_s"] for r in runs),
        "init_s_median": statistics.median(r["init_s"] for r in runs),
        "init_cpu_s_best": min(r["init_cpu_s"] for r in runs),
    }


def run_persist(repo: Path, base: str, folder: Path, index: int, entries: int, new: int) -> dict[str, Any]:
    copy = folder / f"persist{index}.msgpack"
    shutil.copyfile(base, copy)
    return _run(repo, "persist", copy, entries, new)


def summarize_persist(runs: list[dict[str, Any]]) -> dict[str, Any]:
    names = tuple(
        f"{n}{kind}" for n in ("first_new", "second_new", "nothing_new") for kind in ("_s", "_cpu_s")
    )
    return (
        {name: min(r[name] for r in runs) for name in names}
        | {f"{name}_median": statistics.median(r[name] for r in runs) for name in names}
        | {"written": runs[0]["written"], "rewrote_on_nothing_new": runs[0]["rewrote_on_nothing_new"]}
    )


def part_concurrent(repo: Path, base: str, folder: Path, procs: int, new: int) -> dict[str, Any]:
    from megatron_tuning.tables.table import load_table  # this checkout's reader

    path = folder / "concurrent.msgpack"
    shutil.copyfile(base, path)
    start_at = time.time() + 3.0 + 0.4 * procs  # every child imported and opened before the gun
    children = [_spawn(repo, "concurrent", path, w, new, start_at) for w in range(procs)]
    results = [_result(child) for child in children]
    held = {e.key for e in load_table(path).values()}
    claimed = [key for r in results for key in r["keys"]]
    times = sorted(r["seconds"] for r in results)
    return {
        "procs": procs,
        "new_each": new,
        "persist_s_min": times[0],
        "persist_s_median": statistics.median(times),
        "persist_s_max": times[-1],
        "cpu_s_total": sum(r["cpu_s"] for r in results),
        "persisted": [r["persisted"] for r in sorted(results, key=lambda r: r["writer"])],
        "lost": sum(1 for key in claimed if key not in held),
        "warnings": [w[:300] for r in results for w in r["warnings"]][:4],
    }


def summarize_concurrent(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The first round's details, and the slowest persist of every round."""
    return rounds[0] | {
        "persist_s_max": statistics.median(r["persist_s_max"] for r in rounds),
        "persist_s_max_per_round": [r["persist_s_max"] for r in rounds],
        "persist_s_median": statistics.median(r["persist_s_median"] for r in rounds),
        "cpu_s_total": statistics.median(r["cpu_s_total"] for r in rounds),
        "lost": sum(r["lost"] for r in rounds),
        # A persist that returned 0 wrote nothing: with the old code, a lock timeout did that.
        "wrote_nothing_per_round": [r["persisted"].count(0) for r in rounds],
    }


def part_growth(repo: Path, folder: Path, entries: int, rounds: int) -> dict[str, Any]:
    path = folder / "growth.msgpack"
    steps = [_run(repo, "growth", path, index, entries) for index in range(rounds)]
    return {"entries_per_round": entries, "rounds": steps, "cli": _cli_checks(path, folder)}


def _cli_checks(path: Path, folder: Path) -> dict[str, Any]:
    """This checkout's ``cache``/``show``/``export`` on the file the growth runs left."""
    env = _env(REPO)
    env["MEGATRON_TUNING_CACHE"] = str(path)
    checks = {
        "cache": ["cache", "--arch", ARCH],
        "show": ["show", str(path), "--kernel", "kernel_7"],
        "show --max-size 256": ["show", str(path), "--kernel", "kernel_7", "--max-size", "256"],
        "export": ["export", str(path), str(folder / "export.json")],
    }
    out = {}
    for name, args in checks.items():
        done = subprocess.run(
            [sys.executable, "-m", "megatron_tuning", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        out[name] = {"exit": done.returncode, "stderr": done.stderr.strip()[-400:]}
        if name == "cache":
            out[name]["stdout"] = done.stdout.strip()[-300:]
    exported = folder / "export.json"
    out["export"]["bytes"] = exported.stat().st_size if exported.exists() else None
    return out


def environment(repo: Path) -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()),
        "checkout": str(REPO),
        "commit": commit or None,
        "library_from": str(repo),
        "load_average_at_start": os.getloadavg(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--procs", type=int, default=10)
    parser.add_argument("--new", type=int, default=100, help="new entries per process (concurrent, persist)")
    parser.add_argument("--rounds", type=int, default=4, help="growth runs")
    parser.add_argument("--repeat", type=int, default=4, help="init and persist processes per library")
    parser.add_argument(
        "--concurrent-repeat", type=int, default=2, help="concurrent rounds per library (median of slowest)"
    )
    parser.add_argument("--parts", default="init,persist,concurrent,growth")
    parser.add_argument("--repo", default=str(REPO), help="checkout to import megatron_tuning from")
    parser.add_argument(
        "--compare", default=None, metavar="DIR", help="also run every part on the checkout in DIR (before)"
    )
    parser.add_argument(
        "--max-entries",
        type=int,
        default=None,
        help="MEGATRON_TUNING_CACHE_MAX_ENTRIES for every child (default: unset, the library's cap)",
    )
    parser.add_argument(
        "--key-pad", type=int, default=0, help="make every key this many bytes longer (a file grows sooner)"
    )
    parser.add_argument("--smoke", action="store_true", help="2,000 entries, 3 processes: the CI check")
    parser.add_argument("--out", default=None, help="write the JSON results here")
    parser.add_argument("--_child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    repo = Path(args.repo).resolve()
    sys.path.insert(0, str(repo))
    global MAX_ENTRIES, KEY_PAD
    MAX_ENTRIES, KEY_PAD = args.max_entries, args.key_pad
    if args._child:
        name, *raw = args._child
        fn, types = _CHILDREN[name]
        result = fn(*(kind(value) for kind, value in zip(types, raw)))
        print(RESULT_MARK + json.dumps(result), flush=True)
        return 0
    if args.smoke:
        args.entries, args.procs, args.new, args.rounds, args.repeat = 2_000, 3, 20, 2, 1
        args.concurrent_repeat = 1
    parts = [p for p in ("init", "persist", "concurrent", "growth") if p in args.parts.split(",")]
    runs = [("before", Path(args.compare).resolve()), ("after", repo)] if args.compare else [("this", repo)]
    result: dict[str, Any] = {
        "environment": environment(repo),
        "entries": args.entries,
        "max_entries_setting": args.max_entries,
        "runs": {label: {"library_from": str(where)} for label, where in runs},
    }
    with tempfile.TemporaryDirectory(prefix="bench_cache_") as scratch:
        folder = Path(scratch)
        for label, where in runs:
            if set(parts) & {"init", "persist", "concurrent"}:
                result["runs"][label]["build"] = _run(
                    where, "build", folder / f"base-{label}.msgpack", args.entries
                )
        for part in parts:
            if part in ("init", "persist"):
                # Repeats alternate between the libraries (ABBA...), so a machine whose load
                # changes over minutes biases neither side.
                samples: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in runs}
                for index in range(args.repeat):
                    for label, where in runs if index % 2 == 0 else runs[::-1]:
                        base, sub = str(folder / f"base-{label}.msgpack"), folder / label
                        sub.mkdir(exist_ok=True)
                        if part == "init":
                            samples[label].append(_run(where, "init", base))
                        else:
                            samples[label].append(
                                run_persist(where, base, sub, index, args.entries, args.new)
                            )
                for label, _ in runs:
                    summary = summarize_init if part == "init" else summarize_persist
                    result["runs"][label][part] = summary(samples[label])
                continue
            if part == "concurrent":
                rounds: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in runs}
                for index in range(args.concurrent_repeat):
                    for label, where in runs if index % 2 == 0 else runs[::-1]:
                        sub = folder / label / f"concurrent{index}"
                        sub.mkdir(parents=True, exist_ok=True)
                        base = str(folder / f"base-{label}.msgpack")
                        rounds[label].append(part_concurrent(where, base, sub, args.procs, args.new))
                for label, _ in runs:
                    result["runs"][label][part] = summarize_concurrent(rounds[label])
                continue
            for label, where in runs:  # growth: one library after the other
                sub = folder / label
                sub.mkdir(exist_ok=True)
                result["runs"][label][part] = part_growth(where, sub, args.entries, args.rounds)
            if args.compare:
                # The upgrade: the new library's next run on the file the old one let grow.
                grown = folder / "before" / "growth.msgpack"
                upgrade = _run(repo, "growth", grown, args.rounds, args.entries)
                result["runs"]["before"]["growth"]["upgrade"] = upgrade | {
                    "cli_after": _cli_checks(grown, folder / "before")
                }
    result["command"] = " ".join(["benchmarks/bench_cache.py", *sys.argv[1:]])
    result["environment"]["load_average_at_end"] = os.getloadavg()
    _print_summary(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


_SUMMARY = [
    ("init: open_cache + TableSet, s (best)", "init", "init_s_best"),
    ("init, CPU s (best)", "init", "init_cpu_s_best"),
    ("first persist of 1 new entry, s", "persist", "first_new_s"),
    ("first persist of 1 new entry, CPU s", "persist", "first_new_cpu_s"),
    ("second persist of 1 new entry, s", "persist", "second_new_s"),
    ("second persist of 1 new entry, CPU s", "persist", "second_new_cpu_s"),
    ("persist, nothing new, s", "persist", "nothing_new_s"),
    ("persist, nothing new, CPU s", "persist", "nothing_new_cpu_s"),
    ("concurrent: slowest persist, s (median over rounds)", "concurrent", "persist_s_max"),
    ("concurrent: median persist, s", "concurrent", "persist_s_median"),
    ("concurrent: CPU s, all processes", "concurrent", "cpu_s_total"),
    ("concurrent: entries lost", "concurrent", "lost"),
    ("concurrent: processes whose persist wrote nothing, per round", "concurrent", "wrote_nothing_per_round"),
]


def _print_summary(result: dict[str, Any]) -> None:
    runs = result["runs"]
    labels = list(runs)
    print(f"{result['command']}   ({result['entries']} entries)")
    print(" | ".join(["metric", *labels, *(["after/before"] if len(labels) == 2 else [])]))
    for name, part, key in _SUMMARY:
        values = [runs[label].get(part, {}).get(key) for label in labels]
        if all(v is None for v in values):
            continue
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in values]
        if len(values) == 2 and all(isinstance(v, float) and v for v in values):
            cells.append(f"{values[1] / values[0]:.2f}x")
        print(" | ".join([name, *cells]))
    for label in labels:
        growth = runs[label].get("growth")
        if growth is None:
            continue
        print(f"growth ({label}): round, readable at open, entries at open, persisted, bytes after")
        for step in growth["rounds"]:
            print(
                f"  {step['round']}  {step['readable_at_open']}  {step['entries_at_open']}  "
                f"{step['persisted']}  {step['bytes_after']}  warnings: {len(step['warnings'])}"
            )
        print("  cli: " + ", ".join(f"{name} exit {check['exit']}" for name, check in growth["cli"].items()))
        upgrade = growth.get("upgrade")
        if upgrade is not None:
            print(
                f"  upgrade (this checkout's next run on that file): readable {upgrade['readable_at_open']}, "
                f"{upgrade['entries_at_open']} entries, persisted {upgrade['persisted']}, "
                f"bytes after {upgrade['bytes_after']}, warnings {len(upgrade['warnings'])}; cli: "
                + ", ".join(f"{name} exit {check['exit']}" for name, check in upgrade["cli_after"].items())
            )


if __name__ == "__main__":
    sys.exit(main())
