"""Cross-rank agreement: prove that every rank launched the same config for each (kernel, key).

``init_deterministic_tuning`` calls ``start_agreement(policy, group)`` after installing the
interception; the returned handle's ``stop()`` detaches it. The checker listens to the decision
log, which calls it at the first use of each (kernel, key) in this process, before the launch.

Modes (``policy.agreement``):

* ``store`` (default): compare through the default process group's key-value store. The first
  rank to reach a (kernel, key) claims it with its signature (one atomic ``compare_set``); later
  ranks get that claim back from the same call and raise ``DivergenceError`` on a mismatch. No
  collective, so ranks that reach kernels at different times, or never, cannot deadlock. The
  first divergence found is recorded in the store; every rank raises that same diagnosis at its
  next check. Cost: two store round trips per new (kernel, key) per rank (claim, then the
  divergence flag); nothing per launch.
* ``allgather``: for strictly SPMD groups. At first use all ranks of ``group`` meet at a store
  barrier with a timeout (so a rank that never arrives is named, not waited for forever), then
  all-gather 64-byte digests of (kernel, key, arch) and signature. Every rank raises the same
  error on a mismatch.
* ``off``: nothing.

``verify_agreement(group)`` compares whole decision logs at a step boundary.

Only fixed-size byte tensors and plain text cross processes: no pickle, no ``all_gather_object``
(a size-mismatched gloo gather has been seen to abort a rank silently). No store or collective
traffic happens while a CUDA graph is captured: such checks wait for the next check outside
capture, or for ``verify_agreement``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .decisions import Decision, decision_log
from .errors import AgreementTimeoutError, DivergenceError, PolicyError

logger = logging.getLogger(__name__)

MODES = ("store", "allgather", "off")
UNCHECKED_SOURCES = frozenset({"out_of_scope", "recorded", "tuned"})
"""Sources never compared: pass-through kernels, and measured picks that may differ by design."""

DEFAULT_TIMEOUT_S = 300.0
DIGEST_BYTES = 32
ROW_BYTES = 2 * DIGEST_BYTES  # identity digest, then signature digest
FIELD_BYTES = (256, 768, 512)  # kernel, key, signature text in a fixed-size naming row
TEXT_BYTES = sum(FIELD_BYTES)
MAX_NAMED = 8  # differing entries named by verify_agreement; the rest are counted
_TRUNCATED = b"...[truncated]"
_PREFIX = "megatron_tuning/agreement/v1"
_FLAG = "divergence"

_active_lock = threading.Lock()
_active: AgreementChecker | None = None
_epochs = 0  # start_agreement calls in this process: each session gets fresh store keys
_verify_calls: dict[str, int] = {}


class AgreementHandle(Protocol):
    """What ``start_agreement`` returns: ``stop()`` detaches the checker (idempotent)."""

    def stop(self) -> None: ...


class _NoAgreement:
    """Handle for a process that checks nothing (no process group, or agreement off)."""

    def stop(self) -> None:
        return None


def start_agreement(policy: Any, group: Any = None) -> AgreementHandle:
    """Start cross-rank checks for ``policy``; call after the interception is installed.

    A no-op handle comes back when torch.distributed has no initialized process group, when
    ``policy.agreement == "off"``, or when ``policy.mode`` is not deterministic/chaos (record
    and tune modes pick by measurement, so ranks may differ by design). ``group`` scopes the
    check (default: the whole job). A previous checker is stopped first.
    """
    global _active, _epochs
    mode = getattr(policy, "agreement", "store")
    if mode not in MODES:
        raise PolicyError("agreement", mode, "one of " + "|".join(MODES))
    if mode == "off" or getattr(policy, "mode", "deterministic") not in ("deterministic", "chaos"):
        return _NoAgreement()
    if not (dist.is_available() and dist.is_initialized()):
        logger.debug("no process group: agreement checks are off in this single process")
        return _NoAgreement()
    with _active_lock:
        previous, _active = _active, None
        _epochs += 1
        epoch = _epochs
    if previous is not None:
        previous.stop()
    # Elastic restarts reuse the rendezvous store: the restart count keeps old claims apart.
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    checker = AgreementChecker(policy, group, namespace=f"r{restart}/e{epoch}")
    checker.attach()
    with _active_lock:
        _active = checker
    return checker


def active_checker() -> AgreementChecker | None:
    """The checker ``start_agreement`` attached, if any."""
    return _active


class AgreementChecker:
    """Decision-log listener that compares each new (kernel, key) with the other ranks.

    ``store``/``rank``/``ranks`` exist so tests can drive the protocol without a process group.
    """

    def __init__(
        self,
        policy: Any,
        group: Any = None,
        *,
        namespace: str = "default",
        store: Any = None,
        rank: int | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self.mode: str = getattr(policy, "agreement", "store")
        if self.mode not in MODES:
            raise PolicyError("agreement", self.mode, "one of " + "|".join(MODES))
        self.timeout_s = float(getattr(policy, "agreement_timeout_s", DEFAULT_TIMEOUT_S))
        self.group = group
        self.rank = dist.get_rank() if rank is None else int(rank)
        self.ranks = list(ranks) if ranks is not None else group_ranks(group)
        base = store if store is not None else default_store()
        self._store = dist.PrefixStore(f"{_PREFIX}/{namespace}/{_scope_id(group, self.ranks)}", base)
        self._lock = threading.RLock()  # allgather checks must not interleave within a process
        self._seen: set[bytes] = set()
        self._pending: list[Decision] = []
        self._seq = 0
        self._attached = False

    def attach(self) -> None:
        if not self._attached:
            decision_log().add_listener(self.check)
            self._attached = True

    def detach(self) -> None:
        if self._attached:
            decision_log().remove_listener(self.check)
            self._attached = False

    def stop(self) -> None:
        """Detach; checks deferred by a CUDA graph capture and never flushed are logged and dropped."""
        global _active
        self.detach()
        with _active_lock:
            if _active is self:
                _active = None
        if self._pending:
            logger.warning(
                "agreement: %d check(s) deferred during CUDA graph capture were never run", len(self._pending)
            )

    def check(self, decision: Decision) -> None:
        """Listener: compare ``decision`` with the other ranks (raises DivergenceError)."""
        if self.mode == "off" or decision.source in UNCHECKED_SOURCES:
            return
        ident = identity_digest(decision.kernel, decision.key, decision.arch)
        with self._lock:
            if ident in self._seen:
                return
            self._seen.add(ident)
            if is_capturing():
                self._pending.append(decision)
                return
            try:
                self._flush_locked()
                self._check_one(decision)
            except BaseException:
                # The interception pins nothing when a listener raises: the next launch of this
                # key comes back here and must fail again, not pass as "already seen".
                self._seen.discard(ident)
                raise

    def flush(self) -> None:
        """Run checks deferred by a CUDA graph capture (no-op while still capturing)."""
        with self._lock:
            if not is_capturing():
                self._flush_locked()

    def poll(self) -> None:
        """Raise the divergence another rank recorded in the store, if any (store mode)."""
        if self.mode == "store":
            record = self._store.compare_set(_FLAG, "", "")
            if record:
                raise _error_from_record(record)

    def _flush_locked(self) -> None:
        while self._pending:
            self._check_one(self._pending.pop(0))

    def _check_one(self, decision: Decision) -> None:
        if self.mode == "store":
            self._store_check(decision)
        elif self.mode == "allgather":
            self._allgather_check(decision)

    def _store_check(self, d: Decision) -> None:
        mine = f"{self.rank}\n{d.signature}"
        # Atomic claim: on an absent key this sets ours; otherwise it returns the first claim.
        claim = self._store.compare_set("k/" + identity_digest(d.kernel, d.key, d.arch).hex(), "", mine)
        claim_text = bytes(claim).decode("utf-8", "replace")
        if claim_text != mine:
            first_rank, _, first_signature = claim_text.partition("\n")
            if first_signature != d.signature:
                signatures = {int(first_rank): first_signature, self.rank: d.signature}
                self._raise_divergence(d, signatures, "Found by the store check at first use.")
        self.poll()

    def _raise_divergence(self, d: Decision, signatures: dict[int, str], detail: str) -> None:
        record = json.dumps(
            {
                "kernel": d.kernel,
                "key": d.key,
                "detail": detail,
                "signatures": {str(r): s for r, s in sorted(signatures.items())},
            },
            sort_keys=True,
        )
        # The first divergence recorded wins, so every rank raises the identical message.
        winner = self._store.compare_set(_FLAG, "", record)
        error = _error_from_record(winner)
        if error.signatures.get(self.rank) != d.signature:
            logger.error(
                "agreement: rank %d launched %s for kernel %s with key %s",
                self.rank,
                d.signature,
                d.kernel,
                d.key,
            )
        raise error

    def _allgather_check(self, d: Decision) -> None:
        self._seq += 1
        what = f"kernel {d.kernel} with key {d.key} (allgather check #{self._seq})"
        arrive(self._store, f"ag/{self._seq}", self.rank, self.ranks, what, self.timeout_s)
        row = identity_digest(d.kernel, d.key, d.arch) + signature_digest(d.signature)
        rows = all_gather_bytes(row, self.group)
        if all(r == rows[0] for r in rows):
            return
        texts = all_gather_bytes(pack_text(d.kernel, d.key, d.signature), self.group)
        raise _allgather_error(rows, [unpack_text(t) for t in texts], self.ranks, self._seq)


def verify_agreement(group: Any = None, *, timeout_s: float | None = None) -> int:
    """Compare every rank's decision log at a step boundary; return how many entries were shared.

    Collective over ``group`` (default: the job): every rank of it must call this. Only
    (kernel, key) entries that two or more ranks observed are compared. On a mismatch every
    rank raises the same ``DivergenceError``, naming up to ``MAX_NAMED`` differing entries. A
    rank that does not arrive within ``timeout_s`` (default: the active policy's agreement
    timeout) is named in an ``AgreementTimeoutError``. Also runs checks deferred by a CUDA
    graph capture. Without a process group it returns 0.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    checker = _active
    late_error: DivergenceError | None = None
    if checker is not None:
        try:
            checker.flush()
            checker.poll()
        except DivergenceError as error:
            if checker.mode != "store":
                raise  # allgather errors are raised on every rank alike
            late_error = error  # one-sided: raising before the collective would hang the others
    timeout = timeout_s if timeout_s is not None else (checker.timeout_s if checker else DEFAULT_TIMEOUT_S)
    ranks = group_ranks(group)
    scope = _scope_id(group, ranks)
    _verify_calls[scope] = seq = _verify_calls.get(scope, 0) + 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"{_PREFIX}/verify/r{restart}/{scope}", default_store())
    arrive(store, str(seq), dist.get_rank(), ranks, f"verify_agreement call #{seq}", timeout)

    table = _log_table()
    idents = list(table)  # launch order, so the first divergence named is the earliest one
    counts = all_gather_bytes(len(idents).to_bytes(8, "little"), group)
    sizes = [int.from_bytes(c, "little") for c in counts]
    width = max(sizes) * ROW_BYTES
    if width == 0:
        return 0
    mine = b"".join(i + signature_digest(table[i].signature) for i in idents).ljust(width, b"\0")
    gathered = all_gather_bytes(mine, group)
    seen: dict[bytes, dict[int, bytes]] = {}
    order: dict[bytes, tuple[int, int]] = {}  # (group index, log position) of the first observer
    for index, (rank, blob, size) in enumerate(zip(ranks, gathered, sizes)):
        for n in range(size):
            row = blob[n * ROW_BYTES : (n + 1) * ROW_BYTES]
            seen.setdefault(row[:DIGEST_BYTES], {})[rank] = row[DIGEST_BYTES:]
            order.setdefault(row[:DIGEST_BYTES], (index, n))
    shared = {i: by_rank for i, by_rank in seen.items() if len(by_rank) >= 2}
    differing = sorted(
        (i for i, by_rank in shared.items() if len(set(by_rank.values())) > 1), key=lambda i: (order[i], i)
    )
    if differing:
        named = differing[:MAX_NAMED]
        # Only ranks that saw an entry fill its row; the others send zeros (an empty text).
        blob = b"".join(
            pack_text(table[i].kernel, table[i].key, table[i].signature) if i in table else bytes(TEXT_BYTES)
            for i in named
        )
        texts = all_gather_bytes(blob, group)
        raise _verify_error(named, len(differing), len(shared), shared, texts, ranks)
    if late_error is not None:
        raise late_error
    logger.info("verify_agreement: %d shared (kernel, key) entries agree across ranks %s", len(shared), ranks)
    return len(shared)


# --- helpers shared with the tests and the benchmark ----------------------------------------


def default_store() -> Any:
    """The default process group's key-value store (private torch API; see the contract test)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def group_ranks(group: Any) -> list[int]:
    """Global ranks of ``group`` (``None``: the whole job), in group-rank order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (then no traffic is allowed)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def identity_digest(kernel: str, key: str, arch: str) -> bytes:
    """32-byte digest of what must agree; arch is part of it (other GPUs may pick otherwise)."""
    # JSON, not a separator join: no text in one field can pass for a field boundary.
    return hashlib.sha256(json.dumps([kernel, key, arch]).encode()).digest()


def signature_digest(signature: str) -> bytes:
    return hashlib.sha256(signature.encode()).digest()


def pack_text(kernel: str, key: str, signature: str) -> bytes:
    """Fixed-size NUL-padded row of the three texts; an over-long field ends in a marker."""
    parts = []
    for text, size in zip((kernel, key, signature), FIELD_BYTES):
        raw = text.encode()
        if len(raw) > size:
            raw = raw[: size - len(_TRUNCATED)].decode("utf-8", "ignore").encode() + _TRUNCATED
        parts.append(raw.ljust(size, b"\0"))
    return b"".join(parts)


def unpack_text(row: bytes) -> tuple[str, str, str]:
    fields, start = [], 0
    for size in FIELD_BYTES:
        fields.append(row[start : start + size].rstrip(b"\0").decode("utf-8", "replace"))
        start += size
    return fields[0], fields[1], fields[2]


def all_gather_bytes(data: bytes, group: Any) -> list[bytes]:
    """All-gather one equal-size byte string per rank, as uint8 tensors on the group's device."""
    device = _collective_device(group)
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return [_tensor_bytes(t) for t in out]


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    try:
        return tensor.cpu().numpy().tobytes()
    except (ImportError, RuntimeError):  # torch built without numpy: slower, same bytes
        return bytes(tensor.cpu().tolist())


def arrive(store: Any, tag: str, rank: int, ranks: Sequence[int], what: str, timeout_s: float) -> None:
    """Store barrier with a deadline: return when every rank arrived, else name the missing ones.

    All ranks settle on one verdict through ``compare_set``, so a rank arriving just after the
    others gave up also raises instead of entering a collective that nobody else will join.
    """
    store.set(f"{tag}/{rank}", "1")
    try:
        store.wait([f"{tag}/{r}" for r in ranks], timedelta(seconds=timeout_s))
        proposal = "go"
    except _store_timeout_errors():
        missing = [r for r in ranks if not store.check([f"{tag}/{r}"])]
        proposal = "timeout:" + ",".join(map(str, missing)) if missing else "go"
    verdict = bytes(store.compare_set(f"{tag}/verdict", "", proposal)).decode()
    if verdict != "go":
        missing = [int(r) for r in verdict.partition(":")[2].split(",") if r]
        raise AgreementTimeoutError(what, missing, timeout_s)


def _store_timeout_errors() -> tuple[type[BaseException], ...]:
    # DistStoreError exists from torch 2.2; older releases raise a bare RuntimeError.
    return (getattr(dist, "DistStoreError", RuntimeError), RuntimeError)


def _collective_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "cpu" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _scope_id(group: Any, ranks: Sequence[int]) -> str:
    if group is None:
        return "world"
    return "g" + hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:16]


def _log_table() -> dict[bytes, Decision]:
    """This process's checked decisions by identity digest, in first-use order.

    After a re-install the same (kernel, key) can appear twice: the latest decision is what the
    process launches now, so it wins (a dict keeps the first insertion's position).
    """
    return {
        identity_digest(d.kernel, d.key, d.arch): d
        for d in decision_log().decisions()
        if d.source not in UNCHECKED_SOURCES
    }


def _error_from_record(record: bytes | str) -> DivergenceError:
    data = json.loads(bytes(record).decode() if not isinstance(record, str) else record)
    signatures = {int(r): s for r, s in data["signatures"].items()}
    return DivergenceError(data["kernel"], data["key"], signatures, data["detail"])


def _allgather_error(
    rows: list[bytes], texts: list[tuple[str, str, str]], ranks: list[int], seq: int
) -> DivergenceError:
    kernel, key, _ = texts[0]
    here = [i for i, row in enumerate(rows) if row[:DIGEST_BYTES] == rows[0][:DIGEST_BYTES]]
    signatures = {ranks[i]: texts[i][2] for i in here}
    detail = f"Found by allgather check #{seq} over ranks {ranks}."
    elsewhere = [
        f"rank {ranks[i]} was at kernel {texts[i][0]} with key {texts[i][1]}"
        for i in range(len(rows))
        if i not in here
    ]
    if elsewhere:
        detail += (
            " Ranks reached different kernels at this check (" + "; ".join(elsewhere) + "): "
            "allgather needs identical kernels in identical order; use agreement 'store' otherwise."
        )
    return DivergenceError(kernel, key, signatures, detail)


def _verify_error(
    named: list[bytes],
    total: int,
    shared: int,
    seen: dict[bytes, dict[int, bytes]],
    texts: list[bytes],
    ranks: list[int],
) -> DivergenceError:
    entries = []
    for n, ident in enumerate(named):
        rows = {
            rank: unpack_text(blob[n * TEXT_BYTES : (n + 1) * TEXT_BYTES]) for rank, blob in zip(ranks, texts)
        }
        observed = {rank: rows[rank] for rank in sorted(seen[ident])}
        kernel, key, _ = next(iter(observed.values()))
        entries.append((kernel, key, {rank: row[2] for rank, row in observed.items()}))
    kernel, key, signatures = entries[0]
    lines = [f"Found by verify_agreement over ranks {ranks}: {total} of {shared} shared entries differ."]
    for other_kernel, other_key, other in entries[1:]:
        listing = "; ".join(f"rank {r}: {s}" for r, s in other.items())
        lines.append(f"  Also kernel {other_kernel} with key {other_key}: {listing}")
    if total > len(named):
        lines.append(f"  ... and {total - len(named)} more.")
    return DivergenceError(kernel, key, signatures, "\n".join(lines))
