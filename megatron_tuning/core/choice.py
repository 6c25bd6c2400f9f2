"""Choosing a config without measuring: the one rule, ``choose``. Every step is a pure function of
the candidates and the call, so each rank computes the same answer."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from . import notices
from .errors import BlockSizeOverrideError, PolicyError, TableMissError
from .fallback import cheapest, filter_configs_by_block_sizes, nearest_keys, pick_neighbour
from .identity import (
    arch_tag,
    config_data,
    config_list_digest,
    config_signature,
    kernel_id,
    kernel_source_hash,
)
from .key import Key, tuning_key
from .policy import FALSE_WORDS, ON_MISS, TuningPolicy


@dataclass(frozen=True, slots=True)
class TableHit:
    """A table entry found for (kernel, key): its config in ``config_data`` form, and where from."""

    config: Mapping[str, Any]
    origin: str
    key: Key  # the entry's own key: the one asked for, or a nearest shape's
    kernel: str | None = None  # the entry's own kernel id when found by content (same code, other module)
    numerics: Any = None  # the entry's tables.entry.Numerics, if the audit recorded one


@runtime_checkable
class ConfigTable(Protocol):
    """A table's usable entry for (kernel, key), or with ``nearest`` those of comparable keys."""

    def lookup(
        self,
        kernel: str,
        key: Key,
        *,
        arch: str,
        source_hash: str | None = None,
        config_list_digest: str | None = None,
        nearest: bool = False,
    ) -> list[TableHit]: ...


class InMemoryTable:
    """A ``{(kernel_id, key): config or config_data}`` dict, any arch; text keys match exactly only."""

    def __init__(self, entries: Mapping[tuple[str, str], Any]) -> None:
        self._entries = {k: (v if isinstance(v, Mapping) else config_data(v)) for k, v in entries.items()}

    def lookup(
        self, kernel: str, key: Key, *, arch: str, nearest: bool = False, **code: Any
    ) -> list[TableHit]:
        if nearest:
            keys = [k for (name, k) in self._entries if name == kernel and isinstance(k, Key)]
            return [TableHit(self._entries[(kernel, k)], "<memory>", k) for k in nearest_keys(key, keys)]
        data = self._entries.get((kernel, key))
        return [] if data is None else [TableHit(data, "<memory>", key)]


def as_config_table(table: ConfigTable | Mapping[tuple[str, str], Any] | None) -> ConfigTable | None:
    if table is None or isinstance(table, ConfigTable):
        return table
    if isinstance(table, Mapping):
        return InMemoryTable(table)
    raise TypeError(
        f"table must provide ConfigTable.lookup or be a {{(kernel, key): config}} mapping, not {table!r}"
    )


@dataclass(frozen=True, slots=True)
class Choice:
    """A chosen live config and why; the fields are ``core.decisions.Decision``'s."""

    config: Any
    source: str
    origin: str | None = None
    nearest_key: str | None = None
    entry_kernel: str | None = None  # found by content: the entry's own kernel id
    chaos: str | None = None
    numerics: Any = None  # ``TableHit.numerics`` of a table or nearest-shape hit
    timings: dict[str, Any] | None = None  # of a measured (or adopted) choice


def _from_hit(config: Any, source: str, hit: TableHit, nearest_key: str | None = None) -> Choice:
    return Choice(config, source, hit.origin, nearest_key, hit.kernel, numerics=hit.numerics)


def match_live(config: Mapping[str, Any], candidates: Sequence[Any]) -> Any | None:
    """The first live candidate whose signature equals ``config``'s, or ``None``."""
    wanted = config_signature(config)
    return next((c for c in candidates if config_signature(c) == wanted), None)


def choose(
    autotuner: Any,
    candidates: Sequence[Any],
    key: Key,
    *,
    table: ConfigTable | Mapping[tuple[str, str], Any] | None = None,
    on_miss: str = "min_cost",
    block_sizes: Mapping[str, int] | Iterable[tuple[str, int]] = (),
    numerics: str = "any",
    unpinned: Callable[[str], Choice | None] | None = None,
    fix: str = notices.FIX_A_MISS,
    list_digest: str | None = None,
) -> Choice:
    """The deterministic rule, for ``deterministic_choice``, every pinning mode and ``auto``: the
    table entry, matched back to a live candidate (so its ``pre_hook`` survives); the block-size
    override; the only config. A key none of them pins goes to ``unpinned(why)`` where given
    (``auto``: adopt the job's decision or tune; under ``numerics='deterministic-only'`` an entry the
    audit found non-deterministic counts as unpinned there), then to the miss rule. ``fix``: how to
    pin the key instead, quoted in the notice. ``list_digest``: the autotuner's checked
    ``config_list_digest``, where the caller has it (else computed, and checked, here).
    """
    if on_miss not in ON_MISS:
        raise PolicyError("on_miss", on_miss, "one of " + "|".join(ON_MISS))
    kernel, lookup = kernel_id(autotuner), as_config_table(table)
    if not candidates:
        raise ValueError(f"no live configs for kernel {kernel}")
    code: dict[str, Any] = {"source_hash": kernel_source_hash(autotuner)}
    code["config_list_digest"] = list_digest or config_list_digest(autotuner)
    reason = "no table configured" if lookup is None else "no table entry"
    for hit in lookup.lookup(kernel, key, arch=arch_tag(), **code) if lookup is not None else ():
        live = match_live(hit.config, candidates)
        if live is None:
            reason = "the table entry matches no live config"
            live_signatures = [config_signature(c) for c in candidates]
            notices.entry_matches_nothing(
                hit.kernel or kernel, key, hit.origin, config_signature(hit.config), live_signatures
            )
        elif (
            unpinned and numerics == "deterministic-only" and hit.numerics and not hit.numerics.deterministic
        ):
            reason = "the table marks its config non-deterministic on its own"  # auto re-tunes it
        else:
            return _from_hit(live, "table", hit)
    override = dict(block_sizes)
    if override:
        notices.override_names(kernel, candidates)
        matching = filter_configs_by_block_sizes(candidates, override)
        if not matching:
            raise BlockSizeOverrideError(kernel, override, [config_signature(c) for c in candidates])
        if len(matching) < len(candidates):
            return Choice(cheapest(matching), "override")
    if len(candidates) == 1:
        return Choice(candidates[0], "single")
    chosen = unpinned(reason) if unpinned is not None else None
    if chosen is not None:
        return chosen
    if on_miss == "error":
        raise TableMissError(kernel, key, reason)
    if on_miss == "nearest" and lookup is not None:
        # A neighbour tuned with other live configs cannot be launched: only matched ones count.
        usable: dict[Key, tuple[TableHit, Any]] = {}
        for hit in lookup.lookup(kernel, key, arch=arch_tag(), nearest=True, **code):
            live = match_live(hit.config, candidates)
            if live is not None:
                usable.setdefault(hit.key, (hit, live))
        if usable:
            neighbour = pick_neighbour(key, {k: config_signature(live) for k, (_, live) in usable.items()})
            hit, live = usable[neighbour or next(iter(usable))]
            notices.nearest_used(kernel, key, hit.key, hit.origin, fix)
            return _from_hit(live, "nearest", hit, nearest_key=hit.key)
    config = cheapest(candidates)
    notices.cheapest_used(kernel, key, reason, on_miss, config_signature(config), len(candidates), fix)
    return Choice(config, "cheapest")


def deterministic_choice(
    autotuner: Any,
    candidates: Sequence[Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    table: ConfigTable | Mapping[tuple[str, str], Any] | None = None,
    on_miss: str = "min_cost",
    block_sizes: Mapping[str, int] | Iterable[tuple[str, int]] = (),
) -> Any:
    """Pick one of ``candidates`` (the live, pruned configs) without measuring: ``choose``'s rule."""
    key = tuning_key(autotuner, args, kwargs)
    return choose(autotuner, candidates, key, table=table, on_miss=on_miss, block_sizes=block_sizes).config


def autotune_configs(configs: Sequence[Any], *, policy: TuningPolicy | None = None) -> list[Any]:
    """At decoration, ``@triton.autotune(configs=autotune_configs([...]))``: under deterministic
    mode the list shrinks to the cheapest config (honouring a block-size override), so neither Triton
    nor torch.compile can benchmark or pick otherwise."""
    policy = policy if policy is not None else TuningPolicy.from_env_if_asked()
    configs = list(configs)
    if policy.mode != "deterministic" or len(configs) <= 1:
        return configs
    matching = filter_configs_by_block_sizes(configs, policy.block_sizes)
    if not matching:
        raise BlockSizeOverrideError(
            "<autotune_configs>", dict(policy.block_sizes), [config_signature(c) for c in configs]
        )
    chosen = cheapest(matching)
    notices.cheapest_at_decoration([config_signature(c) for c in configs], config_signature(chosen))
    return [chosen]


_TRITON_TIMES = "Triton's own autotuner times the configs and keeps whichever wins in this process"
_UNPINNED_BECAUSE = {
    "off": _TRITON_TIMES,
    "record": _TRITON_TIMES,
    "tune": "every process re-tunes each key with the noise-aware tuner",
    "chaos": "each rank launches a different config on purpose (the positive control)",
}


def warn_if_mamba_env_ignored(policy: TuningPolicy | None = None) -> bool:
    """Warn once when ``MAMBA_DETERMINISTIC`` asks for determinism but the mode does not pin configs."""
    raw = os.environ.get("MAMBA_DETERMINISTIC", "").strip().lower()
    if raw in ("", *FALSE_WORDS):
        return False
    policy = policy if policy is not None else TuningPolicy.from_env_if_asked()
    if policy.mode in ("deterministic", "auto"):
        return False
    message = (
        f"MAMBA_DETERMINISTIC={raw} is set but megatron_tuning's mode is {policy.mode!r}: "
        f"{_UNPINNED_BECAUSE.get(policy.mode, 'configs are not pinned')}, so the choice of config can differ "
        "between runs. Set MEGATRON_TUNING_MODE=deterministic (tables, never measures) or "
        "MEGATRON_TUNING_MODE=auto (tunes each new key once and reuses it)."
    )
    return notices.warn_once(("mamba-env", policy.mode), message)
