"""Checks for CI: ``validate`` (would these entries apply here, unchanged? e.g. after a Triton upgrade
or a kernel edit) and ``coverage`` (what did a run launch, per kernel, key and rank?)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..core import identity
from ..core.decisions import SOURCES, Decision
from ..core.errors import MegatronTuningError, printable
from ..core.policy import parse_int
from ..tables.entry import Entry, entry_order
from ..tables.search import installed_triton_version
from ..tables.table import load_table
from . import EXIT_FOUND, EXIT_OK


class Problem(NamedTuple):
    path: str
    arch: str
    kernel: str
    key: str
    problem: str


@dataclass(slots=True)
class ValidationReport:
    checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def find_autotuners(module: Any) -> list[Any]:
    """Triton ``Autotuner`` objects reachable from ``module``'s globals (through wrappers)."""
    from triton.runtime.autotuner import Autotuner

    found: list[Any] = []
    for value in list(vars(module).values()):
        for obj in identity.wrappers(value):
            if isinstance(obj, Autotuner) and not any(obj is f for f in found):
                found.append(obj)
    return found


def _import_kernels(modules: Sequence[str]) -> tuple[set[str], dict[str, Any]]:
    from ..runtime.interception import lazy_benchmarker  # Triton 3.2/3.3 without a GPU needs it

    covered: set[str] = set()
    kernels: dict[str, Any] = {}
    for name in modules:
        try:
            with lazy_benchmarker():
                module = _import(name)
        except (Exception, SystemExit) as exc:  # bad input (exit 2), never a table problem nor an exit
            raise MegatronTuningError(_import_failure(name, exc)) from exc
        # A package that re-exports some kernels of a submodule: scan that submodule too, so its
        # other kernels are not reported missing. Only scanned modules count as covered.
        pending = [(module.__name__, module)]
        while pending:
            module_name, scanned = pending.pop()
            if module_name in covered:
                continue
            covered.add(module_name)
            for autotuner in find_autotuners(scanned):
                home = identity.kernel_module(autotuner)
                if home not in covered and sys.modules.get(home) is not None:
                    pending.append((home, sys.modules[home]))
                kernels[identity.kernel_id(autotuner)] = autotuner
    return covered, kernels


def _import_failure(name: str, exc: BaseException) -> str:
    """What went wrong importing ``--import name``, and the fix: a missing module or file is not the
    same fix as a module that raised while it was imported."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing is not None and (name == missing or name.startswith(missing + ".")):
        return (
            f"--import {name}: no module named {missing!r} on this Python's path. Check the name, install "
            "its package or add its folder to PYTHONPATH, or pass the path of its .py file"
        )
    if name.endswith(".py") and not os.path.isfile(name):
        return f"--import {name}: no such file. Pass the path of an existing .py file, or a module name"
    return (
        f"--import {name}: importing it raised {exc!r}. Fix the module (or install what it needs) so that "
        "it imports, then validate again"
    )


def _import(name: str) -> Any:
    """A module by name, or a ``.py`` file loaded under its stem (as an eval pipeline loads a
    candidate), left out of ``sys.modules``."""
    if not name.endswith(".py"):
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(os.path.basename(name)[:-3], name)
    if spec is None or spec.loader is None or not os.path.isfile(name):
        raise FileNotFoundError(f"no such file: {name}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _resolve_kernel(kernel: str) -> Any:
    """A kernel that is no module global (e.g. a class attribute), found by its qualname."""
    from triton.runtime.autotuner import Autotuner

    module_name, qualname, _ = identity.split_kernel_id(kernel)
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    found = next((o for o in identity.wrappers(obj) if isinstance(o, Autotuner)), None)
    # A ``@digest`` id names a module-level autotuner, found by the scan or nowhere.
    return found if found is not None and identity.kernel_id(found) == kernel else None


def validate_tables(
    paths: Iterable[str],
    *,
    arch: str | None = None,
    triton_version: str | None = None,
    modules: Sequence[str] = (),
) -> ValidationReport:
    """Check every entry of the tables at ``paths``; unreadable tables raise ``TableError``, a module of
    ``modules`` that cannot be imported ``MegatronTuningError`` (bad input, not a table problem)."""
    report = ValidationReport()
    if arch is None:
        arch = identity.arch_tag()
        if arch == "unknown":
            report.notes.append("arch not checked: no GPU visible here (pass --arch to check against one)")
            arch = None
    version = triton_version if triton_version is not None else installed_triton_version()
    if version is None:
        report.notes.append("Triton version not checked: Triton is not installed (pass --triton-version)")
    covered, kernels = _import_kernels(modules)
    for path in paths:
        table = load_table(path)
        for entry in table.entries():
            report.checked += 1
            for problem in _entry_problems(entry, arch, version, covered, kernels):
                report.problems.append(Problem(path, entry.arch, entry.kernel, entry.key, problem))
    return report


def _entry_problems(
    entry: Entry, arch: str | None, version: str | None, covered: set[str], kernels: dict[str, Any]
) -> list[str]:
    problems = []
    if arch is not None and entry.arch != arch:
        problems.append(f"entry is for arch {entry.arch}, this machine is {arch}: it never applies here")
    if version is not None and entry.triton_version is not None and entry.triton_version != version:
        problems.append(f"tuned with Triton {entry.triton_version}, installed is {version}")
    module = entry.kernel.split(":", 1)[0]
    if module not in covered:
        return problems
    autotuner = kernels.get(entry.kernel) or _resolve_kernel(entry.kernel)
    # Autotuners with different config lists over one function are told apart by ``@digest``; a plain
    # entry that stored one's digest is that one's (as lookups use it).
    split = sorted(k for k in kernels if k.startswith(entry.kernel + "@")) if autotuner is None else []
    if entry.config_list_digest and f"{entry.kernel}@{entry.config_list_digest}" in split:
        autotuner = kernels[f"{entry.kernel}@{entry.config_list_digest}"]
    if autotuner is None:
        if split:
            problems.append(
                f"{len(split)} autotuners with different config lists wrap this function, so they are "
                f"told apart as {', '.join(split)}: this entry cannot say which one it was tuned "
                "for and is not used; re-tune to get entries under those ids"
            )
        elif "<locals>" not in entry.kernel:  # one made inside a function: only a run can tell
            problems.append(f"no autotuned kernel {entry.kernel} in module {module} (renamed or removed?)")
        return problems
    source_hash = identity.kernel_source_hash(autotuner)
    if entry.source_hash and source_hash and entry.source_hash != source_hash:
        hashes = f"table {entry.source_hash[:12]}, code {source_hash[:12]}"
        problems.append(f"kernel source changed since tuning ({hashes})")
    signature = identity.config_signature(entry.config)
    declared = {identity.config_signature(c) for c in autotuner.configs}
    # A kernel with an early_config_prune may launch configs it does not declare.
    if signature not in declared and getattr(autotuner, "early_config_prune", None) is None:
        problems.append(f"config {signature} is none of the kernel's {len(declared)} declared configs")
    return problems


def add_validate(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Check every entry: its arch is this machine's (or --arch), it was tuned with the installed Triton, "
        "and, for kernels in modules given with --import, the kernel exists, its source hash matches and the "
        "config is one it declares. Exit 1 when a problem is found; exit 2 for bad input: a table that "
        "cannot be read, or a --import module that cannot be imported (named on stderr, with the fix)."
    )
    p.add_argument("tables", nargs="+", metavar="TABLE")
    p.add_argument("--arch", help="the arch to check against (default: this machine's; skipped when unknown)")
    p.add_argument("--triton-version", help="the Triton version to check against (default: installed)")
    module = "a module name, or a .py file: loaded under its file name's stem"
    help = f"import MODULE ({module}) and check its autotuned kernels' source hashes (repeatable)"
    p.add_argument("--import", dest="modules", action="append", default=[], metavar="MODULE", help=help)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run_validate(args: argparse.Namespace) -> int:
    report = validate_tables(
        args.tables, arch=args.arch, triton_version=args.triton_version, modules=args.modules
    )
    if args.json:
        problems = [p._asdict() for p in report.problems]
        doc = {"checked": report.checked, "problems": problems, "notes": report.notes}
        print(json.dumps(doc, indent=1, sort_keys=True))
    else:
        lines = [f"note: {note}" for note in report.notes]
        lines += [f"{p.path}: {p.arch}  {p.kernel}  [{p.key}]: {p.problem}" for p in report.problems]
        lines.append(f"{report.checked} entries checked, {len(report.problems)} problem(s)")
        print("\n".join(map(printable, lines)))
    return 1 if report.problems else 0


STATUS = {"table": "hit", "cheapest": "fallback"}  # other sources keep their own name
STATUS_ORDER = (*(STATUS.get(s, s) for s in SOURCES), "other")  # the summary's order
PINNED_WITHOUT_TABLE = ("override", "single")  # --require-table accepts them besides a hit


class Cell(NamedTuple):
    """What one rank did for one (kernel, key)."""

    status: str
    signature: str
    origin: str | None
    entry_kernel: str | None = None  # the entry matched by content: the kernel id it was tuned under
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

    def to_json(self) -> dict[str, Any]:
        ranks = {label: cell.to_json() for label, cell in self.cells.items()}
        return {"kernel": self.kernel, "key": self.key, "diverged": self.diverged, "ranks": ranks}


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
            status = STATUS.get(d.source, d.source if d.source in SOURCES else "other")
            twin = d.entry_kernel if d.matched_by == "content" else None
            # The first decision per (kernel, key) in a process is the one that launched.
            row.cells.setdefault(label, Cell(status, d.signature, d.origin, twin, d.nearest_key))
    labels.sort(key=lambda label: (parse_int(label.split("@", 1)[0]) or 0, label))
    for row in rows.values():
        row.cells = {label: row.cells[label] for label in labels if label in row.cells}
    return labels, [rows[k] for k in sorted(rows, key=lambda k: entry_order("", *k))]


def add_coverage(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Summarise decision logs (one per rank). Exit 1 when ranks launched different configs for "
        "the same kernel and key."
    )
    p.add_argument("logs", nargs="+", metavar="DECISION_FILE")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    fallback = "also exit 1 when any launch fell back to the cheapest config"
    p.add_argument("--fail-on-fallback", action="store_true", help=fallback)
    p.add_argument(
        "--require-table",
        action="store_true",
        help="also exit 1 unless every in-scope launch was its own table entry (a nearest-shape entry, the "
        "cheapest fallback or an auto-tuned config fails; an override or a single-config kernel passes), "
        "listing the keys that are missing from the table",
    )


def run_coverage(args: argparse.Namespace) -> int:
    from ..tables.records import read_decisions

    logs = [(os.fspath(p), read_decisions(p)) for p in args.logs]
    labels, rows = coverage_of(logs)
    counts = Counter(cell.status for row in rows for cell in row.cells.values())
    # Pinned configs the table's numerics audit found non-deterministic on their own.
    nondet = sorted(
        {(d.kernel, d.key, d.signature) for _, ds in logs for d in ds if d.deterministic is False}
    )
    diverged = [row for row in rows if row.diverged]
    if args.json:
        doc = {
            "files": list(args.logs),
            "ranks": labels,
            "counts": dict(sorted(counts.items())),
            "entries": [row.to_json() for row in rows],
            "nondeterministic": [{"kernel": k, "key": key, "signature": sig} for k, key, sig in nondet],
        }
        print(json.dumps(doc, indent=1, sort_keys=True))
    else:
        lines = [f"Coverage of {len(args.logs)} decision log(s), ranks: {', '.join(labels) or '-'}"]
        lines += [f"{row.kernel}  [{row.key}]  {_describe_row(row, labels)}" for row in rows]
        summary = ", ".join(f"{s} {counts[s]}" for s in STATUS_ORDER if counts.get(s))
        lines.append(f"Summary (kernel/key x rank): {summary or 'no decisions'}")
        lines += [
            f"NOT DETERMINISTIC ON ITS OWN (numerics audit): {k} [{key}] {sig}" for k, key, sig in nondet
        ]
        if nondet:
            lines.append(f"{len(nondet)} pinned config(s) the audit found non-deterministic on their own")
        for row in diverged:
            lines.append(f"DIVERGED: {row.kernel} [{row.key}]")
            lines += [f"  rank {label}: {c.signature or '-'} ({c.status})" for label, c in row.cells.items()]
        print("\n".join(map(printable, lines)))
    found = bool(diverged) or (args.fail_on_fallback and counts.get("fallback", 0) > 0)
    if args.require_table:
        allowed = ("hit", "out_of_scope", *PINNED_WITHOUT_TABLE)
        for row in [r for r in rows if any(c.status not in allowed for c in r.cells.values())]:
            statuses = ", ".join(sorted({c.status for c in row.cells.values()}))
            print(printable(f"not in the table: {row.kernel}  [{row.key}]  ({statuses})"), file=sys.stderr)
            found = True
    return EXIT_FOUND if found else EXIT_OK


def _describe_row(row: Row, labels: list[str]) -> str:
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
