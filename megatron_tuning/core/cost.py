"""Static cost of a config and the total order every fallback uses. Never measures."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .identity import config_signature

_SHORT_BLOCK_NAMES = frozenset({"BM", "BN", "BK", "BD", "BH", "BT", "BS", "BC", "BV"})


def is_block_size_name(name: str) -> bool:
    """Whether a kwarg is a tile extent: ``BLOCK_M``, ``BLOCK_SIZE_N``, ``BM``, ``XBLOCK``, ``R0_BLOCK``."""
    upper = name.upper()
    if upper in _SHORT_BLOCK_NAMES:
        return True
    if "BLOCK" not in upper:
        return False
    # Counts and groupings are not tile extents (NUM_BLOCKS, GROUP_SIZE, BLOCKS_PER_SM).
    return not any(word in upper for word in ("NUM", "GROUP", "BLOCKS"))


def estimate_config_cost(cfg: Any) -> tuple[int, int, int]:
    """Static cost ``(block_cost, num_warps, num_stages)``; lower is cheaper. Never measures.

    ``block_cost`` is the product of the tile extents times the pipeline stages, a proxy for
    the shared-memory footprint (``stages * (BM*BK + BK*BN)`` for a matmul grows with it).
    Kwargs that are not tile extents do not count; ties are broken by the caller.
    """
    kwargs = cfg["kwargs"] if isinstance(cfg, Mapping) else cfg.kwargs
    stages = (cfg.get("num_stages") if isinstance(cfg, Mapping) else getattr(cfg, "num_stages", 1)) or 1
    warps = (cfg.get("num_warps") if isinstance(cfg, Mapping) else getattr(cfg, "num_warps", 1)) or 1
    block = math.prod(
        int(v)
        for k, v in kwargs.items()
        if is_block_size_name(k) and isinstance(v, numbers.Integral) and not isinstance(v, bool)
    )
    return (block * int(stages), int(warps), int(stages))


def order_by_cost(configs: Iterable[Any]) -> list[Any]:
    """Configs in a total order: static cost, then signature text, then list position."""
    indexed = list(enumerate(configs))
    indexed.sort(key=lambda item: (estimate_config_cost(item[1]), config_signature(item[1]), item[0]))
    return [config for _, config in indexed]


def cheapest(configs: Sequence[Any]) -> Any:
    """The deterministic fallback: the first config of ``order_by_cost``."""
    if not configs:
        raise ValueError("cheapest() needs at least one config")
    return order_by_cost(configs)[0]


def as_block_sizes(block_sizes: Mapping[str, int] | Iterable[tuple[str, int]]) -> dict[str, int]:
    return dict(block_sizes.items() if isinstance(block_sizes, Mapping) else block_sizes)


def filter_configs_by_block_sizes(
    configs: Sequence[Any], block_sizes: Mapping[str, int] | Iterable[tuple[str, int]] = ()
) -> list[Any]:
    """Configs whose kwargs match every override name that these configs use.

    Override names no config has are ignored (an override for one kernel family must not
    break the others), so with no relevant names this returns ``configs`` unchanged. An
    empty result means the override is relevant here and matches nothing.
    """
    wanted = as_block_sizes(block_sizes)
    relevant = {k: v for k, v in wanted.items() if any(k in c.kwargs for c in configs)}
    if not relevant:
        return list(configs)
    return [
        c
        for c in configs
        if all(
            k in c.kwargs and c.kwargs[k] == v and type(c.kwargs[k]) is type(v) for k, v in relevant.items()
        )
    ]
