"""The table commands: ``show``, ``export``, ``import``, ``diff``, ``merge``, ``cache``.

They need msgpack only (never torch). Human output escapes every field read from a file
(``core.errors.printable``); ``--json`` output is exact.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
from collections.abc import Iterable
from typing import Any

from ..core.errors import MegatronTuningError, printable
from ..core.identity import config_signature
from ..core.policy import parse_int
from ..tables.entry import entry_order
from . import EXIT_FOUND, EXIT_OK, EXIT_USAGE, write_utf8


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
        raise MegatronTuningError("--json takes one TABLE (run it once per table)")
    for index, path in enumerate(args.tables):
        table = load_table(path, max_bytes=args.max_size)
        entries = table.entries()
        chosen = [e for e in entries if args.arch in (None, e.arch) and kernel_matches(e.kernel, args.kernel)]
        if args.json:
            write_utf8(Table(chosen, library_version=table.library_version, meta=table.meta).to_json())
            continue
        if index:
            print()
        meta = "".join(f", {k}={v}" for k, v in sorted(table.meta.items()))
        header = f"# {path}: {len(chosen)} of {len(table)} entries (library {table.library_version}{meta})"
        print(printable(header))
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
        help="a review view for pull requests: configs, how each was chosen, and the source hash and config "
        "list digest (what content matching needs), without versions/timing/votes/notes or the file's meta "
        "(e.g. kind=auto-cache), so one config change is a few-line diff; not lossless, keep the table "
        "itself as the source",
    )
    _add_max_size(p)


def run_export(args: argparse.Namespace) -> int:
    from ..tables.files import write_atomic
    from ..tables.review import review_view
    from ..tables.table import load_table

    if args.out != "-" and not args.out.endswith(".json"):  # the table commands read other names as msgpack
        fix = "name it .json (import converts JSON back to msgpack)"
        raise MegatronTuningError(f"{args.out} does not end in .json, but export writes the JSON view; {fix}")
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
    from ..tables.files import read_regular_file
    from ..tables.table import Table, save_table

    if args.out.endswith(".json"):  # save_table would write the JSON view again
        fix = "name it .msgpack (export writes JSON views)"
        raise MegatronTuningError(f"{args.out} ends in .json, but import writes the msgpack table; {fix}")
    save_table(Table.from_json(read_regular_file(args.json_file), path=args.json_file), args.out)
    return EXIT_OK


def _add_max_size(p: argparse.ArgumentParser) -> None:
    help = "read tables up to MIB MiB (default 64): for a genuine file over the limit"
    p.add_argument("--max-size", type=_mebibytes, metavar="MIB", help=help)


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
    if entry.numerics is not None:  # what the numerics audit found (docs/numerics.md)
        own = "deterministic" if entry.numerics.deterministic else "NOT deterministic on its own"
        facts.append(f"numerics class {entry.numerics.class_id}, {own}")
    note = f"  # {entry.note}" if entry.note else ""
    return printable(f"{config_signature(entry.config)}  ({', '.join(facts)}){note}")


def entry_lines(entries: Iterable[Any]) -> list[str]:
    """Entries under an ``arch  kernel`` heading, one indented line per key, numbers in order."""
    lines: list[str] = []
    heading = None
    for entry in sorted(entries, key=lambda e: entry_order(*e.ident)):
        if (entry.arch, entry.kernel) != heading:
            heading = (entry.arch, entry.kernel)
            lines.append(printable(f"{entry.arch}  {entry.kernel}"))
        lines.append(f"    [{printable(entry.key)}]  {describe_entry(entry)}")
    return lines


def add_diff(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Compare the entries of two tables. Exit 0 when they hold the same entries, 1 when they differ."
    )
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    help = "compare configs only, not timings, hashes, versions or notes"
    p.add_argument("--ignore-provenance", action="store_true", help=help)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run_diff(args: argparse.Namespace) -> int:
    from ..tables.review import diff_tables
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
        effect = item.get("numerics", "")
        effect = f"  ({effect.upper() if effect == 'changes numerics' else effect})" if effect else ""
        print(printable(f"~ {item['arch']}  {item['kernel']}  [{item['key']}]{effect}"))
        for name, values in item["fields"].items():
            before, after = ("-" if value is None else value for value in values)
            print(printable(f"    {name}: {before} -> {after}"))
    counts = {k: len(v) for k, v in changes.items()}
    summary = f"{counts['added']} added, {counts['removed']} removed, {counts['changed']} changed"
    print(summary if any(counts.values()) else "no differences")
    return EXIT_FOUND if any(counts.values()) else EXIT_OK


def add_merge(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Merge recordings (one per rank), tables, or decision logs of measuring runs (tune's per-process "
        "tuned-*.json or its --results, a record-mode decision log: one vote per process, its first decision "
        "per key, as tune counts them, stamped with the "
        "Triton the log says measured it, as tune stamps them; a log from before logs said so, with the "
        "installed one): one vote per input for each (arch, kernel, key); ties go "
        "to the lowest median time, then the lowest static cost, then the signature. Prints every entry "
        "where inputs disagreed. OUT is replaced; list it among INPUTS to keep its entries as one vote."
    )
    p.add_argument("out", metavar="OUT")
    help = "table files, folders of recordings (their *.msgpack), or decision logs (named one by one)"
    p.add_argument("inputs", nargs="+", metavar="INPUT", help=help)
    p.add_argument("--json", action="store_true", help="print the disagreement report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when any inputs disagreed")


def run_merge(args: argparse.Namespace) -> int:
    from ..tables.vote import vote_files

    result = vote_files(args.out, args.inputs)
    if args.json:
        print(json.dumps(result.to_json(), indent=1, sort_keys=True))
    else:
        merged = f"Merged {len(result.inputs)} input(s) into {len(result.table)} entries"
        print(f"{merged}; {len(result.disagreements)} with disagreement.")
        for item in result.disagreements:
            print(printable(f"{item.arch}  {item.kernel}  [{item.key}]  ({item.rule})"))
            for index, vote in enumerate(item.votes):
                timing = f", median {vote.median_ms:.4g} ms" if vote.median_ms is not None else ""
                who = ", ".join(vote.inputs) if len(vote.inputs) <= 8 else "..."
                arrow = "->" if index == 0 else "  "
                print(printable(f"  {arrow} {len(vote.inputs)} vote(s){timing}: {vote.signature}  [{who}]"))
        for arch, kernel, key, hashes in result.mixed_source_hashes:
            sources = ", ".join(h[:12] for h in hashes)
            warning = f"{arch} {kernel} [{key}] was recorded from different kernel sources: {sources}"
            print(printable(f"warning: {warning}"))
        print(f"Wrote {args.out}")
    return EXIT_FOUND if args.strict and result.disagreements else EXIT_OK


def add_cache(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Print the path of auto mode's cache table for an arch (MEGATRON_TUNING_CACHE, else "
        "<user cache dir>/megatron_tuning/<arch>/auto.msgpack) and its entry count. Review it with "
        "show/export/validate like any table."
    )
    p.add_argument(
        "--arch", type=_arch_name, help="the arch (default: this machine's; 'unknown' without a GPU)"
    )


def _arch_name(text: str) -> str:
    """An arch tag as the cache path uses it (``sm90``): one plain name, never a path."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an arch tag; give one such as sm90 or unknown")
    return text


def run_cache(args: argparse.Namespace) -> int:
    from ..core.identity import arch_tag
    from ..core.policy import ENV_CACHE, TuningPolicy
    from ..tables.cache import cache_path
    from ..tables.table import load_table

    # Only the cache setting: an unrelated bad MEGATRON_TUNING_* value is no reason to fail here.
    policy = TuningPolicy.from_env({ENV_CACHE: os.environ.get(ENV_CACHE, "")}, mode="auto")
    path = cache_path(policy, args.arch or arch_tag())
    if path is None:
        print("auto cache: off (MEGATRON_TUNING_CACHE=off)")
    elif os.path.isfile(path):
        print(f"{path}\t{len(load_table(path))} entries")
    elif os.path.lexists(path):  # what `auto` refuses at start-up ("running without a cache")
        print(f"{path}\t(not a file: auto runs without a cache; name a file in MEGATRON_TUNING_CACHE)")
        return EXIT_USAGE
    else:
        print(f"{path}\t(not written yet)")
    return EXIT_OK
