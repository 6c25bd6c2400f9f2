"""What crosses ranks, and how: fixed-size digests and text rows, store barriers, byte all-gathers.

Only fixed-size byte tensors and plain text cross processes: no pickle, no
``all_gather_object`` (a size-mismatched gloo gather has been seen to abort a rank silently).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core.errors import AgreementTimeoutError

DIGEST_BYTES = 32
ROW_BYTES = 2 * DIGEST_BYTES  # identity digest, then signature digest
FIELD_BYTES = (256, 768, 512)  # kernel, key, signature text in a fixed-size naming row
TEXT_BYTES = sum(FIELD_BYTES)
_TRUNCATED = b"...[truncated]"


def default_store() -> Any:
    """The default process group's key-value store (private torch API; see the contract test)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def group_ranks(group: Any) -> list[int]:
    """Global ranks of ``group`` (``None``: the whole job), in group-rank order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


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


def all_to_all_bytes(chunks: Sequence[bytes], group: Any) -> list[bytes]:
    """Send ``chunks[i]`` to the group's i-th rank; return what each rank sent to this one.

    Sizes travel first (one int64 per rank pair), then one ``all_to_all_single`` of the bytes, so
    each rank moves only its own data: O(rows) per rank, not O(ranks x rows) as an all-gather.
    """
    device = _collective_device(group)
    world = dist.get_world_size(group)
    if len(chunks) != world:
        raise ValueError(f"all_to_all_bytes needs {world} chunks, got {len(chunks)}")
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
    data = _tensor_bytes(recv)
    out, start = [], 0
    for size in incoming:
        out.append(data[start : start + size])
        start += size
    return out


def broadcast_bytes(data: bytes, size: int, source: int, group: Any) -> bytes:
    """Broadcast ``size`` bytes from global rank ``source`` (others pass anything; it is padded)."""
    device = _collective_device(group)
    tensor = torch.frombuffer(bytearray(data[:size].ljust(size, b"\0")), dtype=torch.uint8).to(device)
    dist.broadcast(tensor, src=source, group=group)
    return _tensor_bytes(tensor)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    try:
        return tensor.cpu().numpy().tobytes()
    except (ImportError, RuntimeError):  # torch built without numpy: slower, same bytes
        return bytes(tensor.cpu().tolist())


def arrive(
    store: Any,
    tag: str,
    rank: int,
    ranks: Sequence[int],
    what: str,
    timeout_s: float,
    *,
    on_wait: Callable[[list[int]], None] | None = None,
) -> None:
    """Store barrier with a deadline: return when every rank arrived, else name the missing ones.

    O(1) requests per rank, whatever the group size: an arrival counter, one ``go`` key the last
    arrival sets, and a list of arrivals read only on a timeout. All ranks settle on one verdict
    through ``compare_set``, so a rank arriving just after the others gave up also raises instead of
    entering a collective that nobody else will join. The last rank to leave deletes the barrier's
    keys, so a long job does not fill the store.

    ``on_wait`` (small groups: allgather checks) is called with the missing ranks about once a
    second while waiting and may raise; the wait then polls with ``check`` instead of one long
    ``wait``, because each timed-out ``wait`` makes torch print two warnings.
    """
    count = len(ranks)
    store.append(f"{tag}/in", f"{rank},")
    if store.add(f"{tag}/n", 1) >= count:
        store.set(f"{tag}/go", "go")
    proposal = "go"
    if not _wait_for(store, f"{tag}/go", timeout_s, lambda: _missing(store, tag, ranks), on_wait):
        missing = _missing(store, tag, ranks)
        proposal = "timeout:" + ",".join(map(str, missing)) if missing else "go"
    verdict = bytes(store.compare_set(f"{tag}/verdict", "", proposal)).decode("utf-8", "replace")
    if store.add(f"{tag}/out", 1) >= count:
        for suffix in ("in", "n", "go", "verdict", "out"):
            store.delete_key(f"{tag}/{suffix}")
    if verdict != "go":
        missing = [int(r) for r in verdict.partition(":")[2].split(",") if r.isdigit()]
        raise AgreementTimeoutError(what, missing, timeout_s)


def _missing(store: Any, tag: str, ranks: Sequence[int]) -> list[int]:
    arrived = bytes(store.compare_set(f"{tag}/in", "", "")).decode("utf-8", "replace").split(",")
    here = {int(r) for r in arrived if r.isdigit()}
    return [r for r in ranks if r not in here]


def _wait_for(
    store: Any,
    key: str,
    timeout_s: float,
    missing: Callable[[], list[int]],
    on_wait: Callable[[list[int]], None] | None,
) -> bool:
    """Whether ``key`` appeared within ``timeout_s``."""
    if on_wait is None:
        try:
            store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
            return True
        except _store_timeout_errors():
            return bool(store.check([key]))
    deadline = time.monotonic() + timeout_s
    pause, last_report = 0.002, time.monotonic()
    while not store.check([key]):
        now = time.monotonic()
        if now >= deadline:
            return False
        if now - last_report >= _WAIT_SLICE_S:
            last_report = now
            on_wait(missing())
        time.sleep(min(pause, max(deadline - now, 0.0)))
        pause = min(pause * 2, 0.25)
    return True


_WAIT_SLICE_S = 1.0


def _store_timeout_errors() -> tuple[type[BaseException], ...]:
    # DistStoreError exists from torch 2.2; older releases raise a bare RuntimeError.
    return (getattr(dist, "DistStoreError", RuntimeError), RuntimeError)


def _collective_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "cpu" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def scope_id(group: Any, ranks: Sequence[int]) -> str:
    if group is None:
        return "world"
    return "g" + hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:16]
