"""``report``: print and plot what a ``tune`` run measured (its ``--results`` decision logs)."""

from __future__ import annotations

import argparse
import hashlib
import io
import math
import re
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..core.decisions import Decision
from ..core.errors import TableError, printable
from ..tables.files import write_atomic
from ..tables.records import read_decisions


def add_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="decision logs (tune's --results), or folders of them")
    parser.add_argument("--plot", metavar="DIR", help="draw one PNG per (kernel, key, rank) here")


def run_report(args: argparse.Namespace) -> int:
    decisions: list[Decision] = []
    try:
        for name in args.inputs:
            files = sorted(Path(name).glob("*.json")) if Path(name).is_dir() else [Path(name)]
            for path in files:
                found = [d for d in read_decisions(path) if d.source in ("tuned", "recorded")]
                for d in found:
                    problem = _timings_problem(d.timings)
                    if problem:
                        raise TableError(str(path), f"{d.kernel} [{d.key}]: {problem}", "Tuning results")
                decisions += found
    except TableError as exc:
        print(f"report: cannot read {printable(str(exc))}", file=sys.stderr)
        return 2
    if not decisions:
        print("report: no tuned or recorded timings in the inputs", file=sys.stderr)
        return 1
    print(summary(decisions))
    if args.plot:
        try:
            plot_into(decisions, args.plot, prog="report")
        except ImportError as exc:
            print(f"report: {exc}", file=sys.stderr)
            return 2
    return 0


def _timings_problem(timings: Any) -> str | None:
    """What makes a decision's timings unusable by ``summary`` and the plots (hand-edited logs)."""
    if not isinstance(timings, dict) or not isinstance(timings.get("candidates", {}), dict):
        return "timings.candidates must be an object"
    for signature, value in timings.get("candidates", {}).items():
        values = value if type(value) is list else [value]
        if len(values) > 16 or not all(
            v is None or (type(v) in (int, float) and not math.isnan(v)) for v in values
        ):
            return f"timings.candidates[{signature!r}] must be a number or a list of numbers"
    tied, band = timings.get("tied", []), timings.get("tie_band", 0.0)
    if type(tied) is not list or not all(type(t) is str for t in tied):
        return "timings.tied must be a list of signatures"
    if type(band) not in (int, float) or not 0 <= band < 1:
        return f"timings.tie_band must be a fraction in [0, 1), got {band!r}"
    return None


def summary(decisions: Sequence[Decision]) -> str:
    """A plain-text table: kernel, key, rank, the winner's median, how many tied, the fastest median."""
    lines = [f"{'kernel':<28} {'key':<36} {'rank':>4} {'median ms':>10} {'tied':>4} {'best ms':>9}  winner"]
    for d in decisions:
        timings = d.timings or {}
        candidates = timings.get("candidates", {})
        medians = [v[0] for v in candidates.values() if isinstance(v, list) and v and v[0] is not None]
        win = candidates.get(d.signature) or [None]
        win_ms = f"{win[0]:.4f}" if isinstance(win, list) and win[0] is not None else "-"
        best = f"{min(medians):.4f}" if medians else "-"
        tied = len(timings.get("tied", [d.signature]))
        name = d.kernel.rsplit(":", 1)[-1][:28]
        row = f"{name:<28} {d.key[:36]:<36} {d.rank:>4} {win_ms:>10} {tied:>4} {best:>9}  {d.signature}"
        lines.append(printable(row))
    return "\n".join(lines)


def require_matplotlib() -> None:
    try:
        import matplotlib.backends.backend_agg  # noqa: F401
        import matplotlib.figure  # noqa: F401
    except ImportError as exc:
        how = "pip install matplotlib (or install megatron_tuning with the [plot] extra)"
        raise ImportError(f"Plotting needs matplotlib: {how}.") from exc


def plot_into(decisions: Sequence[Decision], directory: str, *, prog: str) -> None:
    """One PNG per decision (candidate medians, p20-p80 bars, the tie band, the winner) under ``directory``.

    File names keep only ``[A-Za-z0-9_]`` of kernel and key (a hand-made log's ``/`` or ``..`` cannot
    place a plot elsewhere), plus a digest so they stay unique."""
    for d in decisions:
        slug = "__".join(
            re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:60] or "x"
            for text in (d.kernel.rsplit(":", 1)[-1], d.key.split("|")[0])
        )
        digest = hashlib.sha256(f"{d.kernel}\n{d.key}\n{d.rank}".encode()).hexdigest()[:10]
        plot_decision(d, Path(directory) / f"{slug}__{digest}.png")
    print(f"{prog}: {len(decisions)} plot(s) written to {directory}")


def plot_decision(d: Decision, path: Path) -> None:
    """Draw one decision's candidate timings to ``path`` as a PNG (no pyplot state, no display)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    timings: Mapping[str, Any] = d.timings or {}
    rows, failed = [], []  # rows: (median, p20, p80, signature), fastest first
    for signature, value in timings.get("candidates", {}).items():
        values = [
            math.nan if v is None else float(v) for v in (value if isinstance(value, list) else [value])
        ]
        if values and math.isfinite(values[0]):
            rows.append((values[0], *(values + values[:1] * 2)[1:3], signature))
        else:
            failed.append(signature)
    rows.sort()
    tied, band = set(timings.get("tied", [d.signature])), float(timings.get("tie_band", 0.02))
    height = 2.0 + 0.34 * max(1, len(rows) + len(failed))
    figure = Figure(figsize=(11.0, height), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    green, light = "#1b7837", "#7fbf7b"
    handles = [
        Patch(color=green, label="winner"),
        Patch(color=light, label="tied (lost the static-cost tie-break)"),
    ]
    if rows:
        best = rows[0][0]
        label = f"tie band ({band:.1%} of best median)"
        handles.append(
            axes.axvspan(best, best * (1 + band), color="#fee08b", alpha=0.45, zorder=4, label=label)
        )
        colors = [green if r[3] == d.signature else light if r[3] in tied else "#9e9e9e" for r in rows]
        spread = [[r[0] - r[1] for r in rows], [r[2] - r[0] for r in rows]]
        axes.barh(range(len(rows)), [r[0] for r in rows], xerr=spread, color=colors, height=0.7, capsize=3)
    # Names come from a log file: escaped, as every human output (a control character has no glyph).
    labels = [("★ " if r[3] == d.signature else "") + printable(r[3]) for r in rows]
    labels += [f"{printable(s)} (failed)" for s in failed]
    axes.set_yticks(range(len(labels)))
    axes.set_yticklabels(labels, fontsize=7)
    axes.invert_yaxis()  # fastest on top
    axes.set_xlabel(f"median time per launch ({timings.get('unit', 'ms')}), bars: p20-p80")
    key_lines = textwrap.wrap(printable(d.key), 120) or [""]
    figure.suptitle("\n".join([f"{printable(d.kernel)} (rank {d.rank})", *key_lines]), fontsize=8)
    figure.legend(handles=handles, fontsize=7, ncol=3, loc="lower center")
    figure.tight_layout(rect=(0.0, 0.4 / height, 1.0, 1.0 - (0.2 + 0.14 * len(key_lines)) / height))
    image = io.BytesIO()
    figure.savefig(image, format="png")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, image.getvalue(), error=lambda p, problem: TableError(p, problem, "Plot"))
