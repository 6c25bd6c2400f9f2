"""What the library does: the tuning policy.

A ``TuningPolicy`` is a frozen, validated value. Build it in code, or from the
``MEGATRON_TUNING_*`` environment with ``TuningPolicy.from_env()`` (read when called,
never at import). Every rank of a job must use the same policy. One rule holds for every
knob, in code and environment alike (docs/policy.md): words in any case, booleans are bools
(env: 1/0, true/false, yes/no, on/off), numbers are finite non-bools, paths are ``str`` or
``os.PathLike``, lists any sequence; an empty variable means unset.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import env
from .errors import PolicyError

MODES = ("off", "deterministic", "chaos", "record", "tune", "auto")
ON_MISS = ("nearest", "min_cost", "error")
AGREEMENT_MODES = ("store", "allgather", "verify", "off")
STALE_ENTRIES = ("use", "miss", "error")

# Modes in which the interception chooses without measuring; benchmarking is an error there.
NON_MEASURING_MODES = ("deterministic", "chaos")

ENV_MODE = "MEGATRON_TUNING_MODE"
ENV_SCOPE = "MEGATRON_TUNING_SCOPE"
ENV_ON_MISS = "MEGATRON_TUNING_ON_MISS"
ENV_TABLE = "MEGATRON_TUNING_TABLE"
ENV_AGREEMENT = "MEGATRON_TUNING_AGREEMENT"
ENV_AGREEMENT_TIMEOUT = "MEGATRON_TUNING_AGREEMENT_TIMEOUT"
ENV_STRICT = "MEGATRON_TUNING_STRICT"
ENV_STALE_ENTRIES = "MEGATRON_TUNING_STALE_ENTRIES"
ENV_BLOCK_SIZES = "MEGATRON_TUNING_BLOCK_SIZES"
ENV_RECORD_DIR = "MEGATRON_TUNING_RECORD_DIR"
ENV_DECISION_LOG = "MEGATRON_TUNING_DECISION_LOG"
ENV_SHIPPED_TABLES = "MEGATRON_TUNING_SHIPPED_TABLES"
ENV_CACHE = "MEGATRON_TUNING_CACHE"

# A week: longer is a typo, and a huge value would overflow the store's timedelta much later.
MAX_AGREEMENT_TIMEOUT_S = 7 * 24 * 3600.0

# What ``cache`` may say besides a path: no cache table at all.
CACHE_OFF = "off"


@dataclass(frozen=True, kw_only=True, slots=True)
class TuningPolicy:
    """How in-scope Triton autotuners choose their config."""

    mode: str = "deterministic"
    """off: stock Triton. deterministic: table entry, else a static rule; never measures.
    chaos: a different pick per rank on purpose (positive control for the agreement check).
    record: Triton autotunes as usual and every winner is recorded. tune: the noise-aware tuner.
    auto: table entry, else a decision another rank of this job published, else tune once with
    the noise-aware tuner and publish it (first writer wins); tuned decisions persist in ``cache``."""

    scope: tuple[str, ...] = ()
    """Module prefixes of the kernels to pin (``pkg`` covers ``pkg`` and ``pkg.sub``); empty = all.
    Any sequence of strings is accepted and stored as a tuple."""

    on_miss: str = "nearest"
    """No usable table entry (and, in ``auto``, no way to measure): ``nearest`` launches the entry
    of the nearest shape of the same kernel (log-space distance over the key's numbers), else the
    cheapest live config; ``min_cost`` launches the cheapest live config; ``error`` raises."""

    tables: tuple[str, ...] = ()
    """Table files searched before ``MEGATRON_TUNING_TABLE`` and the shipped tables; earlier wins.
    Any sequence of ``str`` or ``os.PathLike`` paths is accepted and stored as a tuple of ``str``."""

    use_shipped_tables: bool = True
    """Search the tables shipped in the package's ``configs/<arch>/`` after the others."""

    agreement: str | None = None
    """Cross-rank check: ``store`` (each new (kernel, key) before its launch), ``allgather`` (strictly
    SPMD groups), ``verify`` (``verify_agreement()`` at step boundaries and a bounded check at close,
    for large jobs) or ``off``. ``None``: ``store`` up to 64 ranks, ``verify`` above."""

    agreement_timeout_s: float = 300.0
    """How long an ``allgather`` check waits for missing ranks before naming them."""

    strict: bool = False
    """Raise instead of warn on stale table entries (same as ``stale_entries='error'``), and when
    compiled code launches an in-scope kernel without the pin (``CompiledLaunchNotPinnedError``)."""

    stale_entries: str = "use"
    """An entry tuned for another kernel source or Triton version: use (warn once), miss, or error."""

    block_sizes: tuple[tuple[str, int], ...] = ()
    """Explicit block-size override, e.g. ``{"BLOCK_SIZE_M": 64}`` or ``(("BLOCK_SIZE_M", 64),)``, for
    kernels that have those names. Each name once; stored as sorted ``(name, int)`` pairs."""

    record_dir: str | None = None
    """Where record/tune mode writes per-rank results (one file per rank)."""

    decision_log: str | None = None
    """If set, the decision log is written here at exit (``{rank}`` is replaced by the rank)."""

    cache: str | None = None
    """``auto`` mode's cache table: decisions it tuned or adopted are merged into this msgpack file
    at ``close()`` and at exit, and it is searched after the explicit tables and before the shipped
    ones. ``None``: ``<user cache dir>/megatron_tuning/<arch>/auto.msgpack``; ``"off"``: none.
    The words off/0/false/no (any case) are stored as ``"off"``, on/1/true/yes as ``None``: a
    word is never a file name. Read and written in ``auto`` mode only, so other modes never
    depend on a per-user file."""

    def __post_init__(self) -> None:
        # One rule for every knob, in code and in the environment alike (docs/policy.md): words
        # in any case, stored lower-case; booleans are bools; numbers are finite and not bools;
        # paths are text or os.PathLike, stored as text; lists are any sequence, stored as tuples.
        # Normalised values are written back (``object.__setattr__``: the dataclass is frozen).
        for name, allowed in (
            ("mode", MODES),
            ("on_miss", ON_MISS),
            ("agreement", AGREEMENT_MODES),
            ("stale_entries", STALE_ENTRIES),
        ):
            if name == "agreement" and self.agreement is None:
                continue  # unset: chosen by world size at start (distributed.agreement.resolve_mode)
            _set(self, name, _word(name, getattr(self, name), allowed))
        scope = _sequence("scope", self.scope, "module-name prefixes such as ['my_pkg.kernels']")
        if any(not isinstance(p, str) or not env.is_module_prefix(p.strip()) for p in scope):
            raise PolicyError("scope", self.scope, "module-name prefixes such as ['my_pkg.kernels']")
        _set(self, "scope", tuple(p.strip() for p in scope))
        tables = _sequence("tables", self.tables, "file system paths such as ['tables/sm90.msgpack']")
        _set(self, "tables", tuple(_path("tables", p) for p in tables))
        _set(self, "block_sizes", _block_sizes(self.block_sizes))
        for name in ("strict", "use_shipped_tables"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyError(name, getattr(self, name), "True or False (a bool)")
        timeout = self.agreement_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or not 0 < timeout <= MAX_AGREEMENT_TIMEOUT_S
        ):
            raise PolicyError(
                "agreement_timeout_s",
                timeout,
                f"a positive number of seconds up to {MAX_AGREEMENT_TIMEOUT_S:g} (not a bool)",
            )
        _set(self, "agreement_timeout_s", float(timeout))
        for name in ("decision_log", "record_dir"):
            value = getattr(self, name)
            if value is not None:
                _set(self, name, _path(name, value))
        _set(self, "cache", _cache(self.cache))

    @property
    def effective_stale_entries(self) -> str:
        return "error" if self.strict else self.stale_entries

    @property
    def measures(self) -> bool:
        """Whether this policy may benchmark in-scope kernels."""
        return self.mode not in NON_MEASURING_MODES

    def in_scope(self, module: str) -> bool:
        """Whether kernels defined in ``module`` are pinned by this policy."""
        if not self.scope:
            return True
        return any(module == prefix or module.startswith(prefix + ".") for prefix in self.scope)

    def replace(self, **changes: Any) -> TuningPolicy:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line for logs."""
        scope = ",".join(self.scope) if self.scope else "all"
        tables = ":".join(self.tables) if self.tables else "-"
        cache = f" cache={self.cache or 'default'}" if self.mode == "auto" else ""
        return (
            f"mode={self.mode} scope={scope} on_miss={self.on_miss} tables={tables} "
            f"agreement={self.agreement or 'by-size'} strict={int(self.strict)}{cache}"
        )

    def summary(self) -> str:
        """The fields every rank of one session must share (compared by the inputs check)."""
        blocks = ",".join(f"{k}={v}" for k, v in self.block_sizes) or "-"
        return (
            f"mode={self.mode} agreement={self.agreement} scope={','.join(self.scope) or 'all'} "
            f"on_miss={self.on_miss} block_sizes={blocks} stale_entries={self.effective_stale_entries}"
        )

    @classmethod
    def from_env(
        cls, *, default_mode: str = "off", follow_torch_determinism: bool = True, **overrides: Any
    ) -> TuningPolicy:
        """Build a policy from ``MEGATRON_TUNING_*`` variables, read now.

        With ``MEGATRON_TUNING_MODE`` unset, the mode is ``deterministic`` when
        ``torch.are_deterministic_algorithms_enabled()`` (unless
        ``follow_torch_determinism=False``), else ``default_mode``. Keyword ``overrides``
        win over the environment.
        """
        fields: dict[str, Any] = {}
        mode = env.env_choice(ENV_MODE, MODES)
        if mode is None:
            mode = "deterministic" if follow_torch_determinism and _torch_deterministic() else default_mode
        fields["mode"] = mode
        optional: Mapping[str, Any] = {
            "scope": env.env_module_prefixes(ENV_SCOPE),
            "on_miss": env.env_choice(ENV_ON_MISS, ON_MISS),
            "tables": env.env_list(ENV_TABLE, ":"),
            "agreement": env.env_choice(ENV_AGREEMENT, AGREEMENT_MODES),
            "agreement_timeout_s": env.env_float(ENV_AGREEMENT_TIMEOUT, maximum=MAX_AGREEMENT_TIMEOUT_S),
            "strict": env.env_bool(ENV_STRICT),
            "stale_entries": env.env_choice(ENV_STALE_ENTRIES, STALE_ENTRIES),
            "block_sizes": env.env_assignments(ENV_BLOCK_SIZES),
            "use_shipped_tables": env.env_bool(ENV_SHIPPED_TABLES),
            "record_dir": env.env_str(ENV_RECORD_DIR) or None,
            "decision_log": env.env_str(ENV_DECISION_LOG) or None,
            "cache": cache_from_env(),
        }
        fields.update({k: v for k, v in optional.items() if v is not None})
        if fields.get("agreement_timeout_s") is not None and fields["agreement_timeout_s"] <= 0:
            raise PolicyError(
                ENV_AGREEMENT_TIMEOUT, env.env_str(ENV_AGREEMENT_TIMEOUT), "a positive number of seconds"
            )
        env.warn_unknown_variables()  # a misspelt name (..._TABLES) would otherwise be ignored silently
        fields.update(overrides)
        return cls(**fields)


def _set(policy: TuningPolicy, name: str, value: Any) -> None:
    object.__setattr__(policy, name, value)


def _word(name: str, value: object, allowed: tuple[str, ...]) -> str:
    """A word from ``allowed``, in any case and with surrounding spaces ignored; stored lower-case."""
    if isinstance(value, str) and value.strip().lower() in allowed:
        return value.strip().lower()
    raise PolicyError(name, value, "one of " + "|".join(allowed) + " (any case)")


def _sequence(name: str, value: object, allowed: str) -> tuple[Any, ...]:
    """Any sequence (list, tuple, ...) as a tuple; one bare string or path is refused, not split."""
    if isinstance(value, (str, bytes, os.PathLike)) or not isinstance(value, Sequence):
        raise PolicyError(name, value, f"a list or tuple of {allowed}; a single one goes in a list")
    return tuple(value)


def _path(name: str, value: object) -> str:
    """A file system path: text or ``os.PathLike`` (``pathlib.Path``), non-empty, without NUL."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str) or not text or "\0" in text:
        raise PolicyError(
            name, value, "a file system path: a non-empty str or os.PathLike without NUL characters"
        )
    return text


def _block_sizes(value: object) -> tuple[tuple[str, int], ...]:
    """``{name: int}`` or ``(name, int)`` pairs, each name once; stored sorted, as the env parser does."""
    allowed = (
        "{NAME: int} or (NAME, int) pairs with identifier names, each name once, e.g. {'BLOCK_SIZE_M': 64}"
    )
    items: Any = list(value.items()) if isinstance(value, Mapping) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise PolicyError("block_sizes", value, allowed)
    seen: dict[str, int] = {}
    for item in items:
        if not (
            isinstance(item, (tuple, list))
            and len(item) == 2
            and isinstance(item[0], str)
            and item[0].isidentifier()
            and type(item[1]) is int
        ):
            raise PolicyError("block_sizes", value, allowed)
        if item[0] in seen:  # the last would silently win, as a repeated env name would
            raise PolicyError("block_sizes", value, f"each name once ({item[0]} is given twice)")
        seen[item[0]] = item[1]
    return tuple(sorted(seen.items()))


def _cache(value: object) -> str | None:
    """A cache path, ``off`` (or another false word: 0, false, no; any case), or None (the default).

    A true word (1, true, yes, on) also means the default: words are settings, never file names
    (``MEGATRON_TUNING_CACHE=OFF`` must not create a file called ``OFF``).
    """
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in env.FALSE_WORDS and value.strip():
        return CACHE_OFF
    if isinstance(value, str) and value.strip().lower() in env.TRUE_WORDS:
        return None
    try:
        return _path("cache", value)
    except PolicyError:
        allowed = f"a file path, {CACHE_OFF!r} (no cache), or None (the default)"
        raise PolicyError("cache", value, allowed) from None


def cache_from_env() -> str | None:
    """``MEGATRON_TUNING_CACHE`` read now by the knob rule: ``"off"``, a path, or ``None`` (default).

    For code that falls back to the variable when a policy built in code names no cache
    (``tables.cache.cache_path``): the raw text would turn ``OFF`` or ``1`` into a file name.
    """
    raw = env.env_str(ENV_CACHE)
    if not raw:  # empty means unset
        return None
    try:
        return _cache(raw)
    except PolicyError:
        raise PolicyError(ENV_CACHE, raw, f"a file path, or {CACHE_OFF!r} for no cache") from None


def _torch_deterministic() -> bool:
    try:
        import torch
    except ImportError:  # torch is a dependency, but policy parsing must not need it
        return False
    return bool(torch.are_deterministic_algorithms_enabled())
