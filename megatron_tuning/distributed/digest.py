"""``digest`` agreement: launch at once, compare in batches, O(1) store requests per rank per flush.

Per-key checks cost every rank a store round trip per new (kernel, key): O(ranks x keys) requests
on one store server, seconds at 1,024 ranks and minutes at 10,000 (``benchmarks/bench_scale.py``).
Here a rank records its new decisions as 32-byte rows (identity digest, signature digest) and
launches; at a *flush* (the first repeated launch after new keys, ``verify_agreement``, ``close``,
or when a batch reaches ``MAX_BATCH`` rows) it sends what it has:

1. ``add("n/<batch digest>", 1)``. Ranks that decided exactly the same batch (tensor-parallel
   peers, data-parallel replicas) get a count above one and are done: their rows are the first
   sender's rows, and the first sender compares them.
2. The first sender of a batch claims the *reference* of its flush number
   (``add("refn/<flush>", 1)``): the first batch of each flush number becomes the reference, and
   every later sender fetches it (one reply) and compares its rows with it locally (a row whose
   identity is in the reference with another signature is a divergence, found at once). Its
   remaining rows (keys the reference does not have: other pipeline stages, a rank's
   own variable-length shapes) are appended to ``S`` identity-sharded logs (``append``: no reply).
   The reference's owner appends its whole batch there, so every row sent lives in exactly one
   shard log once.
3. Rank ``s`` reads shard logs ``s, s + world, ...`` at each of its flushes, and the last rank to
   close reads them all: any two rows with one identity and two signatures are a divergence.
4. Every flush reads the job's divergence flag, so every rank raises the first divergence found.

What crosses ranks is raw digests and, for error messages only, JSON text of the rows a rank
made visible (``t/<rank>/<flush>``: the reference owner's whole batch, a later sender's rows the
reference lacks), written before those rows can be seen. A divergence is noticed at the flush
of the rank that differs from a reference, or at the next flush (or close) of the rank reading the
shard the two rows fall in; ``verify_agreement`` always compares everything (``verify.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..core.decisions import Decision
from .storeops import BadRecord, decode_record, decode_text, request
from .wire import identity_digest, signature_digest

logger = logging.getLogger(__name__)

HALF = 16
ROW = 2 * HALF  # identity digest (16 bytes), then signature digest (16 bytes)
MAX_BATCH = 4096
"""Rows per flush at most: a longer burst of new keys flushes early (bounded values in the store)."""
SHARDS = 4
"""Identity-sharded logs of rows not every rank has: a rank with such rows appends to at most this
many (one request each); rank s of the first SHARDS reads log s at its flushes."""
REFERENCE_WAIT_S = 30.0
"""How long a sender waits for a reference its owner has claimed (the owner's next request sets it)."""
_HEADER = struct.Struct("<III")  # rank, flush number, row count


@dataclass(frozen=True, slots=True)
class Conflict:
    """Two rows with one identity and two signatures, and where each came from."""

    ident: bytes
    mine: tuple[int, int, bytes]  # (rank, flush, signature digest)
    theirs: tuple[int, int, bytes]


def row_of(decision: Decision) -> bytes:
    ident = identity_digest(decision.kernel, decision.key, decision.arch)[:HALF]
    return ident + signature_digest(decision.signature)[:HALF]


def batch_digest(rows: Iterable[bytes]) -> str:
    return hashlib.sha256(b"".join(rows)).hexdigest()[:32]


def pack_batch(rank: int, flush: int, rows: list[bytes]) -> bytes:
    return _HEADER.pack(rank, flush, len(rows)) + b"".join(rows)


def unpack_batches(blob: bytes, what: str) -> list[tuple[int, int, list[bytes]]]:
    """Batches appended back to back: ``(rank, flush, rows)`` each; a torn blob is a ``BadRecord``."""
    out, offset, size = [], 0, len(blob)
    while offset < size:
        if size - offset < _HEADER.size:
            raise BadRecord(what, f"a truncated batch header at byte {offset}")
        rank, flush, count = _HEADER.unpack_from(blob, offset)
        offset += _HEADER.size
        end = offset + count * ROW
        if end > size:
            raise BadRecord(what, f"a batch of {count} rows with only {size - offset} bytes left")
        out.append((rank, flush, [blob[i : i + ROW] for i in range(offset, end, ROW)]))
        offset = end
    return out


class DigestLedger:
    """One rank's side of the digest protocol for one session (``store`` is the session's prefix)."""

    def __init__(self, store: Any, rank: int, world: int, *, shards: int = SHARDS) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.shards = max(1, min(shards, world))
        self.flushes = 0
        self.pending: dict[bytes, tuple[bytes, Decision]] = {}
        self.sent: dict[bytes, bytes] = {}  # identity -> signature digest, every row flushed
        self.texts: dict[bytes, Decision] = {}
        self._read_offsets: dict[int, int] = {}
        self._shard_rows: dict[bytes, tuple[int, int, bytes]] = {}
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
    def flush(self, on_conflict: Callable[[Conflict], None]) -> None:
        """Send the pending batch (if any), read this rank's shards, and report conflicts."""
        if self.pending:
            self._send(on_conflict)
        self.read_shards(self._my_shards(), on_conflict)

    def _send(self, on_conflict: Callable[[Conflict], None]) -> None:
        rows = sorted(row for row, _ in self.pending.values())
        self.flushes += 1
        flush = self.flushes
        what = f"the digest flush #{flush} of rank {self.rank} ({len(rows)} new decisions)"
        digest = batch_digest(rows)
        count = self._ask(what, "add", f"n/{digest}", 1)
        for ident, (row, _) in self.pending.items():
            self.sent[ident] = row[HALF:]
        self.pending.clear()
        if int(count) > 1:
            return  # an identical batch was sent first: its sender compares it
        if int(self._ask(what, "add", f"refn/{flush}", 1)) == 1:
            # This batch is the reference of its flush number. Texts first: whoever reads the
            # reference may need them for an error message.
            self.store.set(f"t/{self.rank}/{flush}", _texts_blob(self.texts, rows))
            self.store.set(f"ref/{flush}", pack_batch(self.rank, flush, rows))
            residual = rows
        else:
            reference = self._reference(flush, what)
            residual = self._against_reference(rows, reference, flush, what, on_conflict)
            self.store.set(f"t/{self.rank}/{flush}", _texts_blob(self.texts, residual))
        self._append_to_shards(flush, residual)

    def _reference(self, flush: int, what: str) -> bytes:
        """The reference of ``flush``: its owner sets it with its very next request after claiming it."""
        deadline = time.monotonic() + REFERENCE_WAIT_S
        pause = 0.001
        while True:
            blob = bytes(self._ask(what, "compare_set", f"ref/{flush}", "", ""))
            if blob:
                return blob
            if time.monotonic() > deadline:
                raise BadRecord(what, f"no reference for flush #{flush} after {REFERENCE_WAIT_S:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def _against_reference(
        self,
        rows: list[bytes],
        reference: bytes,
        flush: int,
        what: str,
        on_conflict: Callable[[Conflict], None],
    ) -> list[bytes]:
        batches = unpack_batches(reference, f"{what}: the reference of flush #{flush}")
        if len(batches) != 1:
            raise BadRecord(what, f"a reference of {len(batches)} batches (expected one)")
        owner, owner_flush, ref_rows = batches[0]
        known = {row[:HALF]: row[HALF:] for row in ref_rows}
        residual = []
        for row in rows:
            ident, signature = row[:HALF], row[HALF:]
            theirs = known.get(ident)
            if theirs is None:
                residual.append(row)
            elif theirs != signature:
                on_conflict(Conflict(ident, (self.rank, flush, signature), (owner, owner_flush, theirs)))
        return residual

    def _append_to_shards(self, flush: int, rows: list[bytes]) -> None:
        by_shard: dict[int, list[bytes]] = {}
        for row in rows:
            by_shard.setdefault(row[0] % self.shards, []).append(row)
        for shard, shard_rows in sorted(by_shard.items()):
            self.store.append(f"s/{shard}", pack_batch(self.rank, flush, shard_rows))

    # -- reading -------------------------------------------------------------------------
    def _my_shards(self) -> list[int]:
        return list(range(self.rank, self.shards, self.world))

    def all_shards(self) -> list[int]:
        return list(range(self.shards))

    def read_shards(self, shards: Iterable[int], on_conflict: Callable[[Conflict], None]) -> None:
        """Compare every row appended to ``shards`` since this rank last read them."""
        for shard in shards:
            what = f"shard {shard} of the digest agreement"
            raw = self._ask(what, "compare_set", f"s/{shard}", "", "")
            blob = bytes(raw)
            start = self._read_offsets.get(shard, 0)
            if len(blob) < start:
                raise BadRecord(what, f"a log that shrank from {start} to {len(blob)} bytes")
            self._read_offsets[shard] = len(blob)
            for rank, flush, rows in unpack_batches(blob[start:], what):
                for row in rows:
                    ident, signature = row[:HALF], row[HALF:]
                    first = self._shard_rows.setdefault(ident, (rank, flush, signature))
                    if first[2] != signature:
                        on_conflict(Conflict(ident, (rank, flush, signature), first))

    def texts_of(self, rank: int, flush: int) -> dict[bytes, tuple[str, str, str]]:
        """The (kernel, key, signature) texts another rank sent with ``flush``; ``{}`` if unreadable."""
        if rank == self.rank:
            return {i: (d.kernel, d.key, d.signature) for i, d in self.texts.items()}
        what = f"the decision texts of rank {rank}'s flush #{flush}"
        raw = self._ask(what, "compare_set", f"t/{rank}/{flush}", "", "")
        if not bytes(raw):
            return {}
        data = decode_record(raw, what)
        out = {}
        for ident_hex, fields in data.items():
            if isinstance(fields, list) and len(fields) == 3 and all(isinstance(f, str) for f in fields):
                try:
                    out[bytes.fromhex(ident_hex)] = (fields[0], fields[1], fields[2])
                except ValueError:
                    continue
        return out

    def _ask(self, what: str, method: str, *args: Any) -> Any:
        """One store request with a reply, counted and named."""
        self.requests += 1
        call = getattr(self.store, method)
        return request(what, lambda: call(*args), store=self.store)


def _texts_blob(texts: dict[bytes, Decision], rows: list[bytes]) -> str:
    chosen = {}
    for row in rows:
        d = texts[row[:HALF]]
        chosen[row[:HALF].hex()] = [d.kernel, d.key, d.signature]
    return json.dumps(chosen, sort_keys=True)


__all__ = ["Conflict", "DigestLedger", "MAX_BATCH", "SHARDS", "batch_digest", "decode_text", "row_of"]
