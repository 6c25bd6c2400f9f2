"""``auto`` mode's consensus: one tuned decision per (arch, kernel, key) for the whole job.

A rank that misses the tables looks for a decision already published in the job's c10d store
and adopts it; otherwise it tunes, then publishes with the store's atomic ``compare_set``. The
first writer wins, and a rank that loses the race launches the winner's config, not its own.

A rank never waits for another rank: ``check`` and ``compare_set`` return at once, and ``get``
is only called on a key that ``check`` saw. So no order of ranks, no pipeline stage that never
reaches a kernel, and no peer stuck in a collective can stall a launch. What crosses ranks is
plain JSON text (the config's ``config_data`` and signature), never a pickle.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..core.errors import ConsensusError
from .wire import default_store, identity_digest

logger = logging.getLogger(__name__)

_PREFIX = "megatron_tuning/auto/v1"


@dataclass(frozen=True, slots=True)
class Published:
    """A decision as the job's store holds it."""

    config: dict[str, Any]
    signature: str
    rank: int


class StoreConsensus:
    """Publish and adopt ``auto`` decisions through a c10d store (the job's, by default).

    ``store`` and ``rank`` exist so tests can drive the protocol without a process group.
    """

    def __init__(self, store: Any = None, *, rank: int | None = None, namespace: str | None = None) -> None:
        base = store if store is not None else default_store()
        # Elastic restarts reuse the rendezvous store: a restarted job tunes afresh, but its cache
        # table (written at exit) already holds what the previous attempt tuned.
        namespace = (
            namespace if namespace is not None else "r" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        )
        self._store = dist.PrefixStore(f"{_PREFIX}/{namespace}", base)
        self.rank = dist.get_rank() if rank is None else int(rank)

    def lookup(self, kernel: str, key: str, arch: str) -> Published | None:
        """The decision published for (arch, kernel, key), or ``None``; never waits."""
        name = _store_key(kernel, key, arch)
        if not self._store.check([name]):
            return None
        return _decode(self._store.get(name), kernel, key)

    def publish(
        self, kernel: str, key: str, arch: str, config: Mapping[str, Any], signature: str
    ) -> Published:
        """Publish ours unless someone was first; return the decision every rank must launch."""
        mine = json.dumps({"config": dict(config), "signature": signature, "rank": self.rank}, sort_keys=True)
        winner = self._store.compare_set(_store_key(kernel, key, arch), "", mine)
        published = _decode(winner, kernel, key)
        if published.rank != self.rank:
            logger.info(
                "auto: rank %d published %s for %s [%s] first; launching it (ours was %s)",
                published.rank,
                published.signature,
                kernel,
                key,
                signature,
            )
        return published


def start_consensus() -> StoreConsensus | None:
    """The job's consensus when a process group is up; ``None`` for a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return StoreConsensus()


def _store_key(kernel: str, key: str, arch: str) -> str:
    return "d/" + identity_digest(kernel, key, arch).hex()


def _decode(raw: Any, kernel: str, key: str) -> Published:
    text = bytes(raw).decode("utf-8") if not isinstance(raw, str) else raw
    try:
        data = json.loads(text)
        return Published(
            config=dict(data["config"]), signature=str(data["signature"]), rank=int(data["rank"])
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ConsensusError(
            kernel,
            key,
            f"the job's store holds an unreadable decision ({type(exc).__name__}: {exc}); "
            "was it written by another megatron_tuning version?",
        ) from exc


__all__ = ["Published", "StoreConsensus", "start_consensus"]
