"""The table commands: ``show``, ``export``, ``import``, ``diff``, ``merge``, ``cache``, ``coverage``.

They need msgpack only (never torch). Human output escapes every field read from a file
(``core.warn.printable``); ``--json`` output is exact.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..core.decisions import Decision
from ..core.identity import config_signature
from ..core.policy import parse_int
from ..core.warn import printable
from . import EXIT_FOUND, EXIT_OK, EXIT_USAGE, write_utf8

# --------------------------------------------------------------------------- show, export, import


def add_show(p: argparse.ArgumentParser) -> None:
    p.description = "Print table entries grouped by arch and kernel: key, config, provenance."
    p.add_argument("tables", nargs="+", metavar="TABLE", help="table files (.msgpack, or .json views)")
    p.add_argument("--kernel", help="only kernels whose id contains this text (or matches this glob)")
    p.add_argument("--arch", help="only entries for this arch, e.g. sm90")
    p.add_argument(
        "--json", action="store_true", help="print the (filtered) table as its JSON view (one TABLE only)"
    )
    _add_max_size(p)


def run_show(args: argparse.Namespace) -> int:
    from ..tables.table import Table, load_table

    if args.json and len(args.tables) > 1:  # several JSON documents back to back are not JSON
        print("megatron-tuning show: --json takes one TABLE (run it once per table)", file=sys.stderr)
        return EXIT_USAGE
    for index, path in enumerate(args.tables):
        table = load_table(path, max_bytes=args.max_size)
        chosen = [
            e
            for e in table.entries()
            if args.arch in (None, e.arch) and kernel_matches(e.kernel, args.kernel)
        ]
        if args.json:
            write_utf8(Table(chosen, library_version=table.library_version, meta=table.meta).to_json())
            continue
        if index:
            print()
        meta = "".join(f", {k}={v}" for k, v in sorted(table.meta.items()))
        print(
            printable(
                f"# {path}: {len(chosen)} of {len(table)} entries (library {table.library_version}{meta})"
            )
        )
        for line in entry_lines(chosen):
            print(line)
    return EXIT_OK


def add_export(p: argparse.ArgumentParser) -> None:
    p.description = "Write the JSON view of a table (to stdout when OUT is omitted or '-'), as UTF-8."
    p.add_argument("table", metavar="TABLE")
    p.add_argument("out", nargs="?", default="-", metavar="OUT")
    p.add_argument(
        "--no-provenance",
        action="store_true",
        help="a review view for pull requests: configs only, without how/hashes/versions/timing/votes/notes "
        "(what `diff --ignore-provenance` ignores), so one config change is a few-line diff; not lossless, "
        "keep the table itself as the source",
    )
    _add_max_size(p)


def run_export(args: argparse.Namespace) -> int:
    from ..tables.files import write_atomic
    from ..tables.merge import review_view
    from ..tables.table import load_table

    if args.out.endswith(".msgpack"):  # load_table reads a .msgpack name as msgpack
        print(
            f"megatron-tuning export: {args.out} ends in .msgpack, but export writes the JSON view; name it "
            ".json (import converts JSON back to msgpack)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    table = load_table(args.table, max_bytes=args.max_size)
    text = (review_view(table) if args.no_provenance else table).to_json()
    if args.out == "-":
        write_utf8(text)
    else:
        write_atomic(args.out, text.encode("utf-8"))
    return EXIT_OK


def add_import(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Read a JSON view (as export writes it) and write the canonical msgpack table: export then "
        "import gives back the same bytes."
    )
    p.add_argument("json_file", metavar="JSON")
    p.add_argument("out", metavar="OUT")


def run_import(args: argparse.Namespace) -> int:
    from ..tables.files import read_table_bytes
    from ..tables.table import Table, save_table

    if args.out.endswith(".json"):  # save_table would write the JSON view again
        print(
            f"megatron-tuning import: {args.out} ends in .json, but import writes the msgpack table; name "
            "it .msgpack (export writes JSON views)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    save_table(Table.from_json(read_table_bytes(args.json_file), path=args.json_file), args.out)
    return EXIT_OK


def _add_max_size(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-size",
        type=_mebibytes,
        default=None,
        metavar="MIB",
        help="read tables up to MIB MiB (default 64): for a genuine file over the limit",
    )


def _mebibytes(text: str) -> int:
    value = parse_int(text)
    if value is None or not 1 <= value <= 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB from 1 to 65536")
    return value * 2**20


def kernel_matches(kernel: str, pattern: str | None) -> bool:
    """``pattern`` as a glob when it has glob characters, else as a substring."""
    if not pattern:
        return True
    return fnmatch.fnmatchcase(kernel, pattern) if any(ch in pattern for ch in "*?[") else pattern in kernel


# A number in key text: after "=", a bracket, a space, a comma or at the start (not "float16").
_NUMBER = re.compile(r"(?:(?<=[=\[(,\s])|^)(-?\d+(?:\.\d+)?)")


def natural_key(text: str) -> tuple[Any, ...]:
    """Sort key ordering the numbers in ``text`` as numbers (``M=32`` before ``M=100``)."""
    parts: list[Any] = _NUMBER.split(text)
    for i in range(1, len(parts), 2):
        parts[i] = float(parts[i]) if "." in parts[i] else int(parts[i])
    return tuple(parts)


def describe_entry(entry: Any) -> str:
    """The config signature, then provenance in parentheses."""
    facts, timing = [entry.how], entry.timing
    if timing is not None and timing.median_ms is not None:
        spread = f" ±{timing.spread_ms / 2:.2g}" if timing.spread_ms is not None else ""
        facts.append(f"median {timing.median_ms:.4g} ms{spread}")
        if timing.runner_up_ms is not None and timing.median_ms > 0:
            # The winner is not always the fastest (a tie broken by static cost): say "faster".
            delta = 100 * (timing.runner_up_ms / timing.median_ms - 1)
            facts.append(f"runner-up {-delta:.1f}% faster" if delta < 0 else f"runner-up +{delta:.1f}%")
    if timing is not None and timing.candidates is not None:
        facts.append(f"{timing.candidates} candidates")
    if entry.votes is not None:
        facts.append(f"{entry.votes[0]}/{entry.votes[1]} votes")
    if entry.source_hash:
        facts.append(f"src {entry.source_hash[:12]}")
    if entry.triton_version:
        facts.append(f"triton {entry.triton_version}")
    note = f"  # {entry.note}" if entry.note else ""
    return printable(f"{config_signature(entry.config)}  ({', '.join(facts)}){note}")


def entry_lines(entries: Iterable[Any]) -> list[str]:
    """Entries under an ``arch  kernel`` heading, one indented line per key, numbers in order."""
    lines: list[str] = []
    heading = None
    for entry in sorted(entries, key=lambda e: (e.arch, e.kernel, natural_key(e.key), e.key)):
        if (entry.arch, entry.kernel) != heading:
            heading = (entry.arch, entry.kernel)
            lines.append(printable(f"{entry.arch}  {entry.kernel}"))
        lines.append(f"    [{printable(entry.key)}]  {describe_entry(entry)}")
    return lines


# --------------------------------------------------------------------------- diff, merge, cache


def add_diff(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Compare the entries of two tables. Exit 0 when they hold the same entries, 1 when they differ."
    )
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument(
        "--ignore-provenance",
        action="store_true",
        help="compare configs only, not timings, hashes, versions or notes",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run_diff(args: argparse.Namespace) -> int:
    from ..tables.merge import diff_tables
    from ..tables.table import load_table

    changes = diff_tables(load_table(args.a), load_table(args.b), ignore_provenance=args.ignore_provenance)
    if args.json:
        print(json.dumps(changes, indent=1, sort_keys=True))
        return EXIT_FOUND if any(changes.values()) else EXIT_OK
    print(printable(f"--- {args.a}"))
    print(printable(f"+++ {args.b}"))
    for mark, kind in (("-", "removed"), ("+", "added")):
        for item in changes[kind]:
            print(printable(f"{mark} {item['arch']}  {item['kernel']}  [{item['key']}]  {item['config']}"))
    for item in changes["changed"]:
        print(printable(f"~ {item['arch']}  {item['kernel']}  [{item['key']}]"))
        for name, (before, after) in item["fields"].items():
            print(
                printable(
                    f"    {name}: {'-' if before is None else before} -> {'-' if after is None else after}"
                )
            )
    counts = {k: len(v) for k, v in changes.items()}
    print(
        f"{counts['added']} added, {counts['removed']} removed, {counts['changed']} changed"
        if any(counts.values())
        else "no differences"
    )
    return EXIT_FOUND if any(counts.values()) else EXIT_OK


def add_merge(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Merge recordings (one per rank) or tables: one vote per input for each (arch, kernel, key); ties go "
        "to the lowest median time, then the lowest static cost, then the signature. Prints every entry "
        "where inputs disagreed. OUT is replaced; list it among INPUTS to keep its entries as one vote."
    )
    p.add_argument("out", metavar="OUT")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="table files or folders of recordings")
    p.add_argument("--json", action="store_true", help="print the disagreement report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when any inputs disagreed")


def run_merge(args: argparse.Namespace) -> int:
    from ..tables.merge import merge_files

    result = merge_files(args.out, args.inputs)
    if args.json:
        print(json.dumps(result.to_json(), indent=1, sort_keys=True))
    else:
        print(
            f"Merged {len(result.inputs)} input(s) into {len(result.table)} entries; "
            f"{len(result.disagreements)} with disagreement."
        )
        for item in result.disagreements:
            print(printable(f"{item.arch}  {item.kernel}  [{item.key}]  ({item.rule})"))
            for index, vote in enumerate(item.votes):
                timing = f", median {vote.median_ms:.4g} ms" if vote.median_ms is not None else ""
                who = ", ".join(vote.inputs) if len(vote.inputs) <= 8 else "..."
                print(
                    printable(
                        f"  {'->' if index == 0 else '  '} {len(vote.inputs)} vote(s){timing}: "
                        f"{vote.signature}  [{who}]"
                    )
                )
        for arch, kernel, key, hashes in result.mixed_source_hashes:
            sources = ", ".join(h[:12] for h in hashes)
            print(
                printable(
                    f"warning: {arch} {kernel} [{key}] was recorded from different kernel sources: {sources}"
                )
            )
        print(f"Wrote {args.out}")
    return EXIT_FOUND if args.strict and result.disagreements else EXIT_OK


def add_cache(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Print the path of auto mode's cache table for an arch (MEGATRON_TUNING_CACHE, else "
        "<user cache dir>/megatron_tuning/<arch>/auto.msgpack) and its entry count. Review it with "
        "show/export/validate like any table."
    )
    p.add_argument("--arch", help="the arch (default: this machine's; 'unknown' without a GPU)")


def run_cache(args: argparse.Namespace) -> int:
    from ..core.identity import arch_tag
    from ..core.policy import TuningPolicy
    from ..tables.cache import cache_path, read_cache_file

    # Only the cache setting: an unrelated bad MEGATRON_TUNING_* value is no reason to fail here.
    path = cache_path(TuningPolicy(mode="auto"), args.arch or arch_tag())
    if path is None:
        print("auto cache: off (MEGATRON_TUNING_CACHE=off)")
    elif os.path.isfile(path):
        print(f"{path}\t{len(read_cache_file(path)[1])} entries")
    else:
        print(f"{path}\t(not written yet)")
    return EXIT_OK


# --------------------------------------------------------------------------- coverage

STATUS = {"table": "hit", "cheapest": "fallback"}  # other sources keep their own name
STATUS_ORDER = (
    "hit",
    "override",
    "single",
    "tuned",
    "adopted",
    "recorded",
    "nearest",
    "fallback",
    "chaos",
    "out_of_scope",
    "other",
)
PINNED_WITHOUT_TABLE = ("override", "single")
"""What ``--require-table`` accepts besides a hit: an explicit override, or a single live config."""


@dataclass(frozen=True, slots=True)
class Cell:
    """What one rank did for one (kernel, key)."""

    status: str
    signature: str
    origin: str | None
    entry_kernel: str | None = None
    """Set when the table entry was matched by content: the kernel id it was tuned under."""
    nearest_key: str | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"status": self.status, "signature": self.signature, "origin": self.origin}
        if self.entry_kernel is not None:
            data.update(matched_by="content", entry_kernel=self.entry_kernel)
        if self.nearest_key is not None:
            data["nearest_key"] = self.nearest_key
        return data


@dataclass(slots=True)
class Row:
    kernel: str
    key: str
    cells: dict[str, Cell] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return len({c.signature for c in self.cells.values() if c.status != "out_of_scope"}) > 1


def coverage_of(logs: list[tuple[str, list[Decision]]]) -> tuple[list[str], list[Row]]:
    """Rank labels and one row per (kernel, key). A rank claimed by two files (separate
    single-process runs, all rank 0) is labelled with the file name too."""
    per_file_ranks = Counter(r for _, ds in logs for r in {d.rank for d in ds})
    rows: dict[tuple[str, str], Row] = {}
    labels: list[str] = []
    for path, decisions in logs:
        for d in decisions:
            label = str(d.rank) + (f"@{os.path.basename(path)}" if per_file_ranks[d.rank] > 1 else "")
            if label not in labels:
                labels.append(label)
            row = rows.setdefault((d.kernel, d.key), Row(d.kernel, d.key))
            status = STATUS.get(d.source, d.source if d.source in STATUS_ORDER else "other")
            twin = d.entry_kernel if d.matched_by == "content" else None
            # The first decision per (kernel, key) in a process is the one that launched.
            row.cells.setdefault(label, Cell(status, d.signature, d.origin, twin, d.nearest_key))
    labels.sort(key=lambda label: (parse_int(label.split("@", 1)[0]) or 0, label))
    for row in rows.values():
        row.cells = {label: row.cells[label] for label in labels if label in row.cells}
    return labels, [rows[k] for k in sorted(rows)]


def add_coverage(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Summarise decision logs (one per rank). Exit 1 when ranks launched different configs for "
        "the same kernel and key."
    )
    p.add_argument("logs", nargs="+", metavar="DECISION_FILE")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--fail-on-fallback",
        action="store_true",
        help="also exit 1 when any launch fell back to the cheapest config",
    )
    p.add_argument(
        "--require-table",
        action="store_true",
        help="also exit 1 unless every in-scope launch was its own table entry (a nearest-shape entry, the "
        "cheapest fallback or an auto-tuned config fails; an override or a single-config kernel passes), "
        "listing the keys that are missing from the table",
    )


def run_coverage(args: argparse.Namespace) -> int:
    from ..tables.merge import read_decisions

    labels, rows = coverage_of([(os.fspath(p), read_decisions(p)) for p in args.logs])
    counts = Counter(cell.status for row in rows for cell in row.cells.values())
    diverged = [row for row in rows if row.diverged]
    if args.json:
        entries = [
            {
                "kernel": r.kernel,
                "key": r.key,
                "diverged": r.diverged,
                "ranks": {k: c.to_json() for k, c in r.cells.items()},
            }
            for r in rows
        ]
        doc = {
            "files": list(args.logs),
            "ranks": labels,
            "counts": dict(sorted(counts.items())),
            "entries": entries,
        }
        print(json.dumps(doc, indent=1, sort_keys=True))
    else:
        lines = [f"Coverage of {len(args.logs)} decision log(s), ranks: {', '.join(labels) or '-'}"]
        lines += [f"{row.kernel}  [{row.key}]  {_describe(row, labels)}" for row in rows]
        summary = ", ".join(f"{s} {counts[s]}" for s in STATUS_ORDER if counts.get(s))
        lines.append(f"Summary (kernel/key x rank): {summary or 'no decisions'}")
        for row in diverged:
            lines.append(f"DIVERGED: {row.kernel} [{row.key}]")
            lines += [
                f"  rank {label}: {cell.signature or '-'} ({cell.status})"
                for label, cell in row.cells.items()
            ]
        print("\n".join(map(printable, lines)))
    found = bool(diverged) or (args.fail_on_fallback and counts.get("fallback", 0) > 0)
    if args.require_table:
        allowed = ("hit", "out_of_scope", *PINNED_WITHOUT_TABLE)
        for row in [r for r in rows if any(c.status not in allowed for c in r.cells.values())]:
            statuses = ", ".join(sorted({c.status for c in row.cells.values()}))
            print(printable(f"not in the table: {row.kernel}  [{row.key}]  ({statuses})"), file=sys.stderr)
            found = True
    return EXIT_FOUND if found else EXIT_OK


def _describe(row: Row, labels: list[str]) -> str:
    by_status: dict[str, list[str]] = {}
    for label in labels:
        cell = row.cells.get(label)
        by_status.setdefault(cell.status if cell else "absent", []).append(label)
    parts = [
        f"{s}: {'all ranks' if len(ls) == len(labels) else 'rank(s) ' + ','.join(ls)}"
        for s, ls in by_status.items()
    ]
    origins = sorted({c.origin for c in row.cells.values() if c.origin})
    twins = sorted({c.entry_kernel for c in row.cells.values() if c.entry_kernel})
    neighbours = sorted({c.nearest_key for c in row.cells.values() if c.nearest_key})
    suffix = f"  from {', '.join(origins)}" if origins else ""
    if twins:
        suffix += f"  (matched by content: tuned as {', '.join(twins)})"
    if neighbours:  # which neighbour's config ran: what a reviewer checks before trusting it
        suffix += "  using the entry for " + "; ".join(f"[{k}]" for k in neighbours)
    return "; ".join(parts) + suffix
