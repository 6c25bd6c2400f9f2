"""One PNG per (kernel, key): candidate medians with p20-p80 bars, the tie band, the winner.

For people who would rather look than read a table of numbers. Works on the records of
``commands.tune`` (``tuned`` timings, with a tie band) and on Triton's own ``recorded`` timings
(no tie band: the band is drawn at the default width for reference). matplotlib is an optional
dependency; without it ``plot_records`` raises an ``ImportError`` that says how to install it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
import re
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..core.errors import TableError
from ..tables.files import write_atomic

logger = logging.getLogger(__name__)

_DEFAULT_BAND = 0.02
_WINNER, _TIED, _OTHER, _BAND = "#1b7837", "#7fbf7b", "#9e9e9e", "#fee08b"


def require_matplotlib() -> None:
    """Raise an ``ImportError`` that says how to install matplotlib when it is missing."""
    try:
        import matplotlib.backends.backend_agg  # noqa: F401
        import matplotlib.figure  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "Plotting needs matplotlib: pip install matplotlib "
            "(or install megatron_tuning with the [plot] extra)."
        ) from exc


def _pyplot_free_figure(width: float, height: float) -> Any:
    """A matplotlib Figure on the Agg canvas: no pyplot global state, no display needed."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def plot_file_name(kernel: str, key: str) -> str:
    """A readable, filesystem-safe and unique name for the plot of (kernel, key).

    Kernel ids and keys come from files (a decision log may be hand-made): only ``[A-Za-z0-9_]``
    of them reaches the name, so no ``/``, ``..`` or control character can place a plot
    outside its folder.
    """
    short = _slug(kernel.rsplit(":", 1)[-1], 40) or "kernel"
    slug = _slug(key.split("|", 1)[0], 60) or "key"
    digest = hashlib.sha256(f"{kernel}\n{key}".encode()).hexdigest()[:10]
    return f"{short}__{slug}__{digest}.png"


def _slug(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:limit]


def plot_record(record: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Draw one record (``kernel``, ``key``, ``winner``, ``timings``) to ``path`` as a PNG."""
    timings = record["timings"]
    candidates: Mapping[str, Any] = timings.get("candidates", {})
    rows = []
    failed = []
    for signature, value in candidates.items():
        triple = list(value) if isinstance(value, (list, tuple)) else [value]
        if not triple or triple[0] is None or not math.isfinite(float(triple[0])):
            failed.append(signature)
            continue
        median = float(triple[0])
        low = float(triple[1]) if len(triple) > 1 and triple[1] is not None else median
        high = float(triple[2]) if len(triple) > 2 and triple[2] is not None else median
        rows.append((median, low, high, signature))
    rows.sort(key=lambda row: (row[0], row[3]))
    winner = record.get("winner")
    tied = set(timings.get("tied", [winner]))
    band = float(timings.get("tie_band", _DEFAULT_BAND))

    height = 2.0 + 0.34 * max(1, len(rows) + len(failed))
    figure = _pyplot_free_figure(11.0, height)
    axes = figure.add_subplot(1, 1, 1)
    span = None
    if rows:
        best = rows[0][0]
        # Drawn over the bars, translucent, so the band's edge is visible on every row.
        span = axes.axvspan(
            best,
            best * (1.0 + band),
            color=_BAND,
            alpha=0.45,
            zorder=4,
            label=f"tie band ({band:.1%} of best median)",
        )
        for y, (median, low, high, signature) in enumerate(rows):
            color = _WINNER if signature == winner else _TIED if signature in tied else _OTHER
            axes.barh(y, median, color=color, height=0.7, zorder=2)
            axes.errorbar(
                median,
                y,
                xerr=[[median - low], [high - median]],
                fmt="none",
                ecolor="black",
                capsize=3,
                lw=1,
                zorder=3,
            )
        lo = min(r[1] for r in rows)
        hi = max(r[2] for r in rows)
        axes.set_xlim(max(0.0, lo - (hi - lo) * 0.5 - best * 0.01), hi + (hi - lo) * 0.15 + best * 0.01)
    labels = [("★ " if r[3] == winner else "") + r[3] for r in rows] + [f"{s} (failed)" for s in failed]
    axes.set_yticks(range(len(labels)))
    axes.set_yticklabels(labels, fontsize=7)
    axes.invert_yaxis()  # fastest on top
    axes.set_xlabel(f"median time per launch ({timings.get('unit', 'ms')}), bars: p20-p80")
    key_lines = textwrap.wrap(str(record["key"]), 120) or [""]
    figure.suptitle("\n".join([str(record["kernel"]), *key_lines]), fontsize=8)
    from matplotlib.patches import Patch

    handles = [
        Patch(color=_WINNER, label="winner"),
        Patch(color=_TIED, label="tied (lost the static-cost tie-break)"),
    ]
    if span is not None:
        handles.append(span)
    figure.legend(handles=handles, fontsize=7, ncol=3, loc="lower center")
    # Leave room for the legend below and the title lines above (sizes in inches of this figure).
    figure.tight_layout(rect=(0.0, 0.4 / height, 1.0, 1.0 - (0.2 + 0.14 * len(key_lines)) / height))
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    image = io.BytesIO()
    figure.savefig(image, format="png")
    # The tables' safe writer: atomic, never through a planted symlink, never over a device.
    write_atomic(
        target, image.getvalue(), error=lambda path, problem: TableError(path, problem, "Tuning results")
    )
    return target


def plot_records(records: Iterable[Mapping[str, Any]], directory: str | os.PathLike[str]) -> list[Path]:
    """One PNG per record under ``directory``; returns the paths written."""
    out = Path(directory)
    paths = []
    for record in records:
        name = plot_file_name(str(record["kernel"]), str(record["key"]))
        if os.path.basename(name) != name or name.startswith("."):  # belt and braces: stay in DIR
            raise ValueError(f"unsafe plot file name {name!r}")
        path = plot_record(record, out / name)
        logger.info("plot written: %s", path)
        paths.append(path)
    return paths
