"""Nearest-shape rule: on a miss, the table entry whose key is closest, as a pure function.

Two keys of one kernel are *comparable* when they name the same key arguments in the same order,
with the same dtypes, and differ only in numeric values (ints and floats; ``True`` is not a
number here, so it must match exactly, as must strings, ``None`` and every other value). The
distance between comparable keys is the sum over their numeric values of
``|s(a) - s(b)|`` with ``s(v) = sign(v) * log2(1 + |v|)`` (log space, defined at 0). The
nearest entry wins; ties break by key text, so the answer depends only on the table and the key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

# Key text is ``name=value, name=value | arg:dtype, ...`` (``identity.tuning_key``). Values are
# found between ``name=`` markers, so a value may itself hold ", " (a tuple, a string), but not
# ", word=": such a string key argument would be read as two values.
_VALUE_START = re.compile(r"(?:^|, )([A-Za-z_]\w*)=")
_INT = re.compile(r"-?\d+")
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
