"""How two sets of 32-byte rows differ, learnt from a summary a fraction of their size.

``digest`` agreement compares each rank's batch of decision rows with a reference batch. Fetching
the reference costs a store request and its bytes; a rank whose batch differs by a few rows (its
own variable-length shapes) needs only *which* rows differ. So a claim carries a *summary* of its
rows: the rows themselves when that is small, else an invertible Bloom lookup table (IBLT;
Eppstein, Goodrich, Uyeda, Varghese, "What's the difference?", SIGCOMM 2011). A cell holds the
count, the XOR and the XOR of a check hash of the rows that hash to it; subtracting another
set's rows and *peeling* cells that hold one row recovers both one-sided differences exactly.

Decoding is all or nothing: ``difference`` returns the complete symmetric difference, or ``None``
when the sets differ by more than the table holds (about ``CELLS_PER_ROW / 1.35`` of the rows) or
when the bytes are not a consistent table. A caller that gets ``None`` fetches the rows. Every
decoded row is checked to hash to the cells it came from, and rows said to be ours must be ours,
so a torn or forged summary cannot make a divergence disappear, only make the caller fetch.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ROW = 32
HASHES = 4
"""Cells each row is added to, one in each quarter of the table (so never twice in one cell)."""
CELL = 4 + ROW + 8  # count (int32), XOR of the rows (4 x uint64), XOR of their check hashes (uint64)
CELLS_PER_ROW = 0.25
"""Table size as a share of the summarized rows: decodes differences up to ~1/5 of the batch."""
MIN_CELLS = 48
INLINE = b"R"  # the summary is the rows themselves
TABLE = b"I"  # the summary is an IBLT
_PERSON = b"mt-reconcile"
_HASH = np.dtype([("cells", "<u4", (HASHES,)), ("check", "<u8")])  # one row's blake2b digest (24 bytes)


def cells_for(rows: int) -> int:
    """Cells of the table that summarizes ``rows`` rows (a multiple of ``HASHES``)."""
    wanted = max(MIN_CELLS, math.ceil(rows * CELLS_PER_ROW))
    return HASHES * math.ceil(wanted / HASHES)


def summary_kind(rows: int) -> bytes:
    """``INLINE`` when the rows take no more bytes than their table, else ``TABLE``."""
    return INLINE if rows * ROW <= cells_for(rows) * CELL else TABLE


def summary_bytes(kind: bytes, rows: int) -> int:
    """Bytes of a summary of ``kind`` over ``rows`` rows."""
    return rows * ROW if kind == INLINE else cells_for(rows) * CELL


def summarize(rows: Sequence[bytes]) -> tuple[bytes, bytes]:
    """(kind, payload): the summary a claim carries for ``rows`` (32-byte rows, any order)."""
    kind = summary_kind(len(rows))
    if kind == INLINE:
        return kind, b"".join(sorted(rows))
    return kind, _Table.of(rows, cells_for(len(rows))).encode()


@dataclass(frozen=True, slots=True)
class Difference:
    """What two row sets differ by: rows only in ours, rows only in theirs (each sorted)."""

    ours: list[bytes]
    theirs: list[bytes]


def difference(kind: bytes, payload: bytes, count: int, ours: Sequence[bytes]) -> Difference | None:
    """How ``ours`` differs from the ``count`` rows the summary ``(kind, payload)`` stands for.

    ``None``: the table cannot be decoded (the sets differ by more than it holds, or it is not a
    consistent table). Raises ``ValueError`` when the payload's length does not match ``count``.
    """
    if len(payload) != summary_bytes(kind, count):
        raise ValueError(f"a summary of {len(payload)} bytes for {count} rows")
    if kind == INLINE:
        theirs = {payload[i : i + ROW] for i in range(0, len(payload), ROW)}
        mine = set(ours)
        return Difference(sorted(mine - theirs), sorted(theirs - mine))
    if kind != TABLE:
        raise ValueError(f"a summary of kind {kind!r}")
    table = _Table.decode(payload, cells_for(count))
    table.remove(ours)
    peeled = table.peel()
    if peeled is None:
        return None
    only_ours, only_theirs = peeled
    mine = set(ours)
    if not all(row in mine for row in only_ours) or any(row in mine for row in only_theirs):
        return None  # not a table of real rows: fetch them instead
    return Difference(sorted(only_ours), sorted(only_theirs))


class _Table:
    """An IBLT over 32-byte rows: counts, row XORs and check-hash XORs per cell."""

    def __init__(self, counts: np.ndarray, keys: np.ndarray, checks: np.ndarray) -> None:
        self.counts = counts  # int64 [cells]
        self.keys = keys  # uint64 [cells, 4]
        self.checks = checks  # uint64 [cells]

    @classmethod
    def of(cls, rows: Sequence[bytes], cells: int) -> _Table:
        table = cls(np.zeros(cells, np.int64), np.zeros((cells, 4), np.uint64), np.zeros(cells, np.uint64))
        table._add(rows, 1)
        return table

    def remove(self, rows: Sequence[bytes]) -> None:
        self._add(rows, -1)

    def _add(self, rows: Sequence[bytes], sign: int) -> None:
        if not rows:
            return
        cells, checks = _hashes(rows, len(self.counts))
        words = np.frombuffer(b"".join(rows), dtype="<u8").reshape(len(rows), 4)
        np.add.at(self.counts, cells.ravel(), sign)
        for h in range(HASHES):
            np.bitwise_xor.at(self.keys, cells[:, h], words)
            np.bitwise_xor.at(self.checks, cells[:, h], checks)

    def encode(self) -> bytes:
        return (
            self.counts.astype("<i4").tobytes()
            + self.keys.astype("<u8").tobytes()
            + self.checks.astype("<u8").tobytes()
        )

    @classmethod
    def decode(cls, blob: bytes, cells: int) -> _Table:
        counts_end, keys_end = 4 * cells, 4 * cells + ROW * cells
        counts = np.frombuffer(blob, dtype="<i4", count=cells).astype(np.int64)
        keys = np.frombuffer(blob[counts_end:keys_end], dtype="<u8").reshape(cells, 4).copy()
        checks = np.frombuffer(blob[keys_end:], dtype="<u8", count=cells).copy()
        return cls(counts, keys, checks)

    def peel(self) -> tuple[list[bytes], list[bytes]] | None:
        """(rows with count -1 after removing ours, rows with count +1): decoded, or ``None``."""
        cells = len(self.counts)
        counts = self.counts.tolist()
        raw = self.keys.astype("<u8").tobytes()
        keys = [int.from_bytes(raw[i * ROW : (i + 1) * ROW], "little") for i in range(cells)]
        checks = self.checks.tolist()
        ours: list[bytes] = []
        theirs: list[bytes] = []
        queue = [i for i in range(cells) if counts[i] in (1, -1)]
        budget = sum(abs(c) for c in counts) + cells  # each real peel removes one row
        while queue and budget > 0:
            budget -= 1
            i = queue.pop()
            sign = counts[i]
            if sign not in (1, -1):
                continue
            row = keys[i].to_bytes(ROW, "little")
            where, check = _hash_one(row, cells)
            if check != checks[i] or i not in where:
                continue  # more than one row here, whatever the count says
            (theirs if sign == 1 else ours).append(row)
            value = keys[i]
            for j in where:
                counts[j] -= sign
                keys[j] ^= value
                checks[j] ^= check
                if counts[j] in (1, -1):
                    queue.append(j)
        if any(counts) or any(keys) or any(checks):
            return None
        return ours, theirs


def _hashes(rows: Sequence[bytes], cells: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``HASHES`` cells (one per quarter of the table) and its check hash."""
    digests = b"".join(
        hashlib.blake2b(row, digest_size=_HASH.itemsize, person=_PERSON).digest() for row in rows
    )
    parsed = np.frombuffer(digests, dtype=_HASH)
    part = cells // HASHES
    offsets = np.arange(HASHES, dtype=np.int64) * part
    cell_of = parsed["cells"].astype(np.int64) % part + offsets
    return cell_of, parsed["check"].astype(np.uint64)


_ONE = struct.Struct(f"<{HASHES}IQ")


def _digest(row: bytes) -> bytes:
    return hashlib.blake2b(row, digest_size=_HASH.itemsize, person=_PERSON).digest()


def _hash_one(row: bytes, cells: int) -> tuple[tuple[int, ...], int]:
    """``_hashes`` for one row, in plain Python (the peeling loop)."""
    *picks, check = _ONE.unpack(_digest(row))
    part = cells // HASHES
    return tuple(p % part + h * part for h, p in enumerate(picks)), check


__all__ = [
    "CELL",
    "INLINE",
    "ROW",
    "TABLE",
    "Difference",
    "cells_for",
    "difference",
    "summarize",
    "summary_bytes",
]
