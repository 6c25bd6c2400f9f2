"""What the user sees: notices (``warnings``, once per cause) and diagnostics (``logging``).

Two channels, on purpose:

* A **notice** is something the user must act on to get what they asked for: a kernel launched
  the cheapest config because no table has its shape, a stale or unusable table entry, timing
  with the host clock, a misspelt setting. ``warn_once`` issues it as a ``TuningWarning``
  through Python's ``warnings`` machinery, once per cause, so it reaches stderr by default
  in any program, and users filter it with the standard tools: ``warnings.filterwarnings`` or
  pytest's ``filterwarnings`` by category, ``-W``/``PYTHONWARNINGS`` by the message prefix
  (``-W "error:megatron_tuning"`` makes notices fatal in CI; Python parses ``-W`` before any
  package can be imported, so a category option naming ours is ignored there), and
  ``logging.captureWarnings(True)`` routes them into logging. The warning is attributed to the
  first frame outside this library, Triton and torch, so it points at the user's launch.
* A **diagnostic** (one line per decision, tables loaded, a lock wait) stays in ``logging``
  under the ``megatron_tuning`` logger. ``default_handler()`` prints those records on stderr
  only while the application has configured no logging handler of its own (the role Python's
  ``logging.lastResort`` plays, which the usual library ``NullHandler`` would disable), so
  ``logging.getLogger("megatron_tuning").setLevel(logging.INFO)`` alone shows INFO lines, and
  an application's ``logging.basicConfig``/``dictConfig`` takes over completely.

Every notice is counted per policy (``tally``), so the end of a policy can say how many keys a
cause covered; ``reset_warnings`` (called by ``interception.install`` for every new policy) lets
a new policy report again.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Hashable
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "megatron_tuning: "
"""Every notice starts with this, so ``-W "ignore:megatron_tuning"`` (or ``error:``) filters them
by message, which works on the command line where a category of ours cannot be named."""


class TuningWarning(UserWarning):
    """A notice from megatron_tuning: something to act on (a fallback, a stale entry, a typo).

    Shown once per cause and policy. Filter it like any warning, e.g.
    ``warnings.filterwarnings("ignore", category=megatron_tuning.TuningWarning)`` in code, or
    ``python -W "error:megatron_tuning"`` (fail on any notice) on the command line.
    """


_warned: set[tuple[Any, ...]] = set()
_tallies: dict[tuple[Any, ...], set[Hashable]] = {}
_warned_lock = threading.Lock()


def reset_warnings() -> None:
    """Forget which causes were reported and what was tallied, so a new policy reports again.

    ``interception.install`` calls it for every new policy; tests and long-lived REPLs may too.
    """
    with _warned_lock:
        _warned.clear()
        _tallies.clear()


def warn_once(cause: tuple[Any, ...], message: str, *args: Any) -> bool:
    """Issue ``message % args`` as a ``TuningWarning`` the first time ``cause`` is seen.

    Returns whether it was issued. The message should name the kernel, key or file, and the fix.
    Under an ``error`` filter the warning raises, and the cause stays unreported so the next
    occurrence raises too.
    """
    with _warned_lock:
        if cause in _warned:
            return False
        _warned.add(cause)
    text = message % args if args else message
    if not text.startswith(PREFIX):
        text = PREFIX + text
    try:
        _warn_at_caller(text)
    except BaseException:
        with _warned_lock:
            _warned.discard(cause)
        raise
    return True


def tally(group: tuple[Any, ...], item: Hashable) -> int:
    """Add ``item`` to ``group``'s set for this policy; return how many distinct items it holds."""
    with _warned_lock:
        items = _tallies.setdefault(group, set())
        items.add(item)
        return len(items)


def tallies(kind: str) -> dict[tuple[Any, ...], frozenset[Hashable]]:
    """The groups whose first element is ``kind``, with their items, tallied under this policy."""
    with _warned_lock:
        return {group: frozenset(items) for group, items in _tallies.items() if group and group[0] == kind}


def _internal_prefixes() -> tuple[str, ...]:
    prefixes = []
    for name in ("megatron_tuning", "triton", "torch"):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            prefixes.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(prefixes)


def _warn_at_caller(text: str) -> None:
    """``warnings.warn`` attributed to the first frame outside this library, Triton and torch.

    ``warn_explicit`` with a fresh registry: which causes were reported is ``warn_once``'s job
    (reset per policy), so Python's per-location registry must not swallow a repeat after a reset.
    """
    internal = _internal_prefixes()
    frame = sys._getframe(2)
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(internal) or frame.f_code.co_filename.startswith("<frozen ")
    ):
        frame = frame.f_back
    # No ``module_globals``: asking a module's loader for its source raises ImportError for a
    # script run with ``python -m`` (``__main__``); the source line is read from the file instead.
    warnings.warn_explicit(
        text,
        TuningWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=str(frame.f_globals.get("__name__", "<unknown>")),
        registry={},
    )


# --------------------------------------------------------------------------- diagnostics


class _StderrUnlessConfigured(logging.Handler):
    """Writes the package's log records to stderr while no other handler would receive them."""

    def emit(self, record: logging.LogRecord) -> None:
        if _configured_elsewhere(record.name):
            return  # the application's handlers get the record through propagation
        stream = sys.stderr  # looked up now: tests and launchers replace sys.stderr
        if stream is None:
            return
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def _configured_elsewhere(name: str) -> bool:
    """Whether a handler other than ours sits on ``name``'s logger or an ancestor it propagates to."""
    current: logging.Logger | None = logging.getLogger(name)
    while current is not None:
        if any(not isinstance(h, _StderrUnlessConfigured) for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent  # type: ignore[assignment]
    return False


def default_handler() -> logging.Handler:
    """The handler the package logger carries instead of a ``NullHandler`` (see the module doc)."""
    handler = _StderrUnlessConfigured()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    return handler


def install_default_handler(package_logger: logging.Logger) -> None:
    """Attach ``default_handler()`` to ``package_logger`` once (re-imports must not stack them)."""
    if not any(isinstance(h, _StderrUnlessConfigured) for h in package_logger.handlers):
        package_logger.addHandler(default_handler())


def printable(text: str) -> str:
    """``text`` with every non-printable character written as an escape.

    Keys, kernel ids and notes come from files other people wrote: printed raw, a ``\\r``, an ANSI
    sequence or a bidi override could rewrite what a reviewer sees. JSON output stays exact.
    """
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ord(ch)) for ch in text)


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


__all__ = [
    "PREFIX",
    "printable",
    "TuningWarning",
    "default_handler",
    "install_default_handler",
    "reset_warnings",
    "tallies",
    "tally",
    "warn_once",
]
