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

    All ranks settle on one verdict through ``compare_set``, so a rank arriving just after the
    others gave up also raises instead of entering a collective that nobody else will join.
    ``on_wait`` is called with the missing ranks about once a second while waiting; it may raise
    (e.g. when a missing rank is known never to come).
    """
    store.set(f"{tag}/{rank}", "1")
    keys = [f"{tag}/{r}" for r in ranks]
    deadline = time.monotonic() + timeout_s
    proposal = "go"
    while True:
        left = deadline - time.monotonic()
        step = left if on_wait is None else min(left, _WAIT_SLICE_S)
        try:
            store.wait(keys, timedelta(seconds=max(step, 0.001)))
            break
        except _store_timeout_errors():
            missing = [r for r in ranks if not store.check([f"{tag}/{r}"])]
            if not missing:
                break
            if time.monotonic() >= deadline:
                proposal = "timeout:" + ",".join(map(str, missing))
                break
            if on_wait is not None:
                on_wait(missing)
    verdict = bytes(store.compare_set(f"{tag}/verdict", "", proposal)).decode()
    if verdict != "go":
        missing = [int(r) for r in verdict.partition(":")[2].split(",") if r]
        raise AgreementTimeoutError(what, missing, timeout_s)


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
