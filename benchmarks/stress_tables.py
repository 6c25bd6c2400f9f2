"""Concurrent table writers SIGKILLed at random: are committed entries ever lost, or reads corrupt?

    python benchmarks/stress_tables.py [--writers 3] [--kills 200] [--readers 2] [--out r.json]
    python benchmarks/stress_tables.py --cache [...]     # writers persist through auto's cache

CPU only. One table, ``v3.msgpack``, and a symlink to it, ``current.msgpack``: odd-numbered
writers write through the link, even-numbered ones name the file, so the test also covers
writers that name one table differently (they must share one lock). Each writer adds one new
entry per ``add_entries`` call and, once the call has returned, appends the entry's number to
its own commit log (fsynced). The parent SIGKILLs a random writer at a random moment (``--kills``
times, 20-200 ms apart, or ``--kill-gap-ms``) and restarts it; the restarted writer continues
after its last logged entry. Readers load the table in a loop, alternating the two names, and
count loads that fail.

At the end: **lost** = entries in a commit log but not in the table (must be 0); **corrupt reads**
= loads that raised (must be 0). An entry written but not yet logged when its writer died is
*unlogged*, not lost: the kill came between the write and the log. Temp files a killed writer
left behind (``.v3.msgpack.<pid>.<token>.tmp``) are counted; they are never read as tables.
``--smoke`` runs 2 writers and 6 kills (the CI check of this script).

``--cache``: each writer is a job of ``auto`` mode instead: it opens the table as its cache
(``tables.cache.open_cache``) once per start and, after each new decision, calls
``AutoCache.persist`` with all its decisions so far (as ``handle.persist()`` at a checkpoint
does); numbers are logged once a persist reported them written.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_tuning.core.errors import TableError  # noqa: E402
from megatron_tuning.core.key import Key  # noqa: E402
from megatron_tuning.tables.table import Entry, Table, add_entries, load_table, save_table  # noqa: E402

CONFIG = {"kwargs": {"BLOCK": 64}, "num_warps": 4, "num_stages": 3}


def _entry(writer: int, number: int) -> Entry:
    return Entry(
        arch="cpu", kernel=f"stress.writer:w{writer}", key=Key({"n": number}), config=CONFIG, how="hand"
    )


# -- children --------------------------------------------------------------------------------------
def run_cache_writer(path: str, writer: int, log: str, pause_s: float) -> None:
    """Like ``run_writer``, through ``AutoCache.persist`` (a job persisting at every checkpoint)."""
    from megatron_tuning.core.decisions import Decision
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.tables.cache import open_cache

    done = _logged(log)
    number = done[-1] + 1 if done else 0
    cache = open_cache(TuningPolicy(mode="auto", cache=path, use_shipped_tables=False), "cpu")
    assert cache is not None and cache.writable, f"writer {writer}: the cache {path} did not open"
    decisions, unlogged = [], []
    with open(log, "a", encoding="ascii") as handle:
        while True:
            entry = _entry(writer, number)
            decisions.append(
                Decision(kernel=entry.kernel, key=entry.key, signature="BLOCK=64", source="tuned",
                         config=CONFIG, arch="cpu")
            )  # fmt: skip
            unlogged.append(number)
            if cache.persist(decisions):  # every pending decision is written in one atomic replace
                handle.write("".join(f"{n}\n" for n in unlogged))
                handle.flush()
                os.fsync(handle.fileno())
                unlogged.clear()
            number += 1
            if pause_s:
                time.sleep(random.uniform(0, pause_s))


def run_writer(path: str, writer: int, log: str, pause_s: float) -> None:
    """Add entries one by one forever; log each number once ``add_entries`` returned."""
    done = _logged(log)
    number = done[-1] + 1 if done else 0
    with open(log, "a", encoding="ascii") as handle:
        while True:
            add_entries(path, [_entry(writer, number)], timeout_s=120)
            handle.write(f"{number}\n")
            handle.flush()
            os.fsync(handle.fileno())
            number += 1
            if pause_s:
                time.sleep(random.uniform(0, pause_s))


def run_reader(paths: list[str], out: str) -> None:
    """Load the table in a loop until SIGTERM; then write ``{"reads", "corrupt", "errors"}``."""
    counts: dict[str, Any] = {"reads": 0, "corrupt": 0, "errors": []}
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    while not stop:
        for path in paths:
            try:
                load_table(path)
            except TableError as exc:
                counts["corrupt"] += 1
                if len(counts["errors"]) < 5:
                    counts["errors"].append(str(exc))
            counts["reads"] += 1
    Path(out).write_text(json.dumps(counts))


# -- parent ----------------------------------------------------------------------------------------
def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, __file__, *args], env=env, stderr=subprocess.PIPE)


def _logged(log: str) -> list[int]:
    return [int(n) for n in Path(log).read_text().split()] if os.path.exists(log) else []


def _wait_for_first_commits(logs: list[str], procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 120
    while not all(_logged(log) for log in logs):
        for w, proc in enumerate(procs):
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"writer {w} exited with {proc.returncode}:\n{err[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError("writers committed nothing within 120 s")
        time.sleep(0.05)


def stress(
    folder: Path,
    writers: int,
    kills: int,
    readers: int,
    seed: int,
    pause_s: float,
    cache: bool = False,
    gap_s: tuple[float, float] = (0.02, 0.2),
) -> dict[str, Any]:
    rng = random.Random(seed)
    real, link = folder / "v3.msgpack", folder / "current.msgpack"
    save_table(Table(), real)
    link.symlink_to(real.name)
    paths = [str(real if w % 2 == 0 else link) for w in range(writers)]
    logs = [str(folder / f"writer{w}.log") for w in range(writers)]

    def start_writer(w: int) -> subprocess.Popen[bytes]:
        return _spawn(["--_cache-writer" if cache else "--_writer", paths[w], str(w), logs[w], str(pause_s)])

    procs = [start_writer(w) for w in range(writers)]
    reader_outs = [str(folder / f"reader{r}.json") for r in range(readers)]
    reader_procs = [_spawn(["--_reader", str(real), str(link), out]) for out in reader_outs]
    start = time.monotonic()
    _wait_for_first_commits(logs, procs)  # a writer killed while importing would test nothing
    for _ in range(kills):
        time.sleep(rng.uniform(*gap_s))
        w = rng.randrange(writers)
        if procs[w].poll() is not None:  # a writer that died by itself is a failure of the test
            err = procs[w].stderr.read().decode() if procs[w].stderr else ""
            raise RuntimeError(f"writer {w} exited with {procs[w].returncode}:\n{err[-3000:]}")
        procs[w].send_signal(signal.SIGKILL)
        procs[w].wait()
        procs[w] = start_writer(w)
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    for proc in reader_procs:
        proc.send_signal(signal.SIGTERM)
    for proc in reader_procs:
        proc.wait(timeout=60)
    elapsed = time.monotonic() - start

    table = load_table(real)
    logged = {(w, n) for w in range(writers) for n in _logged(logs[w])}
    present = {
        (int(e.kernel.rsplit(":w", 1)[1]), e.key.values[0])
        for e in table.values()
        if e.kernel.startswith("stress.writer:")
    }
    reads = [json.loads(Path(out).read_text()) for out in reader_outs]
    return {
        "through": "AutoCache.persist" if cache else "add_entries",
        "kill_gap_ms": [gap_s[0] * 1000, gap_s[1] * 1000],
        "writers": writers,
        "writers_via_symlink": sum(1 for w in range(writers) if w % 2),
        "kills": kills,
        "readers": readers,
        "seconds": round(elapsed, 1),
        "entries_committed": len(logged),
        "entries_in_table": len(table),
        "entries_lost": len(logged - present),
        "entries_unlogged": len(present - logged),
        "reads": sum(r["reads"] for r in reads),
        "corrupt_reads": sum(r["corrupt"] for r in reads),
        "read_errors": [e for r in reads for e in r["errors"]],
        "orphaned_temp_files": len(list(folder.glob(".v3.msgpack.*.tmp"))),
        "seed": seed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--writers", type=int, default=3)
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kill-gap-ms",
        type=float,
        nargs=2,
        default=(20.0, 200.0),
        metavar=("MIN", "MAX"),
        help="random gap between kills (default 20 200); longer gaps let restarted writers commit",
    )
    parser.add_argument("--pause-ms", type=float, default=0.0, help="random pause after each commit")
    parser.add_argument("--dir", default=None, help="work folder (default: a temp folder, removed)")
    parser.add_argument("--smoke", action="store_true", help="2 writers, 6 kills: the CI check")
    parser.add_argument("--out", default=None, help="write the JSON results here")
    parser.add_argument("--cache", action="store_true", help="writers persist through auto's cache")
    parser.add_argument("--_writer", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--_cache-writer", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--_reader", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._writer or args._cache_writer:
        path, writer, log, pause = args._writer or args._cache_writer
        (run_cache_writer if args._cache_writer else run_writer)(path, int(writer), log, float(pause))
        return 0
    if args._reader:
        run_reader(args._reader[:2], args._reader[2])
        return 0
    writers, kills, readers = (2, 6, 1) if args.smoke else (args.writers, args.kills, args.readers)
    with tempfile.TemporaryDirectory(prefix="stress_tables_") as scratch:
        folder = Path(args.dir or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        gap = (args.kill_gap_ms[0] / 1000, args.kill_gap_ms[1] / 1000)
        result = stress(folder, writers, kills, readers, args.seed, args.pause_ms / 1000, args.cache, gap)
    result["command"] = " ".join(["benchmarks/stress_tables.py", *sys.argv[1:]])
    for name, value in result.items():
        print(f"{name:22} {value}")
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": _environment(), **result}, indent=1) + "\n")
    return 0 if result["entries_lost"] == 0 and result["corrupt_reads"] == 0 else 1


def _environment() -> dict[str, Any]:
    import platform

    return {
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()),
    }


if __name__ == "__main__":
    sys.exit(main())
