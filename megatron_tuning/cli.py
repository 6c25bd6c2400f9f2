"""``python -m megatron_tuning`` / ``megatron-tuning``: review, merge and check tuning tables.

Exit codes scripts can rely on: 0 ok; 1 differences or problems found (``diff``,
``validate``, and ``coverage`` when ranks diverged); 2 usage error or bad input (an
unreadable table or decision log: one line on stderr, no traceback).

Subcommands owned by other modules (``selftest``, ``tune``, ``report``, ``run``, ``enable``,
``disable``) are wired in
lazily: only if their module exists, and it is imported only when that command runs,
so ``show``/``diff`` never pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .core.errors import MegatronTuningError
from .core.warn import printable

EXIT_OK = 0
EXIT_FOUND = 1
EXIT_USAGE = 2

# name -> (module, add_arguments function, run function, help)
_HOOKS: dict[str, tuple[str, str, str, str]] = {
    "selftest": (
        "megatron_tuning.commands.selftest",
        "add_arguments",
        "run",
        "check this install end to end (interception, agreement, chaos control)",
    ),
    "tune": (
        "megatron_tuning.commands.tune",
        "add_arguments",
        "run",
        "noise-aware tuning of kernels on a GPU, writing a table",
    ),
    "report": (
        "megatron_tuning.commands.report",
        "add_arguments",
        "run",
        "report on a tuning run (timings, noise, plots)",
    ),
    "run": (
        "megatron_tuning.commands.run",
        "add_arguments",
        "run",
        "run a command with its autotuned kernels pinned, without editing it",
    ),
    "enable": (
        "megatron_tuning.commands.enable",
        "add_arguments",
        "run_enable",
        "pin every process of this Python environment that sets MEGATRON_TUNING_MODE",
    ),
    "disable": (
        "megatron_tuning.commands.enable",
        "add_arguments",
        "run_disable",
        "undo `enable`",
    ),
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser. ``argv`` tells which hook command (if any) to import for real."""
    parser = argparse.ArgumentParser(
        prog="megatron-tuning",
        description="Review, merge and check megatron_tuning tables (deterministic Triton autotuning).",
        epilog="Exit codes: 0 ok, 1 differences/problems found, 2 usage error or bad input.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "show",
        help="print the entries of tables in readable form",
        description="Print table entries grouped by arch and kernel: key, config, provenance.",
    )
    p.add_argument("tables", nargs="+", metavar="TABLE", help="table files (.msgpack, or .json views)")
    p.add_argument("--kernel", help="only kernels whose id contains this text (or matches this glob)")
    p.add_argument("--arch", help="only entries for this arch, e.g. sm90")
    p.add_argument(
        "--json", action="store_true", help="print the (filtered) table as its JSON view (one TABLE only)"
    )
    _add_max_size(p)
    p.set_defaults(handler=_cmd_show)

    p = sub.add_parser(
        "export",
        help="convert a msgpack table to its lossless JSON view",
        description="Write the JSON view of a table (to stdout when OUT is omitted or '-'). "
        "The view is UTF-8 whatever the terminal's encoding.",
    )
    p.add_argument("table", metavar="TABLE")
    p.add_argument("out", nargs="?", default="-", metavar="OUT")
    p.add_argument(
        "--no-provenance",
        action="store_true",
        help="a review view for pull requests: configs only, without how/hashes/versions/timing/"
        "votes/notes (what `diff --ignore-provenance` ignores), so one config change is a few-line "
        "diff; not lossless, keep the table itself as the source",
    )
    _add_max_size(p)
    p.set_defaults(handler=_cmd_export)

    p = sub.add_parser(
        "import",
        help="convert a JSON view back to a msgpack table",
        description="Read a JSON view (as written by export) and write the canonical msgpack table. "
        "export then import gives back the same bytes.",
    )
    p.add_argument("json_file", metavar="JSON")
    p.add_argument("out", metavar="OUT")
    p.set_defaults(handler=_cmd_import)

    p = sub.add_parser(
        "diff",
        help="added, removed and changed entries between two tables",
        description="Compare the entries of two tables. Exit 0 when they hold the same entries, "
        "1 when they differ (like diff(1)).",
    )
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument(
        "--ignore-provenance",
        action="store_true",
        help="compare configs only, not timings, hashes, versions or notes",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_cmd_diff)

    p = sub.add_parser(
        "merge",
        help="majority-vote recordings/tables into one table",
        description="Merge recordings (one per rank) or tables: one vote per input for each "
        "(arch, kernel, key); ties go to the lowest median time, then the lowest static "
        "cost, then the signature. Prints every entry where inputs disagreed. "
        "OUT is replaced; list it among INPUTS to keep its entries as one vote.",
    )
    p.add_argument("out", metavar="OUT")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="table files or folders of recordings")
    p.add_argument("--json", action="store_true", help="print the disagreement report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when any inputs disagreed")
    p.set_defaults(handler=_cmd_merge)

    p = sub.add_parser(
        "validate",
        help="check tables against this machine, Triton and kernel sources",
        description="Check every entry: its arch is this machine's (or --arch), it was tuned with "
        "the installed Triton, and, for kernels in modules given with --import, the "
        "kernel exists, its source hash matches and the config is one it declares. "
        "Exit 1 when a problem is found.",
    )
    p.add_argument("tables", nargs="+", metavar="TABLE")
    p.add_argument("--arch", help="the arch to check against (default: this machine's; skipped when unknown)")
    p.add_argument("--triton-version", help="the Triton version to check against (default: installed)")
    p.add_argument(
        "--import",
        dest="modules",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE and check its autotuned kernels' source hashes (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_cmd_validate)

    p = sub.add_parser(
        "coverage",
        help="per kernel and key: table hit / fallback / out of scope, per rank",
        description="Summarise decision logs (decisions.write_decisions, one per rank). Exit 1 when "
        "ranks launched different configs for the same kernel and key.",
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
        help="also exit 1 unless every in-scope launch was its own table entry (a nearest-shape "
        "entry, the cheapest fallback or an auto-tuned config fails; an override or a single-config "
        "kernel passes), listing the keys that are missing from the table",
    )
    p.set_defaults(handler=_cmd_coverage)

    p = sub.add_parser(
        "cache",
        help="where auto mode's cache table is, and how many entries it holds",
        description="Print the path of auto mode's cache table for an arch (the policy's cache from "
        "MEGATRON_TUNING_CACHE, else <user cache dir>/megatron_tuning/<arch>/auto.msgpack) and its "
        "entry count. Review it with show/export/validate like any table.",
    )
    p.add_argument("--arch", help="the arch (default: this machine's; 'unknown' without a GPU)")
    p.set_defaults(handler=_cmd_cache)

    _add_hooks(sub, argv)
    return parser


def _add_max_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-size",
        type=_mebibytes,
        default=None,
        metavar="MIB",
        help="read tables up to MIB MiB (default 64): for a genuine file over the limit, e.g. an "
        "auto cache an older version let grow",
    )


def _mebibytes(text: str) -> int:
    from .core.policy import parse_int

    value = parse_int(text)
    if value is None or not 1 <= value <= 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB from 1 to 65536")
    return value * 2**20


def _add_hooks(sub: Any, argv: Sequence[str] | None) -> None:
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((w for w in words if not w.startswith("-")), None)
    for name, (module_name, add_name, run_name, help_text) in _HOOKS.items():
        if not _module_exists(module_name):
            continue
        if name != command:
            # A stub keeps ``--help`` cheap; the real options appear with ``COMMAND --help``.
            stub = sub.add_parser(name, help=help_text, add_help=False)
            stub.set_defaults(handler=None)
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
            add = getattr(module, add_name)
            run = getattr(module, run_name)
        except (ImportError, AttributeError) as exc:
            p.set_defaults(handler=_unavailable(name, f"{module_name}.{add_name}/{run_name}: {exc}"))
            continue
        add(p)
        p.set_defaults(handler=run)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _tolerate_unencodable_output() -> None:
    # Keys, notes and paths may hold any Unicode; a terminal (or PYTHONIOENCODING) that
    # cannot show a character must not turn `show` into a traceback. JSON views bypass
    # this and are written as UTF-8 bytes (``_write_utf8``).
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # a closed or exotic stream: leave it alone
                pass


def _write_utf8(text: str) -> None:
    """Write a JSON view to stdout as UTF-8 (its defined encoding), as a file would hold it."""
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:
        sys.stdout.write(text)
        return
    sys.stdout.flush()
    buffer.write(text.encode("utf-8"))
    buffer.flush()


def _unavailable(name: str, why: str) -> Callable[[argparse.Namespace], int]:
    def handler(_: argparse.Namespace) -> int:
        print(f"megatron-tuning {name}: not available in this install ({why})", file=sys.stderr)
        return EXIT_USAGE

    return handler


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m megatron_tuning`` and the ``megatron-tuning`` script."""
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    _tolerate_unencodable_output()
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.handler is None:  # a stub that parse_args accepted without importing its module
        parser.error(f"internal: command {args.command!r} was not wired")
    try:
        return int(args.handler(args))
    except MegatronTuningError as exc:
        # Messages quote file contents (kernel ids, keys): escaped like every human output.
        message = f"megatron-tuning {args.command}: {exc}"
        print("\n".join(map(printable, message.split("\n"))), file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `megatron-tuning show ... | head`: not an error
        # Point stdout at devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as exc:  # e.g. an output path that cannot be written: bad input, not a crash
        print(f"megatron-tuning {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


# -- command implementations -------------------------------------------------------
# Imported inside the handlers: tables need msgpack only; validate alone needs torch/triton.


def _cmd_show(args: argparse.Namespace) -> int:
    from .tables.review import entry_lines, kernel_matches
    from .tables.table import Table, load_table

    if args.json and len(args.tables) > 1:
        # Several JSON documents back to back are not JSON; a script wants one per call.
        print("megatron-tuning show: --json takes one TABLE (run it once per table)", file=sys.stderr)
        return EXIT_USAGE
    for index, path in enumerate(args.tables):
        table = load_table(path, max_bytes=args.max_size)
        chosen = [
            e
            for e in table.entries()
            if (args.arch is None or e.arch == args.arch) and kernel_matches(e.kernel, args.kernel)
        ]
        if args.json:
            view = Table(chosen, library_version=table.library_version, meta=table.meta)
            _write_utf8(view.to_json())
            continue
        if index:
            print()
        meta = "".join(f", {k}={v}" for k, v in sorted(table.meta.items()))
        header = f"# {path}: {len(chosen)} of {len(table)} entries (library {table.library_version}{meta})"
        print(printable(header))
        for line in entry_lines(chosen):
            print(line)
    return EXIT_OK


def _cmd_export(args: argparse.Namespace) -> int:
    from .tables.files import write_atomic
    from .tables.table import load_table

    if args.out.endswith(".msgpack"):
        # load_table reads a .msgpack name as msgpack: JSON there would be unreadable.
        print(
            f"megatron-tuning export: {args.out} ends in .msgpack, but export writes the JSON "
            "view; name it .json (import converts JSON back to msgpack)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    table = load_table(args.table, max_bytes=args.max_size)
    if args.no_provenance:
        from .tables.review import review_view

        table = review_view(table)
    text = table.to_json()
    if args.out == "-":
        _write_utf8(text)
    else:
        write_atomic(args.out, text.encode("utf-8"))
    return EXIT_OK


def _cmd_import(args: argparse.Namespace) -> int:
    from .tables.files import read_table_bytes
    from .tables.table import Table, save_table

    if args.out.endswith(".json"):
        # save_table would write the JSON view again, not the msgpack table import promises.
        print(
            f"megatron-tuning import: {args.out} ends in .json, but import writes the msgpack "
            "table; name it .msgpack (export writes JSON views)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    # The same reader as load_table (size limit, one TableError), whatever the input's name.
    table = Table.from_json(read_table_bytes(args.json_file), path=args.json_file)
    save_table(table, args.out)
    return EXIT_OK


def _cmd_diff(args: argparse.Namespace) -> int:
    from .tables.review import diff_tables, format_diff
    from .tables.table import load_table

    changes = diff_tables(load_table(args.a), load_table(args.b), ignore_provenance=args.ignore_provenance)
    if args.json:
        print(json.dumps(changes, indent=1, sort_keys=True))
    else:
        for line in format_diff(changes, args.a, args.b):
            print(line)
    return EXIT_FOUND if any(changes.values()) else EXIT_OK


def _cmd_merge(args: argparse.Namespace) -> int:
    from .tables.merge import merge_files

    result = merge_files(args.out, args.inputs)
    if args.json:
        print(json.dumps(result.to_json(), indent=1, sort_keys=True))
    else:
        print(result.report())
        print(f"Wrote {args.out}")
    return EXIT_FOUND if args.strict and result.disagreements else EXIT_OK


def _cmd_validate(args: argparse.Namespace) -> int:
    from .commands.validate import validate_tables

    report = validate_tables(
        args.tables, arch=args.arch, triton_version=args.triton_version, modules=args.modules
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=1, sort_keys=True))
    else:
        for line in report.lines():
            print(line)
    return EXIT_FOUND if report.problems else EXIT_OK


def _cmd_coverage(args: argparse.Namespace) -> int:
    from .tables.coverage import coverage_json_text, coverage_of, read_decision_files

    coverage = coverage_of(read_decision_files(args.logs))
    print(coverage_json_text(coverage) if args.json else coverage.report())
    found = bool(coverage.diverged()) or (args.fail_on_fallback and coverage.counts().get("fallback", 0) > 0)
    if args.require_table:
        missing = coverage.not_in_table()
        for row in missing:  # on stderr: stdout stays the report (or the JSON document)
            statuses = ", ".join(sorted({c.status for c in row.cells.values()}))
            print(printable(f"not in the table: {row.kernel}  [{row.key}]  ({statuses})"), file=sys.stderr)
        found = found or bool(missing)
    return EXIT_FOUND if found else EXIT_OK


def _cmd_cache(args: argparse.Namespace) -> int:
    from .core.policy import TuningPolicy
    from .tables.cache import cache_path, read_cache_file

    if args.arch is None:
        from .core.identity import arch_tag

        args.arch = arch_tag()
    # Only the cache setting: an unrelated bad MEGATRON_TUNING_* value is no reason to fail here.
    path = cache_path(TuningPolicy(mode="auto"), args.arch)
    if path is None:
        print("auto cache: off (MEGATRON_TUNING_CACHE=off)")
    elif os.path.isfile(path):
        # The cache's own reader: it also reads a cache an older version let grow past the
        # table read limit (with a warning on stderr).
        print(f"{path}\t{len(read_cache_file(path)[1])} entries")
    else:
        print(f"{path}\t(not written yet)")
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
