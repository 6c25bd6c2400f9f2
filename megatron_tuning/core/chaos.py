"""Chaos mode: a per-rank different config, on purpose, as the agreement check's positive control.

The pick is among the *distinct* live configs (duplicates in a config list launch the same thing,
torchao's ``int8_mm`` lists 27 configs of which 25 differ). A rank-only formula cannot keep every
pair of ranks apart once there are more ranks than distinct configs, so in a job the ranks
coordinate through a ``ChaosCoordinator`` (``distributed.store``): the first rank to reach a
(kernel, key) keeps its pick and every later one launches another. Without one (a single process)
the rank formula applies. ``chaos_choice`` is the seed API, a pure function of rank and candidates.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .choice import Choice
from .decisions import CHAOS_NO_OTHER_CONFIG
from .fallback import order_by_cost
from .identity import config_signature, current_rank, kernel_id, tuning_key


def chaos_index(kernel: str, key: str, rank: int, count: int) -> int:
    """Position that the rank formula picks among ``count`` distinct configs: ranks fewer than
    ``count`` apart get different positions; ranks a multiple of ``count`` apart the same one."""
    offset = int(hashlib.sha256(f"{kernel}\n{key}".encode()).hexdigest()[:8], 16)
    return (rank + offset) % count


@dataclass(frozen=True, slots=True)
class ChaosClaim:
    """The first chaos pick the job saw for a (kernel, key): who made it, and its signature."""

    rank: int
    signature: str


class ChaosCoordinator(Protocol):
    """What chaos mode needs from the job; ``distributed.store.StoreChaos`` implements it.

    ``claim`` records ``signature`` as the job's first pick for (kernel, key, arch) unless a rank
    was first, and returns the first claim either way (one atomic store request); ``None`` when
    it cannot coordinate (no process group yet), so the rank formula applies. ``recall`` returns
    the last claim this process got for (kernel, key, arch), in any session, without store
    traffic (inside a CUDA graph capture), so a key re-decided there launches what it did outside.
    """

    def claim(self, kernel: str, key: str, arch: str, signature: str) -> ChaosClaim | None: ...

    def recall(self, kernel: str, key: str, arch: str) -> ChaosClaim | None: ...


def choose_chaos(
    kernel: str,
    key: str,
    candidates: Sequence[Any],
    *,
    rank: int,
    arch: str = "unknown",
    coordinator: ChaosCoordinator | None = None,
    offline: bool = False,
) -> Choice:
    """Chaos mode's pick for one rank: a config other ranks do not launch, on purpose.

    Picks among the *distinct* live configs in cost order. Without a coordinator, by the rank
    formula (``chaos_index``). With one, the first rank to reach (kernel, key) keeps its formula
    pick and every later rank launches a different config (its formula pick, or, where that is
    the first claim, another one), so any two ranks that reach a key include one that differs
    from the first: the agreement check must fire, whatever the layout or number of ranks.
    With a single distinct config no rank can differ: ``chaos="no_other_config"`` says so.
    ``offline`` (inside a CUDA graph capture): no claim is made, the coordinator's recalled claim
    (or else the rank formula) decides.
    """
    if not candidates:
        raise ValueError(f"no live configs for kernel {kernel}")
    by_signature: dict[str, Any] = {}  # distinct signatures in cost order, first config of each
    for config in order_by_cost(candidates):
        by_signature.setdefault(config_signature(config), config)
    signatures = list(by_signature)
    if len(signatures) == 1:
        detail = f"no other distinct config (1 distinct of {len(candidates)} live)"
        return Choice(by_signature[signatures[0]], "chaos", detail, chaos=CHAOS_NO_OTHER_CONFIG)
    mine = signatures[chaos_index(kernel, key, rank, len(signatures))]
    if coordinator is None:
        claim = None
    else:
        claim = (
            coordinator.recall(kernel, key, arch) if offline else coordinator.claim(kernel, key, arch, mine)
        )
    if claim is None:
        detail = "rank formula (CUDA graph capture: no store traffic)" if offline else "rank formula"
        return Choice(by_signature[mine], "chaos", detail, chaos="rank_formula")
    if claim.rank == rank:  # ours (also when a second autotuner of this id asks again)
        return Choice(
            by_signature.get(claim.signature, by_signature[mine]), "chaos", "first claim", chaos="first"
        )
    if mine != claim.signature:
        return Choice(by_signature[mine], "chaos", f"differs from rank {claim.rank}'s claim", chaos="differs")
    others = [s for s in signatures if s != claim.signature]
    moved = others[chaos_index(kernel, key, rank, len(others))]
    return Choice(by_signature[moved], "chaos", f"moved off rank {claim.rank}'s claim", chaos="differs")


def chaos_choice(
    autotuner: Any, candidates: Sequence[Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """A per-rank different config, on purpose: the positive control for the agreement check.

    Reproducible (the same rank picks the same config in every run). The pick is among the
    distinct configs (duplicates count once): with ``n >= 2`` of them, ranks fewer than ``n``
    apart, consecutive ranks in particular, always pick different configs; ranks ``n`` apart
    pick the same one. ``init_deterministic_tuning`` in chaos mode does better in a job: the
    ranks coordinate through the job's store so no rank repeats the first rank's pick.
    """
    if not candidates:
        raise ValueError(f"no live configs for kernel {kernel_id(autotuner)}")
    key = tuning_key(autotuner, args, kwargs)
    return choose_chaos(kernel_id(autotuner), key, candidates, rank=current_rank()).config


__all__ = [
    "ChaosClaim",
    "ChaosCoordinator",
    "chaos_choice",
    "chaos_index",
    "choose_chaos",
]
