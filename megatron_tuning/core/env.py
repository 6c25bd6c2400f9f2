"""Typed access to ``MEGATRON_TUNING_*`` environment variables.

Variables are read when a function here is called, never at import, so tests and
launchers can change the environment at any time. A bad value raises ``PolicyError``
naming the variable, the value and what is allowed.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence

from .errors import PolicyError

PREFIX = "MEGATRON_TUNING_"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")

# ASCII only, written out: Python's int()/float() also accept "١" (Arabic-Indic one), "1_000",
# "nan", "inf" and "1e400" (inf), none of which belongs in a setting.
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def env_str(name: str) -> str | None:
    """The raw value, or ``None`` when unset. Surrounding whitespace is ignored."""
    value = os.environ.get(name)
    return None if value is None else value.strip()


def env_choice(name: str, choices: Sequence[str]) -> str | None:
    value = env_str(name)
    if value is None or value == "":
        return None
    lowered = value.lower()
    if lowered not in choices:
        raise PolicyError(name, value, "one of " + "|".join(choices))
    return lowered


def env_bool(name: str) -> bool | None:
    value = env_str(name)
    if value is None:
        return None
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise PolicyError(name, value, "a boolean (1/0, true/false, yes/no, on/off)")


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
