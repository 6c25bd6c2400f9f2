"""``auto`` mode's decision for one (kernel, key): table, else the job's published decision, else tune.

1. A table entry (or a block-size override, or a single live config) pins it, as in
   ``deterministic``; the cache table of earlier ``auto`` runs is part of the table search path.
2. Else a decision another rank of this job already published is adopted, matched back to a
   live candidate by signature (so its ``Config.pre_hook`` survives).
3. Else this rank tunes the live candidates with the noise-aware tuner and publishes the result;
   the first writer wins and a rank that loses the race launches the winner's config.

Where measuring is not possible (``may_measure=False``: compiled-code tracing, no tuner) the
policy's miss rule applies instead (nearest shape, cheapest, or an error). The consensus object
is handed in by the session (``distributed.consensus``); ``None`` means a single process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ..core.choice import Choice, ConfigTable, Miss, choose_on_miss, match_live, pin_without_fallback
from ..core.errors import ConsensusError
from ..core.identity import config_data, config_signature, kernel_source_hash
from ..core.policy import TuningPolicy
from ..tables.search import installed_triton_version
from ..tables.shipped import shipped_tables_dir

# measure(autotuner, candidates, args, kwargs, kernel, key) -> (config, timings)
Measure = Callable[[Any, list[Any], tuple[Any, ...], dict[str, Any], str, str], tuple[Any, dict[str, Any]]]


class PublishedDecision(Protocol):
    config: Mapping[str, Any]
    signature: str
    rank: int


class Consensus(Protocol):
    """What ``auto`` needs from the job: ``distributed.consensus.StoreConsensus`` implements it."""

    rank: int

    def lookup(self, kernel: str, key: str, arch: str) -> PublishedDecision | None: ...

    def publish(
        self, kernel: str, key: str, arch: str, config: Mapping[str, Any], signature: str
    ) -> PublishedDecision: ...


class CacheView(Protocol):
    """How to treat this rank's cache hits (``distributed.job_cache.JobCacheView`` implements it)."""

    local_path: str
    differs: bool
    origin: str

    def job_entry(self, arch: str, kernel: str, key: str) -> Any: ...


def auto_choice(
    autotuner: Any,
    candidates: list[Any],
    key: str,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    kernel: str,
    arch: str,
    policy: TuningPolicy,
    table: ConfigTable | None,
    measure: Measure | None,
    consensus: Consensus | None,
    may_measure: bool = True,
) -> tuple[Choice, dict[str, Any] | None]:
    """The choice for (kernel, key) in ``auto`` mode, and the timings when this rank measured."""
    pinned = pin_without_fallback(autotuner, candidates, key, table=table, block_sizes=policy.block_sizes)
    view: CacheView | None = getattr(consensus, "cache_view", None)
    if consensus is not None and view is not None and view.differs:
        reconciled = _with_job_cache(
            autotuner, candidates, key, pinned, view, consensus, kernel=kernel, arch=arch
        )
        if reconciled is not None:
            return reconciled, None
        if isinstance(pinned, Choice) and pinned.origin == view.local_path:
            pinned = Miss("this rank's cache entry is not the job's")  # it was proposed and lost
    if isinstance(pinned, Choice):
        return pinned, None
    if consensus is not None:
        published = consensus.lookup(kernel, key, arch)
        if published is not None:
            return _adopt(published, candidates, kernel, key, consensus.rank), None
    if not may_measure or measure is None:
        return choose_on_miss(autotuner, candidates, key, pinned, table=table, on_miss=policy.on_miss), None
    args, kwargs = call
    config, timings = measure(autotuner, candidates, args, kwargs, kernel, key)
    if consensus is None:
        return Choice(config, "tuned"), timings
    winner = consensus.publish(kernel, key, arch, config_data(config), config_signature(config))
    if winner.rank == consensus.rank and winner.signature == config_signature(config):
        return Choice(config, "tuned"), timings
    # Another rank published first (maybe the same config): launch its config, keep our
    # measurement for the record. A record naming this rank with another config is adopted too.
    return _adopt(winner, candidates, kernel, key, consensus.rank), timings


def _with_job_cache(
    autotuner: Any,
    candidates: list[Any],
    key: str,
    pinned: Choice | Miss,
    view: CacheView,
    consensus: Consensus,
    *,
    kernel: str,
    arch: str,
) -> Choice | None:
    """This rank's cache differs from the job's: the job's entry wins, a local-only hit is proposed.

    ``None`` leaves the decision to the usual path (an explicit table, an override, a shipped
    table, or a miss). Explicit tables come before the cache in the search order on every rank,
    so their hits stand; a cache hit or a shipped-table hit yields to the job's cache entry.
    """
    if isinstance(pinned, Choice) and (pinned.source != "table" or _explicit(pinned.origin, view)):
        return None
    entry = view.job_entry(arch, kernel, key)
    if entry is not None and _fresh(entry, autotuner):
        live = match_live(entry.config, candidates)
        if live is None:
            raise ConsensusError(
                kernel,
                key,
                f"{view.origin} holds {config_signature(entry.config)}, which is not among this rank's "
                f"{len(candidates)} live configs",
            )
        return Choice(live, "adopted", view.origin)
    if not (isinstance(pinned, Choice) and pinned.origin == view.local_path):
        return None
    # Only this rank's cache has the key: propose it like a tuned result (first writer wins).
    published = consensus.lookup(kernel, key, arch)
    if published is None:
        mine = pinned.config
        published = consensus.publish(kernel, key, arch, config_data(mine), config_signature(mine))
        if published.signature == config_signature(mine):
            return Choice(mine, "table", f"{view.local_path} (proposed to the job)")
    return _adopt(published, candidates, kernel, key, consensus.rank)


def _explicit(origin: str | None, view: CacheView) -> bool:
    if origin is None or origin == view.local_path:
        return False
    return not os.path.realpath(origin).startswith(os.path.realpath(str(shipped_tables_dir())) + os.sep)


def _fresh(entry: Any, autotuner: Any) -> bool:
    """A cache entry tuned for this kernel source and this Triton (stale ones are misses)."""
    running = kernel_source_hash(autotuner)
    if entry.source_hash is not None and running is not None and entry.source_hash != running:
        return False
    version = installed_triton_version()
    return entry.triton_version is None or version is None or entry.triton_version == version


def _adopt(
    published: PublishedDecision, candidates: Sequence[Any], kernel: str, key: str, rank: int
) -> Choice:
    for candidate in candidates:  # position order: the first live duplicate wins
        if config_signature(candidate) == published.signature:
            # A record naming this rank that this rank did not publish (it is adopting, so its own
            # pick differed or it never tuned) came from elsewhere: say so rather than "this rank".
            origin = (
                f"rank {published.rank}" if published.rank != rank else "the job's store (names this rank)"
            )
            return Choice(candidate, "adopted", origin)
    live = "; ".join(config_signature(c) for c in candidates) or "(none)"
    raise ConsensusError(
        kernel,
        key,
        f"rank {published.rank} published {published.signature}, which is not among this rank's "
        f"{len(candidates)} live configs ({live})",
    )


__all__ = ["CacheView", "Consensus", "Measure", "PublishedDecision", "auto_choice"]
