"""Typed access to ``MEGATRON_TUNING_*`` environment variables.

Variables are read when a function here is called, never at import, so tests and
launchers can change the environment at any time. A bad value raises ``PolicyError``
naming the variable, the value and what is allowed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence

from .errors import PolicyError

PREFIX = "MEGATRON_TUNING_"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


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


def env_float(name: str) -> float | None:
    value = env_str(name)
    if value is None or value == "":
        return None
    try:
        return float(value)
    except ValueError:
        raise PolicyError(name, value, "a number") from None


def env_list(name: str, sep: str) -> tuple[str, ...] | None:
    """Split on ``sep``, dropping empty items; ``None`` when unset."""
    value = env_str(name)
    if value is None:
        return None
    return tuple(item.strip() for item in value.split(sep) if item.strip())


def env_assignments(name: str) -> tuple[tuple[str, int], ...] | None:
    """Parse ``NAME=INT,NAME=INT`` (block-size overrides); ``None`` when unset."""
    items = env_list(name, ",")
    if items is None:
        return None
    parsed: dict[str, int] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        try:
            if not sep or not key.isidentifier():
                raise ValueError
            parsed[key] = int(raw.strip())
        except ValueError:
            raise PolicyError(
                name, os.environ.get(name), "comma-separated NAME=INT pairs, e.g. BLOCK_SIZE_M=64"
            ) from None
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
