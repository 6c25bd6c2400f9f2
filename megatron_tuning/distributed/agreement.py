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
* ``digest``: for large worlds. First use records the decision and launches; at a flush (the
  first repeated launch after new keys, ``verify_agreement``, ``close``) each rank sends one
  digest of its new rows, and only distinct row sets are uploaded and compared (``digest.py``):
  O(1) store requests per rank per flush, whatever the number of keys. A divergence is noticed at
  the flush after it was launched instead of before the launch.
* ``off``: nothing.

Unset (``policy.agreement is None``): ``store`` up to ``DIGEST_ABOVE_RANKS`` ranks, ``digest``
above (measured in ``benchmarks/bench_scale.py``; see RESULTS.md).

``verify_agreement(group)`` (``verify.py``) compares whole decision logs at a step boundary.

No store or collective traffic happens while a CUDA graph is captured: such checks wait for the
next check outside capture, or for ``verify_agreement``. What crosses ranks is in ``wire.py``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, Protocol

import torch.distributed as dist

from ..core.decisions import Decision, decision_log
from ..core.errors import (
    AgreementTimeoutError,
    DivergenceError,
    InputMismatchError,
    PolicyError,
    SessionMismatchError,
    StoreRecordError,
)
from ..runtime import pinning
from ..runtime.pinning import is_capturing
from .digest import DIVERGED, REFERENCE_WAIT_S, Conflict, DigestLedger, DivergenceAlarm
from .inputs import INPUTS_KIND, compare_inputs, describe_inputs, inputs_record
from .inputs import mismatch_from_record as inputs_mismatch_from_record
from .inputs import mismatch_record as inputs_mismatch_record
from .sessions import SESSION_KIND, SessionRegistry, mismatch_from_record, mismatch_record, policy_summary
from .storeops import (
    BadRecord,
    decode_record,
    decode_text,
    parse_rank_text,
    poll_until,
    record_field,
    request,
)
from .wire import (
    DIGEST_BYTES,
    all_gather_bytes,
    arrive,
    default_store,
    group_ranks,
    identity_digest,
    pack_text,
    scope_id,
    signature_digest,
    unpack_text,
)

logger = logging.getLogger(__name__)

MODES = ("store", "allgather", "digest", "off")
DIGEST_ABOVE_RANKS = 64
"""Worlds larger than this use ``digest`` when the policy leaves ``agreement`` unset."""
UNCHECKED_SOURCES = frozenset({"out_of_scope", "recorded", "tuned"})
"""Sources never compared: pass-through kernels, and measured picks that may differ by design."""
CHECKED_MODES = ("deterministic", "chaos", "auto")


def unchecked_sources(mode: str | None) -> frozenset[str]:
    """Decision sources that ``mode`` does not compare across ranks.

    In ``auto`` a tuned decision is published for the whole job, so every rank must launch it:
    ``tuned`` and ``adopted`` are compared there. In ``tune``/``record`` each rank measures for
    itself, and ranks may differ by design.
    """
    return UNCHECKED_SOURCES - {"tuned"} if mode == "auto" else UNCHECKED_SOURCES


DEFAULT_TIMEOUT_S = 300.0
PREFIX = "megatron_tuning/agreement/v1"
_FLAG = "divergence"

_active_lock = threading.Lock()
_active: AgreementChecker | None = None
_epochs = 0  # start_agreement calls in this process: each session gets fresh store keys


class AgreementHandle(Protocol):
    """What ``start_agreement`` returns: ``stop()`` detaches the checker (idempotent)."""

    def stop(self) -> None: ...


class _NoAgreement:
    """Handle for a process that checks nothing (no process group, or agreement off)."""

    def stop(self) -> None:
        return None


def start_agreement(
    policy: Any, group: Any = None, *, inputs: Mapping[str, str] | None = None
) -> AgreementHandle:
    """Start cross-rank checks for ``policy``; call after the interception is installed.

    A no-op handle comes back when torch.distributed has no initialized process group, when
    ``policy.agreement == "off"``, or when ``policy.mode`` is not deterministic/chaos/auto (record
    and tune modes pick by measurement, so ranks may differ by design). ``group`` scopes the
    check (default: the whole job). A previous checker is stopped first. ``inputs``
    (``inputs.describe_inputs``; default: from the policy alone) are compared with the session's
    first rank: a difference raises ``InputMismatchError`` here, naming it.
    """
    global _active, _epochs
    mode = resolve_mode(policy, group)
    if mode not in MODES:
        raise PolicyError("agreement", mode, "one of " + "|".join(MODES))
    if mode == "off" or getattr(policy, "mode", "deterministic") not in CHECKED_MODES:
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
    checker = AgreementChecker(policy, group, namespace=f"r{restart}/e{epoch}", mode=mode)
    # Unequal init calls, policies or inputs are named now, not missed or found key by key.
    checker.start_session(
        f"r{restart}", epoch, policy, inputs if inputs is not None else describe_inputs(policy)
    )
    checker.attach()
    with _active_lock:
        _active = checker
    return checker


STORE_MODE_HINT = "with many ranks use agreement 'digest' (one request per flush instead of two per key)"


def resolve_mode(policy: Any, group: Any = None) -> str:
    """The agreement mode ``policy`` asks for; unset means ``store`` for small worlds, else ``digest``."""
    mode = getattr(policy, "agreement", None)
    if mode is not None:
        return str(mode)
    if not (dist.is_available() and dist.is_initialized()):
        return "store"
    return "digest" if len(group_ranks(group)) > DIGEST_ABOVE_RANKS else "store"


def session_number() -> int:
    """How many checked sessions this process has started (``verify_agreement`` compares them)."""
    return _epochs


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
        mode: str | None = None,
    ) -> None:
        self.mode: str = mode if mode is not None else (getattr(policy, "agreement", None) or "store")
        if self.mode not in MODES:
            raise PolicyError("agreement", self.mode, "one of " + "|".join(MODES))
        self.timeout_s = float(getattr(policy, "agreement_timeout_s", DEFAULT_TIMEOUT_S))
        self.unchecked = unchecked_sources(getattr(policy, "mode", "deterministic"))
        self.group = group
        self.rank = dist.get_rank() if rank is None else int(rank)
        self.ranks = list(ranks) if ranks is not None else group_ranks(group)
        base = store if store is not None else default_store()
        self._base = base
        self._store = dist.PrefixStore(f"{PREFIX}/{namespace}/{scope_id(group, self.ranks)}", base)
        self.session: SessionRegistry | None = None
        self._lock = threading.RLock()  # allgather checks must not interleave within a process
        self._seen: set[bytes] = set()
        self._pending: list[Decision] = []
        self._seq = 0
        self._attached = False
        self._world = max(self.ranks) + 1 if self.ranks else 1
        reader = self.rank == min(self.ranks, default=-1)  # the group's first rank reads the log
        self.ledger = (
            DigestLedger(self._store, self.rank, len(self.ranks), reader=reader)
            if self.mode == "digest"
            else None
        )

    def start_session(
        self, job: str, number: int, policy: Any, inputs: Mapping[str, str] | None = None
    ) -> None:
        """Publish this process's session ``number``; raise ``SessionMismatchError`` when another
        rank started that number with a different policy (``sessions.py``), and
        ``InputMismatchError`` when it started it with other tables or versions (``inputs.py``)."""
        store = dist.PrefixStore(f"{PREFIX}/{job}/sessions/{scope_id(self.group, self.ranks)}", self._base)
        self.session = SessionRegistry(store, self.rank, number, policy_summary(policy))
        error = self.session.register()
        if error is not None:
            self._record_flag(mismatch_record(error))  # the other rank raises it next
            raise error
        if inputs is None:
            return
        session = f"tuning session #{number}"
        mine = inputs_record(self.rank, inputs)
        first = request(f"the inputs of {session}", lambda: store.compare_set(f"e{number}/inputs", "", mine))
        mismatch = compare_inputs(session, self.rank, inputs, first, self._world)
        if mismatch is not None:
            self._record_flag(inputs_mismatch_record(mismatch))
            raise mismatch

    def attach(self) -> None:
        if not self._attached:
            decision_log().add_listener(self.check)
            self._attached = True

    def detach(self) -> None:
        if self._attached:
            decision_log().remove_listener(self.check)
            self._attached = False

    def stop(self) -> None:
        """Detach; ``digest`` mode sends what is pending first (and may raise ``DivergenceError``).

        Checks deferred by a CUDA graph capture and never flushed are logged and dropped.
        """
        global _active
        self.detach()
        with _active_lock:
            if _active is self:
                _active = None
        pinning.cancel_flush(self.flush)
        if self.ledger is not None and not is_capturing():
            with self._lock:
                self._close_digest()
        if self._pending:
            logger.warning(
                "agreement: %d check(s) deferred during CUDA graph capture were never run", len(self._pending)
            )

    def check(self, decision: Decision) -> None:
        """Listener: compare ``decision`` with the other ranks (raises DivergenceError)."""
        if self.mode == "off" or decision.source in self.unchecked:
            return
        ident = identity_digest(decision.kernel, decision.key, decision.arch)
        with self._lock:
            if ident in self._seen:
                return
            self._seen.add(ident)
            if self.ledger is not None:
                if self.ledger.add(decision) and not is_capturing():
                    self._flush_digest()  # a full batch goes now, not at the next repeated launch
                else:
                    pinning.request_flush(self.flush)
                return
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
        """Send ``digest`` decisions, run checks deferred by a CUDA graph capture (not while capturing)."""
        with self._lock:
            if is_capturing():
                pinning.request_flush(self.flush)  # try again at a launch after the capture
                return
            if self.ledger is not None:
                self._flush_digest()
            self._flush_locked()

    def poll(self) -> None:
        """Raise the divergence another rank recorded in the store, if any (store and digest modes)."""
        if self.mode in ("store", "digest"):
            record = self._read_flag()
            if record:
                raise _error_from_record(record)

    def _read_flag(self) -> bytes:
        return bytes(
            request("the agreement's divergence flag", lambda: self._store.compare_set(_FLAG, "", ""))
        )

    # -- digest mode ---------------------------------------------------------------------
    def _flush_digest(self) -> None:
        """Send the batch; a batch whose reference was only claimed yet is compared at the next
        launch (re-requested flush). No flag poll: a divergence recorded elsewhere is learnt from
        the alarm in a claim reply (``DigestLedger.sound_alarm``) or from the close count."""
        assert self.ledger is not None
        try:
            deferred = self.ledger.flush(self._on_conflict)
        except BadRecord as bad:
            raise StoreRecordError(bad.what, bad.problem) from None
        except DivergenceAlarm:
            self._await_flag()
        if deferred:
            pinning.request_flush(self.flush)

    def _close_digest(self) -> None:
        """Last flush at stop; the last rank of the group to stop also reads the whole log.

        One request besides the flush: the close count's reply also says whether a divergence
        was recorded (``DIVERGED``), and only then is the flag read.
        """
        assert self.ledger is not None
        try:
            self.ledger.flush(self._on_conflict, final=True)
            closed = int(request("the digest agreement's close count", lambda: self._store.add("closed", 1)))
            if closed % DIVERGED >= len(self.ranks):
                self.ledger.read_log(self._on_conflict)
        except BadRecord as bad:
            raise StoreRecordError(bad.what, bad.problem) from None
        except DivergenceAlarm:
            self._await_flag()
        if closed >= DIVERGED:
            self._await_flag()

    def _await_flag(self) -> NoReturn:
        """Raise the recorded divergence; its recorder marks the close count just before writing it
        (and sounds the alarm just after). A read is ``compare_set(flag, "", "")``, which leaves an
        empty flag behind, so this polls for a record rather than waiting for the key (error path)."""
        record = poll_until(lambda: self._read_flag() or None, REFERENCE_WAIT_S)
        if record is None:
            raise StoreRecordError(
                "the agreement's divergence flag",
                f"a divergence mark but no divergence record after {REFERENCE_WAIT_S:g} s",
            )
        raise _error_from_record(record)

    def _record_flag(self, record: str) -> bytes:
        """Record a divergence (the first one wins) and return the winner; the close count says so first."""
        request("the agreement's close count", lambda: self._store.add("closed", DIVERGED))
        winner = bytes(self._store.compare_set(_FLAG, "", record))
        if self.ledger is not None:
            self.ledger.sound_alarm()  # after the flag: whoever sees the alarm finds the record
        return winner

    def _on_conflict(self, conflict: Conflict) -> None:
        assert self.ledger is not None
        (rank_a, flush_a, _), (rank_b, flush_b, _) = conflict.mine, conflict.theirs
        text_a = self.ledger.texts_of(rank_a, flush_a).get(conflict.ident)
        text_b = self.ledger.texts_of(rank_b, flush_b).get(conflict.ident)
        kernel, key = next(((t[0], t[1]) for t in (text_a, text_b) if t), ("?", conflict.ident.hex()))
        signatures = {
            rank_a: text_a[2] if text_a else f"(signature digest {conflict.mine[2].hex()})",
            rank_b: text_b[2] if text_b else f"(signature digest {conflict.theirs[2].hex()})",
        }
        d = Decision(kernel=kernel, key=key, signature=signatures.get(self.rank, ""), source="table")
        self._raise_divergence(d, signatures, "Found by the digest check at a flush (after the launch).")

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
        what = f"the store check of kernel {d.kernel} with key {d.key}"
        name = "k/" + identity_digest(d.kernel, d.key, d.arch).hex()
        claim = request(what, lambda: self._store.compare_set(name, "", mine), hint=STORE_MODE_HINT)
        try:
            claim_text = decode_text(claim, what)
            first, _, first_signature = claim_text.partition("\n")
            first_rank = parse_rank_text(first, what, self._world)
        except BadRecord as bad:
            detail = f"The store's claim for this key is unreadable: {bad.problem}."
            self._raise_divergence(d, {self.rank: d.signature}, detail)
        if claim_text != mine and first_signature != d.signature:
            signatures = {first_rank: first_signature, self.rank: d.signature}
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
        winner = self._record_flag(record)
        error = _error_from_record(winner)
        if isinstance(error, DivergenceError) and error.signatures.get(self.rank) != d.signature:
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
        session = self.session
        on_wait = None if session is None else (lambda missing: session.fail_if_moved_on(missing, what))
        try:
            arrive(
                self._store, f"ag/{self._seq}", self.rank, self.ranks, what, self.timeout_s, on_wait=on_wait
            )
        except AgreementTimeoutError as error:
            mismatch = session.explain_timeout(error, what) if session is not None else None
            if mismatch is not None:
                raise mismatch from error
            raise
        row = identity_digest(d.kernel, d.key, d.arch) + signature_digest(d.signature)
        rows = all_gather_bytes(row, self.group)
        if all(r == rows[0] for r in rows):
            return
        texts = all_gather_bytes(pack_text(d.kernel, d.key, d.signature), self.group)
        raise _allgather_error(rows, [unpack_text(t) for t in texts], self.ranks, self._seq)


def _error_from_record(record: bytes | str) -> DivergenceError | SessionMismatchError | InputMismatchError:
    what = "the agreement's divergence flag"
    try:
        data = decode_record(record, what)
        if data.get("kind") == SESSION_KIND:
            return mismatch_from_record(data)
        if data.get("kind") == INPUTS_KIND:
            return inputs_mismatch_from_record(data)
        raw = record_field(data, "signatures", dict, what)
        signatures = {}
        for rank, signature in raw.items():
            if not isinstance(signature, str):
                raise BadRecord(what, f"signature {signature!r} for rank {rank!r}")
            signatures[parse_rank_text(str(rank), what, None)] = signature
        kernel = record_field(data, "kernel", str, what)
        key = record_field(data, "key", str, what)
        detail = record_field(data, "detail", str, what)
    except BadRecord as bad:
        raise StoreRecordError(bad.what, bad.problem) from None
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreRecordError(
            what, f"a record the library cannot read ({type(exc).__name__}: {exc})"
        ) from None
    return DivergenceError(kernel, key, signatures, detail)


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
