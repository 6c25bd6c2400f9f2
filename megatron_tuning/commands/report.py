"""``python -m megatron_tuning report``: print (and plot) the statistics of a tuning run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ..tuning.results import format_summary, read_results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs",
        nargs="+",
        help="tuning results (*.tuning.json), decision logs, or per-process result folders",
    )
    parser.add_argument("--plot", metavar="DIR", default=None, help="draw one PNG per (kernel, key) here")


def run(args: argparse.Namespace) -> int:
    records: list[dict[str, Any]] = []
    for name in args.inputs:
        try:
            records.extend(read_results(name))
        except (OSError, ValueError, KeyError) as exc:
            print(f"report: cannot read {name}: {exc}", file=sys.stderr)
            return 2
    if not records:
        print("report: no tuned or recorded timings in the inputs", file=sys.stderr)
        return 1
    print(format_summary(records))
    if args.plot:
        try:
            plot_records_to(records, args.plot)
        except ImportError as exc:
            print(f"report: {exc}", file=sys.stderr)
            return 2
    return 0


def plot_records_to(records: Sequence[Mapping[str, Any]], directory: str, *, prog: str = "report") -> None:
    """Draw one PNG per record into ``directory`` and say how many were written."""
    from ..tuning.plotting import plot_records

    paths = plot_records(records, directory)
    print(f"{prog}: {len(paths)} plot(s) written to {directory}")
