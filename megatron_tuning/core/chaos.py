"""Chaos mode: a per-rank different config, on purpose, as the agreement check's positive control.
In a job the first rank to reach a (kernel, key) keeps its pick and every later one differs (a rank
formula alone cannot keep every pair apart)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .choice import Choice
from .decisions import CHAOS_NO_OTHER_CONFIG
from .fallback import order_by_cost
from .identity import config_signature, current_rank, kernel_id
from .key import tuning_key


def chaos_index(kernel: str, key: str, rank: int, count: int) -> int:
    """The rank formula: ranks fewer than ``count`` apart pick different configs."""
    offset = int(hashlib.sha256(f"{kernel}\n{key}".encode()).hexdigest()[:8], 16)
    return (rank + offset) % count


@dataclass(frozen=True, slots=True)
class ChaosClaim:
    rank: int
    signature: str


class ChaosCoordinator(Protocol):
    """The job's first claim (``None`` without a process group); ``recall``: without store traffic."""

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
    """This rank's pick among the distinct live configs, in cost order: the rank formula without a
    coordinator, else the first claim wins and later ranks move off it. ``offline`` (a CUDA graph
    capture): the recalled claim, or the rank formula, decides."""
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
    claim = None
    if coordinator is not None:
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
    """A per-rank different config by the rank formula (in a job, chaos mode uses the store)."""
    key = tuning_key(autotuner, args, kwargs)
    return choose_chaos(kernel_id(autotuner), key, candidates, rank=current_rank()).config
