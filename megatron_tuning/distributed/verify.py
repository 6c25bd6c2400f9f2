"""``verify_agreement``: compare every rank's whole decision log at a step boundary (collective)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

from ..core.decisions import Decision, decision_log
from ..core.errors import DivergenceError, SessionMismatchError
from ..runtime.interception import current_policy
from . import agreement
from .agreement import DEFAULT_TIMEOUT_S, PREFIX, unchecked_sources
from .sessions import compare_session_numbers
from .wire import (
    DIGEST_BYTES,
    ROW_BYTES,
    TEXT_BYTES,
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

MAX_NAMED = 8  # differing entries named by verify_agreement; the rest are counted
_verify_calls: dict[str, int] = {}


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
    checker = agreement.active_checker()
    late_error: DivergenceError | SessionMismatchError | None = None
    if checker is not None:
        try:
            checker.flush()
            checker.poll()
        except (DivergenceError, SessionMismatchError) as error:
            if checker.mode != "store" and isinstance(error, DivergenceError):
                raise  # allgather errors are raised on every rank alike
            late_error = error  # one-sided: raising before the collective would hang the others
    timeout = timeout_s if timeout_s is not None else (checker.timeout_s if checker else DEFAULT_TIMEOUT_S)
    ranks = group_ranks(group)
    scope = scope_id(group, ranks)
    _verify_calls[scope] = seq = _verify_calls.get(scope, 0) + 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"{PREFIX}/verify/r{restart}/{scope}", default_store())
    arrive(store, str(seq), dist.get_rank(), ranks, f"verify_agreement call #{seq}", timeout)

    policy = current_policy()
    table = _log_table(unchecked_sources(policy.mode if policy is not None else None))
    idents = list(table)  # launch order, so the first divergence named is the earliest one
    # Each rank's entry count and session number: ranks that called init_deterministic_tuning a
    # different number of times compare nothing at first use; here every rank names them alike.
    header = len(idents).to_bytes(8, "little") + agreement.session_number().to_bytes(8, "little")
    headers = all_gather_bytes(header, group)
    sessions = {rank: int.from_bytes(h[8:], "little") for rank, h in zip(ranks, headers)}
    compare_session_numbers(sessions, f"verify_agreement call #{seq}")
    sizes = [int.from_bytes(h[:8], "little") for h in headers]
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


def _log_table(unchecked: frozenset[str]) -> dict[bytes, Decision]:
    """This process's checked decisions by identity digest, in first-use order.

    After a re-install the same (kernel, key) can appear twice: the latest decision is what the
    process launches now, so it wins (a dict keeps the first insertion's position).
    """
    return {
        identity_digest(d.kernel, d.key, d.arch): d
        for d in decision_log().decisions()
        if d.source not in unchecked
    }


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
