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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ..core.choice import Choice, ConfigTable, choose_on_miss, pin_without_fallback
from ..core.errors import ConsensusError
from ..core.identity import config_data, config_signature
from ..core.policy import TuningPolicy

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
    if winner.rank == consensus.rank:
        return Choice(config, "tuned"), timings
    # Another rank published first: launch its config, keep our measurement for the record.
    return _adopt(winner, candidates, kernel, key, consensus.rank), timings


def _adopt(
    published: PublishedDecision, candidates: Sequence[Any], kernel: str, key: str, rank: int
) -> Choice:
    for candidate in candidates:  # position order: the first live duplicate wins
        if config_signature(candidate) == published.signature:
            origin = "this rank" if published.rank == rank else f"rank {published.rank}"
            return Choice(candidate, "adopted", origin)
    live = "; ".join(config_signature(c) for c in candidates) or "(none)"
    raise ConsensusError(
        kernel,
        key,
        f"rank {published.rank} published {published.signature}, which is not among this rank's "
        f"{len(candidates)} live configs ({live})",
    )


__all__ = ["Consensus", "Measure", "PublishedDecision", "auto_choice"]
