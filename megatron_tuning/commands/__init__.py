"""``python -m megatron_tuning`` / ``megatron-tuning``: the command line (exit codes: docs/tables.md).

Each command's module defines ``add_<name>(parser)`` and ``run_<name>(args) -> int``; only the module
of the command being run is imported, so ``show`` or ``diff`` never pay for importing torch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from ..core.errors import MegatronTuningError, printable

EXIT_OK, EXIT_FOUND, EXIT_USAGE = 0, 1, 2
EXIT_SIGNAL = 128  # + N: ended by signal N, as a shell reports it

COMMANDS: dict[str, tuple[str, str]] = {
    "show": ("tables", "print the entries of tables in readable form"),
    "export": ("tables", "convert a msgpack table to its lossless JSON view"),
    "import": ("tables", "convert a JSON view back to a msgpack table"),
    "diff": ("tables", "added, removed and changed entries between two tables"),
    "merge": ("tables", "majority-vote recordings/tables into one table"),
    "cache": ("tables", "where auto mode's cache table is, and how many entries it holds"),
    "coverage": ("validate", "per kernel and key: table hit / fallback / out of scope, per rank"),
    "validate": ("validate", "check tables against this machine, Triton and kernel sources"),
    "tune": ("tune", "noise-aware tuning of a job's kernels on a GPU, writing a table"),
    "audit": ("audit", "which configs of a job's kernels give bit-identical outputs (numerics classes)"),
    "report": ("report", "report on a tuning run (timings, noise, plots)"),
    "run": ("launch", "run a command with its autotuned kernels pinned, without editing it"),
    "enable": ("launch", "pin every process of this Python environment that sets MEGATRON_TUNING_MODE"),
    "disable": ("launch", "undo `enable`"),
    "selftest": ("selftest", "check this install end to end: pinned choices agree, chaos is caught"),
    "score": ("score", "score a command's kernels: an interval, clock evidence, a verdict (docs/score.md)"),
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; ``argv`` tells which command's module to import for its real options."""
    parser = argparse.ArgumentParser(
        prog="megatron-tuning",
        description="Deterministic Triton autotuning: tables, pinned jobs, tuning and checks.",
        epilog="Exit codes: 0 ok, 1 differences/problems found, 2 usage error or bad input, 3 divergence, "
        "128+N ended by signal N (130 Ctrl-C, 141 output cut short by a closed pipe).",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    words = list(sys.argv[1:] if argv is None else argv)
    chosen = next((w for w in words if not w.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        if name != chosen:  # a stub keeps `--help` cheap; `COMMAND --help` shows the real options
            sub.add_parser(name, help=help_text, add_help=False).set_defaults(handler=None)
            continue
        command = sub.add_parser(name, help=help_text, description=help_text)
        loaded = importlib.import_module(f"{__name__}.{module}")
        getattr(loaded, f"add_{name}")(command)
        command.set_defaults(handler=getattr(loaded, f"run_{name}"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m megatron_tuning`` and the ``megatron-tuning`` script."""
    args = build_parser(argv).parse_args(argv)
    for stream in (sys.stdout, sys.stderr):  # a terminal that cannot show a character: escape it
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.handler(args))
    except MegatronTuningError as exc:
        # Messages quote file contents (kernel ids, keys): escaped like every human output.
        message = f"megatron-tuning {args.command}: {exc}"
        print("\n".join(map(printable, message.split("\n"))), file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `... | head`: as a shell reports a death by SIGPIPE, never a pass
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_SIGNAL + signal.SIGPIPE
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for SIGINT, no traceback
        print(file=sys.stderr)
        return EXIT_SIGNAL + signal.SIGINT
    except OSError as exc:  # e.g. an output path that cannot be written: bad input, not a crash
        print(f"megatron-tuning {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


def write_utf8(text: str) -> None:
    """Write a JSON view to stdout as UTF-8 (its defined encoding), as a file would hold it."""
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:
        sys.stdout.write(text)
        return
    sys.stdout.flush()
    buffer.write(text.encode("utf-8"))
    buffer.flush()
