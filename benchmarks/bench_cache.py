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

Code: this script is the parent (parts, repeats, summary); ``cache_children`` holds the entries
and what each child process measures.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
from cache_children import ARCH, CHILDREN

REPO = common.REPO


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
    return common.start_child(
        "bench_cache.py", ["--repo", str(repo), "--_child", name, *map(str, args)], _env(repo)
    )


def _run(repo: Path, name: str, *args: Any) -> dict[str, Any]:
    return common.child_result(_spawn(repo, name, *args), timeout=900)


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
    results = [common.child_result(child, timeout=900) for child in children]
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
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()),
        "checkout": str(REPO),
        "commit": common.git_commit(REPO),
        "library_from": str(repo),
        "load_average_at_start": os.getloadavg(),
    }


SUMMARIZE = {"init": summarize_init, "persist": summarize_persist, "concurrent": summarize_concurrent}


def _alternating(
    runs: list[tuple[str, Path]], repeat: int, measure: Callable[[int, str, Path], dict[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    """``measure(index, label, library)`` ``repeat`` times per library. Repeats alternate between
    the libraries (ABBA...), so a machine whose load changes over minutes biases neither side."""
    samples: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in runs}
    for index in range(repeat):
        for label, where in common.alternated(runs, index):
            samples[label].append(measure(index, label, where))
    return samples


def _measure(part: str, args: argparse.Namespace, folder: Path) -> Callable[[int, str, Path], dict[str, Any]]:
    """One sample of ``part`` (init, persist or one concurrent round) on a copy of the base file."""

    def measure(index: int, label: str, where: Path) -> dict[str, Any]:
        base = str(folder / f"base-{label}.msgpack")
        if part == "concurrent":
            sub = folder / label / f"concurrent{index}"
            sub.mkdir(parents=True, exist_ok=True)
            return part_concurrent(where, base, sub, args.procs, args.new)
        sub = folder / label
        sub.mkdir(exist_ok=True)
        if part == "init":
            return _run(where, "init", base)
        return run_persist(where, base, sub, index, args.entries, args.new)

    return measure


def run_parts(
    args: argparse.Namespace, parts: list[str], runs: list[tuple[str, Path]], repo: Path, folder: Path
) -> dict[str, dict[str, Any]]:
    """Every part on every library in ``runs``; per label, what ``result["runs"]`` holds."""
    out: dict[str, dict[str, Any]] = {label: {"library_from": str(where)} for label, where in runs}
    for label, where in runs:
        if set(parts) & {"init", "persist", "concurrent"}:
            out[label]["build"] = _run(where, "build", folder / f"base-{label}.msgpack", args.entries)
    for part in parts:
        if part in SUMMARIZE:
            repeat = args.concurrent_repeat if part == "concurrent" else args.repeat
            samples = _alternating(runs, repeat, _measure(part, args, folder))
            for label, _ in runs:
                out[label][part] = SUMMARIZE[part](samples[label])
            continue
        for label, where in runs:  # growth: one library after the other
            sub = folder / label
            sub.mkdir(exist_ok=True)
            out[label][part] = part_growth(where, sub, args.entries, args.rounds)
        if args.compare:
            # The upgrade: the new library's next run on the file the old one let grow.
            grown = folder / "before" / "growth.msgpack"
            upgrade = _run(repo, "growth", grown, args.rounds, args.entries)
            out["before"]["growth"]["upgrade"] = upgrade | {
                "cli_after": _cli_checks(grown, folder / "before")
            }
    return out


def parse_args() -> argparse.Namespace:
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
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    repo = Path(args.repo).resolve()
    sys.path.insert(0, str(repo))
    global MAX_ENTRIES, KEY_PAD
    MAX_ENTRIES, KEY_PAD = args.max_entries, args.key_pad
    if args._child:
        name, *raw = args._child
        fn, types = CHILDREN[name]
        common.emit(fn(*(kind(value) for kind, value in zip(types, raw))))
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
    }
    with tempfile.TemporaryDirectory(prefix="bench_cache_") as scratch:
        result["runs"] = run_parts(args, parts, runs, repo, Path(scratch))
    result["command"] = " ".join(["benchmarks/bench_cache.py", *sys.argv[1:]])
    result["environment"]["load_average_at_end"] = os.getloadavg()
    _print_summary(result)
    common.write_json(args.out, result)
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
