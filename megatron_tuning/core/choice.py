"""Choosing a config without measuring: table entry, then block-size override, then the miss rule.
Every rule is a pure function of the candidates and the call, so each rank computes the same answer."""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .errors import BlockSizeOverrideError, NumericsError, PolicyError, TableMissError
from .fallback import as_block_sizes, cheapest, filter_configs_by_block_sizes, nearest_keys, pick_neighbour
from .identity import (
    arch_tag,
    base_kernel_id,
    config_data,
    config_list_digest,
    config_signature,
    kernel_id,
    kernel_source_hash,
    tuning_key,
)
from .notices import tallies, tally, warn_once
from .policy import ON_MISS, TuningPolicy

# What the cheapest-config rule costs, measured (benchmarks/RESULTS.md): quoted where it is used.
CHEAPEST_COST = "on an H200 the cheapest-config rule ran large GEMMs at 12-14% of the best config's speed"
FIX_A_MISS = (
    "use MEGATRON_TUNING_MODE=auto (tunes each new key once per job and caches it), a tuning table "
    "(MEGATRON_TUNING_TABLE=...), or build one with `python -m megatron_tuning tune -- <your command>`"
)
# The same advice where ``auto`` already runs but could not measure this key.
FIX_AN_AUTO_MISS = (
    "let auto tune it: launch the key once in eager code, outside CUDA graph capture and not under `audit` "
    "(which never tunes), or build a table with `python -m megatron_tuning tune -- <your command>`"
)


@dataclass(frozen=True, slots=True)
class TableHit:
    """A table entry found for (kernel, key): its config in ``config_data`` form, and where from."""

    config: Mapping[str, Any]
    origin: str
    key: str | None = None  # the entry's own key, for a nearest-shape neighbour
    kernel: str | None = None  # the entry's own kernel id when found by content (same code, other module)
    numerics: Any = None  # the entry's tables.entry.Numerics (what the numerics audit found), if recorded


@runtime_checkable
class ConfigTable(Protocol):
    """What choosing needs from a table (``tables.search.TableSet``). With ``neighbours`` (same arguments:
    comparable entries, nearest first) ``on_miss='nearest'`` can use them. ``source_hash`` and
    ``config_list_digest`` name the running code, for matches under another module name."""

    def lookup(
        self,
        kernel: str,
        key: str,
        *,
        arch: str,
        source_hash: str | None = None,
        config_list_digest: str | None = None,
    ) -> TableHit | None: ...


class InMemoryTable:
    """A table held in a dict ``{(kernel_id, key): config or config_data}``, any arch."""

    def __init__(self, entries: Mapping[tuple[str, str], Any], origin: str = "<memory>") -> None:
        self._entries = {k: (v if isinstance(v, Mapping) else config_data(v)) for k, v in entries.items()}
        self._origin = origin

    def lookup(self, kernel: str, key: str, *, arch: str, **code: str | None) -> TableHit | None:
        data = self._entries.get((kernel, key))
        return None if data is None else TableHit(data, self._origin)

    def neighbours(self, kernel: str, key: str, *, arch: str, **code: str | None) -> list[TableHit]:
        keys = [k for (name, k) in self._entries if name == kernel]
        return [TableHit(self._entries[(kernel, k)], self._origin, k) for k in nearest_keys(key, keys)]


def as_config_table(table: ConfigTable | Mapping[tuple[str, str], Any] | None) -> ConfigTable | None:
    if table is None or isinstance(table, ConfigTable):
        return table
    if isinstance(table, Mapping):
        return InMemoryTable(table)
    raise TypeError(
        f"table must provide lookup(kernel, key, *, arch, source_hash, config_list_digest) or be a mapping, "
        f"not {table!r}"
    )


@dataclass(frozen=True, slots=True)
class Choice:
    """A chosen live config and why: ``source`` is a ``core.decisions.SOURCES`` value."""

    config: Any
    source: str
    origin: str | None = None
    nearest_key: str | None = None  # the rest as in ``core.decisions.Decision``
    matched_by: str | None = None
    entry_kernel: str | None = None
    chaos: str | None = None
    numerics: Any = None  # ``TableHit.numerics`` of a table or nearest-shape hit


def _from_hit(config: Any, source: str, hit: TableHit, nearest_key: str | None = None) -> Choice:
    content = "content" if hit.kernel is not None else None
    return Choice(config, source, hit.origin, nearest_key, content, hit.kernel, numerics=hit.numerics)


def check_numerics(numerics: str, kernel: str, key: str, choice: Choice) -> None:
    """Where the table marks the pinned config non-deterministic on its own: under ``numerics=
    'deterministic-only'`` a ``NumericsError`` naming the entry (``auto`` re-tunes such an entry
    before this; other modes cannot), else one notice per kernel."""
    if choice.numerics is None or choice.numerics.deterministic:
        return
    others = "; ".join(choice.numerics.alternatives) or "none among the live configs"
    found = (
        f"the numerics audit in {choice.origin} found {config_signature(choice.config)} non-deterministic "
        "on its own (its launches on the same inputs gave different bits)"
    )
    if numerics == "deterministic-only":
        why = (
            f"the table entry pins its config, and {found}. Re-tune the key (`tune --numerics "
            "deterministic-only`, or MEGATRON_TUNING_MODE=auto, which re-tunes such an entry), or set the "
            f"entry's config to a deterministic alternative the audit found: {others}"
        )
        raise NumericsError(kernel, key, numerics, why, {})
    message = (
        f"kernel {kernel} key {key}: {found}: pinning the config cannot make this kernel bitwise "
        f"reproducible. Deterministic alternatives the audit found: {others}. Re-tune with "
        "MEGATRON_TUNING_NUMERICS=deterministic-only to pin one (docs/numerics.md)."
    )
    warn_once(("nondeterministic", kernel), message)


@dataclass(frozen=True, slots=True)
class Miss:
    """No pin for (kernel, key): why, for the error or the fallback that follows."""

    reason: str


def match_live(config: Mapping[str, Any], candidates: Sequence[Any]) -> Any | None:
    """The live candidate whose signature equals ``config``'s (the first in list order), or ``None``."""
    wanted = config_signature(config)
    return next((c for c in candidates if config_signature(c) == wanted), None)


def pin_without_fallback(
    autotuner: Any,
    candidates: Sequence[Any],
    key: str,
    *,
    table: ConfigTable | Mapping[tuple[str, str], Any] | None = None,
    block_sizes: Mapping[str, int] | Iterable[tuple[str, int]] = (),
) -> Choice | Miss:
    """The pin that needs no miss rule: the table entry, then a block-size override, then a single config."""
    if not candidates:
        raise ValueError(f"no live configs for kernel {kernel_id(autotuner)}")
    kernel, lookup = kernel_id(autotuner), as_config_table(table)
    reason = "no table configured" if lookup is None else "no table entry"
    if lookup is not None:
        hit = lookup.lookup(kernel, key, arch=arch_tag(), **_running_code(lookup.lookup, autotuner))
        if hit is None:
            _warn_if_ambiguous_entry(lookup, autotuner, kernel, key)
        else:
            live = match_live(hit.config, candidates)
            if live is not None:
                return _from_hit(live, "table", hit)
            reason = "the table entry matches no live config"
            offered = "; ".join(config_signature(c) for c in candidates[:8]) + "; ..." * (len(candidates) > 8)
            message = (
                f"table entry for kernel {hit.kernel or kernel} key {key} in {hit.origin} "
                f"({config_signature(hit.config)}) matches none of the {len(candidates)} live configs after "
                "pruning, so it is a miss (auto mode re-tunes it and replaces such an entry in its cache; "
                "other modes apply the miss rule). Re-tune the kernel, or fix the entry's config to one "
                f"the kernel offers: {offered}"
            )
            warn_once(("entry-no-match", kernel, key, hit.origin), message)
    override = as_block_sizes(block_sizes)
    if override:
        names = {name for c in candidates for name in getattr(c, "kwargs", {})}
        for name in override.keys() & names:
            tally(("override-name-used", name), kernel)
        for name in names:
            tally(("kernel-config-names", kernel), name)
        matching = filter_configs_by_block_sizes(candidates, override)
        if not matching:
            raise BlockSizeOverrideError(kernel, override, [config_signature(c) for c in candidates])
        if len(matching) < len(candidates):
            return Choice(cheapest(matching), "override")
    return Choice(candidates[0], "single") if len(candidates) == 1 else Miss(reason)


def _running_code(method: Any, autotuner: Any) -> dict[str, str | None]:
    """What a content match compares with an entry: the kernel's source hash and, where the table's
    ``method`` takes it (ours do; a user's table written before it may not), its config list."""
    code = {"source_hash": kernel_source_hash(autotuner)}
    parameters = inspect.signature(method).parameters.values()
    if any(p.name == "config_list_digest" or p.kind is p.VAR_KEYWORD for p in parameters):
        code["config_list_digest"] = config_list_digest(autotuner)
    return code


def _warn_if_ambiguous_entry(lookup: ConfigTable, autotuner: Any, kernel: str, key: str) -> None:
    """Say once why an entry under the plain ``module:qualname`` is not used for ``...@digest``."""
    base = base_kernel_id(autotuner)
    if base == kernel:
        return
    find = getattr(lookup, "find", lookup.lookup)  # TableSet.find: no validators, no stale warnings
    found = find(base, key, arch=arch_tag())
    if found is not None:
        origin = found[1] if isinstance(found, tuple) else found.origin
        message = (
            f"Table {origin} has an entry for kernel {base} (key {key}) but several autotuners with "
            f"different config lists wrap that function, so it is now told apart as {kernel} and the others; "
            "the entry cannot say which autotuner it was tuned for and is not used. Re-tune (tune or auto "
            "mode) to get entries under the new ids. Other keys of this kernel are skipped without another "
            "warning."
        )
        warn_once(("ambiguous-entry", base, origin), message)


def _check_on_miss(on_miss: str) -> None:
    if on_miss not in ON_MISS:
        raise PolicyError("on_miss", on_miss, "one of " + "|".join(ON_MISS))


def choose_on_miss(
    autotuner: Any,
    candidates: Sequence[Any],
    key: str,
    miss: Miss,
    *,
    table: ConfigTable | Mapping[tuple[str, str], Any] | None = None,
    on_miss: str = "nearest",
    fix: str = FIX_A_MISS,
) -> Choice:
    """What a miss launches, without measuring: the nearest shape's entry (``core.fallback``: the
    nearest usable entry, or the lower of two bracketing ones that disagree), the cheapest, or an error.
    ``fix``: how to pin the key instead, quoted in the notice."""
    _check_on_miss(on_miss)
    kernel = kernel_id(autotuner)
    if on_miss == "error":
        raise TableMissError(kernel, key, miss.reason)
    neighbours = getattr(as_config_table(table), "neighbours", None)
    if on_miss == "nearest" and neighbours is not None:
        hits = neighbours(kernel, key, arch=arch_tag(), **_running_code(neighbours, autotuner))
        # A neighbour tuned with other live configs cannot be launched: only matched ones count.
        usable: dict[str, tuple[TableHit, Any]] = {}
        for hit in hits:
            live = match_live(hit.config, candidates)
            if live is not None and hit.key is not None:
                usable.setdefault(hit.key, (hit, live))
        if usable:
            chosen = pick_neighbour(key, {k: config_signature(live) for k, (_, live) in usable.items()})
            hit, live = usable[chosen or next(iter(usable))]
            tally(("nearest", kernel), key)
            message = (
                f"kernel {kernel} has no table entry for key {key}; it launches the entry tuned for the "
                f"nearest shape [{hit.key}] from {hit.origin} (on_miss='nearest'), and so will every other "
                "key of this kernel without an entry (counted when the policy ends). To pin each shape's own "
                f"best config, {fix}."
            )
            warn_once(("nearest", kernel), message)
            return _from_hit(live, "nearest", hit, nearest_key=hit.key)
    config = cheapest(candidates)
    tally(("cheapest", kernel), key)
    rule = "on_miss='min_cost'" if on_miss == "min_cost" else "no nearest-shape entry either"
    message = (
        f"kernel {kernel} has no tuned config for key {key} ({miss.reason}; {rule}), so it launches the "
        f"cheapest of its {len(candidates)} configs by static cost ({config_signature(config)}), and so will "
        "every other key of this kernel without an entry (counted when the policy ends). That is pinned but "
        f"can be slow: {CHEAPEST_COST}. To be pinned and fast, {fix}."
    )
    warn_once(("cheapest", kernel), message)
    return Choice(config, "cheapest")


def report_policy_end(policy: TuningPolicy | None) -> None:
    """At the end of a policy: how many keys fell back, and override names no launched kernel has."""
    fix = FIX_AN_AUTO_MISS if policy is not None and policy.mode == "auto" else FIX_A_MISS
    for kind, what in (("cheapest", "the cheapest config"), ("nearest", "a nearest-shape entry")):
        by_kernel = {group[1]: len(keys) for group, keys in tallies(kind).items()}
        if sum(by_kernel.values()) > len(by_kernel):  # one key per kernel was said by its own notice
            listing = ", ".join(f"{k} ({n} key{'s' * (n > 1)})" for k, n in sorted(by_kernel.items()))
            message = (
                f"{sum(by_kernel.values())} keys of {len(by_kernel)} kernel(s) launched {what} for lack of a "
                f"table entry under this policy: {listing}. To pin them to their best configs, {fix}."
            )
            warn_once(("policy-end", kind), message)
    kernels = {group[1]: sorted(map(str, names)) for group, names in tallies("kernel-config-names").items()}
    if policy is None or not policy.block_sizes or not kernels:
        return  # no in-scope kernel launched with the override: nothing to compare it with
    used = {group[1] for group in tallies("override-name-used")}
    everything = sorted({name for names in kernels.values() for name in names})
    for name, value in policy.block_sizes:
        if name not in used:
            close = difflib.get_close_matches(name, everything, n=1)
            message = (
                f"block-size override {name}={value} (MEGATRON_TUNING_BLOCK_SIZES / block_sizes) names a "
                f"parameter that none of the {len(kernels)} kernel(s) launched under this policy has, so it "
                f"changed nothing.{f' Did you mean {close[0]}?' if close else ''} The kernels' config names: "
                + "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(kernels.items()))
                + "."
            )
            warn_once(("override-name-unused", name), message)


def choose_deterministically(
    autotuner: Any,
    candidates: Sequence[Any],
    key: str,
    *,
    table: ConfigTable | Mapping[tuple[str, str], Any] | None = None,
    on_miss: str = "min_cost",
    block_sizes: Mapping[str, int] | Iterable[tuple[str, int]] = (),
) -> Choice:
    """``deterministic_choice`` with a precomputed key, returning the source of the choice."""
    _check_on_miss(on_miss)
    pinned = pin_without_fallback(autotuner, candidates, key, table=table, block_sizes=block_sizes)
    if isinstance(pinned, Choice):
        return pinned
    return choose_on_miss(autotuner, candidates, key, pinned, table=table, on_miss=on_miss)


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
    """Pick one of ``candidates`` (the live, pruned configs) without measuring.

    Order: the table entry for this kernel and key, matched back to a live candidate (so its
    ``pre_hook`` survives); then an explicit block-size override; then the miss rule:
    ``on_miss='min_cost'`` (the default here) takes the cheapest config by static cost,
    ``'nearest'`` the table entry of the nearest comparable shape (else the cheapest), and
    ``'error'`` raises ``TableMissError`` naming kernel and key.
    """
    key = tuning_key(autotuner, args, kwargs)
    return choose_deterministically(
        autotuner, candidates, key, table=table, on_miss=on_miss, block_sizes=block_sizes
    ).config


def autotune_configs(configs: Sequence[Any], *, policy: TuningPolicy | None = None) -> list[Any]:
    """For a project's own kernels, at decoration: ``@triton.autotune(configs=autotune_configs([...]))``.

    Under deterministic mode (``TuningPolicy.from_env()``) the list shrinks to the cheapest config,
    honouring a block-size override, so neither Triton nor torch.compile can benchmark or pick
    otherwise. (``TRITON_CACHE_AUTOTUNING`` is not enough: a miss still times the candidates.)
    """
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
    # Decoration has no kernel name: the notice names the configs and is issued at the caller's line.
    message = (
        f"autotune_configs shrank {len(configs)} configs to the cheapest by static cost "
        f"({config_signature(chosen)}) under deterministic mode (at decoration, where no table is read): "
        f"every key of this kernel launches it. That is pinned but can be slow: {CHEAPEST_COST}. To be "
        f"pinned and fast, pass the whole list to @triton.autotune and {FIX_A_MISS}."
    )
    warn_once(("autotune_configs", tuple(config_signature(c) for c in configs)), message)
    return [chosen]


_UNPINNED_BECAUSE = {
    "off": "Triton's own autotuner times the configs and keeps whichever wins in this process",
    "record": "Triton's own autotuner times the configs and keeps whichever wins in this process",
    "tune": "every process re-tunes each key with the noise-aware tuner",
    "chaos": "each rank launches a different config on purpose (the positive control)",
}


def warn_if_mamba_env_ignored(policy: TuningPolicy | None = None) -> bool:
    """Warn once when ``MAMBA_DETERMINISTIC`` asks for determinism but the mode does not pin configs
    (``deterministic`` and ``auto`` pin, so they are silent)."""
    raw = os.environ.get("MAMBA_DETERMINISTIC", "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
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
    return warn_once(("mamba-env", policy.mode), message)
