"""Typed access to ``MEGATRON_TUNING_*`` environment variables.

Variables are read when a function here is called, never at import, so tests and
launchers can change the environment at any time. A bad value raises ``PolicyError``
naming the variable, the value and what is allowed. The rule for every variable
(docs/policy.md): surrounding whitespace is ignored, an empty value means unset (the
default), words and booleans are read in any case.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence

from .errors import PolicyError
from .warn import warn_once

PREFIX = "MEGATRON_TUNING_"

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

# Every variable the package reads, whatever layer reads it: a name outside this list is a typo
# (..._TABLES for ..._TABLE) and gets one warning naming the closest. A test checks
# that each ``MEGATRON_TUNING_*`` name written in the package is listed here.
KNOWN_VARIABLES = frozenset(
    {
        "MEGATRON_TUNING_MODE",
        "MEGATRON_TUNING_SCOPE",
        "MEGATRON_TUNING_ON_MISS",
        "MEGATRON_TUNING_TABLE",
        "MEGATRON_TUNING_AGREEMENT",
        "MEGATRON_TUNING_AGREEMENT_TIMEOUT",
        "MEGATRON_TUNING_STRICT",
        "MEGATRON_TUNING_STALE_ENTRIES",
        "MEGATRON_TUNING_BLOCK_SIZES",
        "MEGATRON_TUNING_RECORD_DIR",
        "MEGATRON_TUNING_DECISION_LOG",
        "MEGATRON_TUNING_SHIPPED_TABLES",
        "MEGATRON_TUNING_CACHE",
        "MEGATRON_TUNING_CACHE_MAX_ENTRIES",
        "MEGATRON_TUNING_TUNE_ROUNDS",
        "MEGATRON_TUNING_TUNE_TIE_BAND",
        "MEGATRON_TUNING_TUNE_DIR",
        "MEGATRON_TUNING_LAUNCHER",  # set by `run`/`tune` for their job (commands/bootstrap.py)
    }
)

# ASCII only, written out: Python's int()/float() also accept "١" (Arabic-Indic one), "1_000",
# "nan", "inf" and "1e400" (inf), none of which belongs in a setting.
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def env_str(name: str) -> str | None:
    """The raw value, or ``None`` when unset. Surrounding whitespace is ignored."""
    value = os.environ.get(name)
    return None if value is None else value.strip()


def env_choice(name: str, choices: Sequence[str]) -> str | None:
    """One of ``choices`` in any case, stored lower-case; ``None`` when unset or empty."""
    value = env_str(name)
    if value is None or value == "":
        return None
    lowered = value.lower()
    if lowered not in choices:
        raise PolicyError(name, value, "one of " + "|".join(choices) + " (any case)")
    return lowered


def env_bool(name: str) -> bool | None:
    """1/0, true/false, yes/no, on/off in any case; ``None`` when unset or empty (the default)."""
    value = env_str(name)
    if value is None or value == "":
        return None
    lowered = value.lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    raise PolicyError(name, value, "a boolean (1/0, true/false, yes/no, on/off; any case)")


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """``MEGATRON_TUNING_*`` names set that the package does not read, each with the closest known one."""
    names = sorted(n for n in (os.environ if environ is None else environ) if n.startswith(PREFIX))
    # Compared without the shared prefix, which would make every name look close to every other.
    known = sorted(name[len(PREFIX) :] for name in KNOWN_VARIABLES)
    out = []
    for name in names:
        if name in KNOWN_VARIABLES:
            continue
        close = difflib.get_close_matches(name[len(PREFIX) :], known, n=1, cutoff=0.6)
        out.append((name, PREFIX + close[0] if close else None))
    return out


def warn_unknown_variables() -> None:
    """One notice per unknown ``MEGATRON_TUNING_*`` name: it is ignored, so it is most likely a typo."""
    for name, close in unknown_variables():
        hint = f"Did you mean {close}?" if close else "Known variables: " + ", ".join(sorted(KNOWN_VARIABLES))
        warn_once(
            ("unknown-env", name),
            "%s is set but is not a megatron_tuning setting, so it is ignored. %s (docs/policy.md)",
            name,
            hint,
        )


def env_float(name: str, *, minimum: float | None = None, maximum: float | None = None) -> float | None:
    """A finite decimal number (ASCII digits; no nan, inf or overflow), within the bounds given."""
    value = env_str(name)
    if value is None or value == "":
        return None
    allowed = "a finite decimal number" + _bounds_text(minimum, maximum)
    if not _FLOAT.fullmatch(value):
        raise PolicyError(name, value, allowed)
    number = float(value)
    if not math.isfinite(number) or not _within(number, minimum, maximum):
        raise PolicyError(name, value, allowed)
    return number


def env_int(name: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
    """An integer written in ASCII digits, within the bounds given."""
    value = env_str(name)
    if value is None or value == "":
        return None
    allowed = "an integer (ASCII digits)" + _bounds_text(minimum, maximum)
    if not _INT.fullmatch(value) or not _within(int(value), minimum, maximum):
        raise PolicyError(name, value, allowed)
    return int(value)


def parse_int(text: str) -> int | None:
    """``text`` as an integer if it is ASCII digits with an optional sign, else ``None``."""
    stripped = text.strip()
    return int(stripped) if _INT.fullmatch(stripped) else None


def _within(number: float, minimum: float | None, maximum: float | None) -> bool:
    return (minimum is None or number >= minimum) and (maximum is None or number <= maximum)


def _bounds_text(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" from {minimum:g} to {maximum:g}"
    if minimum is not None:
        return f" >= {minimum:g}"
    return f" <= {maximum:g}" if maximum is not None else ""


def is_module_prefix(text: str) -> bool:
    """Whether ``text`` could name a module: dot-separated Python identifiers (``pkg.kernels``)."""
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def env_module_prefixes(name: str) -> tuple[str, ...] | None:
    """Comma-separated module prefixes (``pkg.kernels,other``); anything else is refused, not ignored."""
    items = env_list(name, ",")
    if items is None:
        return None
    bad = [item for item in items if not is_module_prefix(item)]
    if bad:
        raise PolicyError(
            name,
            env_str(name),
            f"comma-separated module names such as my_pkg.kernels ({', '.join(map(repr, bad))} "
            "cannot name a module, so it would pin nothing)",
        )
    return items


def env_list(name: str, sep: str) -> tuple[str, ...] | None:
    """Split on ``sep``, dropping empty items; ``None`` when unset."""
    value = env_str(name)
    if value is None:
        return None
    return tuple(item.strip() for item in value.split(sep) if item.strip())


def env_assignments(name: str) -> tuple[tuple[str, int], ...] | None:
    """Parse ``NAME=INT,NAME=INT`` (block-size overrides); ``None`` when unset.

    Names are identifiers, values ASCII integers, and each name appears once: a repeated name
    would otherwise silently keep its last value.
    """
    items = env_list(name, ",")
    if items is None:
        return None
    parsed: dict[str, int] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        number = parse_int(raw)
        if not sep or not key.isidentifier() or number is None:
            raise PolicyError(
                name, os.environ.get(name), "comma-separated NAME=INT pairs, e.g. BLOCK_SIZE_M=64"
            )
        if key in parsed:
            raise PolicyError(name, os.environ.get(name), f"each name once ({key} is given twice)")
        parsed[key] = number
    return tuple(sorted(parsed.items()))


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or with ``None`` unset) variables for the duration of the block, then restore."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
