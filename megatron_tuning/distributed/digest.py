"""``digest`` agreement: launch at once, compare in batches, O(1) store requests per rank per flush.

Per-key checks cost every rank a store round trip per new (kernel, key): O(ranks x keys) requests
on one store server, seconds at 1,024 ranks and minutes at 10,000 (``benchmarks/bench_scale.py``).
Here a rank records its new decisions as 32-byte rows (identity digest, signature digest) and
launches; at a *flush* (the first repeated launch after new keys, ``verify_agreement``, ``close``,
or when a batch reaches ``MAX_BATCH`` rows) it sends what it has:

1. ``compare_set("ref/<flush>", "", <claim>)``, the claim naming this rank and the digest of its
   sorted rows (a few dozen bytes each way). The first rank of each flush number claims that
   number's *reference* and publishes its rows under ``rows/<flush>``, then ``ready/<flush>``,
   then its log record (step 3; an error message naming the owner's config waits for it).
   Everyone else gets the claim back. A batch with the reference's digest (tensor-parallel peers,
   data-parallel replicas, the reference's own pipeline stage) is done: one small request.
2. Otherwise ``add("n/<batch digest>", 1)``: of ranks with one batch (a pipeline stage's), only
   the first goes on. It fetches ``rows/<flush>`` and compares locally: a row whose identity the
   reference has with another signature is a divergence, found at once; the rows the reference
   lacks (other pipeline stages, a rank's own variable-length shapes) are its *residual*. A rank
   whose reference is claimed but not yet published does not wait: it compares at its next
   flush, which the checker requests for the next launch, and a final flush (close) waits for
   ``ready/<flush>``, at most ``REFERENCE_WAIT_S`` (the owner sets it right after its claim).
3. Uploading is one ``append`` (no reply) to the job's one log: a record of (rank, flush, row
   count, text length), the rows, and zlib-compressed JSON texts (kernel, key, signature) of those
   rows in row order, read only to write an error message. So a row's text reaches the store with
   the row (the reference's owner: one request after), and every row any rank can compare lives
   in the log.
4. The group's first rank reads the log at each of its flushes, and the last rank to close reads
   it all: two rows with one identity and two signatures are a divergence.
5. Every flush reads the job's divergence flag (a flush that deferred its comparison reads it at
   the next one), so every rank raises the first divergence found.
   Whoever records a divergence adds ``DIVERGED`` to the close counter, so a closing rank
   learns of it from the reply of its ``add("closed", 1)`` (and then reads the flag) without a
   request of its own for the flag.

Requests per rank and flush: 1 (same batch as the reference), 2 (a pipeline stage's peers), 4
with rows of its own (claim, add, reference rows, append), one more when the comparison was
deferred; plus the flag poll (not at a deferring flush), and one ``add`` at close. Only a distinct
batch's first sender downloads the reference (one value of 32 bytes per row).
A divergence is noticed at the flush of the rank that differs from a reference, or at the next
flush (or close) of the log's reader; ``verify_agreement`` always compares everything
(``verify.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..core.decisions import Decision
from ..core.errors import StoreRequestError
from .storeops import BadRecord, decode_text, max_nesting, request
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
_CLAIM = struct.Struct("<cII16s")  # kind (b"C" claim, b"R" reference), rank, flush, batch digest
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
        self.deferred: dict[int, list[bytes]] = {}  # flush -> rows whose reference was only claimed
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
        for flush, rows in list(self.deferred.items()):
            self._compare(flush, rows, on_conflict, final=final)
        if self.pending:
            self._send(on_conflict, final=final)
        if self.reader:
            self.read_log(on_conflict)
        return bool(self.deferred)

    def _send(self, on_conflict: Callable[[Conflict], None], *, final: bool) -> None:
        rows = sorted(row for row, _ in self.pending.values())
        self.flushes += 1
        flush = self.flushes
        what = f"the digest flush #{flush} of rank {self.rank} ({len(rows)} new decisions)"
        digest = batch_digest(rows)
        claim = _CLAIM.pack(b"C", self.rank, flush, digest)
        reply = bytes(self._ask(what, "compare_set", f"ref/{flush}", "", claim))
        for ident, (row, _) in self.pending.items():
            self.sent[ident] = row[HALF:]
        self.pending.clear()
        if reply == claim:
            # This batch is the reference of its flush number. Rows first, since ranks that got
            # only the claim wait for them; then the record with the texts, which only an error
            # message reads (and waits for: ``texts_of``).
            self.store.set(f"rows/{flush}", _CLAIM.pack(b"R", self.rank, flush, digest) + b"".join(rows))
            self.store.set(f"ready/{flush}", "1")
            self._append(flush, rows)
            return
        _, _, _, their_digest = _parse_claim(reply, f"{what}: the reference of flush #{flush}")
        if their_digest == digest:
            return  # the reference's very rows: nothing new, nothing that can differ
        if int(self._ask(what, "add", f"n/{digest.hex()}", 1)) > 1:
            return  # an identical batch was sent first (a pipeline stage's peers): its sender compares
        self.deferred[flush] = rows
        self._compare(flush, rows, on_conflict, final=final)

    def _compare(
        self, flush: int, rows: list[bytes], on_conflict: Callable[[Conflict], None], *, final: bool
    ) -> None:
        """Compare a deferred batch with its reference: now if published, else wait only if ``final``."""
        what = f"the digest flush #{flush} of rank {self.rank} ({len(rows)} new decisions)"
        if final:
            reference = self._reference(flush, what)
        else:
            reference = bytes(self._ask(what, "compare_set", f"rows/{flush}", "", ""))
            if not reference:
                return  # claimed, not yet published: compare at the next flush (or at close)
        del self.deferred[flush]
        self._finish(flush, rows, reference, on_conflict)

    def _finish(
        self, flush: int, rows: list[bytes], reference: bytes, on_conflict: Callable[[Conflict], None]
    ) -> None:
        what = f"the digest flush #{flush} of rank {self.rank} ({len(rows)} new decisions)"
        residual = self._against_reference(rows, reference, flush, what, on_conflict)
        if residual:
            self._append(flush, residual)

    def _append(self, flush: int, rows: list[bytes]) -> None:
        texts = texts_blob([self.texts[row[:HALF]] for row in rows])
        self.store.append("log", pack_record(self.rank, flush, rows, texts))

    def _reference(self, flush: int, what: str) -> bytes:
        """The reference of ``flush``: its owner sets it with its very next requests after claiming it."""
        try:
            self._ask(what, "wait", [f"ready/{flush}"], timedelta(seconds=REFERENCE_WAIT_S))
        except StoreRequestError:
            # A timed-out wait: the owner died between its claim and its reference (a store that
            # is gone fails this check too, and says so).
            if not self._ask(what, "check", [f"ready/{flush}"]):
                problem = f"no reference for flush #{flush} after {REFERENCE_WAIT_S:g} s"
                raise BadRecord(what, problem) from None
        return bytes(self._ask(what, "compare_set", f"rows/{flush}", "", ""))

    def _against_reference(
        self,
        rows: list[bytes],
        reference: bytes,
        flush: int,
        what: str,
        on_conflict: Callable[[Conflict], None],
    ) -> list[bytes]:
        kind, owner, owner_flush, _ = _parse_claim(reference, f"{what}: the reference of flush #{flush}")
        body = reference[_CLAIM.size :]
        if kind != b"R" or len(body) % ROW:
            raise BadRecord(what, f"a reference of kind {kind!r} and {len(body)} row bytes")
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
        deadline = time.monotonic() + REFERENCE_WAIT_S
        pause = 0.005
        while True:
            blob = bytes(self._ask(what, "compare_set", "log", "", ""))
            found = [
                (rows, texts) for r, f, rows, texts in unpack_records(blob, what) if (r, f) == (rank, flush)
            ]
            if found or time.monotonic() > deadline:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        out: dict[bytes, tuple[str, str, str]] = {}
        for rows, texts in found:
            out.update(zip((row[:HALF] for row in rows), decode_texts(texts, len(rows), what)))
        return out

    def _ask(self, what: str, method: str, *args: Any) -> Any:
        """One store request with a reply, counted and named."""
        self.requests += 1
        call = getattr(self.store, method)
        return request(what, lambda: call(*args), store=self.store)


def _parse_claim(blob: bytes, what: str) -> tuple[bytes, int, int, bytes]:
    if len(blob) < _CLAIM.size or blob[:1] not in (b"C", b"R"):
        raise BadRecord(what, f"{blob[:48]!r}, not a reference claim")
    kind, rank, flush, digest = _CLAIM.unpack_from(blob)
    return kind, rank, flush, digest


__all__ = [
    "DIVERGED",
    "Conflict",
    "DigestLedger",
    "MAX_BATCH",
    "batch_digest",
    "decode_texts",
    "row_of",
]
