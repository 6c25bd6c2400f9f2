"""``auto`` mode's decision for one (kernel, key): table, else the job's decision, else tune once.

1. A table entry (or a block-size override, or a single live config) pins it, as in
   ``deterministic``. Explicit and shipped tables are inputs every rank compares at init; a hit in
   this rank's own ``auto`` cache is not: caches are per node, so in a job it is *proposed* through
   the consensus (first writer wins) like a tuned result, and the winner is launched.
2. Else a decision another rank of this job already published is adopted, matched back to a live
   candidate by signature (so its ``Config.pre_hook`` survives).
3. Else this rank tunes the live candidates with the noise-aware tuner and publishes the result;
   a rank that loses the race launches the winner's config.

Where nothing can be measured (``may_measure=False``: compiled-code tracing, no tuner) the
policy's miss rule applies instead. The consensus (``distributed.store.StoreConsensus``) is handed
in by the session; ``None`` means a single process.
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
    """What ``auto`` needs from the job: ``distributed.store.StoreConsensus`` implements it."""

    rank: int

    def is_local(self, origin: str | None) -> bool: ...

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
        return _proposed(pinned, candidates, kernel, key, arch, consensus), None
    if consensus is not None:
        published = consensus.lookup(kernel, key, arch)
        if published is not None:
            return _adopt(published, candidates, kernel, key, consensus.rank), None
    if not may_measure or measure is None:
        fallback = choose_on_miss(autotuner, candidates, key, pinned, table=table, on_miss=policy.on_miss)
        return _proposed(fallback, candidates, kernel, key, arch, consensus), None
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


def _proposed(
    choice: Choice, candidates: Sequence[Any], kernel: str, key: str, arch: str, consensus: Consensus | None
) -> Choice:
    """``choice``, unless it came from this node's own cache in a job: then it is proposed to the
    job (first writer wins) and the winner is launched, so per-node caches never split ranks."""
    if consensus is None or not consensus.is_local(choice.origin):
        return choice
    mine = config_signature(choice.config)
    winner = consensus.publish(kernel, key, arch, config_data(choice.config), mine)
    return choice if winner.signature == mine else _adopt(winner, candidates, kernel, key, consensus.rank)


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


__all__ = ["Consensus", "Measure", "PublishedDecision", "auto_choice"]
