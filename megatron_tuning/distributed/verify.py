"""``verify_agreement``: compare every rank's whole decision log at a step boundary (collective).

A store barrier with a deadline, then a 32-byte header per rank (log digest, row count, session and
call number); equal digests end it. Otherwise one rank per distinct log sends each row to the rank
owning its identity, and every rank raises the same error (docs/agreement.md). Byte tensors only.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core.decisions import Decision, decision_log, unchecked_sources
from ..core.errors import (
    AgreementTimeoutError,
    DivergenceError,
    InputMismatchError,
    MegatronTuningError,
    StoreError,
)
from ..core.notices import warn_once
from ..core.policy import ENV_AGREEMENT_TIMEOUT, default
from ..runtime.interception import current_policy
from . import store as kv

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 60.0  # the final check at close waits at most this long (or the policy's timeout)
FIELD_BYTES = (256, 768, 512)  # kernel, key, signature text in a fixed-size naming row
_TEXT = struct.Struct("".join(f"{size}s" for size in FIELD_BYTES))
TEXT_BYTES = _TEXT.size
MAX_NAMED = 8  # differing entries named by verify_agreement; the rest are counted
MAX_SIGNATURES_NAMED = 4  # distinct logs whose configs are listed per named entry
_HEADER = struct.Struct("<16sQII")  # log digest, row count, session number, call number (0: at close)
_ROW = struct.Struct("<16s16sI")  # identity, signature, position in the sender's log
_LIST_ROW = 1 << 31  # a row's position flag: a kernel's config list, not a (kernel, key) entry
_NAMED = struct.Struct("<16sII")  # identity, first observer's group index, its log position
_SUMMARY = struct.Struct("<QII")  # shared entries, differing entries and lists, shared lists (this owner's)


@dataclass
class _Calls:
    """One scope's checks in this process: every rank numbers them alike, or the pairing is broken."""

    paired: int = 0  # verify_agreement calls and checks at close: the barrier's tag
    user: int = 0  # verify_agreement calls: the header's call number
    broken: InputMismatchError | None = None  # raised by every later check of the scope


_verify_calls: dict[str, _Calls] = {}
_sessions = 0
_sessions_lock = threading.Lock()


def next_session() -> int:
    global _sessions
    with _sessions_lock:
        _sessions += 1
        return _sessions


def compare_logs(
    group: Any, timeout_s: float | None, checker: Any, *, at_close: bool = False, compare_rows: bool = True
) -> int:
    """``verify_agreement`` over ``group``: flush ``checker`` (the session's ``agreement.Agreement``,
    or ``None``) first, then compare every rank's decision log; return how many entries were shared.
    ``compare_rows=False`` (``store``'s check at close, on every rank alike): headers only, no log rows."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    ranks = kv.group_ranks(group)
    scope = kv.scope_id(group, ranks)
    calls = _verify_calls.setdefault(scope, _Calls())
    if calls.broken is not None:
        raise calls.broken  # ranks no longer pair their checks: waiting would only time out
    late_error: MegatronTuningError | None = None
    if checker is not None:
        try:
            checker.flush()
        except MegatronTuningError as error:
            if checker.mode == "allgather" and isinstance(error, DivergenceError):
                raise  # allgather errors are raised on every rank alike
            late_error = error  # one-sided: raising before the collective would hang the others
    if timeout_s is None:
        timeout_s = checker.timeout_s if checker else default(ENV_AGREEMENT_TIMEOUT)
    calls.paired += 1
    calls.user += not at_close
    seq, call = calls.paired, 0 if at_close else calls.user
    store = kv.prefixed(f"verify/{kv.job_namespace()}/{scope}")
    kv.arrive(store, str(seq), dist.get_rank(), ranks, f"verify_agreement call #{seq}", timeout_s)
    if late_error is None and checker is not None:
        try:  # every rank flushed before the barrier: a divergence or mismatch one recorded is here now
            checker.poll()
        except MegatronTuningError as error:
            late_error = error

    policy = current_policy()
    unchecked = unchecked_sources(policy.mode if policy is not None else None)
    checked = [d for d in decision_log().decisions() if d.source not in unchecked]
    # By identity in first-use order; after a re-install the latest decision of a key (what launches now).
    # Each plain kernel's config list is a row too, before its first key's (``kv.config_list_row``).
    table: dict[bytes, Decision] = {}
    lists: set[bytes] = set()
    for d in checked:
        listing = kv.config_list_row(d)
        if listing is not None and (ident := kv.decision_digest(listing)) not in table:
            table[ident] = listing
            lists.add(ident)
        table[kv.decision_digest(d)] = d
    idents = list(table)  # launch order, so the first divergence named is the earliest one
    rows = sorted(i[:16] + kv.signature_digest(table[i].signature)[:16] for i in idents)
    digest = hashlib.sha256(b"".join(rows)).digest()[:16]
    headers = all_gather_bytes(_HEADER.pack(digest, len(idents) - len(lists), _sessions, call), group)
    parsed = [_HEADER.unpack(h) for h in headers]
    # Every rank sees every header, so all raise the same error. Session 0 (a rank that started
    # none, e.g. one that never imported Triton under `run`) pairs with any: only its log counts.
    calls.broken = _mispaired(seq, ranks, parsed)
    if calls.broken is not None:
        raise calls.broken
    groups: dict[bytes, list[int]] = {}
    for index, (log_digest, *_) in enumerate(parsed):
        groups.setdefault(log_digest, []).append(index)
    shared = parsed[0][1] if len(ranks) >= 2 else 0
    if compare_rows and len(groups) > 1:
        weight = {members[0]: len(members) for members in groups.values()}  # representative -> ranks
        me = ranks.index(dist.get_rank())
        rows_to_send = idents if me in weight else []  # only one rank per distinct log sends its rows
        shared, listed, differing, named = _compare_sharded(
            table, rows_to_send, weight, len(ranks), group, lists
        )
        if differing:  # every rank joins; config lists count as shared entries in the message
            found = _divergence(named, differing, shared + listed, table, groups, ranks, group)
            if late_error is not None:
                raise late_error
            raise DivergenceError(*found, planted=policy is not None and policy.mode == "chaos")
    if late_error is not None:
        raise late_error
    logger.info("verify_agreement: %d shared (kernel, key) entries agree across ranks %s", shared, ranks)
    return shared


def _compare_sharded(
    table: dict[bytes, Decision],
    idents: list[bytes],
    weight: dict[int, int],
    world: int,
    group: Any,
    lists: set[bytes],
) -> tuple[int, int, int, list[tuple[bytes, int, int]]]:
    """Owners compare the representatives' rows; every rank gets the same (shared entries, shared
    config lists, differing rows, named). A config-list row (of ``lists``) carries a flag."""
    chunks: list[list[bytes]] = [[] for _ in range(world)]
    for position, ident in enumerate(idents):
        owner = int.from_bytes(ident[:8], "little") % world
        signature = kv.signature_digest(table[ident].signature)[:16]
        chunks[owner].append(
            _ROW.pack(ident[:16], signature, position | (_LIST_ROW if ident in lists else 0))
        )
    received = all_to_all_bytes([b"".join(c) for c in chunks], group)
    holders: dict[bytes, dict[bytes, tuple[int, int]]] = {}  # ident -> signature -> (index, position)
    count: dict[bytes, int] = {}
    listed: set[bytes] = set()
    for index, blob in enumerate(received):
        for offset in range(0, len(blob), _ROW.size):
            ident, signature, position = _ROW.unpack_from(blob, offset)
            if position & _LIST_ROW:
                listed.add(ident)
            holders.setdefault(ident, {}).setdefault(signature, (index, position & ~_LIST_ROW))
            count[ident] = count.get(ident, 0) + weight.get(index, 0)
    shared = [ident for ident in holders if count[ident] >= 2]
    differing = sorted(
        (min(observers.values()), ident) for ident, observers in holders.items() if len(observers) > 1
    )
    lists_shared = sum(1 for ident in shared if ident in listed)
    mine = _SUMMARY.pack(len(shared) - lists_shared, len(differing), lists_shared) + b"".join(
        _NAMED.pack(ident, index, position) for (index, position), ident in differing[:MAX_NAMED]
    )
    summaries = all_gather_bytes(mine.ljust(_SUMMARY.size + MAX_NAMED * _NAMED.size, b"\0"), group)
    total_shared = total_differing = total_lists = 0
    named: list[tuple[bytes, int, int]] = []
    for blob in summaries:
        owner_shared, owner_differing, owner_lists = _SUMMARY.unpack_from(blob)
        total_shared += owner_shared
        total_differing += owner_differing
        total_lists += owner_lists
        for n in range(min(owner_differing, MAX_NAMED)):
            named.append(_NAMED.unpack_from(blob, _SUMMARY.size + n * _NAMED.size))
    named.sort(key=lambda item: (item[1], item[2], item[0]))
    return total_shared, total_lists, total_differing, named[:MAX_NAMED]


def _mispaired(seq: int, ranks: list[int], parsed: list[tuple[Any, ...]]) -> InputMismatchError | None:
    """Ranks met at one check from other sessions, or other calls (one of them a check at close)."""
    differences = {}
    sessions = {r: p[2] for r, p in zip(ranks, parsed)}
    if len(set(sessions.values()) - {0}) > 1:
        differences["tuning sessions started"] = sessions
    calls = {r: f"#{p[3]}" if p[3] else "the check at close" for r, p in zip(ranks, parsed)}
    if len(set(calls.values())) > 1:
        differences["verify_agreement calls"] = calls
    return InputMismatchError(f"verify_agreement call #{seq}", ranks, differences) if differences else None


def _divergence(
    named: list[tuple[bytes, int, int]],
    total: int,
    shared: int,
    table: dict[bytes, Decision],
    groups: dict[bytes, list[int]],
    ranks: list[int],
    group: Any,
) -> tuple[str, str, dict[int, str], str]:
    """Every rank builds the same error's fields from texts the representatives broadcast."""
    short = {ident[:16]: decision for ident, decision in table.items()}
    me = ranks.index(dist.get_rank())
    members = {members[0]: members for members in groups.values()}  # representative -> its log's ranks
    texts: dict[int, list[tuple[str, str, str] | None]] = {}
    for index in sorted(members):  # one broadcast per distinct log: few on an error path
        mine = [short.get(ident) for ident, _, _ in named] if index == me else []
        block = b"".join(pack_text(d.kernel, d.key, d.signature) if d else bytes(TEXT_BYTES) for d in mine)
        data = broadcast_bytes(block, TEXT_BYTES * len(named), ranks[index], group)
        rows = [data[n * TEXT_BYTES : (n + 1) * TEXT_BYTES] for n in range(len(named))]
        texts[index] = [unpack_text(row) if any(row) else None for row in rows]
    entries = []
    for n in range(len(named)):
        by_signature: dict[str, list[int]] = {}
        seen = [(index, row) for index, rows in texts.items() if (row := rows[n]) is not None]
        for index, row in seen:
            by_signature.setdefault(row[2], []).extend(ranks[m] for m in members[index])
        entries.append((seen[0][1][0], seen[0][1][1], by_signature))
    kernel, key, first = entries[0]
    signatures = {}
    for signature, holders in list(first.items())[:MAX_SIGNATURES_NAMED]:
        for rank in holders[:MAX_SIGNATURES_NAMED]:
            signatures[rank] = signature
    lines = [f"Found by verify_agreement over {len(ranks)} ranks: {total} of {shared} shared entries differ."]
    for signature, holders in first.items():
        if len(holders) > MAX_SIGNATURES_NAMED:
            lines.append(f"  {len(holders)} ranks ran {signature} (first {holders[:MAX_SIGNATURES_NAMED]})")
    for other_kernel, other_key, other in entries[1:]:
        listing = "; ".join(f"rank(s) {_ranks_text(r)}: {s}" for s, r in other.items())
        lines.append(f"  Also kernel {other_kernel} with key {other_key}: {listing}")
    if total > len(named):
        lines.append(f"  ... and {total - len(named)} more.")
    return kernel, key, signatures, "\n".join(lines)


def _ranks_text(ranks: list[int]) -> str:
    shown = ranks[:MAX_SIGNATURES_NAMED]
    more = f" and {len(ranks) - len(shown)} more" if len(ranks) > len(shown) else ""
    return f"{shown}{more}"


def verify_at_close(group: Any, timeout_s: float, checker: Any = None, *, rows: bool = True) -> None:
    """The final check of a ``verify`` session (``checker``, flushed first), or with ``rows=False``
    the meeting of a ``store`` session's: bounded (``CLOSE_TIMEOUT_S``), so a rank that died or never
    closes cannot hang it; then it says so, naming the ranks. A divergence (``verify``), or ranks
    that started different numbers of sessions, raise."""
    if not (dist.is_available() and dist.is_initialized()):
        if not rows:  # store: its per-key checks ran at first use
            logger.info("megatron_tuning: no process group at close: the check at close did not run")
            return
        warn_once(
            ("close-check-no-group",),
            "the final agreement check did not run: the process group was destroyed before the tuning "
            "session closed. Call megatron_tuning.verify_agreement() (or handle.close()) before "
            "destroy_process_group().",
        )
        return
    try:
        compare_logs(group, min(timeout_s, CLOSE_TIMEOUT_S), checker, at_close=True, compare_rows=rows)
    except (AgreementTimeoutError, StoreError) as exc:
        warn_once(
            ("close-check", type(exc).__name__), "the final agreement check at close did not run: %s", exc
        )


def pack_text(kernel: str, key: str, signature: str) -> bytes:
    """Fixed-size NUL-padded row of the three texts; an over-long field ends in a marker."""
    parts = []
    for text, size in zip((kernel, key, signature), FIELD_BYTES):
        raw = text.encode()
        if len(raw) > size:
            raw = raw[: size - 14].decode("utf-8", "ignore").encode() + b"...[truncated]"
        parts.append(raw)
    return _TEXT.pack(*parts)


def unpack_text(row: bytes) -> tuple[str, str, str]:
    kernel, key, signature = (field.rstrip(b"\0").decode("utf-8", "replace") for field in _TEXT.unpack(row))
    return kernel, key, signature


def all_gather_bytes(data: bytes, group: Any) -> list[bytes]:
    """All-gather one equal-size byte string per rank, as uint8 tensors on the group's device."""
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(_device(group))
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return [_bytes(t) for t in out]


def all_to_all_bytes(chunks: Sequence[bytes], group: Any) -> list[bytes]:
    """Send ``chunks[i]`` to the group's i-th rank; return what each rank sent to this one (sizes
    first, then one ``all_to_all_single``: O(rows) per rank, not O(ranks x rows))."""
    device = _device(group)
    send_sizes = torch.tensor([len(c) for c in chunks], dtype=torch.int64, device=device)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    incoming = [int(n) for n in recv_sizes.cpu().tolist()]
    payload = b"".join(chunks)
    send = torch.frombuffer(bytearray(payload or b"\0"), dtype=torch.uint8)[: len(payload)].to(device)
    recv = torch.empty(sum(incoming), dtype=torch.uint8, device=device)
    dist.all_to_all_single(
        recv, send, output_split_sizes=incoming, input_split_sizes=[len(c) for c in chunks], group=group
    )
    data, out, start = _bytes(recv), [], 0  # one copy to the host, then slices: one per rank
    for size in incoming:
        out.append(data[start : start + size])
        start += size
    return out


def broadcast_bytes(data: bytes, size: int, source: int, group: Any) -> bytes:
    """Broadcast ``size`` bytes from global rank ``source`` (others pass anything; it is padded)."""
    tensor = torch.frombuffer(bytearray(data[:size].ljust(size, b"\0")), dtype=torch.uint8).to(_device(group))
    dist.broadcast(tensor, src=source, group=group)
    return _bytes(tensor)


def _bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.cpu().numpy().tobytes())


def _device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "cpu" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
