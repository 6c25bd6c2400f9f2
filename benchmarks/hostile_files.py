"""What hostile table files cost the loader: peak memory and time until the one ``TableError``.

    python benchmarks/hostile_files.py [--mib 20] [--out r.json]

CPU only. Writes files built to make a decoder allocate far more than their size (arrays of empty
arrays or maps, negative integers, one-character strings; whole files, single columns of an
otherwise valid table, short lists nested inside one header value or one config), loads each with
``load_table`` in a fresh process, and prints its peak RSS growth (``ru_maxrss``) per file byte. A genuine
100k-entry table is measured for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FORMAT = "megatron_tuning.table"
BASE = {
    "strings": ["hand", "m:k", "sm90"],
    "configs": [{"kwargs": {}, "num_stages": 3, "num_warps": 4}],
    "arch": [2],
    "config": [0],
    "how": [0],
    "kernel": [1],
    "key": ["k"],
}


def _array(n: int, element: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + element * n


def _column(name: str, raw: bytes) -> bytes:
    marker = "\x00" * 7
    packed = msgpack.packb([FORMAT, 1, {"library_version": "1"}, {**BASE, name: marker}], use_bin_type=True)
    return packed.replace(msgpack.packb(marker), raw)


def _nested_lists(widths: list[int], leaf: bytes = b"\x90") -> bytes:
    node = leaf  # lists of widths[0] lists of widths[1] lists ... of empty lists (or ``leaf``)
    for width in reversed(widths):
        node = b"\xdc" + width.to_bytes(2, "big") + node * width
    return node


def _header_value(raw: bytes) -> bytes:
    marker = "\x00" * 7
    packed = msgpack.packb([FORMAT, 1, {"library_version": marker}, BASE], use_bin_type=True)
    return packed.replace(msgpack.packb(marker), raw)


def make_files(folder: Path, size: int) -> list[Path]:
    files: dict[str, bytes | str] = {
        "array_of_empty_arrays.msgpack": _array(size, b"\x90"),
        "key_column_of_empty_arrays.msgpack": _column("key", _array(size, b"\x90")),
        "key_column_of_empty_maps.msgpack": _column("key", _array(size, b"\x80")),
        "arch_column_of_negative_ints.msgpack": _column("arch", _array(size, b"\xe0")),
        "configs_column_of_nested_maps.msgpack": _column(
            "configs", b"\x91\x81\xa6kwargs" + _nested_lists([128, 128, (size >> 14) - 1], b"\x80")
        ),
        # Short lists nested inside one value: refused at the first list, where a single value belongs.
        "header_value_of_nested_lists.msgpack": _header_value(
            _nested_lists([128, 128, 128, (size >> 21) - 3])
        ),
        "array_of_empty_arrays.json": "[" + ",".join(["[]"] * (size // 3)) + "]",
        "array_of_negative_ints.json": "[" + ",".join(["-6"] * (size // 3)) + "]",
        "array_of_one_char_strings.json": "[" + ",".join(['"\u0101"'] * (size // 5)) + "]",
    }
    paths = []
    for name, data in files.items():
        path = folder / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
        paths.append(path)
    from bench_table_load import make_table

    from megatron_tuning.tables.table import save_table

    genuine = folder / "genuine_100k_entries.msgpack"
    save_table(make_table(100_000), genuine)
    return paths + [genuine]


def _peak_rss() -> int:
    """This process's peak RSS in bytes: ``VmHWM`` (reset at exec, unlike ``ru_maxrss``, which a
    child inherits from its parent on Linux), else ``ru_maxrss``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(path: str) -> dict[str, Any]:
    from megatron_tuning.tables.table import load_table

    before = _peak_rss()
    start = time.perf_counter()
    try:
        outcome = f"loaded {len(load_table(path))} entries"
    except Exception as exc:  # the one TableError, or whatever a regression raises
        outcome = f"{type(exc).__name__}: {str(exc)[len(path) + 16 :][:90]}"
    seconds = time.perf_counter() - start
    grown = _peak_rss() - before
    size = os.path.getsize(path)
    return {
        "file": os.path.basename(path),
        "bytes": size,
        "rss_growth": grown,
        "seconds": seconds,
        "outcome": outcome,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=20, help="size of each hostile file")
    parser.add_argument("--out", default=None)
    parser.add_argument("--_measure", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._measure:
        print(json.dumps(measure(args._measure)))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    rows = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory(prefix="hostile_files_") as scratch:
        for path in make_files(Path(scratch), args.mib << 20):
            done = subprocess.run(
                [sys.executable, __file__, "--_measure", str(path)], env=env, capture_output=True, text=True
            )
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for row in rows:
        ratio = row["rss_growth"] / row["bytes"]
        print(
            f"{row['file']:38} {row['bytes'] / 2**20:6.1f} MiB  +{row['rss_growth'] / 2**20:6.0f} MiB RSS "
            f"({ratio:4.1f}x)  {row['seconds']:5.2f} s  {row['outcome']}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
