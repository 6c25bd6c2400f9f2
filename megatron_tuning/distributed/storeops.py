"""Talking to the job's c10d store safely: every request names what it was for, every reply is checked.

The store is shared with torch itself and, in principle, with anything else in the job, so what
the library reads back is untrusted input: a reply that is not valid UTF-8, not the JSON we wrote,
nested absurdly deep, or that names a rank outside the job raises ``BadRecord`` here, which the
caller turns into ``ConsensusError`` / ``DivergenceError`` / ``StoreRecordError`` naming the
kernel, key (or session) and the bad value, never a bare ``UnicodeDecodeError`` or
``RecursionError``.

A request that fails (the store host died, or is paused past the store's timeout) raises
``StoreRequestError`` naming the kernel and key being checked; one that succeeds but took longer
than ``SLOW_REQUEST_S`` logs one warning per cause, so a stalled store is not a silent stall.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..core.errors import StoreRequestError
from ..core.warn import warn_once

logger = logging.getLogger(__name__)

SLOW_REQUEST_S = 5.0
"""A store request slower than this is reported once per purpose (a paused or overloaded store)."""
MAX_RECORD_BYTES = 1 << 20
"""The largest JSON record the library writes under one key is a few KiB; refuse anything huge."""
_MAX_DEPTH = 8

T = TypeVar("T")


class BadRecord(ValueError):
    """What the store returned under one of our keys is not what the library writes there."""

    def __init__(self, what: str, problem: str) -> None:
        self.what = what
        self.problem = problem
        super().__init__(f"{what}: the job's store holds {problem}")


def store_errors() -> tuple[type[BaseException], ...]:
    """What a failed store request raises: torch's DistError family (2.2+), else RuntimeError."""
    import torch.distributed as dist

    return (getattr(dist, "DistError", RuntimeError), RuntimeError, ConnectionError, TimeoutError)


def request(
    what: str, call: Callable[[], T], *, store: Any = None, hint: str = "", where: str = "the job's store"
) -> T:
    """Run one store request for ``what`` (e.g. "the store check of kernel K with key Y").

    A request slower than ``SLOW_REQUEST_S`` gets one notice per kind of request (``what`` with
    its numbers taken out); ``hint`` is the fix it suggests, where the caller knows one, and
    ``where`` names the store (another than the job's: ``auto``'s hosted stores).
    """
    start = time.monotonic()
    try:
        result = call()
    except store_errors() as exc:
        raise StoreRequestError(what, _address(store), f"{type(exc).__name__}: {exc}") from exc
    elapsed = time.monotonic() - start
    if elapsed > SLOW_REQUEST_S:
        warn_once(
            ("slow-store", re.sub(r"[#\d]+", "", what.split(" of ", 1)[0])),
            "megatron_tuning: a request to %s (%s) for %s took %.1f s. The store host "
            "may be overloaded or paused%s.",
            where,
            _address(store),
            what,
            elapsed,
            f"; {hint}" if hint else "",
        )
    return result


def poll_until(fetch: Callable[[], T | None], timeout_s: float) -> T | None:
    """``fetch()`` until it returns something, with a doubling pause (5 ms to 0.5 s); ``None`` once
    ``timeout_s`` has passed. For error paths that wait on another rank's next request."""
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while True:
        found = fetch()
        if found is not None or time.monotonic() > deadline:
            return found
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def _address(store: Any) -> str:
    for candidate in (store, getattr(store, "underlying_store", None)):
        host, port = getattr(candidate, "host", None), getattr(candidate, "port", None)
        if host is not None and port is not None:
            return f"{host}:{port}"
    return "the job's c10d store"


def decode_text(raw: Any, what: str) -> str:
    """The store's reply as text; invalid UTF-8 is a ``BadRecord`` naming ``what``."""
    if isinstance(raw, str):
        return raw
    data = bytes(raw)
    if len(data) > MAX_RECORD_BYTES:
        raise BadRecord(what, f"a record of {len(data)} bytes (the library writes a few KiB)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRecord(what, f"bytes that are not UTF-8 text: {data[:48]!r}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def decode_record(raw: Any, what: str) -> dict[str, Any]:
    """A JSON object the library wrote: ``NaN``/``Infinity``, deep nesting and non-objects refused."""
    text = decode_text(raw, what)
    depth = max_nesting(text)
    if depth > _MAX_DEPTH:
        raise BadRecord(what, f"JSON nested {depth} levels deep ({text[:48]!r}...)")
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise BadRecord(what, f"text that is not the library's JSON ({exc}): {text[:80]!r}") from None
    if not isinstance(data, dict):
        raise BadRecord(what, f"JSON that is not an object: {text[:80]!r}")
    return data


def max_nesting(text: str) -> int:
    """Bracket depth of JSON text, counted without parsing (strings skipped)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def record_field(data: dict[str, Any], name: str, kind: type, what: str) -> Any:
    """``data[name]``, which must be of exactly ``kind`` (``bool`` is not an ``int`` here)."""
    value = data.get(name)
    if type(value) is not kind:
        raise BadRecord(what, f"field {name!r} = {value!r} (expected {kind.__name__})")
    return value


def record_rank(data: dict[str, Any], what: str, world: int | None, name: str = "rank") -> int:
    """A rank field: a plain integer in ``[0, world)`` (not ``true``, ``1.9``, ``-7`` or ``99``)."""
    value = data.get(name)
    if type(value) is not int or value < 0 or (world is not None and value >= world):
        bound = f" in 0..{world - 1}" if world is not None else " >= 0"
        raise BadRecord(what, f"field {name!r} = {value!r} (expected a rank{bound})")
    return value


def parse_rank_text(text: str, what: str, world: int | None) -> int:
    """A rank written as ASCII digits (claims are ``"<rank>\\n<signature>"``)."""
    if not text.isascii() or not text.isdigit():
        raise BadRecord(what, f"rank {text[:32]!r} (expected ASCII digits)")
    rank = int(text)
    if world is not None and rank >= world:
        raise BadRecord(what, f"rank {rank} (the job has ranks 0..{world - 1})")
    return rank


__all__ = [
    "SLOW_REQUEST_S",
    "BadRecord",
    "decode_record",
    "decode_text",
    "parse_rank_text",
    "record_field",
    "record_rank",
    "request",
    "store_errors",
]
