"""The per-process decision log: what config each in-scope (kernel, key) launched, and why."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import printable
from .key import Key, text_key_error

# Where a decision's config came from, in the order `coverage` summarizes them.
SOURCES = (
    "table",  # a tuning-table entry, matched back to a live candidate
    "override",  # an explicit block-size override
    "single",  # only one live candidate (no choice to make)
    "tuned",  # tune/auto mode: measured here by the noise-aware tuner
    "adopted",  # auto mode: the decision another rank of this job published
    "recorded",  # record mode: Triton's own autotune winner
    "nearest",  # a miss: the table entry of the nearest comparable shape (``nearest_key``)
    "cheapest",  # a miss: the cheapest live candidate by static cost
    "chaos",  # chaos mode: a per-rank different pick, on purpose
    "out_of_scope",  # passed through to Triton untouched (key is "*")
)

CHAOS_NO_OTHER_CONFIG = "no_other_config"  # a chaos key with one distinct config: it proves nothing


def unchecked_sources(mode: str | None) -> frozenset[str]:
    """Sources the ranks of a ``mode`` session need not agree on: pass-through kernels and, outside
    ``auto``, measured picks (``tune``/``record`` ranks measure for themselves and may differ by design)."""
    sources = {"out_of_scope", "recorded"}
    return frozenset(sources if mode == "auto" else sources | {"tuned"})


@dataclass(frozen=True, slots=True)
class Decision:
    """One choice made at the first use of a (kernel, key) in this process."""

    kernel: str  # ``core.identity.kernel_id``
    key: str  # the call's ``core.key.Key`` (its text); ``"*"`` for out-of-scope kernels
    signature: str  # ``config_signature`` of the launched config; empty when out of scope
    source: str  # one of ``SOURCES``
    config: dict[str, Any] = field(default_factory=dict)  # ``config_data`` of the launched config
    arch: str = "unknown"
    rank: int = 0
    origin: str | None = None  # the table file of a ``table``/``nearest`` decision; the ``adopted`` publisher
    source_hash: str | None = None
    timings: dict[str, Any] | None = None  # of ``tuned``/``recorded`` decisions; ``adopted``: the publisher's
    nearest_key: str | None = None  # ``nearest``: the key of the table entry whose config was launched
    matched_by: str | None = None  # ``"content"``: entry found under another module (same qualname, source)
    entry_kernel: str | None = None  # ``matched_by="content"``: the kernel id the entry was tuned under
    # ``chaos``: ``first`` (claimed first in the job), ``differs`` (off the first claim: this rank must
    # raise), ``rank_formula`` (no process group, or a graph capture), or ``CHAOS_NO_OTHER_CONFIG``.
    chaos: str | None = None
    # The table entry's numerics audit of the launched config: ``False`` when its own launches gave
    # different bits (docs/numerics.md); ``None``: not audited.
    deterministic: bool | None = None
    # ``core.identity.config_list_digest``: the declared configs the candidates came from. Entries
    # carry it, so one source under two module names with two config lists is two kernels.
    config_list_digest: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain data, the key in ``Key.to_data`` form; a key given as text raises ``ValueError``."""
        key = self.key
        if not isinstance(key, Key) and key != "*":
            raise ValueError(f"decision of kernel {self.kernel!r}: {text_key_error(key)}")
        data = asdict(self)
        data["key"] = key.to_data() if isinstance(key, Key) else key
        return data


Listener = Callable[[Decision], None]


class DecisionLog:
    """Thread-safe append-only log of decisions, with first-use listeners."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._decisions: list[Decision] = []
        self._listeners: list[Listener] = []

    def record(self, decision: Decision) -> None:
        """Append ``decision``, then notify listeners (before its launch); a listener's exception
        reaches the launch after the decision is logged, so a divergence still shows in the log."""
        with self._lock:
            self._decisions.append(decision)
            listeners = list(self._listeners)
        for listener in listeners:
            listener(decision)

    def decisions(self) -> list[Decision]:
        with self._lock:
            return list(self._decisions)

    def clear(self) -> None:
        with self._lock:
            self._decisions.clear()

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            if listener not in self._listeners:
                self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)


_LOG = DecisionLog()


def decision_log() -> DecisionLog:
    return _LOG


def get_decisions() -> list[Decision]:
    """A snapshot of every decision recorded in this process, in order."""
    return _LOG.decisions()


def print_decision(d: Decision) -> None:
    """Listener for ``print_decisions``: one line per decision on stderr, as ``TRITON_PRINT_AUTOTUNING``."""
    origin = f" from {d.origin}" if d.origin else ""
    line = f"rank {d.rank}: {d.kernel} [{d.key}] -> {d.signature or '-'} ({d.source}{origin})"
    sys.stderr.write(f"megatron_tuning: {printable(line)}\n")
