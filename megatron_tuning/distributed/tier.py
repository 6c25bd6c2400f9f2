"""A node-level tier for ``auto``: one small store per node, so the job's store sees a node, not 8 ranks.

At 10,000 ranks, one request per rank per new key is 10,000 requests per key on the one store
server of the job (``benchmarks/bench_scale.py``). With the tier, the first rank of each node
(``LOCAL_RANK`` 0) hosts a ``TCPStore`` on the loopback interface and advertises its port in the
job's store. For each global request that every rank of a node would make alike (the lookup of a
new key, the publish once its tuning is done), the first rank of the node to get there makes it
and leaves the answer in the node's store; the node's other ranks read it there.

Waiting is bounded and only ever for a node-mate's *single store request* (never for its tuning,
which could sit behind a collective on its GPU stream): a rank that finds a node-mate's claim
waits up to ``WAIT_S`` for the answer, then makes the request itself. The job's store stays the
authority (first writer wins there), so a rank that goes around the tier is still correct, only
costlier. Ranks start using the tier once its store is advertised; until then they go direct.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..core import env
from ..core.errors import PolicyError
from .storeops import decode_text, request, store_errors

logger = logging.getLogger(__name__)

ENV_TIER = "MEGATRON_TUNING_TIER"
TIER_CHOICES = ("node", "off")
TIER_ABOVE_RANKS = 64
"""Unset ``MEGATRON_TUNING_TIER``: the node tier is used in worlds larger than this."""
WAIT_S = 10.0
_TIMEOUT = timedelta(seconds=60)


def tier_wanted(world: int, local_world: int) -> bool:
    """Whether ``auto`` should use the node tier (``MEGATRON_TUNING_TIER``, else by world size)."""
    choice = env.env_choice(ENV_TIER, TIER_CHOICES)
    if choice is None:
        return world > TIER_ABOVE_RANKS and local_world > 1
    if choice == "node" and local_world <= 1:
        raise PolicyError(ENV_TIER, "node", "a job with several ranks per node (LOCAL_WORLD_SIZE > 1)")
    return choice == "node"


class NodeTier:
    """This rank's view of its node's store (``node`` names the node, e.g. torchrun's GROUP_RANK)."""

    def __init__(self, job_store: Any, node: str, local_rank: int, *, rank: int) -> None:
        self._job = job_store
        self.node = node
        self.local_rank = local_rank
        self.rank = rank
        self._store: Any = None
        self._server: Any = None
        self.global_requests = 0
        self._dead = False
        if local_rank == 0:
            self._server = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_TIMEOUT, use_libuv=True
            )
            self._store = self._server
            request(
                "the node tier's advertisement",
                lambda: self._job.set(f"tier/{node}", str(self._server.port)),
                store=self._job,
            )

    def store(self) -> Any:
        """The node's store, or ``None`` while its first rank has not advertised it yet."""
        if self._store is None and not self._dead:
            name = f"tier/{self.node}"
            if not request("the node tier's address", lambda: self._job.check([name]), store=self._job):
                return None
            port = int(decode_text(self._job.get(name), "the node tier's address"))
            self._store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_TIMEOUT, use_libuv=True)
        return self._store

    def once(self, name: str, ask: Callable[[], Any]) -> bytes:
        """``ask()`` (one request to the job's store) made once per node; every caller gets its answer.

        A node store that fails (its host rank died) is dropped: this rank goes direct from then on.
        """
        try:
            node = self.store()
            if node is None:
                return self._direct(ask)
            mine = str(self.rank)
            claim = bytes(node.compare_set(f"c/{name}", "", mine)).decode("utf-8", "replace")
            if claim == mine:
                answer = self._direct(ask)
                node.set(f"v/{name}", answer)
                return answer
            try:
                node.wait([f"v/{name}"], timedelta(seconds=WAIT_S))
            except store_errors():
                logger.warning(
                    "megatron_tuning: node tier: rank %s claimed %s but left no answer within %.0f s; "
                    "asking the job's store directly",
                    claim,
                    name,
                    WAIT_S,
                )
                return self._direct(ask)
            return bytes(node.get(f"v/{name}"))
        except store_errors() as exc:
            if self._store is not None and self._store is not self._server:
                logger.warning("megatron_tuning: node tier %s failed (%s); going direct", self.node, exc)
                self._store = None
                self._dead = True
            return self._direct(ask)

    def _direct(self, ask: Callable[[], Any]) -> bytes:
        self.global_requests += 1
        return bytes(ask())


def start_tier(job_store: Any) -> NodeTier | None:
    """The node tier for this rank when the job wants one (torchrun's LOCAL_* and GROUP_RANK)."""
    try:
        world = dist.get_world_size()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return None
    if not tier_wanted(world, local_world):
        return None
    node = os.environ.get("GROUP_RANK") or str(dist.get_rank() // local_world)
    return NodeTier(job_store, node, local_rank, rank=dist.get_rank())


__all__ = ["ENV_TIER", "NodeTier", "start_tier", "tier_wanted"]
