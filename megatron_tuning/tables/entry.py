"""Tuning-table entries and their one validation path, ``entry_from_data``, shared by the loaders
and code that builds an ``Entry``: an entry made in memory encodes exactly like one read back."""

from __future__ import annotations

import functools
import math
import re
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgpack

from ..core.identity import CONFIG_FIELDS
from ..core.key import INT_MAX, INT_MIN, Key, has_utf8

HOW_VALUES = ("tuned", "recorded", "hand")
Ident = tuple[str, str, str]  # (arch, kernel id, key): what a table holds one entry of
_LARGEST = {int: INT_MAX, float: sys.float_info.max}
_MAX_WARPS_OR_STAGES = 1024
_MAX_DEPTH = 6  # nesting allowed inside config data (kwargs values are scalars in practice)


def entry_order(arch: str, kernel: str, key: str) -> tuple[Any, ...]:
    """The order people read: arch, kernel, then the key with numbers as numbers (8 before 100)."""
    return (arch, kernel, (0, key.order()) if isinstance(key, Key) else (1, key))


class Invalid(ValueError):
    """A validation problem: a ``TableError`` naming the file when loading, else a ``ValueError``."""


class InvalidType(Invalid):
    """A config value of a type no table holds (a jit function): no other value of it would do."""


class Timing(NamedTuple):
    median_ms: float | None = None
    spread_ms: float | None = None  # inter-quantile spread (p80 - p20) of the winner's samples
    samples: int | None = None  # timed samples per candidate
    candidates: int | None = None  # how many candidates were timed
    runner_up_ms: float | None = None  # the second-best candidate's median: how close the choice was

    def to_data(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in sorted(self._fields) if getattr(self, name) is not None}


class Numerics(NamedTuple):
    """What the numerics audit found for an entry's config (docs/numerics.md)."""

    class_id: str  # 16 hex: the distinct outputs its launches gave on the audited inputs
    inputs: str  # 16 hex: digest of those inputs; class ids compare only between equal inputs
    deterministic: bool  # its own launches on the same inputs gave the same bits
    alternatives: tuple[str, ...] = ()  # when not: the deterministic configs the audit found

    def to_data(self) -> dict[str, Any]:
        return dict(sorted({**self._asdict(), "alternatives": list(self.alternatives)}.items()))


_HEX16 = re.compile(r"[0-9a-f]{16}")


def check_numerics(value: Any) -> Numerics | None:
    if value is None or isinstance(value, Numerics):
        return value
    if type(value) is not dict or not set(Numerics._fields[:3]) <= value.keys() <= set(Numerics._fields):
        raise Invalid(f"numerics must be a map with fields {sorted(Numerics._fields)}")
    alternatives = value.get("alternatives", [])
    if not all(type(value[n]) is str and _HEX16.fullmatch(value[n]) for n in ("class_id", "inputs")):
        raise Invalid("numerics.class_id and numerics.inputs must be 16 lowercase hex digits")
    if type(value["deterministic"]) is not bool:
        raise Invalid("numerics.deterministic must be true or false")
    listed = type(alternatives) in (list, tuple) and len(alternatives) <= 16
    if not (listed and all(type(a) is str for a in alternatives)):
        raise Invalid("numerics.alternatives must be a list of at most 16 config signatures")
    for text in alternatives:
        check_text("numerics alternative", text)
    return Numerics(value["class_id"], value["inputs"], value["deterministic"], tuple(alternatives))


class _EntryFields(NamedTuple):
    arch: str
    kernel: str  # ``module:qualname``
    key: Key  # ``core.key``: the ident's text and the stored parts
    config: dict[str, Any]  # ``config_data`` form, keys sorted; shared between entries: read-only
    how: str  # ``tuned`` | ``recorded`` | ``hand``
    source_hash: str | None
    triton_version: str | None
    timing: Timing | None
    votes: tuple[int, int] | None  # after a merge: (votes for this config, inputs that had this entry)
    note: str | None  # free text for reviewers, e.g. why a hand entry was chosen
    numerics: Numerics | None  # what the numerics audit found for this config
    # ``core.identity.config_list_digest`` of the autotuner it was tuned for: with the source hash,
    # what a match under another module name compares (``None``: unknown, from before it was kept).
    config_list_digest: str | None


class Entry(_EntryFields):
    """One table entry: immutable, validated and canonicalised when built. A named tuple because the
    loader builds 100k per table. ``key``: a ``core.key.Key`` or its stored form, never text."""

    __slots__ = ()

    def __new__(
        cls,
        *,
        arch: str,
        kernel: str,
        key: str | Mapping[str, Any],
        config: Mapping[str, Any],
        how: str = "hand",
        source_hash: str | None = None,
        triton_version: str | None = None,
        timing: Timing | Mapping[str, Any] | None = None,
        votes: tuple[int, int] | list[int] | None = None,
        note: str | None = None,
        numerics: Numerics | Mapping[str, Any] | None = None,
        config_list_digest: str | None = None,
    ) -> Entry:
        data = {name: value for name, value in locals().items() if name in _EntryFields._fields}
        data["config"] = dict(config) if isinstance(config, Mapping) else config
        return entry_from_data(data)  # the loader's path: built in code, encoded as if read back

    # Tuple equality would say a config with True equals one with 1 (True == 1 in Python);
    # for Triton they are different constexprs, so configs compare by their exact encoding.
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Entry):
            return NotImplemented
        return self[:3] == other[:3] and self[4:] == other[4:] and same_config(self.config, other.config)

    def __ne__(self, other: object) -> bool:  # tuple.__ne__ would not follow __eq__
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # type: ignore[assignment]  # config is a dict

    @property
    def ident(self) -> Ident:
        return (self.arch, self.kernel, self.key)

    def to_data(self) -> dict[str, Any]:
        """The JSON view's entry: fields sorted, absent optional fields omitted."""
        data = {name: getattr(self, name) for name in sorted(self._fields) if getattr(self, name) is not None}
        for name in data.keys() & {"key", "timing", "numerics"}:
            data[name] = data[name].to_data()
        if self.votes is not None:
            data["votes"] = list(self.votes)
        return data


def same_config(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Exact equality of config data: ``True`` differs from ``1`` and ``1.0``, ``(1,)`` equals ``[1]``."""
    # Entries' configs passed check_config, which packs them: packing cannot fail here.
    return a is b or bool(msgpack.packb(a, use_bin_type=True) == msgpack.packb(b, use_bin_type=True))


# The loaders' fast path: an already-validated entry.
make_entry = functools.partial(tuple.__new__, Entry)


def entry_from_data(row: Any) -> Entry:
    if type(row) is not dict:
        raise Invalid(f"must be a map, got {type(row).__name__}")
    if unknown := row.keys() - _EntryFields._fields:
        raise Invalid(f"unknown fields {sorted(map(str, unknown))}")
    arch, kernel, key, how = row.get("arch"), row.get("kernel"), row.get("key"), row.get("how", "hand")
    if type(arch) is not str or not arch:
        raise Invalid("arch must be a non-empty string")
    if type(kernel) is not str or ":" not in kernel:
        raise Invalid(f"kernel must be a 'module:qualname' string, got {kernel!r}")
    key = key if type(key) is Key else key_from_data(key, kernel)
    for name, text in (("arch", arch), ("kernel", kernel), ("key", key)):
        check_text(name, text)
    if type(how) is not str or how not in HOW_VALUES:
        raise Invalid(f"how must be one of {HOW_VALUES}, got {how!r}")
    try:
        config = check_config(row.get("config"))
        texts = {
            name: row.get(name) for name in ("source_hash", "triton_version", "note", "config_list_digest")
        }
        for name, value in texts.items():
            if value is not None:
                if type(value) is not str:
                    raise Invalid(f"{name} must be a string")
                check_text(name, value)
        timing, votes = _check_timing(row.get("timing")), _check_votes(row.get("votes"))
        numerics = check_numerics(row.get("numerics"))
    except Invalid as exc:
        raise Invalid(f"{exc} (arch={arch!r} kernel={kernel!r} key={key!r})") from None
    source_hash, triton_version, note, digest = texts.values()
    return make_entry(
        (arch, kernel, key, config, how, source_hash, triton_version, timing, votes, note, numerics, digest)
    )


def check_text(name: str, text: str) -> None:
    """Refuse text msgpack cannot store (``has_utf8``)."""
    if not has_utf8(text):
        raise Invalid(f"{name} {text!r} is not valid Unicode (lone surrogate)")


# Canonical configs are interned: entries share one read-only dict per config, which is validated
# and packed once. Keyed by exact msgpack bytes (strict_types: bool/int, tuple/list never alias).
_INTERNED: dict[bytes, dict[str, Any]] = {}
_INTERN_LIMIT = 65536


def check_config(config: Any) -> dict[str, Any]:
    """Config data (``config_data`` form) validated, in its canonical, shared form."""
    try:
        blob = msgpack.packb(config, use_bin_type=True, strict_types=True)
    except Exception:  # anything msgpack cannot pack exactly: the slow path says what is wrong
        blob = None
    if blob is not None and blob in _INTERNED:
        return _INTERNED[blob]
    if type(config) is not dict:
        raise Invalid("config must be a map (config_data form)")
    if type(config.get("kwargs")) is not dict:
        raise Invalid("config.kwargs must be a map")
    if unknown := sorted(map(str, config.keys() - CONFIG_FIELDS)):
        raise Invalid(
            f"config has unknown field(s) {unknown}: a config holds {', '.join(CONFIG_FIELDS)}; put a "
            f"meta-parameter such as BLOCK_M under config.kwargs, or fix the spelling"
        )
    for name, low in (("num_warps", 1), ("num_stages", 0)):
        value = config.get(name)
        if type(value) is not int:
            raise Invalid(f"config.{name} must be an integer")
        # Triton launches at most 1024 threads' worth of warps; -2**63 is no config at all.
        if not low <= value <= _MAX_WARPS_OR_STAGES:
            raise Invalid(f"config.{name}={value} is outside {low}..{_MAX_WARPS_OR_STAGES}")
    canonical = _canonical(config, 0, "config")
    if len(_INTERNED) >= _INTERN_LIMIT:
        _INTERNED.clear()
    interned = _INTERNED.setdefault(msgpack.packb(canonical, use_bin_type=True, strict_types=True), canonical)
    if blob is not None:
        _INTERNED[blob] = interned
    return interned  # type: ignore[no-any-return]


def _canonical(value: Any, depth: int, field: str) -> Any:
    """A msgpack/JSON-safe value validated, every map's keys sorted. ``field``: the name of the map
    entry it is in (a list's items are in their list's), what a refusal names."""
    kind = type(value)
    if kind is str:
        check_text("config string", value)
    elif kind is int and not INT_MIN <= value <= INT_MAX:
        raise Invalid(f"integer {value} in config field {field} is outside msgpack's range")
    elif kind is float and not math.isfinite(value):
        raise Invalid(f"non-finite number {value!r} in config field {field}")
    elif kind in (str, bool, int, float) or value is None:
        pass
    elif depth >= _MAX_DEPTH:
        raise Invalid("config nests too deeply")
    elif kind is dict:
        for k in value:
            if type(k) is not str:
                raise InvalidType(f"config map keys must be strings, got {k!r}")
            check_text("config key", k)
        return {k: _canonical(value[k], depth + 1, k) for k in sorted(value)}
    elif kind is list or kind is tuple:  # tuples become lists: that is what a reload gives
        return [_canonical(item, depth + 1, field) for item in value]
    else:
        raise InvalidType(
            f"config field {field} holds a value of type {kind.__name__}, which cannot be stored (tables "
            "and the job's store hold int, float, bool, str and None, and lists and maps of them)"
        )
    return value


def _check_timing(timing: Any) -> Timing | None:
    if isinstance(timing, Timing):
        timing = timing.to_data()
    if timing is None:
        return None
    if type(timing) is not dict or not timing.keys() <= set(Timing._fields):
        raise Invalid(f"timing must be a map with fields {sorted(Timing._fields)}")
    values: dict[str, Any] = {k: v for k, v in timing.items() if v is not None}
    for name, value in values.items():
        if name in ("samples", "candidates"):
            if type(value) is not int or not 0 <= value <= INT_MAX:
                raise Invalid(f"timing.{name} must be a non-negative integer")
        # Compared, never converted, first: a huge JSON integer would overflow a float; NaN fails.
        elif type(value) not in _LARGEST or not 0 <= value <= _LARGEST[type(value)]:
            raise Invalid(f"timing.{name} must be a finite number >= 0")
        else:
            values[name] = float(value)  # canonical: ints written by hand become floats
    return Timing(**values) if values else None


def _check_votes(votes: Any) -> tuple[int, int] | None:
    if votes is None:
        return None
    pair = type(votes) in (list, tuple) and len(votes) == 2 and all(type(v) is int for v in votes)
    if not (pair and 0 < votes[0] <= votes[1] <= INT_MAX):
        raise Invalid("votes must be [winner_votes, total] with 0 < winner_votes <= total")
    return (votes[0], votes[1])


def key_from_data(data: Any, kernel: Any = None) -> Key:
    try:
        return Key.from_data(data)
    except ValueError as exc:
        form = '{"values": {"M": 32, "N": 32}, "dtypes": {"a_ptr": "torch.float16"}}'
        raise Invalid(
            f"key of kernel {kernel!r}: {exc}; in a file a key reads {form}, in the kernel's key order"
        ) from None


def entry_with(entry: Entry, **changes: Any) -> Entry:
    return Entry(**{**entry._asdict(), **changes})
