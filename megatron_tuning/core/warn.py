"""What the user sees: notices (``warnings``, once per cause) and diagnostics (``logging``).

A notice (a fallback, a stale entry, a misspelt setting) is a ``TuningWarning`` from ``warn_once``,
once per job (rank 0's; other ranks log it at INFO) and attributed to the user's frame, so it reaches
stderr and ``-W "error:megatron_tuning"`` filters it.
Diagnostics go to stderr (``install_default_handler``) only while the application configures none.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Hashable
from typing import Any

PREFIX = "megatron_tuning: "


class TuningWarning(UserWarning):
    """A notice from megatron_tuning: something to act on (a fallback, a stale entry, a typo)."""


_warned: set[tuple[Any, ...]] = set()
_tallies: dict[tuple[Any, ...], set[Hashable]] = {}
_warned_lock = threading.Lock()


def reset_warnings() -> None:
    """Forget which causes were reported and what was tallied, so a new policy reports again."""
    with _warned_lock:
        _warned.clear()
        _tallies.clear()


def warn_once(cause: tuple[Any, ...], message: str, *args: Any) -> bool:
    """Issue ``message % args`` as a ``TuningWarning`` the first time ``cause`` is seen; return
    whether it was. Under an ``error`` filter it raises, and the next occurrence raises too."""
    with _warned_lock:
        if cause in _warned:
            return False
        _warned.add(cause)
    text = message % args if args else message
    if not text.startswith(PREFIX):
        text = PREFIX + text
    if _other_rank():  # once per job, not per rank: ranks of one job meet the same causes
        logging.getLogger(__name__).info("%s", text)
        return True
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


def _warn_at_caller(text: str) -> None:
    """``warnings.warn`` attributed to the first frame outside this library, Triton and torch, with
    a fresh registry: ``warn_once`` decides repeats (reset per policy), not Python's per location."""
    paths = (getattr(sys.modules.get(n), "__file__", None) for n in ("megatron_tuning", "triton", "torch"))
    # Also skipped: the stdlib's frozen modules and the launch code interception generates.
    internal = tuple(os.path.dirname(os.path.abspath(p)) + os.sep for p in paths if p)
    internal += ("<frozen ", "<megatron_tuning ")
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(internal):
        frame = frame.f_back
    where, line, module = frame.f_code.co_filename, frame.f_lineno, frame.f_globals.get("__name__")
    if where.startswith(internal):  # no frame of the user's runs (at exit): name their program
        where, line, module = getattr(sys.modules.get("__main__"), "__file__", None) or where, 0, "__main__"
    # No ``module_globals``: asking a module's loader for its source raises ImportError for a
    # script run with ``python -m`` (``__main__``); the source line is read from the file instead.
    warnings.warn_explicit(text, TuningWarning, where, line, module=str(module), registry={})


def _other_rank() -> bool:
    """Whether this process is a rank other than 0 (torch.distributed's, else torchrun's ``RANK``)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return bool(dist.get_rank() != 0)
    return os.environ.get("RANK", "0").strip() not in ("", "0")


class _StderrUnlessConfigured(logging.Handler):
    """Writes the package's log records to stderr while no other handler would receive them."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr  # looked up now: tests and launchers replace sys.stderr
        if stream is None or _configured_elsewhere(record.name):
            return  # no stderr, or the application's handlers get the record (propagation)
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


def install_default_handler(package_logger: logging.Logger) -> None:
    """Attach the stderr-unless-configured handler to ``package_logger`` once (re-imports must not stack)."""
    if not any(isinstance(h, _StderrUnlessConfigured) for h in package_logger.handlers):
        handler = _StderrUnlessConfigured()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped: keys and notes come from files others
    wrote, and a raw ``\\r``, ANSI sequence or bidi override could rewrite what a reviewer sees."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(ord(c)) for c in text)


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
