"""What a miss launches without measuring: the cheapest config by static cost, or the entry of the
nearest tuned shape. Keys are comparable when they differ only in numbers (``True`` is not one);
distance sums ``|s(a) - s(b)|``, ``s(v) = sign(v) * log2(1 + |v|)``. Of two disagreeing brackets the
lower wins while at most ``BRACKET_RATIO`` times as far: a config tuned for the smaller shape keeps
more tiles in flight (RESULTS section 9: 90.7% of the best the other way)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .identity import config_data, config_signature
from .key import Key, render

_SHORT_BLOCK_NAMES = frozenset({"BM", "BN", "BK", "BD", "BH", "BT", "BS", "BC", "BV"})


def is_block_size_name(name: str) -> bool:
    """Whether a kwarg is a tile extent: ``BLOCK_M``, ``BLOCK_SIZE_N``, ``BM``, ``XBLOCK``, ``R0_BLOCK``."""
    upper = name.upper()
    # Counts and groupings are not tile extents (NUM_BLOCKS, GROUP_SIZE, BLOCKS_PER_SM).
    counts = any(word in upper for word in ("NUM", "GROUP", "BLOCKS"))
    return upper in _SHORT_BLOCK_NAMES or ("BLOCK" in upper and not counts)


def estimate_config_cost(cfg: Any) -> tuple[int, int, int]:
    """Static cost ``(block_cost, num_warps, num_stages)``, lower is cheaper; ``block_cost`` (tile
    extents times stages) is a proxy for shared memory."""
    data = cfg if isinstance(cfg, Mapping) else config_data(cfg)
    stages, warps = data.get("num_stages") or 1, data.get("num_warps") or 1
    block = math.prod(
        int(v)
        for k, v in data["kwargs"].items()
        if is_block_size_name(k) and isinstance(v, numbers.Integral) and not isinstance(v, bool)
    )
    return (block * int(stages), int(warps), int(stages))


def order_by_cost(configs: Iterable[Any]) -> list[Any]:
    """Configs in a total order: static cost, then signature text, then list position."""
    indexed = list(enumerate(configs))
    indexed.sort(key=lambda item: (estimate_config_cost(item[1]), config_signature(item[1]), item[0]))
    return [config for _, config in indexed]


def cheapest(configs: Sequence[Any]) -> Any:
    if not configs:
        raise ValueError("cheapest() needs at least one config")
    return order_by_cost(configs)[0]


def filter_configs_by_block_sizes(
    configs: Sequence[Any], block_sizes: Mapping[str, int] | Iterable[tuple[str, int]] = ()
) -> list[Any]:
    """Configs whose kwargs match every override name these configs use; names no config has are
    ignored (an override for one kernel family must not break the others)."""
    relevant = {k: v for k, v in dict(block_sizes).items() if any(k in c.kwargs for c in configs)}
    return [
        c
        for c in configs
        if all(
            k in c.kwargs and c.kwargs[k] == v and type(c.kwargs[k]) is type(v) for k, v in relevant.items()
        )
    ]


BRACKET_RATIO = 2.0


@dataclass(frozen=True, slots=True)
class KeyShape:
    fixed: tuple[Any, ...]  # what comparable keys share: names, other values (``#`` for a number), dtypes
    numbers: tuple[float, ...]


def key_shape(key: Key) -> KeyShape:
    fixed: list[Any] = []
    values: list[float] = []
    for name, value in zip(key.names, key.values):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            fixed.append(f"{name}=#")
            values.append(float(value))
        else:
            fixed.append(f"{name}={render(value)}")
    fixed.append(key.dtypes)
    return KeyShape(tuple(fixed), tuple(values))


def _scale(value: float) -> float:
    return math.copysign(math.log2(1.0 + abs(value)), value)


def key_distance(a: KeyShape, b: KeyShape) -> float:
    """Distance in log space; ``math.inf`` between keys that are not comparable."""
    if a.fixed != b.fixed:
        return math.inf
    return sum(abs(_scale(x) - _scale(y)) for x, y in zip(a.numbers, b.numbers))


def nearest_keys(key: Key, candidates: Iterable[Key]) -> list[Key]:
    """Comparable ``candidates`` other than ``key``, nearest first (ties by key text)."""
    target = key_shape(key)
    ranked = sorted((key_distance(target, key_shape(c)), c) for c in set(candidates) - {key})
    return [c for distance, c in ranked if distance != math.inf]


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


def pick_neighbour(key: Key, signatures: Mapping[Key, str]) -> Key | None:
    """The neighbour a miss launches; ``signatures``: usable neighbours, nearest first, to signatures."""
    ordered = list(signatures)
    if not ordered:
        return None
    nearest = ordered[0]
    target, nearest_shape = key_shape(key), key_shape(nearest)
    if side_of(target, nearest_shape) != 1:
        return nearest
    for candidate in ordered[1:]:  # nearest first: the first entry below is the lower bracket
        shape = key_shape(candidate)
        if side_of(target, shape) not in (-1, 0):
            continue
        agree = signatures[candidate] == signatures[nearest]  # then there is nothing to choose
        close = key_distance(target, shape) <= BRACKET_RATIO * key_distance(target, nearest_shape)
        return candidate if close and not agree else nearest
    return nearest
