"""Chaos mode's coordinator: no rank repeats the job's first pick for a (kernel, key).

A rank-only formula cannot keep every pair of ranks apart once there are more ranks than
distinct configs (8 ranks, pipeline stage ``rank % 4``, 4 configs: each stage's two ranks pick
the same config under ``(rank + h) % 4``, and the positive control passes silently). So the
first rank to reach a (kernel, key) claims its pick in the job's c10d store with one atomic
``compare_set``, and every later rank gets that claim back from the same call and launches a
different config (``core.chaos.choose_chaos``). Any two ranks that reach a key then include one
that differs from the first: the agreement check must fire in every layout.

Chaos is a test mode, so one store request per new (kernel, key) per rank is fine. A rank never
waits: ``compare_set`` returns at once. Inside a CUDA graph capture nothing touches the store: a
key re-decided there (a new session after a warm-up) uses this process's last claim for it. The
process group is looked up at each claim, so a coordinator made before ``init_process_group``
starts coordinating once one exists. Claims are scoped to the agreement group, so a group check
compares ranks that avoided one claim.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch.distributed as dist

from ..core.chaos import ChaosClaim
from ..core.env import parse_int
from .wire import default_store, group_ranks, identity_digest, scope_id

logger = logging.getLogger(__name__)

_PREFIX = "megatron_tuning/chaos/v1"
_sessions = 0  # coordinators made in this process: each session claims under fresh store keys
_sessions_lock = threading.Lock()
# The last claim this process got per (kernel, key, arch), any session: what ``recall`` answers.
_recalled: dict[tuple[str, str, str], ChaosClaim] = {}


class StoreChaos:
    """``core.choice.ChaosCoordinator`` over a c10d store (the job's default store by default).

    ``store``, ``rank`` and ``ranks`` exist so tests can drive it without a process group.
    """

    def __init__(
        self,
        group: Any = None,
        *,
        store: Any = None,
        rank: int | None = None,
        ranks: Any = None,
        namespace: str | None = None,
    ) -> None:
        global _sessions
        with _sessions_lock:
            _sessions += 1
            number = _sessions
        # Elastic restarts reuse the rendezvous store: the restart count keeps old claims apart.
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._namespace = namespace if namespace is not None else f"r{restart}/s{number}"
        self._group = group
        self._given_store = store
        self._given_rank = rank
        self._given_ranks = list(ranks) if ranks is not None else None
        self._store: Any = None
        self._rank = 0
        self._lock = threading.Lock()

    def claim(self, kernel: str, key: str, arch: str, signature: str) -> ChaosClaim | None:
        """Claim ``signature`` as the job's first pick for (kernel, key, arch); return the first claim."""
        store = self._bound_store()
        if store is None:
            return None
        mine = f"{self._rank}\n{signature}"
        raw = store.compare_set("c/" + identity_digest(kernel, key, arch).hex(), "", mine)
        claim = _decode(raw, kernel, key)
        if claim is not None:
            with _sessions_lock:
                _recalled[(kernel, key, arch)] = claim
        return claim

    def recall(self, kernel: str, key: str, arch: str) -> ChaosClaim | None:
        """The last claim this process got for (kernel, key, arch), without touching the store."""
        with _sessions_lock:
            return _recalled.get((kernel, key, arch))

    def _bound_store(self) -> Any:
        with self._lock:
            if self._store is not None:
                return self._store
            if self._given_store is None and not (dist.is_available() and dist.is_initialized()):
                return None  # not (yet) in a job: the rank formula applies
            base = self._given_store if self._given_store is not None else default_store()
            ranks = self._given_ranks if self._given_ranks is not None else group_ranks(self._group)
            self._rank = self._given_rank if self._given_rank is not None else dist.get_rank()
            scope = scope_id(self._group, ranks)
            self._store = dist.PrefixStore(f"{_PREFIX}/{self._namespace}/{scope}", base)
            return self._store


def _decode(raw: Any, kernel: str, key: str) -> ChaosClaim | None:
    text = bytes(raw).decode("utf-8", "replace") if not isinstance(raw, str) else raw
    head, sep, signature = text.partition("\n")
    rank = parse_int(head) if len(head) <= 12 else None
    if not sep or rank is None or rank < 0 or not signature:
        # Chaos is a test mode and the job must go on: say what is wrong, fall back to the formula.
        logger.warning(
            "chaos: the job's store holds an unreadable claim %r for kernel %s with key %s "
            "(written by another megatron_tuning version?); this rank picks by the rank formula",
            text[:200],
            kernel,
            key,
        )
        return None
    return ChaosClaim(rank, signature)


def start_chaos(group: Any = None) -> StoreChaos:
    """The coordinator for a chaos session; it coordinates once a process group exists."""
    return StoreChaos(group)


__all__ = ["StoreChaos", "start_chaos"]
