"""``digest`` agreement: launch at once, compare in batches, O(1) store requests per rank per flush.

Per-key checks cost every rank a store round trip per new (kernel, key): O(ranks x keys) requests
on one store server, seconds at 1,024 ranks and minutes at 10,000 (``benchmarks/bench_scale.py``).
Here a rank records its new decisions as 32-byte rows (identity digest, signature digest) and
launches; at a *flush* (the first repeated launch after new keys, ``verify_agreement``, ``close``,
or when a batch reaches ``MAX_BATCH`` rows) it sends what it has:

1. ``compare_set("ref/<flush>/<bucket>", "", <claim>)``. The claim names this rank, its row count,
   the digest of its sorted rows and a *summary* of them (``reconcile.py``: the rows when few,
   else an invertible Bloom lookup table of a quarter as many cells as rows). The *bucket* is the
   batch's smallest identity modulo ``BUCKETS``: batches that share most rows (tensor- and
   data-parallel peers, ranks with a few shapes of their own) almost always meet in one bucket,
   disjoint ones (pipeline stages with keys of their own) almost always in different buckets.
   The first rank in a bucket claims it as that bucket's *reference* and publishes its rows
   (``rows/<flush>/<bucket>``, then ``ready/<flush>/<bucket>``, then its log record, step 3);
   everyone else gets the claim back. A batch with the reference's digest is done: one request.
2. Otherwise the rank decodes how its rows differ from the reference's from the summary alone:
   a row whose identity the reference has with another signature is a divergence, found at
   once; rows the reference lacks are the batch's *residual*, uploaded (step 3). Still one
   request. Only when the summary cannot be decoded (the batches differ by more than about a
   fifth: another pipeline stage in the same bucket, chaos) does the rank first
   ``add("n/<batch digest>", 1)``, so that of the ranks with that very batch only the first goes
   on, then fetch the reference's rows and compare them. A rank whose reference is claimed but
   not yet published does not wait: it compares at its next flush, which the checker requests
   for the next launch, and a final flush (close) waits for ``ready``, at most
   ``REFERENCE_WAIT_S`` (the owner sets it right after its claim).
3. Uploading is one ``append`` (no reply) to the job's one log: a record of (rank, flush, row
   count, text length), the rows, and zlib-compressed JSON texts (kernel, key, signature) of those
   rows in row order, read only to write an error message. So a row's text reaches the store with
   the row (a reference's owner: one request after), and every row any rank can compare lives
   in the log.
4. The group's first rank reads the log at each of its flushes, and the last rank to close reads
   it all: two rows with one identity and two signatures are a divergence. This is also where
   batches of different buckets meet.
5. No flush polls the divergence flag. Whoever records a divergence adds ``DIVERGED`` to the
   close counter, writes the flag, then *sounds the alarm*: it appends ``ALARM`` to the claim
   keys of every bucket of the flush numbers around its own (``ALARM_BEHIND`` before,
   ``ALARM_AHEAD`` after; no replies). Every rank's flushes are numbered 1, 2, ..., so a rank's
   next flush meets a marked claim key (or one with the alarm alone) and it raises the recorded
   error; a rank further ahead learns from its ``add("closed", 1)`` reply at close.

Requests with a reply per rank and flush: 1 (claim) when the summary decodes, which covers equal
batches, a few keys of a rank's own and one differing config; 2 or 3 when it does not (claim,
dedup ``add``, and for the first of a batch the reference's rows); one more when that comparison
was deferred; one ``add`` at close. Uploads (``append``, ``set``) have no reply.
A divergence is noticed at the flush of the rank that differs from its bucket's reference, or
at the next flush (or close) of the log's reader; every other rank raises at its next flush (or
close); ``verify_agreement`` always compares everything (``verify.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..core.decisions import Decision
from ..core.errors import StoreRequestError
from .reconcile import INLINE, TABLE, Difference, difference, summarize, summary_bytes
from .storeops import BadRecord, decode_text, max_nesting, poll_until, request
from .wire import identity_digest, signature_digest

logger = logging.getLogger(__name__)

HALF = 16
ROW = 2 * HALF  # identity digest (16 bytes), then signature digest (16 bytes)
MAX_BATCH = 4096
"""Rows per flush at most: a longer burst of new keys flushes early (bounded values in the store)."""
REFERENCE_WAIT_S = 30.0
"""How long a sender waits for a reference its owner has claimed (the owner's next requests set it)."""
DIVERGED = 1 << 32
"""Added to the close counter by whoever records a divergence: closers see it in their reply."""
MAX_TEXT_BYTES = 64 << 20
"""The decompressed texts of one log record at most (4,096 rows of long keys are a few MB)."""
BUCKETS = 64
"""Claim keys per flush number. A batch's bucket is its smallest identity modulo this: batches
sharing most rows almost always meet (a rank's own rows hold the minimum with the probability
of their share), and k disjoint ones collide with probability about k^2 / (2 BUCKETS)."""
ALARM_AHEAD = 8
ALARM_BEHIND = 64
"""Flush numbers around the recorder's own whose claim keys (every bucket) get the alarm."""
ALARM = b"!"
_ABSENT = b"\x00absent"  # what a read of a missing key returns (no value the library writes)
_CLAIM = struct.Struct("<cIII16s")  # kind (b"C" claim, b"R" reference), rank, flush, rows, digest
_RECORD = struct.Struct("<IIII")  # rank, flush number, row count, compressed text bytes


@dataclass(frozen=True, slots=True)
class Conflict:
    """Two rows with one identity and two signatures, and where each came from."""

    ident: bytes
    mine: tuple[int, int, bytes]  # (rank, flush, signature digest)
    theirs: tuple[int, int, bytes]


def row_of(decision: Decision) -> bytes:
    ident = identity_digest(decision.kernel, decision.key, decision.arch)[:HALF]
    return ident + signature_digest(decision.signature)[:HALF]


def batch_digest(rows: Iterable[bytes]) -> bytes:
    return hashlib.sha256(b"".join(rows)).digest()[:HALF]


def bucket_of(rows: list[bytes]) -> int:
    """The claim bucket of sorted ``rows``: their smallest identity, modulo ``BUCKETS``."""
    return int.from_bytes(rows[0][:8], "big") % BUCKETS


def pack_record(rank: int, flush: int, rows: list[bytes], texts: bytes) -> bytes:
    """One log record: header, rows, then the rows' compressed texts."""
    return _RECORD.pack(rank, flush, len(rows), len(texts)) + b"".join(rows) + texts


def unpack_records(blob: bytes, what: str, start: int = 0) -> list[tuple[int, int, list[bytes], bytes]]:
    """Records appended back to back from ``start``: ``(rank, flush, rows, texts)``; torn is ``BadRecord``."""
    out, offset, size = [], start, len(blob)
    while offset < size:
        if size - offset < _RECORD.size:
            raise BadRecord(what, f"a truncated record header at byte {offset}")
        rank, flush, count, text_bytes = _RECORD.unpack_from(blob, offset)
        offset += _RECORD.size
        end = offset + count * ROW
        if end + text_bytes > size:
            left = size - offset
            raise BadRecord(what, f"a record of {count} rows and {text_bytes} text bytes with {left} left")
        rows = [blob[i : i + ROW] for i in range(offset, end, ROW)]
        out.append((rank, flush, rows, blob[end : end + text_bytes]))
        offset = end + text_bytes
    return out


def texts_blob(decisions: list[Decision]) -> bytes:
    """The (kernel, key, signature) texts of ``decisions`` in order, as compressed JSON."""
    text = json.dumps([[d.kernel, d.key, d.signature] for d in decisions], separators=(",", ":"))
    return zlib.compress(text.encode(), 6)


def decode_texts(blob: bytes, count: int, what: str) -> list[tuple[str, str, str]]:
    """The texts of a record of ``count`` rows; anything but the library's own is a ``BadRecord``."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(blob, MAX_TEXT_BYTES)
    except zlib.error as exc:
        raise BadRecord(what, f"texts that are not zlib data ({exc})") from None
    if inflater.unconsumed_tail:
        raise BadRecord(what, f"texts over {MAX_TEXT_BYTES} bytes uncompressed")
    text = decode_text(raw, what) if len(raw) <= 1 << 20 else raw.decode("utf-8", "replace")
    if max_nesting(text) > 2:
        raise BadRecord(what, f"texts nested deeper than the library writes: {text[:48]!r}")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise BadRecord(what, f"texts that are not the library's JSON ({exc}): {text[:80]!r}") from None
    if not (isinstance(data, list) and len(data) == count):
        raise BadRecord(what, f"texts for {len(data) if isinstance(data, list) else '?'} rows, not {count}")
    out = []
    for fields in data:
        if not (isinstance(fields, list) and len(fields) == 3 and all(isinstance(f, str) for f in fields)):
            raise BadRecord(what, f"a text entry {str(fields)[:80]!r} (expected three strings)")
        out.append((fields[0], fields[1], fields[2]))
    return out


class DigestLedger:
    """One rank's side of the digest protocol for one session (``store`` is the session's prefix).

    ``reader``: this rank reads the log at each of its flushes (the group's first rank).
    """

    def __init__(self, store: Any, rank: int, world: int, *, reader: bool = False) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.reader = reader
        self.flushes = 0
        self.pending: dict[bytes, tuple[bytes, Decision]] = {}
        self.sent: dict[bytes, bytes] = {}  # identity -> signature digest, every row flushed
        self.texts: dict[bytes, Decision] = {}
        self.deferred: dict[int, _Deferred] = {}  # flush -> a batch whose reference was only claimed
        self._read_offset = 0
        self._log_rows: dict[bytes, tuple[int, int, bytes]] = {}
        self.requests = 0  # store requests with a reply, for tests and benchmarks

    # -- recording -----------------------------------------------------------------------
    def add(self, decision: Decision) -> bool:
        """Queue ``decision``'s row; whether the batch is now full (flush before the next one)."""
        row = row_of(decision)
        ident = row[:HALF]
        if ident in self.pending or ident in self.sent:
            return len(self.pending) >= MAX_BATCH
        self.pending[ident] = (row, decision)
        self.texts[ident] = decision
        return len(self.pending) >= MAX_BATCH

    # -- flushing ------------------------------------------------------------------------
    def flush(self, on_conflict: Callable[[Conflict], None], *, final: bool = False) -> bool:
        """Send the pending batch (if any); the reader also reads the log. Reports conflicts.

        Whether a batch waits for its flush's reference (its owner had claimed it but not yet
        published it): the caller flushes again at the next launch instead of waiting now, and a
        ``final`` flush (close) waits for it.
        """
        for flush in list(self.deferred):
            self._compare(flush, on_conflict, final=final)
        if self.pending:
            self._send(on_conflict, final=final)
        if self.reader:
            self.read_log(on_conflict)
        return bool(self.deferred)

    def _send(self, on_conflict: Callable[[Conflict], None], *, final: bool) -> None:
        rows = sorted(row for row, _ in self.pending.values())
        self.flushes += 1
        flush = self.flushes
        bucket = bucket_of(rows)
        what = f"the digest flush #{flush} of rank {self.rank} ({len(rows)} new decisions)"
        digest = batch_digest(rows)
        kind, summary = summarize(rows)
        claim = _CLAIM.pack(b"C", self.rank, flush, len(rows), digest) + kind + summary
        reply = bytes(self._ask(what, "compare_set", f"ref/{flush}/{bucket}", "", claim))
        if reply == claim:
            # This batch is its bucket's reference. Rows first, since a rank whose summary does
            # not decode waits for them; then the record with the texts, which only an error
            # message reads (and waits for: ``texts_of``).
            header = _CLAIM.pack(b"R", self.rank, flush, len(rows), digest)
            self.store.set(f"rows/{flush}/{bucket}", header + b"".join(rows))
            self.store.set(f"ready/{flush}/{bucket}", "1")
        for ident, (row, _) in self.pending.items():
            self.sent[ident] = row[HALF:]
        self.pending.clear()
        if reply == claim:
            self._append(flush, rows)
            return
        theirs = parse_claim(reply, f"{what}: the reference of flush #{flush}")
        if theirs.alarm:
            raise DivergenceAlarm(flush)
        if theirs.digest == digest:
            return  # the reference's very rows: nothing new, nothing that can differ
        try:
            diff = difference(theirs.kind, theirs.summary, theirs.count, rows)
        except ValueError as exc:
            raise BadRecord(f"{what}: the reference of flush #{flush}", f"a claim with {exc}") from None
        if diff is not None:
            self._settle(diff, flush, theirs, on_conflict)
            return
        # Too different to decode (another pipeline stage in this bucket, or chaos): of the ranks
        # with this very batch, only the first fetches the reference, compares and uploads.
        if not self._first_of(digest, what):
            return
        self.deferred[flush] = _Deferred(rows, bucket)
        self._compare(flush, on_conflict, final=final)

    def _settle(
        self, diff: Difference, flush: int, theirs: Claim, on_conflict: Callable[[Conflict], None]
    ) -> None:
        """Report the rows that differ from the reference's in signature; upload the rest of ours."""
        signatures = {row[:HALF]: row[HALF:] for row in diff.theirs}
        residual = []
        for row in diff.ours:
            ident, signature = row[:HALF], row[HALF:]
            other = signatures.get(ident)
            if other is None:
                residual.append(row)
            else:  # one identity on both sides, so the signatures differ (equal rows cancel)
                on_conflict(
                    Conflict(ident, (self.rank, flush, signature), (theirs.rank, theirs.flush, other))
                )
        if residual:
            self._append(flush, residual)

    def _first_of(self, digest: bytes, what: str) -> bool:
        """Whether this rank is the first to send a batch with ``digest`` (one ``add``)."""
        return int(self._ask(what, "add", f"n/{digest.hex()}", 1)) == 1

    def _compare(self, flush: int, on_conflict: Callable[[Conflict], None], *, final: bool) -> None:
        """Compare a deferred batch with its reference: now if published, else wait only if ``final``."""
        batch = self.deferred[flush]
        what = f"the digest flush #{flush} of rank {self.rank} ({len(batch.rows)} new decisions)"
        reference = self._read(what, f"rows/{flush}/{batch.bucket}")
        if reference is None:
            if not final:
                return  # claimed, not yet published: compare at the next flush (or at close)
            reference = self._reference(flush, batch.bucket, what)
        del self.deferred[flush]
        residual = self._against_reference(batch.rows, reference, flush, what, on_conflict)
        if residual:
            self._append(flush, residual)

    def _append(self, flush: int, rows: list[bytes]) -> None:
        texts = texts_blob([self.texts[row[:HALF]] for row in rows])
        self.store.append("log", pack_record(self.rank, flush, rows, texts))

    def _reference(self, flush: int, bucket: int, what: str) -> bytes:
        """The reference of ``flush`` in ``bucket``: its owner sets it with its very next requests
        after claiming it."""
        try:
            self._ask(what, "wait", [f"ready/{flush}/{bucket}"], timedelta(seconds=REFERENCE_WAIT_S))
        except StoreRequestError:
            # A timed-out wait: the owner died between its claim and its reference (a store that
            # is gone fails this check too, and says so).
            if not self._ask(what, "check", [f"ready/{flush}/{bucket}"]):
                problem = f"no reference for flush #{flush} after {REFERENCE_WAIT_S:g} s"
                raise BadRecord(what, problem) from None
        reference = self._read(what, f"rows/{flush}/{bucket}")
        if reference is None:
            raise BadRecord(what, f"a ready mark for flush #{flush} but no reference rows")
        return reference

    def _read(self, what: str, key: str) -> bytes | None:
        """``key``'s value, or ``None`` if absent, in one request that creates nothing: on an absent
        key ``compare_set`` with a non-empty expected value returns it and sets nothing."""
        value = bytes(self._ask(what, "compare_set", key, _ABSENT, _ABSENT))
        return None if value == _ABSENT else value

    def _against_reference(
        self,
        rows: list[bytes],
        reference: bytes,
        flush: int,
        what: str,
        on_conflict: Callable[[Conflict], None],
    ) -> list[bytes]:
        if reference[:1] != b"R" or len(reference) < _CLAIM.size:
            raise BadRecord(what, f"{reference[:48]!r}, not a reference's rows")
        _, owner, owner_flush, count, _ = _CLAIM.unpack_from(reference)
        body = reference[_CLAIM.size :]
        if len(body) != count * ROW:
            raise BadRecord(what, f"a reference of {count} rows with {len(body)} row bytes")
        known = {body[i : i + HALF]: body[i + HALF : i + ROW] for i in range(0, len(body), ROW)}
        residual = []
        for row in rows:
            ident, signature = row[:HALF], row[HALF:]
            theirs = known.get(ident)
            if theirs is None:
                residual.append(row)
            elif theirs != signature:
                on_conflict(Conflict(ident, (self.rank, flush, signature), (owner, owner_flush, theirs)))
        return residual

    def sound_alarm(self) -> None:
        """After a divergence is recorded: mark the claim keys of every bucket of nearby flush
        numbers (``append``, no reply; once per job), so a rank learns of it from the claim reply
        of its next flush instead of a flag poll at every flush. Flush numbers run 1, 2, ... on
        every rank, so a rank behind this one meets a marked key; one more than ``ALARM_AHEAD``
        flushes ahead learns at close."""
        first = max(1, self.flushes - ALARM_BEHIND + 1)
        for flush in range(first, self.flushes + ALARM_AHEAD + 1):
            for bucket in range(BUCKETS):
                self.store.append(f"ref/{flush}/{bucket}", ALARM)

    # -- reading -------------------------------------------------------------------------
    def read_log(self, on_conflict: Callable[[Conflict], None]) -> None:
        """Compare every row appended to the log since this rank last read it."""
        what = "the log of the digest agreement"
        blob = bytes(self._ask(what, "compare_set", "log", "", ""))
        if len(blob) < self._read_offset:
            raise BadRecord(what, f"a log that shrank from {self._read_offset} to {len(blob)} bytes")
        records = unpack_records(blob, what, self._read_offset)
        self._read_offset = len(blob)
        for rank, flush, rows, _ in records:
            for row in rows:
                ident, signature = row[:HALF], row[HALF:]
                first = self._log_rows.setdefault(ident, (rank, flush, signature))
                if first[2] != signature:
                    on_conflict(Conflict(ident, (rank, flush, signature), first))

    def texts_of(self, rank: int, flush: int) -> dict[bytes, tuple[str, str, str]]:
        """The (kernel, key, signature) texts another rank sent with ``flush``.

        Every (rank, flush) a conflict names has a log record, or will within its sender's next
        request (a reference's owner appends it just after publishing the rows): wait for it up to
        ``REFERENCE_WAIT_S`` (an error path only), then ``{}`` (the message shows digests).
        """
        if rank == self.rank:
            return {i: (d.kernel, d.key, d.signature) for i, d in self.texts.items()}
        what = f"the decision texts of rank {rank}'s flush #{flush}"

        def records() -> list[tuple[list[bytes], bytes]] | None:
            blob = bytes(self._ask(what, "compare_set", "log", "", ""))
            mine = [
                (rows, texts) for r, f, rows, texts in unpack_records(blob, what) if (r, f) == (rank, flush)
            ]
            return mine or None

        found = poll_until(records, REFERENCE_WAIT_S) or []
        out: dict[bytes, tuple[str, str, str]] = {}
        for rows, texts in found:
            out.update(zip((row[:HALF] for row in rows), decode_texts(texts, len(rows), what)))
        return out

    def _ask(self, what: str, method: str, *args: Any) -> Any:
        """One store request with a reply, counted and named."""
        self.requests += 1
        call = getattr(self.store, method)
        return request(what, lambda: call(*args), store=self.store)


class DivergenceAlarm(Exception):
    """A claim key carried the alarm: another rank recorded a divergence (read the flag)."""

    def __init__(self, flush: int) -> None:
        super().__init__(f"the divergence alarm at flush #{flush}")
        self.flush = flush


@dataclass(frozen=True, slots=True)
class _Deferred:
    rows: list[bytes]
    bucket: int


@dataclass(frozen=True, slots=True)
class Claim:
    """A flush's reference claim as read back: owner, rows, digest, summary, and the alarm."""

    rank: int
    flush: int
    count: int
    digest: bytes
    kind: bytes
    summary: bytes
    alarm: bool


def parse_claim(blob: bytes, what: str) -> Claim:
    """A ``ref/<flush>/<bucket>`` value: a claim with its summary, ``ALARM`` bytes appended, or
    the alarm alone."""
    if blob and blob.strip(ALARM) == b"":
        return Claim(-1, 0, 0, b"", b"", b"", alarm=True)  # marked before anybody claimed it
    if len(blob) < _CLAIM.size + 1 or blob[:1] != b"C":
        raise BadRecord(what, f"{blob[:48]!r}, not a reference claim")
    _, rank, flush, count, digest = _CLAIM.unpack_from(blob)
    kind = blob[_CLAIM.size : _CLAIM.size + 1]
    if not 0 < count <= MAX_BATCH or kind not in (INLINE, TABLE):
        raise BadRecord(what, f"a claim of {count} rows with a summary of kind {kind!r}")
    end = _CLAIM.size + 1 + summary_bytes(kind, count)
    if len(blob) < end or blob[end:].strip(ALARM):
        raise BadRecord(what, f"a claim of {count} rows with {len(blob) - _CLAIM.size - 1} summary bytes")
    return Claim(rank, flush, count, digest, kind, blob[_CLAIM.size + 1 : end], alarm=len(blob) > end)


__all__ = [
    "DIVERGED",
    "Conflict",
    "DivergenceAlarm",
    "DigestLedger",
    "MAX_BATCH",
    "batch_digest",
    "decode_texts",
    "row_of",
]
