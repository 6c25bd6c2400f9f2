"""Offline table checks (``megatron-tuning validate``): would these entries apply here, unchanged?

The runtime validators in ``tables.search`` act per lookup; this module checks a whole table
ahead of time, e.g. in CI after a Triton upgrade or a kernel edit: every entry's arch is
this machine's, it was tuned with the installed Triton, and, for kernels of modules the
caller names, the kernel still exists, its source hash matches, and the entry's config
is one the kernel declares (unless the kernel prunes configs itself, which can create new
ones, so only the live run can tell).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.identity import (
    arch_tag,
    config_signature,
    kernel_id,
    kernel_module,
    kernel_source_hash,
    split_kernel_id,
)
from ..core.warn import printable
from ..tables.entry import KEY_FORM, Entry, canonical_key
from ..tables.search import installed_triton_version
from ..tables.table import load_table

logger = logging.getLogger(__name__)

_MAX_WRAPPERS = 8  # heuristics/autotune decorators stacked on one kernel, far above real use


@dataclass(frozen=True, slots=True)
class Problem:
    path: str
    arch: str
    kernel: str
    key: str
    problem: str

    def to_json(self) -> dict[str, str]:
        return {
            "path": self.path,
            "arch": self.arch,
            "kernel": self.kernel,
            "key": self.key,
            "problem": self.problem,
        }


@dataclass(slots=True)
class ValidationReport:
    checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "problems": [p.to_json() for p in self.problems],
            "notes": self.notes,
        }

    def lines(self) -> list[str]:
        out = [f"note: {note}" for note in self.notes]
        out += [f"{p.path}: {p.arch}  {p.kernel}  [{p.key}]: {p.problem}" for p in self.problems]
        out.append(f"{self.checked} entries checked, {len(self.problems)} problem(s)")
        return [printable(line) for line in out]


@dataclass(frozen=True, slots=True)
class _Kernel:
    source_hash: str | None
    signatures: frozenset[str]
    prunes: bool


def find_autotuners(module: Any) -> list[Any]:
    """Triton ``Autotuner`` objects reachable from ``module``'s globals (through wrappers)."""
    from triton.runtime.autotuner import Autotuner

    found: list[Any] = []
    for value in list(vars(module).values()):
        obj = value
        for _ in range(_MAX_WRAPPERS):
            if isinstance(obj, Autotuner) and not any(obj is f for f in found):
                found.append(obj)
            obj = getattr(obj, "fn", None)
            if obj is None:
                break
    return found


def _import_for_inspection(name: str) -> Any:
    # On Triton 3.2/3.3 decorating an autotuned kernel without a GPU fails unless the
    # benchmarker is resolved lazily; the interception provides exactly that.
    from ..runtime.triton_compat import lazy_benchmarker

    with lazy_benchmarker():
        return importlib.import_module(name)


def _import_kernels(modules: Sequence[str], report: ValidationReport) -> tuple[set[str], dict[str, _Kernel]]:
    covered: set[str] = set()
    kernels: dict[str, _Kernel] = {}
    for name in modules:
        try:
            module = _import_for_inspection(name)
        except (Exception, SystemExit) as exc:  # a finding about the user's code, not a crash
            report.problems.append(Problem("-", "-", f"{name}:*", "-", f"cannot import module: {exc!r}"))
            continue
        # A package that re-exports some kernels of a submodule: scan that submodule too,
        # so its other kernels are not reported missing. Only scanned modules count as
        # covered.
        pending = [(name, module)]
        while pending:
            module_name, scanned = pending.pop()
            if module_name in covered:
                continue
            covered.add(module_name)
            for autotuner in find_autotuners(scanned):
                home = kernel_module(autotuner)
                if home not in covered and sys.modules.get(home) is not None:
                    pending.append((home, sys.modules[home]))
                kernels[kernel_id(autotuner)] = _describe(autotuner)
    return covered, kernels


def _split_ids(kernels: dict[str, _Kernel]) -> dict[str, list[str]]:
    """Plain ``module:qualname`` -> the ``@digest`` ids of the autotuners told apart under it."""
    split: dict[str, list[str]] = {}
    for kernel in kernels:
        module, qualname, digest = split_kernel_id(kernel)
        if digest is not None:
            split.setdefault(f"{module}:{qualname}", []).append(kernel)
    return split


def _describe(autotuner: Any) -> _Kernel:
    return _Kernel(
        kernel_source_hash(autotuner),
        frozenset(config_signature(c) for c in autotuner.configs),
        getattr(autotuner, "early_config_prune", None) is not None,
    )


def _resolve_kernel(kernel: str, kernels: dict[str, _Kernel]) -> _Kernel | None:
    """A kernel that is no module global (e.g. a class attribute), found by its qualname."""
    from triton.runtime.autotuner import Autotuner

    module_name, qualname, _ = split_kernel_id(kernel)
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    for _ in range(_MAX_WRAPPERS):
        if obj is None or isinstance(obj, Autotuner):
            break
        obj = getattr(obj, "fn", None)
    if not isinstance(obj, Autotuner) or kernel_id(obj) != kernel:
        return None  # a ``@digest`` id names a module-level autotuner, found by the scan or nowhere
    kernels[kernel] = _describe(obj)
    return kernels[kernel]


def validate_tables(
    paths: Iterable[str],
    *,
    arch: str | None = None,
    triton_version: str | None = None,
    modules: Sequence[str] = (),
) -> ValidationReport:
    """Check every entry of the tables at ``paths``; unreadable tables raise ``TableError``."""
    report = ValidationReport()
    if arch is None:
        arch = arch_tag()
        if arch == "unknown":
            report.notes.append("arch not checked: no GPU visible here (pass --arch to check against one)")
            arch = None
    version = triton_version if triton_version is not None else installed_triton_version()
    if version is None:
        report.notes.append("Triton version not checked: Triton is not installed (pass --triton-version)")
    covered, kernels = _import_kernels(modules, report)
    for path in paths:
        table = load_table(path)
        for entry in table.entries():
            report.checked += 1
            for problem in _entry_problems(entry, arch, version, covered, kernels):
                report.problems.append(Problem(path, entry.arch, entry.kernel, entry.key, problem))
    return report


def _entry_problems(
    entry: Entry,
    arch: str | None,
    version: str | None,
    covered: set[str],
    kernels: dict[str, _Kernel],
) -> list[str]:
    problems = []
    canonical = canonical_key(entry.key)
    if canonical is None:
        problems.append(f"key is not a tuning key ({KEY_FORM}): it can never match a launch")
    elif canonical != entry.key:
        problems.append(
            f"key is not spelt as launches spell it, so it never matches; write it as [{canonical}]"
        )
    if arch is not None and entry.arch != arch:
        problems.append(f"entry is for arch {entry.arch}, this machine is {arch}: it never applies here")
    if version is not None and entry.triton_version is not None and entry.triton_version != version:
        problems.append(f"tuned with Triton {entry.triton_version}, installed is {version}")
    module = entry.kernel.split(":", 1)[0]
    if module not in covered:
        return problems
    kernel = kernels.get(entry.kernel) or _resolve_kernel(entry.kernel, kernels)
    if kernel is None:
        split = _split_ids(kernels).get(entry.kernel)
        if split:
            problems.append(
                f"{len(split)} autotuners with different config lists wrap this function, so they are "
                f"told apart as {', '.join(sorted(split))}: this entry cannot say which one it was tuned "
                "for and is not used; re-tune to get entries under those ids"
            )
            return problems
        if "<locals>" in entry.kernel:  # made inside a function: only a run can tell
            return problems
        problems.append(f"no autotuned kernel {entry.kernel} in module {module} (renamed or removed?)")
        return problems
    if entry.source_hash and kernel.source_hash and entry.source_hash != kernel.source_hash:
        problems.append(
            "kernel source changed since tuning "
            f"(table {entry.source_hash[:12]}, code {kernel.source_hash[:12]})"
        )
    signature = config_signature(entry.config)
    if signature not in kernel.signatures and not kernel.prunes:
        problems.append(
            f"config {signature} is none of the kernel's {len(kernel.signatures)} declared configs"
        )
    return problems


def add_validate(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Check every entry: its arch is this machine's (or --arch), it was tuned with the installed Triton, "
        "and, for kernels in modules given with --import, the kernel exists, its source hash matches and the "
        "config is one it declares. Exit 1 when a problem is found."
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


def run_validate(args: argparse.Namespace) -> int:
    report = validate_tables(
        args.tables, arch=args.arch, triton_version=args.triton_version, modules=args.modules
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=1, sort_keys=True))
    else:
        for line in report.lines():
            print(line)
    return 1 if report.problems else 0


__all__ = [
    "Problem",
    "ValidationReport",
    "add_validate",
    "find_autotuners",
    "run_validate",
    "validate_tables",
]
