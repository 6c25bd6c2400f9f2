"""What choosing tells the user: fallbacks, unusable entries, numerics, the policy's end summary.

Each notice is issued once per cause (``errors.warn_once``); keys that fall back after the first
are tallied and counted when the policy ends (``report_policy_end``).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import NumericsError, tallies, tally, warn_once
from .identity import config_signature
from .policy import TuningPolicy

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


def entry_matches_nothing(
    kernel: str, key: str, origin: str, config: Mapping[str, Any], live: Sequence[Any]
) -> None:
    offered = "; ".join(config_signature(c) for c in live[:8]) + "; ..." * (len(live) > 8)
    message = (
        f"table entry for kernel {kernel} key {key} in {origin} ({config_signature(config)}) matches none "
        f"of the {len(live)} live configs after pruning, so it is a miss (auto mode re-tunes it and replaces "
        "such an entry in its cache; other modes apply the miss rule). Re-tune the kernel, or fix the "
        f"entry's config to one the kernel offers: {offered}"
    )
    warn_once(("entry-no-match", kernel, key, origin), message)


def ambiguous_entry(base: str, kernel: str, key: str, origin: str) -> None:
    """An entry under the plain ``module:qualname`` is not used for ``kernel`` (``...@digest``)."""
    message = (
        f"Table {origin} has an entry for kernel {base} (key {key}) but several autotuners with different "
        f"config lists wrap that function, so it is now told apart as {kernel} and the others; the entry "
        "cannot say which autotuner it was tuned for and is not used. Re-tune (tune or auto mode) to get "
        "entries under the new ids. Other keys of this kernel are skipped without another warning."
    )
    warn_once(("ambiguous-entry", base, origin), message)


def override_names(kernel: str, override: Mapping[str, int], live: Sequence[Any]) -> None:
    """Tally which override names this kernel has, for ``report_policy_end``."""
    names = {name for c in live for name in getattr(c, "kwargs", {})}
    for name in override.keys() & names:
        tally(("override-name-used", name), kernel)
    for name in names:
        tally(("kernel-config-names", kernel), name)


def nearest_used(kernel: str, key: str, neighbour: str, origin: str, fix: str) -> None:
    tally(("nearest", kernel), key)
    message = (
        f"kernel {kernel} has no table entry for key {key}; it launches the entry tuned for the nearest "
        f"shape [{neighbour}] from {origin} (on_miss='nearest'), and so will every other key of this kernel "
        f"without an entry (counted when the policy ends). To pin each shape's own best config, {fix}."
    )
    warn_once(("nearest", kernel), message)


def cheapest_used(
    kernel: str, key: str, reason: str, on_miss: str, config: Any, count: int, fix: str
) -> None:
    tally(("cheapest", kernel), key)
    rule = "on_miss='min_cost'" if on_miss == "min_cost" else "no nearest-shape entry either"
    message = (
        f"kernel {kernel} has no tuned config for key {key} ({reason}; {rule}), so it launches the cheapest "
        f"of its {count} configs by static cost ({config_signature(config)}), and so will every other key of "
        "this kernel without an entry (counted when the policy ends). That is pinned but can be slow: "
        f"{CHEAPEST_COST}. To be pinned and fast, {fix}."
    )
    warn_once(("cheapest", kernel), message)


def cheapest_at_decoration(configs: Sequence[Any], chosen: Any) -> None:
    """``autotune_configs`` has no kernel name: the notice names the configs."""
    message = (
        f"autotune_configs shrank {len(configs)} configs to the cheapest by static cost "
        f"({config_signature(chosen)}) under deterministic mode (at decoration, where no table is read): "
        f"every key of this kernel launches it. That is pinned but can be slow: {CHEAPEST_COST}. To be "
        f"pinned and fast, pass the whole list to @triton.autotune and {FIX_A_MISS}."
    )
    warn_once(("autotune_configs", tuple(config_signature(c) for c in configs)), message)


def cannot_measure(kernel: str, key: str) -> None:
    message = (
        f"kernel {kernel} key {key} is first seen where nothing can be measured (compiled code, or a CUDA "
        "graph capture); using the deterministic choice instead of tuning it. Launch this key once eagerly, "
        "outside graph capture, before compiling or capturing, so the tuner can time it"
    )
    warn_once(("tune-cannot-measure", kernel, key), message)


def check_numerics(numerics: str, kernel: str, key: str, choice: Any) -> None:
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
    policy = policy if policy is not None else TuningPolicy.from_env()
    if policy.mode in ("deterministic", "auto"):
        return False
    message = (
        f"MAMBA_DETERMINISTIC={raw} is set but megatron_tuning's mode is {policy.mode!r}: "
        f"{_UNPINNED_BECAUSE.get(policy.mode, 'configs are not pinned')}, so the choice of config can differ "
        "between runs. Set MEGATRON_TUNING_MODE=deterministic (tables, never measures) or "
        "MEGATRON_TUNING_MODE=auto (tunes each new key once and reuses it)."
    )
    return warn_once(("mamba-env", policy.mode), message)
