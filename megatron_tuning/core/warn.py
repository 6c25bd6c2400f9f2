"""Warn once per distinct cause, so one broken kernel or table cannot bury a log."""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

_warned: set[tuple[Any, ...]] = set()
_warned_lock = threading.Lock()


def reset_warnings() -> None:
    """Forget which warn-once causes were already reported (for tests and long-lived REPLs)."""
    with _warned_lock:
        _warned.clear()


def warn_once(cause: tuple[Any, ...], message: str, *args: Any) -> bool:
    """Log ``message`` at WARNING the first time ``cause`` is seen; return whether it logged."""
    with _warned_lock:
        if cause in _warned:
            return False
        _warned.add(cause)
    logger.warning(message, *args)
    return True
