"""The arguments every benchmark takes, its device check, and the parent-or-child ``main``.

Every benchmark is one script that is both the parent (spawns fresh processes, aggregates,
writes JSON, prints a table) and the child (``--child ...``: does one process's measurement
and prints one ``RESULT {json}`` line). ``--smoke`` runs the same code paths on CPU in the
Triton interpreter with tiny shapes and a host-clock "benchmarker", so a script is exercised
end to end before any GPU minute is spent; smoke numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable

# Contexts held for the whole process (closed at exit); a bare __enter__ would be undone at GC.
_PROCESS_CONTEXTS = contextlib.ExitStack()


def script_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring as the help text, ``--smoke`` and ``--out`` added."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    return parser


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check of every code path (Triton interpreter, tiny shapes; numbers meaningless)",
    )
    parser.add_argument("--out", default=None, help="write the JSON results here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one process's part


def require_device(args: argparse.Namespace, name: str) -> bool:
    """True when the benchmark can run: a CUDA GPU, or ``--smoke``. Explains itself otherwise."""
    if args.smoke:
        use_cpu_interpreter()
        return True
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    print(
        f"{name} measures Triton kernels on a CUDA GPU and none is visible here. "
        f"Run it on a GPU machine (PYTHONPATH=. python benchmarks/{name}.py), "
        f"or add --smoke to check its code paths on CPU.",
        file=sys.stderr,
    )
    return False


def use_cpu_interpreter() -> None:
    """Run this process's kernels in the Triton interpreter (``--smoke``, CPU modes)."""
    os.environ["TRITON_INTERPRET"] = "1"
    # Triton 3.3 resolves its benchmarker when a kernel is decorated, which fails without a
    # GPU driver: keep the lazy one for this whole (short-lived) process.
    from megatron_tuning.runtime.interception import lazy_benchmarker

    _PROCESS_CONTEXTS.enter_context(lazy_benchmarker())


def run_parent_or_child(
    parser: argparse.ArgumentParser,
    name: str,
    child: Callable[[argparse.Namespace], None],
    parent: Callable[[argparse.Namespace], int],
) -> int:
    """The shared ``main`` of the multi-process benchmarks: parse, check the device, dispatch."""
    args = parser.parse_args()
    if not require_device(args, name):
        return 2
    if args.child:
        child(args)
        return 0
    return parent(args)
