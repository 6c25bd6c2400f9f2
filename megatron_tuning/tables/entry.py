"""Tuning-table entries: the data model and the one validation path for it.

Both the loader (``table.py``) and code that builds an ``Entry`` by hand go through
``entry_from_data``, so an entry made in memory always encodes exactly like one read
back from disk (that is what makes the encoding canonical).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgpack

HOW_VALUES = ("tuned", "recorded", "hand")
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1  # msgpack's integer range
_MAX_WARPS_OR_STAGES = 1024
_MAX_DEPTH = 6  # nesting allowed inside config data (kwargs values are scalars in practice)

_ENTRY_FIELDS = frozenset(
    {"arch", "kernel", "key", "config", "how", "source_hash", "triton_version", "timing", "votes", "note"}
)
_TIMING_FLOATS = ("median_ms", "spread_ms", "runner_up_ms")
_TIMING_INTS = ("samples", "candidates")
_TIMING_FIELDS = frozenset(_TIMING_FLOATS + _TIMING_INTS)


class Invalid(ValueError):
    """A validation problem. The loader turns it into a TableError naming the file;
    code that builds an ``Entry`` by hand sees it as a ``ValueError``."""


class Timing(NamedTuple):
    """Measurement statistics of the winning config (all optional)."""

    median_ms: float | None = None
    """Median launch time of the winner."""
    spread_ms: float | None = None
    """Inter-quantile spread (p80 - p20) of the winner's samples."""
    samples: int | None = None
    """Timed samples per candidate."""
    candidates: int | None = None
    """How many candidates were timed."""
    runner_up_ms: float | None = None
    """Median of the second-best candidate: how close the choice was."""

    def to_data(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in sorted(self._fields) if getattr(self, name) is not None}


class _EntryFields(NamedTuple):
    arch: str
    kernel: str
    """Kernel id, ``module:qualname``."""
    key: str
    """Tuning-key text from ``selection.tuning_key``."""
    config: dict[str, Any]
    """``config_data`` form, keys sorted. Shared between entries: read-only."""
    how: str
    """``tuned`` | ``recorded`` | ``hand``."""
    source_hash: str | None
    triton_version: str | None
    timing: Timing | None
    votes: tuple[int, int] | None
    """After a merge: (votes for this config, inputs that had this entry)."""
    note: str | None
    """Free text for reviewers, e.g. why a hand entry was chosen."""


class Entry(_EntryFields):
    """One table entry: immutable, validated and canonicalised when built.

    A named tuple rather than a dataclass because the loader builds 100k of them per
    table: ``tuple.__new__`` is several times cheaper than a frozen dataclass's setattrs.
    """

    __slots__ = ()

    def __new__(
        cls,
        *,
        arch: str,
        kernel: str,
        key: str,
        config: Mapping[str, Any],
        how: str = "hand",
        source_hash: str | None = None,
        triton_version: str | None = None,
        timing: Timing | Mapping[str, Any] | None = None,
        votes: tuple[int, int] | list[int] | None = None,
        note: str | None = None,
    ) -> Entry:
        # The same validation path the loader uses, so an entry built in code always
        # encodes exactly like one read back from disk.
        data: dict[str, Any] = {"arch": arch, "kernel": kernel, "key": key, "how": how}
        data["config"] = dict(config) if isinstance(config, Mapping) else config
        optional = {
            "source_hash": source_hash,
            "triton_version": triton_version,
            "timing": timing,
            "votes": votes,
            "note": note,
        }
        data.update({k: v for k, v in optional.items() if v is not None})
        return entry_from_data(data)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (tuple(self),))

    # Tuple equality would say a config with True equals one with 1 (True == 1 in Python);
    # for Triton they are different constexprs, so configs compare by their exact encoding.
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Entry):
            return NotImplemented
        return self[:3] == other[:3] and self[4:] == other[4:] and same_config(self.config, other.config)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # type: ignore[assignment]  # config is a dict

    @classmethod
    def from_data(cls, data: Any) -> Entry:
        """Build from the plain dict form; raises ``Invalid`` (a ``ValueError``) on bad data."""
        return entry_from_data(data)

    @property
    def ident(self) -> tuple[str, str, str]:
        return (self.arch, self.kernel, self.key)

    def to_data(self) -> dict[str, Any]:
        """Plain dict form (the JSON view's entry), optional fields omitted when absent."""
        data: dict[str, Any] = {
            "arch": self.arch,
            "config": self.config,
            "how": self.how,
            "kernel": self.kernel,
            "key": self.key,
        }
        if self.note is not None:
            data["note"] = self.note
        if self.source_hash is not None:
            data["source_hash"] = self.source_hash
        if self.timing is not None:
            data["timing"] = self.timing.to_data()
        if self.triton_version is not None:
            data["triton_version"] = self.triton_version
        if self.votes is not None:
            data["votes"] = list(self.votes)
        return data


def same_config(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Exact equality of config data: ``True`` differs from ``1`` and ``1.0``, ``(1,)`` equals ``[1]``."""
    if a is b:
        return True
    try:
        return bool(msgpack.packb(a, use_bin_type=True) == msgpack.packb(b, use_bin_type=True))
    except Exception:
        return False


def _rebuild(values: tuple[Any, ...]) -> Entry:
    return entry_from_data(dict(zip(_EntryFields._fields, values)))


# Loader fast path: build an already-validated entry without re-validating it.
make_entry = functools.partial(tuple.__new__, Entry)


def entry_from_data(row: Any) -> Entry:
    """Validate one entry's plain data and build it (the single validation path)."""
    if type(row) is not dict:
        raise Invalid(f"must be a map, got {type(row).__name__}")
    unknown = row.keys() - _ENTRY_FIELDS
    if unknown:
        raise Invalid(f"unknown fields {sorted(map(str, unknown))}")
    arch, kernel, key, how = row.get("arch"), row.get("kernel"), row.get("key"), row.get("how", "hand")
    if type(arch) is not str or not arch:
        raise Invalid("arch must be a non-empty string")
    if type(kernel) is not str or ":" not in kernel:
        raise Invalid(f"kernel must be a 'module:qualname' string, got {kernel!r}")
    if type(key) is not str:
        raise Invalid("key must be a string")
    for name, text in (("arch", arch), ("kernel", kernel), ("key", key)):
        check_text(name, text)
    if type(how) is not str or how not in HOW_VALUES:
        raise Invalid(f"how must be one of {HOW_VALUES}, got {how!r}")
    where = f"(arch={arch!r} kernel={kernel!r} key={key!r})"
    try:
        config = check_config(row.get("config"))
        fields: dict[str, Any] = {"arch": arch, "kernel": kernel, "key": key, "config": config, "how": how}
        for name in ("source_hash", "triton_version", "note"):
            value = row.get(name)
            if value is not None:
                if type(value) is not str:
                    raise Invalid(f"{name} must be a string")
                check_text(name, value)
            fields[name] = value
        fields["timing"] = _check_timing(row.get("timing"))
        fields["votes"] = _check_votes(row.get("votes"))
    except Invalid as exc:
        raise Invalid(f"{exc} {where}") from None
    return make_entry(tuple(fields[name] for name in _EntryFields._fields))


def check_text(name: str, text: str) -> None:
    """Raise ``Invalid`` unless ``text`` can be stored: msgpack strings are UTF-8, and a
    lone surrogate (which a JSON ``\\ud800`` escape produces) has no UTF-8 form."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise Invalid(f"{name} {text!r} is not valid Unicode (lone surrogate)") from None


# Canonical configs are interned: a table has few distinct configs and many entries, so
# entries share one read-only dict per config (memory), equal configs are validated once
# (speed), and the encoder packs each distinct dict once. Keyed by exact msgpack bytes
# (strict_types, so bool/int, float/int and tuple/list never alias).
_INTERNED: dict[bytes, dict[str, Any]] = {}
_INTERN_LIMIT = 65536


def check_config(config: Any) -> dict[str, Any]:
    """Validate config data (``config_data`` form) and return its canonical, shared form."""
    try:
        blob = msgpack.packb(config, use_bin_type=True, strict_types=True)
    except Exception:  # anything msgpack cannot pack exactly: the slow path says what is wrong
        blob = None
    if blob is not None:
        cached = _INTERNED.get(blob)
        if cached is not None:
            return cached
    canonical = _check_config(config)
    canonical_blob = msgpack.packb(canonical, use_bin_type=True, strict_types=True)
    if len(_INTERNED) >= _INTERN_LIMIT:
        _INTERNED.clear()
    interned = _INTERNED.setdefault(canonical_blob, canonical)
    if blob is not None:
        _INTERNED[blob] = interned
    return interned


def _check_config(config: Any) -> dict[str, Any]:
    if type(config) is not dict:
        raise Invalid("config must be a map (config_data form)")
    kwargs = config.get("kwargs")
    if type(kwargs) is not dict:
        raise Invalid("config.kwargs must be a map")
    for name, low in (("num_warps", 1), ("num_stages", 0)):
        value = config.get(name)
        if type(value) is not int:
            raise Invalid(f"config.{name} must be an integer")
        # Triton launches at most 1024 threads' worth of warps; -2**63 is no config at all.
        if not low <= value <= _MAX_WARPS_OR_STAGES:
            raise Invalid(f"config.{name}={value} is outside {low}..{_MAX_WARPS_OR_STAGES}")
    return _canonical(config, 0)  # type: ignore[no-any-return]


def _canonical(value: Any, depth: int) -> Any:
    """Validate a msgpack/JSON-safe value; return it with every map's keys sorted."""
    kind = type(value)
    if kind is str:
        check_text("config string", value)
        return value
    if kind is bool or value is None:
        return value
    if kind is int:
        if not INT_MIN <= value <= INT_MAX:
            raise Invalid(f"integer {value} is outside msgpack's range")
        return value
    if kind is float:
        if not math.isfinite(value):
            raise Invalid(f"non-finite number {value!r} in config")
        return value
    if depth >= _MAX_DEPTH:
        raise Invalid("config nests too deeply")
    if kind is dict:
        out = {}
        for k in sorted(value, key=lambda k: (type(k) is not str, str(k))):
            if type(k) is not str:
                raise Invalid(f"config map keys must be strings, got {k!r}")
            check_text("config key", k)
            out[k] = _canonical(value[k], depth + 1)
        return out
    if kind is list or kind is tuple:  # tuples become lists: that is what a reload gives
        return [_canonical(item, depth + 1) for item in value]
    raise Invalid(f"config value of type {kind.__name__} cannot be stored")


def _check_timing(timing: Any) -> Timing | None:
    if timing is None:
        return None
    if isinstance(timing, Timing):
        timing = timing.to_data()
    if type(timing) is not dict or not timing.keys() <= _TIMING_FIELDS:
        raise Invalid(f"timing must be a map with fields {sorted(_TIMING_FIELDS)}")
    values: dict[str, Any] = {}
    for name in _TIMING_FLOATS:
        value = timing.get(name)
        if value is not None:
            # Range-check ints before float(): a huge JSON integer would overflow.
            if type(value) is int and not 0 <= value <= INT_MAX:
                raise Invalid(f"timing.{name} must be a finite number >= 0")
            if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
                raise Invalid(f"timing.{name} must be a finite number >= 0")
            values[name] = float(value)  # canonical: ints written by hand become floats
    for name in _TIMING_INTS:
        value = timing.get(name)
        if value is not None:
            if type(value) is not int or not 0 <= value <= INT_MAX:
                raise Invalid(f"timing.{name} must be a non-negative integer")
            values[name] = value
    return Timing(**values) if values else None


def _check_votes(votes: Any) -> tuple[int, int] | None:
    if votes is None:
        return None
    if (
        type(votes) not in (list, tuple)
        or len(votes) != 2
        or not all(type(v) is int for v in votes)
        or not 0 < votes[0] <= votes[1] <= INT_MAX
    ):
        raise Invalid("votes must be [winner_votes, total] with 0 < winner_votes <= total")
    return (votes[0], votes[1])


# -- tuning keys ---------------------------------------------------------------------
# The key text ``core.identity.tuning_key`` writes: ``M=32, N=32, K=32 | a_ptr:torch.float16, ...``
# (items joined by ", ", parts by " | "; the values part is empty for a kernel without ``key=``
# arguments, the dtypes part for one without tensor arguments). A hand-written key such as
# ``M=32,N=32,K=32 | ...`` would never match a launch, so JSON views are read through
# ``canonical_key``, which respells the separators and refuses what is not a key at all.
KEY_FORM = "'NAME=VALUE, NAME=VALUE | ARG:DTYPE, ARG:DTYPE' (e.g. 'M=32, N=32 | a_ptr:torch.float16')"
_VALUE_START = re.compile(r"[A-Za-z_]\w*\s*=")
_DTYPE_START = re.compile(r"[A-Za-z_]\w*\s*:")
_VALUE_ITEM = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*(.*?)\s*", re.DOTALL)
_DTYPE_ITEM = re.compile(r"\s*([A-Za-z_]\w*)\s*:\s*(.*?)\s*", re.DOTALL)
_OPEN, _CLOSE = "([{", ")]}"


def canonical_key(key: str) -> str | None:
    """``key`` spelt as ``tuning_key`` spells it, or ``None`` when it is not in that form.

    Only the separators are respelt (spaces around ``,``, ``|``, ``=`` and ``:``); a value's own
    text is kept, and a comma inside quotes or brackets is part of its value, so every key
    ``tuning_key`` writes is returned unchanged.
    """
    values_text, bar, dtypes_text = key.rpartition("|")  # dtype names never contain "|"
    if not bar:
        return None
    values = []
    if values_text.strip():
        for piece in _split_items(values_text, _VALUE_START):
            match = _VALUE_ITEM.fullmatch(piece)
            if match is None:
                return None
            values.append(f"{match.group(1)}={match.group(2)}")
    dtypes = []
    if dtypes_text.strip():
        for piece in _split_items(dtypes_text, _DTYPE_START):
            match = _DTYPE_ITEM.fullmatch(piece)
            if match is None:
                return None
            dtypes.append(f"{match.group(1)}:{match.group(2)}")
    return ", ".join(values) + " | " + ", ".join(dtypes)


def _split_items(text: str, item_start: re.Pattern[str]) -> list[str]:
    """Split at commas outside quotes and brackets that are followed by a new item's start."""
    pieces, start, depth, quote, i = [], 0, 0, "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1  # an escaped character, e.g. \' inside a repr
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0 and item_start.match(text, _skip_spaces(text, i + 1)):
            pieces.append(text[start:i])
            start = i + 1
        i += 1
    pieces.append(text[start:])
    return pieces


def _skip_spaces(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def entry_with(entry: Entry, **changes: Any) -> Entry:
    """A copy of ``entry`` with some fields changed (validated)."""
    fields = entry._asdict()
    fields.update(changes)
    return Entry(**fields)
