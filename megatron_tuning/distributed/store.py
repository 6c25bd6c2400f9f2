"""The job's key-value store: ``claim``, one atomic ``compare_set`` for every first-writer-wins record
(``auto``'s decisions, chaos, the agreement check's), so a rank never waits for another; records are
JSON objects, checked on the way back. ``arrive``, the one wait: a barrier naming missing ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from ..core.chaos import ChaosClaim
from ..core.decisions import Decision
from ..core.errors import CONFIG_LIST_KEY, AgreementTimeoutError, ConsensusError, PolicyError, StoreError
from ..core.identity import shared_kernel_id
from ..core.notices import warn_once
from ..runtime.config_list import config_listing

PREFIX = "megatron_tuning/v2"
SLOW_REQUEST_S = 5.0  # a slower request is reported once per purpose (a paused or overloaded store)
MAX_RECORD_BYTES = 1 << 20  # the largest record the library writes is a few KiB
T = TypeVar("T")


def default_store() -> Any:
    """The default process group's key-value store (private torch API; see the contract test)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def group_ranks(group: Any) -> list[int]:
    """Global ranks of ``group`` (``None``: the whole job), in group-rank order."""
    return list(range(dist.get_world_size())) if group is None else list(dist.get_process_group_ranks(group))


def scope_id(group: Any, ranks: Sequence[int]) -> str:
    digest = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    return "world" if group is None else "g" + digest


def job_namespace() -> str:
    """Elastic restarts reuse the rendezvous store: the restart count keeps their records apart."""
    return "r" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def identity_digest(kernel: str, key: str, arch: str) -> bytes:
    """32-byte digest of what must agree (arch too); JSON, so no field can fake a boundary."""
    return hashlib.sha256(json.dumps([kernel, key, arch]).encode()).digest()


def decision_digest(d: Decision) -> bytes:
    """What the agreement checks and ``verify`` compare a decision under: its kernel's shared id
    (``module:qualname@<config_list_digest>``), key and arch."""
    # With the module, not by content as auto's decisions are: one process may hold one source under
    # two module names whose tables pin different entries, rightly; by content they would be one
    # identity and a false DivergenceError. So ranks loading it under per-rank names are never
    # compared, and agree only where each rank's lookup finds the same entry (a stale or hashless
    # entry under one rank's name pins that rank alone) or, in auto, on keys no table answers
    # (docs/agreement.md, per-rank module names).
    return identity_digest(shared_kernel_id(d.kernel, d.config_list_digest), d.key, d.arch)


def config_list_row(d: Decision) -> Decision | None:
    """What ranks compare ``d``'s kernel's config list as: a decision of ``module:qualname`` under
    ``CONFIG_LIST_KEY`` whose signature is the list's digest and configs. Only for a plain id (the one
    list over its function in its module); a factory's kernels and twins are told apart by their
    digest, so each rank's lists of those are other kernels, not one that differs."""
    if d.config_list_digest is None or "@" in d.kernel:
        return None
    listing = config_listing(d.config_list_digest)
    signature = d.config_list_digest if listing is None else f"{d.config_list_digest}: {listing}"
    return Decision(d.kernel, CONFIG_LIST_KEY, signature, d.source, arch=d.arch, rank=d.rank)


def signature_digest(signature: str) -> bytes:
    return hashlib.sha256(signature.encode()).digest()


def prefixed(name: str, store: Any = None) -> Any:
    """``store`` (default: the job's) with the library's keys under ``PREFIX/name``."""
    return dist.PrefixStore(f"{PREFIX}/{name}", store if store is not None else default_store())


def request(what: str, call: Callable[[], T]) -> T:
    """One store request for ``what``; a failure is a ``StoreError`` naming it, a slow one a notice."""
    start = time.monotonic()
    try:
        result = call()
    except (RuntimeError, ConnectionError, TimeoutError) as exc:  # torch's DistError is a RuntimeError
        raise StoreError(what, f"the job's store failed ({type(exc).__name__}: {exc})") from exc
    elapsed = time.monotonic() - start
    if elapsed > SLOW_REQUEST_S:
        purpose = re.sub(r"[#\d]+", "", what.split(" of ", 1)[0])
        message = "a request to the job's store for %s took %.1f s: its host may be overloaded or paused"
        warn_once(("slow-store", purpose), message, what, elapsed)
    return result


def encode(record: Mapping[str, Any]) -> str:
    return json.dumps(record, sort_keys=True)


def decode(raw: Any, what: str) -> dict[str, Any]:
    """A JSON object the library wrote; anything else (huge, not UTF-8, NaN, too deep) is a StoreError."""
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if len(data) > MAX_RECORD_BYTES:
        raise StoreError(
            what, f"the job's store holds a record of {len(data)} bytes, not one the library writes"
        )
    try:
        record = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StoreError(
            what, f"the job's store holds {data[:80]!r}, not the library's JSON ({exc})"
        ) from None
    if not isinstance(record, dict):
        raise StoreError(what, f"the job's store holds {data[:80]!r}, not a JSON object")
    return record


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def field(record: Mapping[str, Any], name: str, kind: type, what: str) -> Any:
    """``record[name]``, which must be of exactly ``kind`` (``bool`` is not an ``int`` here)."""
    value = record.get(name)
    if type(value) is not kind:
        raise StoreError(what, f"the record's field {name!r} is {value!r}, not a {kind.__name__}")
    return value


def rank_of(record: Mapping[str, Any], what: str, world: int | None) -> int:
    """The record's ``rank``: a plain integer in ``[0, world)``."""
    rank = record.get("rank")
    if type(rank) is not int or rank < 0 or (world is not None and rank >= world):
        raise StoreError(what, f"the record names rank {rank!r}, not a rank of this job")
    return rank


def claim(store: Any, key: str, record: Mapping[str, Any], what: str) -> dict[str, Any]:
    """Store ``record`` under ``key`` unless a record is there; return the record that won."""
    return decode(request(what, lambda: store.compare_set(key, "", encode(record))), what)


def peek(store: Any, key: str, what: str) -> dict[str, Any] | None:
    """The record under ``key``, or ``None``; never waits. (It leaves an empty value when there is
    none, which the next ``claim``'s ``compare_set(key, "", ours)`` replaces.)"""
    raw = request(what, lambda: store.compare_set(key, "", ""))
    return decode(raw, what) if bytes(raw if not isinstance(raw, str) else raw.encode()) else None


def arrive(store: Any, tag: str, rank: int, ranks: Sequence[int], what: str, timeout_s: float) -> None:
    """Return when every rank of ``ranks`` arrived at ``tag``; past ``timeout_s`` name the missing ones.
    O(1) requests per rank; all ranks settle one verdict through ``compare_set``, so a rank arriving
    just after the others gave up raises too instead of entering a collective alone."""
    count = len(ranks)
    request(what, lambda: store.append(f"{tag}/in", f"{rank},"))
    if request(what, lambda: store.add(f"{tag}/n", 1)) >= count:
        request(what, lambda: store.set(f"{tag}/go", "go"))
    proposal = "go"
    try:
        store.wait([f"{tag}/go"], timedelta(seconds=max(timeout_s, 0.001)))
    except RuntimeError:  # torch's DistStoreError: the wait timed out
        if not store.check([f"{tag}/go"]):
            arrived = bytes(store.compare_set(f"{tag}/in", "", "")).decode("utf-8", "replace").split(",")
            here = {int(r) for r in arrived if r.isdigit()}
            proposal = "timeout:" + ",".join(str(r) for r in ranks if r not in here)
    verdict = bytes(store.compare_set(f"{tag}/verdict", "", proposal)).decode("utf-8", "replace")
    if store.add(f"{tag}/out", 1) >= count:
        for suffix in ("in", "n", "go", "verdict", "out"):
            store.delete_key(f"{tag}/{suffix}")
    if verdict != "go":
        missing = [int(r) for r in verdict.partition(":")[2].split(",") if r.isdigit()]
        raise AgreementTimeoutError(what, missing, timeout_s)


class StoreChaos:
    """Chaos mode's coordinator (``core.chaos.ChaosCoordinator``): the job's first pick per key.
    Binds to the process group at its first claim (it may be made before ``init_process_group``)."""

    _sessions = 0
    _recalled: dict[tuple[str, str, str], ChaosClaim] = {}
    _lock = threading.Lock()

    def __init__(
        self,
        group: Any = None,
        *,
        store: Any = None,
        rank: int | None = None,
        ranks: Sequence[int] | None = None,
        namespace: str | None = None,
    ) -> None:
        with StoreChaos._lock:
            StoreChaos._sessions += 1
            number = StoreChaos._sessions
        self._name = f"chaos/{namespace or f'{job_namespace()}/s{number}'}"
        self._group, self._given_store, self._rank, self._ranks = group, store, rank, ranks
        self._store: Any = None

    def claim(self, kernel: str, key: str, arch: str, signature: str) -> ChaosClaim | None:
        """Claim ``signature`` as the job's first pick for (kernel, key, arch); return the first claim."""
        if self._store is None:
            if self._given_store is None and not (dist.is_available() and dist.is_initialized()):
                return None  # not (yet) in a job: the rank formula applies
            ranks = self._ranks if self._ranks is not None else group_ranks(self._group)
            self._store = prefixed(f"{self._name}/{scope_id(self._group, ranks)}", self._given_store)
            self._rank = dist.get_rank() if self._rank is None else self._rank
        what = f"the chaos claim of kernel {kernel} with key {key}"
        name = "c/" + identity_digest(kernel, key, arch).hex()
        won = claim(self._store, name, {"rank": self._rank, "signature": signature}, what)
        first = ChaosClaim(rank_of(won, what, None), field(won, "signature", str, what))
        with StoreChaos._lock:
            StoreChaos._recalled[(kernel, key, arch)] = first
        return first

    def recall(self, kernel: str, key: str, arch: str) -> ChaosClaim | None:
        with StoreChaos._lock:
            return StoreChaos._recalled.get((kernel, key, arch))


# ``auto`` keeps its decisions in the job's store up to this many ranks (RESULTS.md: the store's
# work at the cap); larger jobs tune on one node and run ``deterministic``.
AUTO_MAX_RANKS = 256
AUTO_AT_SCALE = (
    "a table tuned on a smaller job: `python -m megatron_tuning tune --out t.msgpack -- <job on one "
    "node>` (or run `auto` there), review it (`python -m megatron_tuning show t.msgpack`), commit it, "
    "then run this job with MEGATRON_TUNING_MODE=deterministic MEGATRON_TUNING_TABLE=t.msgpack "
    "(docs/agreement.md, 'auto in large jobs')"
)


def check_auto_world(world: int) -> None:
    """Refuse ``auto`` in a job of more than ``AUTO_MAX_RANKS`` ranks (``PolicyError``)."""
    if world > AUTO_MAX_RANKS:
        raise PolicyError(
            "mode",
            "auto",
            f"deterministic in a job of {world} ranks (auto keeps its "
            f"decisions in the job's store up to {AUTO_MAX_RANKS} ranks), with {AUTO_AT_SCALE}",
        )


def start_consensus() -> StoreConsensus | None:
    """``auto``'s consensus for the job (``None`` without a process group); refuses large jobs."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    check_auto_world(dist.get_world_size())
    return StoreConsensus()


@dataclass(frozen=True, slots=True)
class Published:  # a decision as the job's store holds it
    config: dict[str, Any]
    signature: str
    rank: int
    timings: dict[str, Any] | None = None
    """The publisher's measurement, if it measured: what an adopting rank caches."""


class StoreConsensus:
    """``auto``'s decisions shared by the job: one config per (arch, kernel, key), first writer wins.
    A miss adopts the job's decision, else tunes and publishes; a hit in this node's own cache is
    published too (``pinning``), so ranks whose per-node caches differ still agree."""

    def __init__(self, *, store: Any = None, rank: int | None = None, world: int | None = None) -> None:
        self._store = prefixed(f"auto/{job_namespace()}", store)
        self.rank = dist.get_rank() if rank is None else int(rank)
        self.world = world if world is not None or not dist.is_initialized() else dist.get_world_size()

    def lookup(self, kernel: str, key: str, arch: str, *, identity: str | None = None) -> Published | None:
        """The decision published for (arch, kernel, key), or ``None``; one request, never waits.
        ``identity``: what the record is keyed by (``shared_kernel_id``; default ``kernel``), while
        messages name ``kernel``."""
        name = "d/" + identity_digest(identity or kernel, key, arch).hex()
        what = f"the auto lookup of kernel {kernel} with key {key}"
        raw = request(what, lambda: self._store.compare_set(name, "", ""))
        return self._published(raw, kernel, key) if bytes(raw) else None

    def publish(
        self,
        kernel: str,
        key: str,
        arch: str,
        config: Mapping[str, Any],
        signature: str,
        timings: Any = None,
        *,
        identity: str | None = None,
    ) -> Published:
        """Publish ours (and our ``timings``) unless a rank was first; return the decision to launch."""
        name = "d/" + identity_digest(identity or kernel, key, arch).hex()
        record = {"config": dict(config), "signature": signature, "rank": self.rank, "timings": timings}
        try:
            mine = json.dumps(record, sort_keys=True, allow_nan=False)
        except ValueError:  # a failed candidate's inf: the decision travels, the timings stay here
            mine = encode({**record, "timings": None})
        what = f"the auto publish of kernel {kernel} with key {key}"
        return self._published(request(what, lambda: self._store.compare_set(name, "", mine)), kernel, key)

    def _published(self, raw: Any, kernel: str, key: str) -> Published:
        what = f"the decision published for kernel {kernel} with key {key}"
        try:
            record = decode(raw, what)
            config, signature = field(record, "config", dict, what), field(record, "signature", str, what)
            timings = record.get("timings") if isinstance(record.get("timings"), dict) else None
            return Published(config, signature, rank_of(record, what, self.world), timings)
        except StoreError as bad:
            raise ConsensusError(
                kernel, key, f"{bad.problem}; was it written by another megatron_tuning version?"
            ) from None
