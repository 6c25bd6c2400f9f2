"""Cross-rank agreement (docs/agreement.md): the inputs check at every session's start, then
``policy.agreement``'s per-key checks (``store``, ``allgather``) or ``verify``'s, and (``store``,
``verify``) a bounded check at close; nothing runs inside a CUDA graph capture. The running
session's checks (an ``Agreement``) are registered here: ``verify_agreement`` flushes them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from ..core.decisions import Decision, decision_log, unchecked_sources
from ..core.errors import (
    CONFIG_LIST_KEY,
    DivergenceError,
    InputMismatchError,
    MegatronTuningError,
    StoreError,
)
from ..core.policy import TuningPolicy
from ..runtime.pinning import is_capturing
from . import store as kv
from . import verify
from .inputs import CHECKED_MODES, describe_inputs
from .verify import all_gather_bytes, pack_text, unpack_text

STORE_UP_TO_RANKS = 64
"""Worlds up to this size check each key at first use (``store``); larger ones use ``verify``."""
CLOSE_CHECKED = ("store", "verify")  # agreement modes whose session ends with ``verify.verify_at_close``
logger = logging.getLogger(__name__)


_active: Agreement | None = None
_active_lock = threading.Lock()
before_verify: list[Callable[[], None]] = []  # a session still waiting for its group attaches here


def active_checker() -> Agreement | None:
    return _active


def set_active_checker(checker: Agreement | None, *, replacing: Agreement | None = None) -> None:
    """Make ``checker`` the active one; with ``replacing``, only if that one is still active."""
    global _active
    with _active_lock:
        if replacing is None or _active is replacing:
            _active = checker


def verify_agreement(group: Any = None, *, timeout_s: float | None = None) -> int:
    """Compare every rank's decision log at a step boundary (collective over ``group``, default: the
    job); return how many entries two or more ranks observed. Every rank raises the same error: a
    ``DivergenceError``, an ``AgreementTimeoutError`` naming the missing ranks, or an
    ``InputMismatchError`` where calls pair with another session's or call (docs/agreement.md)."""
    for attach in tuple(before_verify):  # ``attach.LateAttach``: never raises, its checker does
        attach()
    checker = _active
    try:
        return verify.compare_logs(group, timeout_s, checker)
    except MegatronTuningError as error:
        if checker is not None:
            checker.note(error)
        raise


class RaisedErrors:
    """What a session's checks raised to this rank's caller, so that its close does not raise it again
    (a caller that caught it, a chaos run, handled it). By text: a flag's error is rebuilt each time."""

    def __init__(self) -> None:
        self._raised: set[str] = set()

    def note(self, error: BaseException) -> None:
        self._raised.add(f"{type(error).__name__}: {error}")

    def raise_new(self, error: BaseException | None) -> None:
        """Raise ``error`` unless this session raised the same one before (then log it at INFO)."""
        if error is None:
            return
        if f"{type(error).__name__}: {error}" in self._raised:
            logger.info("megatron_tuning: at close, not raised again: %s", type(error).__name__)
            return
        self.note(error)
        raise error


def resolve_mode(policy: TuningPolicy, group: Any = None) -> str:
    """The mode ``policy`` asks for; unset: ``store`` up to ``STORE_UP_TO_RANKS`` ranks, else ``verify``."""
    if policy.agreement is not None:
        return policy.agreement
    if not (dist.is_available() and dist.is_initialized()):
        return "store"
    return "verify" if len(kv.group_ranks(group)) > STORE_UP_TO_RANKS else "store"


def checked_mode(policy: TuningPolicy, group: Any = None) -> str | None:
    """The agreement mode a session of ``policy`` started now runs; ``None`` where it checks nothing
    (no process group, agreement ``off``, a measuring mode). ``verify`` checks every decision of the
    process at close, so a session it replaces need not run its own check."""
    mode, grouped = resolve_mode(policy, group), dist.is_available() and dist.is_initialized()
    return mode if grouped and mode != "off" and policy.mode in CHECKED_MODES else None


class FailedAgreement(RaisedErrors):
    """Stands in for the checks of a rank whose late attach failed (its inputs differ, ``auto``'s rank
    cap...): each later check raises that error; ``verify_agreement`` joins the collective first.
    Its close raises it only where no check raised it yet (``verify``: after the check at close)."""

    def __init__(self, error: Exception, policy: TuningPolicy, group: Any = None) -> None:
        super().__init__()
        self.error, self.group, self.mode = error, group, checked_mode(policy, group) or "inputs"
        self.timeout_s = policy.agreement_timeout_s
        set_active_checker(self)

    def check(self, decision: Decision | None = None, *, defer: bool = False) -> None:
        self.note(self.error)
        raise self.error

    flush = poll = check

    def stop(self, *, final_check: bool = True) -> None:
        set_active_checker(None, replacing=self)
        if final_check and self.mode == "verify":  # the others' check at close meets this rank's
            verify.verify_at_close(self.group, self.timeout_s, self)  # and raises the error after it
        elif final_check:  # store: the recorded flag (or the same failure) spares the others' wait
            self.raise_new(self.error)


def start_agreement(
    policy: TuningPolicy, group: Any = None, *, inputs: Mapping[str, str] | None = None
) -> AgreementChecker | None:
    """Start cross-rank checks for ``policy`` and make them the active ones; ``None`` without a process
    group. Every session with a group claims its inputs, whatever its policy: one whose mode or
    agreement checks nothing per key (mode "inputs") still fails a job whose other ranks check.
    ``inputs`` that differ from the first rank's raise ``InputMismatchError`` here, and on that rank
    at its next check (an "inputs" session: at ``verify_agreement`` and at close)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mode = checked_mode(policy, group) or "inputs"
    if _active is not None:
        _active.stop(final_check=False)
    checker = AgreementChecker(policy, group, session=verify.next_session(), mode=mode)
    checker.compare_inputs(inputs if inputs is not None else describe_inputs(policy))
    if mode in ("store", "allgather"):
        decision_log().add_listener(checker.check)
    set_active_checker(checker)
    return checker


class AgreementChecker(RaisedErrors):
    """Decision-log listener comparing each new (kernel, key) with the other ranks. ``store``,
    ``rank`` and ``ranks`` let tests drive it without a process group."""

    def __init__(
        self,
        policy: TuningPolicy,
        group: Any = None,
        *,
        session: int = 1,
        mode: str | None = None,
        store: Any = None,
        rank: int | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.mode: str = mode or policy.agreement or "store"  # or "verify", "allgather", "inputs"
        self.policy = policy
        self.timeout_s = policy.agreement_timeout_s
        self.unchecked = unchecked_sources(policy.mode)
        self.group = group
        self.session = session
        self.rank = dist.get_rank() if rank is None else int(rank)
        self.ranks = list(ranks) if ranks is not None else kv.group_ranks(group)
        self.world = max(self.ranks) + 1 if self.ranks else 1
        scope = kv.scope_id(group, self.ranks)
        self._store = kv.prefixed(f"agreement/{kv.job_namespace()}/e{session}/{scope}", store)
        self._lock = threading.RLock()  # allgather checks must not interleave within a process
        self._seen: set[bytes] = set()
        self._lists: set[bytes] = set()  # config lists this rank's store check compared
        self._pending: list[Decision] = []
        self._seq = 0

    def compare_inputs(self, inputs: Mapping[str, str]) -> None:
        """Claim this session's inputs; raise ``InputMismatchError`` if the first rank's differ."""
        where = f"tuning session #{self.session}"
        mine = {"rank": self.rank, "inputs": dict(inputs)}
        first = kv.claim(self._store, "inputs", mine, f"the inputs of {where}")
        theirs = kv.field(first, "inputs", dict, f"the inputs of {where}")
        first_rank = kv.rank_of(first, f"the inputs of {where}", self.world)
        differences = {
            name: {first_rank: str(theirs.get(name, "-")), self.rank: str(inputs.get(name, "-"))}
            for name in sorted(set(theirs) | set(inputs))
            if str(theirs.get(name, "-")) != str(inputs.get(name, "-"))
        }
        if differences:
            error = InputMismatchError(where, sorted({first_rank, self.rank}), differences)
            self._flag(
                {"kind": "inputs", "where": where, "ranks": error.ranks, "differences": error.differences}
            )
            raise error

    def stop(self, *, final_check: bool = True) -> None:
        """Detach. ``verify``: the bounded final check (``verify_agreement`` again, whole logs).
        ``store``: the deferred checks and the flag, then, if no rank recorded an error, the bounded
        meeting that tells ranks that started different numbers of sessions apart. An "inputs"
        session reads the flag. Other than ``verify``, an error this session raised before is not
        raised again (``RaisedErrors``)."""
        decision_log().remove_listener(self.check)
        set_active_checker(None, replacing=self)
        if final_check and self.mode == "verify":
            verify.verify_at_close(self.group, self.timeout_s, self)
        elif final_check and self.mode == "store":
            self.raise_new(self._store_close())
        elif self._pending or (final_check and self.mode == "inputs"):
            self.raise_new(self._attempt(self._flush))

    def _store_close(self) -> Exception | None:
        if not (dist.is_available() and dist.is_initialized()):
            logger.info("megatron_tuning: no process group at close: the check at close did not run")
            return None
        recorded = self._attempt(self._flush)
        if recorded is not None:  # every rank reads it: none waits for the meeting, all skip it
            return recorded
        paired = self._attempt(lambda: verify.verify_at_close(self.group, self.timeout_s, rows=False))
        return paired or self._attempt(self._poll)  # a flag recorded while this rank waited

    @staticmethod
    def _attempt(action: Callable[[], Any]) -> Exception | None:
        try:
            action()
        except MegatronTuningError as error:
            return error
        return None

    def check(self, decision: Decision, *, defer: bool = False) -> None:
        """Listener: compare ``decision`` with the other ranks (raises ``DivergenceError``); ``defer``:
        at the next ``flush`` (a late attach at ``verify_agreement`` or close)."""
        if self.mode not in ("store", "allgather") or decision.source in self.unchecked:
            return
        ident = kv.decision_digest(decision)
        with self._lock:
            if ident in self._seen:
                return
            self._seen.add(ident)
            if defer or is_capturing():
                self._pending.append(decision)
                return
            try:
                self._run_pending()
                self._check_one(decision)
            except BaseException as error:
                # Nothing is pinned when a listener raises: the next launch of this key comes back
                # here and must fail again, not pass as "already seen".
                self._seen.discard(ident)
                self.note(error)
                raise

    def flush(self) -> None:
        """Run checks deferred by a CUDA graph capture, and raise a divergence another rank recorded."""
        self._raise_noted(self._attempt(self._flush))

    def poll(self) -> None:
        """Raise the divergence (or input mismatch) another rank recorded in the store, if any."""
        self._raise_noted(self._attempt(self._poll))

    def _raise_noted(self, error: Exception | None) -> None:
        if error is not None:  # raised to the caller: its close will not raise it again
            self.note(error)
            raise error

    def _flush(self) -> None:
        with self._lock:
            if not is_capturing():
                self._run_pending()
                self._poll()

    def _poll(self) -> None:
        if self.mode in ("store", "inputs"):
            record = kv.peek(self._store, "flag", "the agreement's divergence flag")
            if record is not None:
                raise _error_from_flag(record)

    def _run_pending(self) -> None:
        while self._pending:
            self._check_one(self._pending.pop(0))

    def _check_one(self, decision: Decision) -> None:
        if self.mode == "store":
            self._store_check(decision)
        elif self.mode == "allgather":
            self._allgather_check(decision)

    def _store_check(self, d: Decision) -> None:
        listing = kv.config_list_row(d)  # the kernel's config list: once per kernel, before its keys
        if listing is not None and (ident := kv.decision_digest(listing)) not in self._lists:
            self._claim(listing)
            self._lists.add(ident)
        self._claim(d)
        self._poll()

    def _claim(self, d: Decision) -> None:
        what = f"the store check of kernel {d.kernel} with key {d.key}"
        name = "k/" + kv.decision_digest(d).hex()
        first = kv.claim(self._store, name, {"rank": self.rank, "signature": d.signature}, what)
        first_rank = kv.rank_of(first, what, self.world)
        first_signature = kv.field(first, "signature", str, what)
        if first_signature != d.signature:
            signatures = {first_rank: first_signature, self.rank: d.signature}
            raise self._divergence(d, signatures, "Found by the store check at first use.")

    def _divergence(self, d: Decision, signatures: dict[int, str], detail: str) -> Exception:
        record: dict[str, Any] = {"kind": "divergence", "kernel": d.kernel, "key": d.key, "detail": detail}
        record["planted"] = self.policy.mode == "chaos"
        record["signatures"] = {str(r): s for r, s in sorted(signatures.items())}
        # The first divergence recorded wins, so every rank raises the identical message.
        return _error_from_flag(self._flag(record))

    def _flag(self, record: dict[str, Any]) -> dict[str, Any]:
        return kv.claim(self._store, "flag", {"rank": self.rank, **record}, "the agreement's divergence flag")

    def _allgather_check(self, d: Decision) -> None:
        self._seq += 1
        what = f"kernel {d.kernel} with key {d.key} (allgather check #{self._seq})"
        kv.arrive(self._store, f"ag/{self._seq}", self.rank, self.ranks, what, self.timeout_s)
        row = kv.decision_digest(d) + kv.signature_digest(d.signature)
        rows = all_gather_bytes(row, self.group)
        if all(r == rows[0] for r in rows):
            return
        packed = pack_text(d.kernel, d.key, d.signature)
        texts = [unpack_text(t) for t in all_gather_bytes(packed, self.group)]
        same = [i for i, r in enumerate(rows) if r[:32] == rows[0][:32]]
        detail = f"Found by allgather check #{self._seq} over ranks {self.ranks}."
        if len({r[:32] for r in rows}) > 1 and len({t[:2] for t in texts}) == 1:
            # One kernel name and key on every rank, other identities: its config lists may differ.
            listing = kv.config_list_row(d)
            mine = ("", "", "") if listing is None else (listing.kernel, listing.key, listing.signature)
            lists = [unpack_text(t)[2] for t in all_gather_bytes(pack_text(*mine), self.group)]
            if all(lists) and len(set(lists)) > 1:
                raise DivergenceError(texts[0][0], CONFIG_LIST_KEY, dict(zip(self.ranks, lists)), detail)
        elsewhere = [
            f"rank {self.ranks[i]} was at kernel {t[0]} with key {t[1]}"
            for i, t in enumerate(texts)
            if i not in same
        ]
        if elsewhere:
            detail += (
                f" Ranks reached different kernels at this check ({'; '.join(elsewhere)}): allgather needs "
                "identical kernels in identical order; use agreement 'store' otherwise."
            )
        signatures = {self.ranks[i]: texts[i][2] for i in same}
        raise DivergenceError(texts[0][0], texts[0][1], signatures, detail, self.policy.mode == "chaos")


Agreement = AgreementChecker | FailedAgreement  # a session's cross-rank checks: ``active_checker()``


def _error_from_flag(record: Mapping[str, Any]) -> Exception:
    what = "the agreement's divergence flag"
    if record.get("kind") == "inputs":
        return InputMismatchError(
            kv.field(record, "where", str, what),
            kv.field(record, "ranks", list, what),
            kv.field(record, "differences", dict, what),
        )
    raw = kv.field(record, "signatures", dict, what)
    signatures = {}
    for rank, signature in raw.items():
        if not (isinstance(rank, str) and rank.isdigit() and isinstance(signature, str)):
            raise StoreError(what, f"the flag names rank {rank!r} with signature {signature!r}")
        signatures[int(rank)] = signature
    return DivergenceError(
        kv.field(record, "kernel", str, what),
        kv.field(record, "key", str, what),
        signatures,
        kv.field(record, "detail", str, what),
        record.get("planted") is True,
    )
