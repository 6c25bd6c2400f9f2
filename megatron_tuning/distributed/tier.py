"""A node-level tier for ``auto``: one request to the job's store per node and new key, not per rank.

At 10,000 ranks, one request per rank per new key is 10,000 requests per key on the one store
server of the job (``benchmarks/bench_scale.py``). With the tier, the ranks of one node share a
folder in node-local memory (``/dev/shm``, else the temp folder): for each global request that
every rank of the node would make alike (the publish-or-adopt ``compare_set`` of a key once its
tuning is done), the first rank to create the request's *claim* file (``O_CREAT | O_EXCL``, atomic)
makes the request and writes the answer next to it (temp file + rename, atomic); the node's other
ranks read the answer there (``once``), and a node-mate that reaches the key later finds it before
tuning (``peek``). No server, no thread, no port, no clock: only local file system calls.

Only final answers are shared (the job's winner for a key never changes), so nothing expires and
nobody asks again in rounds: the number of store requests does not depend on how long a burst
takes. Waiting is bounded and only ever for a node-mate's *single store request* (never for its
tuning, which could sit behind a collective on its GPU stream): a rank that finds a claim without
an answer polls for up to ``WAIT_S``, then makes the request itself. The job's store stays the
authority (first writer wins there), so a rank that goes around the tier is still correct, only
costlier.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core import env
from ..core.errors import PolicyError

logger = logging.getLogger(__name__)

ENV_TIER = "MEGATRON_TUNING_TIER"
TIER_CHOICES = ("node", "off")
TIER_ABOVE_RANKS = 64
"""Unset ``MEGATRON_TUNING_TIER``: the node tier is used in worlds larger than this."""
WAIT_S = 10.0


def tier_wanted(world: int, local_world: int) -> bool:
    """Whether ``auto`` should use the node tier (``MEGATRON_TUNING_TIER``, else by world size)."""
    choice = env.env_choice(ENV_TIER, TIER_CHOICES)
    if choice is None:
        return world > TIER_ABOVE_RANKS and local_world > 1
    if choice == "node" and local_world <= 1:
        raise PolicyError(ENV_TIER, "node", "a job with several ranks per node (LOCAL_WORLD_SIZE > 1)")
    return choice == "node"


def node_folder(job: str) -> Path | None:
    """This user's folder for ``job`` in node-local memory, made private; ``None`` if impossible."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK | os.X_OK) else Path(tempfile.gettempdir())
    name = "megatron_tuning-tier-" + hashlib.sha256(f"{os.getuid()}\n{job}".encode()).hexdigest()[:24]
    folder = base / name
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError as exc:
        logger.warning("megatron_tuning: node tier off: cannot make %s (%s)", folder, exc)
        return None
    # Another user's folder, or a planted link, is never used: its answers could be anything.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        logger.warning("megatron_tuning: node tier off: %s is not this user's private folder", folder)
        return None
    return folder


class NodeTier:
    """This rank's side of its node's shared folder (``folder`` from ``node_folder``)."""

    def __init__(self, folder: Path, *, rank: int, owner: bool = False) -> None:
        self.folder = folder
        self.rank = rank
        self.owner = owner
        """Whether this rank removes the folder at ``close`` (the node's first rank)."""
        self.global_requests = 0

    def once(self, name: str, ask: Callable[[], Any], *, fallback: bytes | None = None) -> bytes:
        """``ask()`` (one request to the job's store) made once per node; every caller gets its answer.

        The answer is kept for the job's life, so it should be final (the same whenever asked).
        A node-mate's claim left without an answer for ``WAIT_S`` means asking the store directly,
        or, where the caller can do without the answer, returning ``fallback`` (no request).
        """
        stem = self._stem(name)
        value = stem.with_suffix(".value")
        try:
            answer = _read(value)
            if answer is not None:
                return answer
            try:
                claim = stem.with_suffix(".claim")
                os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
            except FileExistsError:
                answer = _poll(value, WAIT_S)
                if answer is not None:
                    return answer
                logger.warning(
                    "megatron_tuning: node tier: a node-mate claimed %s but left no answer within %.0f s; %s",
                    name,
                    WAIT_S,
                    "going on without it" if fallback is not None else "asking the job's store directly",
                )
                return fallback if fallback is not None else self._direct(ask)
            answer = self._direct(ask)
            _write(value, answer)
            return answer
        except OSError as exc:  # the folder went away (the node's first rank closed): go direct
            logger.debug("node tier %s: %s; asking the job's store directly", self.folder, exc)
            return self._direct(ask)

    def peek(self, name: str) -> bytes | None:
        """The answer a node-mate's ``once(name, ...)`` left, if one is there; never waits, never asks."""
        try:
            return _read(self._stem(name).with_suffix(".value"))
        except OSError:
            return None

    def _stem(self, name: str) -> Path:
        return self.folder / hashlib.sha256(name.encode()).hexdigest()[:40]

    def _direct(self, ask: Callable[[], Any]) -> bytes:
        self.global_requests += 1
        return bytes(ask())

    def close(self) -> None:
        if self.owner:
            shutil.rmtree(self.folder, ignore_errors=True)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _poll(path: Path, timeout_s: float) -> bytes | None:
    """The answer at ``path`` once there, or ``None`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0002
    while True:
        answer = _read(path)
        if answer is not None:
            return answer
        if not path.parent.is_dir():  # the node's first rank closed the tier: go direct
            raise FileNotFoundError(path.parent)
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        # Most answers come within a millisecond; a long wait polls at 10 Hz, so a node's waiting
        # ranks (1,024 of them on 2 cores in bench_scale) do not starve the one making the request.
        pause = min(pause * 2, 0.1)


def _write(path: Path, data: bytes) -> None:
    temp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(temp, "wb") as handle:
        handle.write(data)
    os.replace(temp, path)


def local_world_size() -> int | None:
    """Ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 unset, ``None`` if not a number)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return None


def start_tier(namespace: str) -> NodeTier | None:
    """The node tier for this rank when the job wants one (torchrun's LOCAL_* variables)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    local_world = local_world_size()
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return None
    if local_world is None:
        return None
    if not tier_wanted(world, local_world):
        return None
    run = os.environ.get("TORCHELASTIC_RUN_ID") or (
        f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    )
    folder = node_folder(f"{run}\n{namespace}")
    if folder is None:
        return None
    return NodeTier(folder, rank=dist.get_rank(), owner=local_rank == 0)


__all__ = ["ENV_TIER", "NodeTier", "local_world_size", "node_folder", "start_tier", "tier_wanted"]
