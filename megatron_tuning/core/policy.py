"""Every ``MEGATRON_TUNING_*`` knob, declared once with its default (as Triton's ``knobs.py``), and
``TuningPolicy``, the whole input of every choice.

``TuningPolicy.from_env`` is the one reader of the variables, when called, never at import;
``docs/policy.md`` lists exactly ``KNOBS`` (a test checks). Whitespace is ignored, empty means unset,
words in any case, numbers finite ASCII decimals. The policy validates every field, built in code
or from the environment; a bad value raises ``PolicyError`` naming the field or variable.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .errors import PolicyError
from .notices import warn_once

PREFIX = "MEGATRON_TUNING_"
MODES = ("off", "deterministic", "chaos", "record", "tune", "auto")
ON_MISS = ("nearest", "min_cost", "error")
AGREEMENT_MODES = ("store", "allgather", "verify", "off")
STALE_ENTRIES = ("use", "miss", "error")
NUMERICS = ("any", "same-class", "deterministic-only")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
CACHE_OFF = "off"
MAX_AGREEMENT_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer is a typo (and overflows a timedelta)
_A_PATH = "a file system path: a non-empty str or os.PathLike without NUL characters"
_DIGEST_REMOVED = (
    "store, allgather, verify or off: 'digest' was removed; jobs above 64 ranks now use 'verify' (the inputs "
    "check at init, verify_agreement() at step boundaries, a bounded check at close; docs/agreement.md)"
)
# ASCII only, written out: int()/float() also accept "١", "1_000", "nan", "inf" and "1e400".
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class Knob(NamedTuple):
    """One ``MEGATRON_TUNING_*`` variable: the field it sets, how its text is read, its one default."""

    name: str
    field: str
    parse: Callable[[str, Any], Any]
    default: Any
    doc: str


KNOBS: dict[str, Knob] = {}


def _knob(suffix: str, parse: Callable[[str, Any], Any], default: Any, doc: str, field: str = "") -> str:
    name = PREFIX + suffix
    KNOBS[name] = Knob(name, field or suffix.lower(), parse, default, doc)
    return name


def parse_int(text: str) -> int | None:
    """``text`` as an integer if it is ASCII digits with an optional sign, else ``None``."""
    stripped = text.strip()
    return int(stripped) if _INT.fullmatch(stripped) else None


def _words(allowed: tuple[str, ...]) -> Callable[[str, Any], str]:
    def parse(name: str, value: object) -> str:
        text = value.strip().lower() if isinstance(value, str) else ""
        if text in allowed:
            return text
        removed = allowed is AGREEMENT_MODES and text == "digest"
        raise PolicyError(
            name, value, _DIGEST_REMOVED if removed else "one of " + "|".join(allowed) + " (any case)"
        )

    return parse


def _bool(name: str, raw: str) -> bool:
    word = raw.lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise PolicyError(name, raw, "a boolean (1/0, true/false, yes/no, on/off; any case)")


# Numbers read the same in code and in the environment: a number (not a bool) or its ASCII text.
def _int(low: int, high: int) -> Callable[[str, Any], int]:
    def parse(name: str, value: Any) -> int:
        number = parse_int(value) if isinstance(value, str) else value
        if type(number) is not int or not low <= number <= high:
            raise PolicyError(name, value, f"an integer (ASCII digits) from {low:g} to {high:g}")
        return number

    return parse


def _decimal(within: Callable[[float], bool], allowed: str) -> Callable[[str, Any], float]:
    def parse(name: str, value: Any) -> float:
        number = float(value) if isinstance(value, str) and _FLOAT.fullmatch(value) else value
        real = isinstance(number, (int, float)) and not isinstance(number, bool)
        if not (real and math.isfinite(number) and within(number)):
            raise PolicyError(name, value, allowed)
        return float(number)

    return parse


_seconds = _decimal(
    lambda s: 0 < s <= MAX_AGREEMENT_TIMEOUT_S,
    f"a positive number of seconds up to {MAX_AGREEMENT_TIMEOUT_S:g}, finite (not a bool)",
)
_fraction = _decimal(lambda f: 0 <= f < 1, "a finite decimal number, a fraction in [0, 1)")


def _split(separator: str) -> Callable[[str, str], tuple[str, ...]]:
    return lambda name, raw: tuple(p.strip() for p in raw.split(separator) if p.strip())


def _assignments(name: str, raw: str) -> list[tuple[str, int | None]]:
    items = [item.partition("=") for item in _split(",")(name, raw)]
    return [(key.strip(), parse_int(value) if sep else None) for key, sep, value in items]


def _text(name: str, raw: str) -> str:
    return raw


# Each knob, the field it sets (its name in lower case unless given) and its one default.
ENV_MODE = _knob("MODE", _words(MODES), "deterministic", "what the library does")
ENV_SCOPE = _knob("SCOPE", _split(","), (), "module prefixes of the kernels to pin; empty: all")
ENV_ON_MISS = _knob("ON_MISS", _words(ON_MISS), "nearest", "what a miss launches")
ENV_TABLE = _knob(
    "TABLE", _split(":"), (), "colon-separated table files or folders, searched first", "tables"
)
ENV_SHIPPED_TABLES = _knob("SHIPPED_TABLES", _bool, True, "search the shipped tables", "use_shipped_tables")
ENV_AGREEMENT = _knob("AGREEMENT", _words(AGREEMENT_MODES), None, "cross-rank check; unset: by world size")
ENV_AGREEMENT_TIMEOUT = _knob(
    "AGREEMENT_TIMEOUT", _seconds, 300.0, "seconds a check waits for missing ranks", "agreement_timeout_s"
)
ENV_STRICT = _knob("STRICT", _bool, False, "raise on stale entries and unpinned compiled launches")
ENV_STALE_ENTRIES = _knob("STALE_ENTRIES", _words(STALE_ENTRIES), "use", "what a stale entry does")
ENV_NUMERICS = _knob("NUMERICS", _words(NUMERICS), "any", "which configs tune and auto may pick")
ENV_BLOCK_SIZES = _knob("BLOCK_SIZES", _assignments, (), "explicit block-size override")
ENV_RECORD_DIR = _knob("RECORD_DIR", _text, None, "where record mode writes one file per rank")
ENV_DECISION_LOG = _knob("DECISION_LOG", _text, None, "write the decision log here at exit")
ENV_PRINT_DECISIONS = _knob("PRINT_DECISIONS", _bool, False, "print each decision (kernel, key, config)")
ENV_CACHE = _knob("CACHE", _text, None, "auto mode's cache table: a path or off")
ENV_CACHE_MAX_ENTRIES = _knob("CACHE_MAX_ENTRIES", _int(1, 1_000_000), 50_000, "entries auto's cache keeps")
ENV_TUNE_ROUNDS = _knob("TUNE_ROUNDS", _int(1, 10_000), 10, "timed rounds per candidate when tuning")
ENV_TUNE_TIE_BAND = _knob("TUNE_TIE_BAND", _fraction, 0.02, "fraction of the best median called a tie")
ENV_AUDIT_RUNS = _knob("AUDIT_RUNS", _int(2, 100), 3, "launches per config when comparing output bits")
_BY_FIELD = {knob.field: knob for knob in KNOBS.values()}


def default(name: str) -> Any:
    return KNOBS[name].default


def _warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """One notice per unknown ``MEGATRON_TUNING_*`` name: it is ignored, so it is most likely a typo."""
    # Compared without the shared prefix, which would make every name look close to every other.
    known = sorted(name[len(PREFIX) :] for name in KNOBS)
    for name in sorted(n for n in environ if n.startswith(PREFIX) and n not in KNOBS):
        close = difflib.get_close_matches(name[len(PREFIX) :], known, n=1, cutoff=0.6)
        listing = ", ".join(sorted(KNOBS))
        hint = f"Did you mean {PREFIX}{close[0]}?" if close else f"Known variables: {listing}"
        text = f"{name} is set but is not a megatron_tuning setting, so it is ignored."
        warn_once(("unknown-env", name), f"{text} {hint} (docs/policy.md)")


@dataclass(frozen=True, kw_only=True, slots=True)
class TuningPolicy:
    """How in-scope Triton autotuners choose their config: the whole input of the choice. Every rank
    of a job must use the same. Each field's default is its knob's (``default``)."""

    mode: str = default(ENV_MODE)
    """off: stock Triton. deterministic: table entry, else the miss rule. chaos: a different pick per
    rank. record: Triton's winners recorded. tune: our tuner. auto: entry, else the job's, else tune."""

    scope: tuple[str, ...] = default(ENV_SCOPE)
    """Module prefixes of the kernels to pin (``pkg`` covers ``pkg`` and ``pkg.sub``); empty: all."""

    on_miss: str = default(ENV_ON_MISS)
    """No usable entry: ``nearest`` shape's entry, else the cheapest; ``min_cost``; or ``error``."""

    tables: tuple[str, ...] = default(ENV_TABLE)
    """Table files or folders, searched in order before the shipped tables."""

    use_shipped_tables: bool = default(ENV_SHIPPED_TABLES)
    """Search the tables shipped in the package's ``configs/<arch>/``, after ``tables``, before ``auto``'s
    cache."""

    agreement: str | None = default(ENV_AGREEMENT)
    """Cross-rank check: store, allgather, verify or off; None: store up to 64 ranks, verify above."""

    agreement_timeout_s: float = default(ENV_AGREEMENT_TIMEOUT)
    """How long a cross-rank check waits for missing ranks before naming them."""

    strict: bool = default(ENV_STRICT)
    """Raise on stale entries (as ``stale_entries='error'``) and on unpinned compiled launches."""

    stale_entries: str = default(ENV_STALE_ENTRIES)
    """An entry tuned for other kernel source or another Triton: use (warn once), miss, or error."""

    numerics: str = default(ENV_NUMERICS)
    """Which configs ``tune`` and ``auto`` may pick: ``any``; ``same-class`` (bit-identical, on the
    call's inputs, to the key's current table entry); ``deterministic-only`` (docs/numerics.md)."""

    block_sizes: tuple[tuple[str, int], ...] = default(ENV_BLOCK_SIZES)
    """Explicit block-size override, e.g. ``{"BLOCK_SIZE_M": 64}``; stored as sorted pairs."""

    record_dir: str | None = default(ENV_RECORD_DIR)
    """Where record mode writes per-rank results (one file per rank)."""

    decision_log: str | None = default(ENV_DECISION_LOG)
    """If set, the decision log is written here at close (``{rank}`` and ``{pid}`` are replaced)."""

    print_decisions: bool = default(ENV_PRINT_DECISIONS)
    """Write one line per decision to stderr, as ``TRITON_PRINT_AUTOTUNING`` does."""

    cache: str | None = default(ENV_CACHE)
    """auto's cache table: None for the user cache folder's, "off" (or a false word) for none, or a path."""

    cache_max_entries: int = default(ENV_CACHE_MAX_ENTRIES)
    """Entries auto's cache keeps; past it, those persisted longest ago are evicted."""

    tune_rounds: int = default(ENV_TUNE_ROUNDS)
    """Timed rounds per candidate when ``tune`` and ``auto`` measure."""

    tune_tie_band: float = default(ENV_TUNE_TIE_BAND)
    """Medians within this fraction of the best are a tie, broken by static cost."""

    audit_runs: int = default(ENV_AUDIT_RUNS)
    """Launches per config when the numerics audit compares output bits."""

    def __post_init__(self) -> None:
        # Words and numbers follow their variable's rule (numbers as numbers), normalised.
        numbers = ("agreement_timeout_s", "cache_max_entries", "tune_rounds", "tune_tie_band", "audit_runs")
        for name in ("mode", "on_miss", "stale_entries", "numerics", "agreement", *numbers):
            value = getattr(self, name)
            if name in numbers and isinstance(value, str):
                raise PolicyError(name, value, "a number, not text")
            if name != "agreement" or value is not None:
                _set(self, name, _BY_FIELD[name].parse(name, value))
        modules = "module-name prefixes such as ['my_pkg.kernels']"
        scope = tuple(p.strip() if isinstance(p, str) else p for p in _sequence("scope", self.scope, modules))
        # A prefix that cannot name a module (``my-pkg``) would pin nothing.
        if bad := [
            p for p in scope if not isinstance(p, str) or not all(map(str.isidentifier, p.split(".")))
        ]:
            raise PolicyError(
                "scope", self.scope, f"{modules} ({', '.join(map(repr, bad))} would pin nothing)"
            )
        _set(self, "scope", scope)
        paths = _sequence("tables", self.tables, "file system paths such as ['tables/sm90.msgpack']")
        _set(self, "tables", tuple(_path("tables", p) for p in paths))
        _set(self, "block_sizes", _block_sizes(self.block_sizes))
        for name in ("strict", "use_shipped_tables", "print_decisions"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyError(name, getattr(self, name), "True or False (a bool)")
        for name in ("decision_log", "record_dir"):
            if getattr(self, name) is not None:
                _set(self, name, _path(name, getattr(self, name)))
        if self.cache is not None:
            _set(self, "cache", _cache(self.cache))

    @property
    def effective_stale_entries(self) -> str:
        return "error" if self.strict else self.stale_entries

    def in_scope(self, module: str) -> bool:
        """Whether kernels defined in ``module`` are pinned by this policy."""
        return not self.scope or any(module == p or module.startswith(p + ".") for p in self.scope)

    def replace(self, **changes: Any) -> TuningPolicy:
        return dataclasses.replace(self, **changes)

    def summary_fields(self) -> dict[str, str]:
        """Every field that changes a choice but the tables, as text: what the inputs check compares."""
        return {
            "mode": self.mode,
            "agreement": str(self.agreement),
            "scope": ",".join(self.scope) or "all",
            "on_miss": self.on_miss,
            "block_sizes": ",".join(f"{k}={v}" for k, v in self.block_sizes) or "-",
            "stale_entries": self.effective_stale_entries,
            "numerics": self.numerics,
            "tune_rounds": str(self.tune_rounds),
            "tune_tie_band": f"{self.tune_tie_band:g}",
            "audit_runs": str(self.audit_runs),
        }

    def summary(self) -> str:
        return " ".join(f"{name}={value}" for name, value in self.summary_fields().items())

    def describe(self) -> str:
        """One line for logs: the summary, the tables and (in ``auto``) the cache."""
        cache = f" cache={self.cache or 'default'}" if self.mode == "auto" else ""
        return f"{self.summary()} tables={':'.join(self.tables) or '-'} strict={int(self.strict)}{cache}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> TuningPolicy:
        """The policy the ``MEGATRON_TUNING_*`` variables of ``environ`` (default: ``os.environ``, read
        now) set, each unset one at its default; ``overrides`` win. Nothing else reads them."""
        environ = os.environ if environ is None else environ
        raw = {k.field: (k, text) for k in KNOBS.values() if (text := environ.get(k.name, "").strip())}
        fields = {field: knob.parse(knob.name, text) for field, (knob, text) in raw.items()}
        _warn_unknown_variables(environ)  # a misspelt name (..._TABLES) would otherwise be ignored silently
        try:
            return cls(**{**fields, **overrides})
        except PolicyError as exc:  # a value the policy refuses: name the variable it came from
            if exc.name not in raw or exc.name in overrides:
                raise
            knob, text = raw[exc.name]
            raise PolicyError(knob.name, text, exc.allowed) from None

    @classmethod
    def from_env_if_asked(cls) -> TuningPolicy:
        """``from_env()``, in mode ``off`` where ``MEGATRON_TUNING_MODE`` is unset: for what runs
        unasked (decoration-time helpers, the ``enable`` switch, a rank's exit)."""
        return cls.from_env() if os.environ.get(ENV_MODE, "").strip() else cls.from_env(mode="off")


def _set(policy: TuningPolicy, name: str, value: Any) -> None:
    object.__setattr__(policy, name, value)


def _sequence(name: str, value: object, allowed: str) -> tuple[Any, ...]:
    """Any sequence as a tuple; one bare string or path is refused, not split into characters."""
    if isinstance(value, (str, bytes, os.PathLike)) or not isinstance(value, Sequence):
        raise PolicyError(name, value, f"a list or tuple of {allowed}; a single one goes in a list")
    return tuple(value)


def _block_sizes(value: object) -> tuple[tuple[str, int], ...]:
    allowed = (
        "{NAME: int} or (NAME, int) pairs with identifier names, each name once, e.g. {'BLOCK_SIZE_M': 64} "
        "(in the environment, comma-separated NAME=INT pairs: BLOCK_SIZE_M=64)"
    )
    items: Any = list(value.items()) if isinstance(value, Mapping) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise PolicyError("block_sizes", value, allowed)
    seen: dict[str, int] = {}
    for item in items:
        ok = isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
        if not ok or not item[0].isidentifier() or type(item[1]) is not int:
            raise PolicyError("block_sizes", value, allowed)
        if item[0] in seen:
            raise PolicyError("block_sizes", value, f"each name once ({item[0]} is given twice)")
        seen[item[0]] = item[1]
    return tuple(sorted(seen.items()))


def _path(name: str, value: object, allowed: str = _A_PATH) -> str:
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str) or not text or "\0" in text:
        raise PolicyError(name, value, allowed)
    return text


def _cache(value: object) -> str | None:
    # Words are settings, never file names: cache=OFF must not create a file "OFF".
    text = _path(
        "cache", value.strip() if isinstance(value, str) else value, "a file path, 'off' (no cache), or None"
    )
    word = text.lower()
    return CACHE_OFF if word in FALSE_WORDS else None if word in TRUE_WORDS else text
