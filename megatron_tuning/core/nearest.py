"""Nearest-shape rule: on a miss, the table entry whose key is closest, as a pure function.

Two keys of one kernel are *comparable* when they name the same key arguments in the same order,
with the same dtypes, and differ only in numeric values (ints and floats; ``True`` is not a
number here, so it must match exactly, as must strings, ``None`` and every other value). The
distance between comparable keys is the sum over their numeric values of
``|s(a) - s(b)|`` with ``s(v) = sign(v) * log2(1 + |v|)`` (log space, defined at 0). The
nearest entry wins; ties break by key text, so the answer depends only on the table and the key.

One refinement (``pick_neighbour``): when the nearest entry lies *above* the key (every number
>= the key's) and the nearest entry *below* it (every number <=) has a different config and is at
most ``BRACKET_RATIO`` times as far, the lower entry's config is used. Between two tuned shapes,
a config tuned for the smaller one keeps more tiles in flight as the problem grows, while one
tuned for the larger problem leaves SMs idle when it shrinks (measured: M=1536 between entries at
M=1024 and M=2048 ran the M=2048 config at 90.7% of the best, RESULTS section 9). Far from the
lower entry (past two thirds of the way up, in log space) the nearer entry wins as before.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# Key text is ``name=value, name=value | arg:dtype, ...`` (``identity.tuning_key``). Values are
# found between ``name=`` markers, so a value may itself hold ", " (a tuple, a string), but not
# ", word=": such a string key argument would be read as two values.
_VALUE_START = re.compile(r"(?:^|, )([A-Za-z_]\w*)=")
_INT = re.compile(r"-?\d+")
BRACKET_RATIO = 2.0
"""The lower bracketing entry is used while it is at most this many times as far as the upper one."""
_FLOAT = re.compile(r"-?(?:\d+\.\d*|\.\d+|\d+)(?:e[-+]?\d+)?|-?inf|nan", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class KeyShape:
    """What must match exactly between comparable keys, and the numeric values that may differ."""

    fixed: tuple[str, ...]
    """Argument names, non-numeric values (with a placeholder where a number sits), and dtypes."""
    numbers: tuple[float, ...]


def key_shape(key: str) -> KeyShape | None:
    """Split key text into its fixed part and its numbers; ``None`` when it cannot be parsed."""
    values_text, sep, dtypes_text = key.partition(" | ")
    if not sep:
        return None
    starts = list(_VALUE_START.finditer(values_text))
    if values_text and (not starts or starts[0].start() != 0):
        return None
    fixed: list[str] = []
    numbers: list[float] = []
    for index, match in enumerate(starts):
        end = starts[index + 1].start() if index + 1 < len(starts) else len(values_text)
        raw = values_text[match.end() : end]
        number = _as_number(raw)
        if number is None:
            fixed.append(f"{match.group(1)}={raw}")
        else:
            fixed.append(f"{match.group(1)}=#")
            numbers.append(number)
    fixed.append("|" + dtypes_text)
    return KeyShape(tuple(fixed), tuple(numbers))


def _as_number(raw: str) -> float | None:
    if _INT.fullmatch(raw):
        return float(int(raw))
    if _FLOAT.fullmatch(raw):
        value = float(raw)
        return value if math.isfinite(value) else None
    return None


def _scale(value: float) -> float:
    return math.copysign(math.log2(1.0 + abs(value)), value)


def key_distance(a: KeyShape, b: KeyShape) -> float:
    """Distance in log space between comparable keys (``math.inf`` when they are not comparable)."""
    if a.fixed != b.fixed:
        return math.inf
    return sum(abs(_scale(x) - _scale(y)) for x, y in zip(a.numbers, b.numbers))


def nearest_keys(key: str, candidates: Iterable[str]) -> list[str]:
    """Comparable ``candidates`` ordered nearest first (ties by key text); ``key`` itself excluded.

    A pure function of its arguments: the same table and key give the same order in every
    process. Keys that cannot be parsed, or are not comparable with ``key``, are left out.
    """
    target = key_shape(key)
    if target is None:
        return []
    ranked: list[tuple[float, str]] = []
    for candidate in set(candidates):
        if candidate == key:
            continue
        shape = key_shape(candidate)
        if shape is None:
            continue
        distance = key_distance(target, shape)
        if distance != math.inf:
            ranked.append((distance, candidate))
    ranked.sort()
    return [candidate for _, candidate in ranked]


def side_of(key: KeyShape, other: KeyShape) -> int | None:
    """``-1`` when every number of ``other`` is <= the key's, ``1`` when every one is >=, ``0``
    when all are equal; ``None`` for a mixed direction or keys that are not comparable."""
    if key.fixed != other.fixed:
        return None
    below = any(o < k for k, o in zip(key.numbers, other.numbers))
    above = any(o > k for k, o in zip(key.numbers, other.numbers))
    if below and above:
        return None
    return -1 if below else 1 if above else 0


def pick_neighbour(key: str, signatures: Mapping[str, str]) -> str | None:
    """The neighbour whose entry a miss of ``key`` launches, by the rule in the module docstring.

    ``signatures`` maps each usable neighbour key, nearest first (``nearest_keys`` order), to the
    signature of the config its entry launches. A pure function of its arguments; ``None`` when
    there is no neighbour.
    """
    ordered = list(signatures)
    if not ordered:
        return None
    nearest = ordered[0]
    target = key_shape(key)
    nearest_shape = key_shape(nearest)
    if target is None or nearest_shape is None or side_of(target, nearest_shape) != 1:
        return nearest
    for candidate in ordered[1:]:  # nearest first: the first entry below is the lower bracket
        shape = key_shape(candidate)
        if shape is None or side_of(target, shape) not in (-1, 0):
            continue
        if signatures[candidate] == signatures[nearest]:
            return nearest  # the brackets agree: nothing to choose
        if key_distance(target, shape) <= BRACKET_RATIO * key_distance(target, nearest_shape):
            return candidate
        return nearest
    return nearest
