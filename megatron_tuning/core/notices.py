"""Notices: what the user must act on (DESIGN 14), told once per cause through ``warnings``.

A notice is a ``TuningWarning`` issued at the user's frame, once per cause and policy, by rank 0
alone unless the cause is rank-local (other ranks log it at INFO): it reaches stderr with no setup,
and ``-W "error:megatron_tuning"`` or ``warnings.filterwarnings`` filter it. Diagnostics stay in
``logging``. Tallies count what a notice stands for (keys that fell back) until the policy ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Hashable
from typing import Any

PREFIX = "megatron_tuning: "

logger = logging.getLogger(__name__)


class TuningWarning(UserWarning):
    """A notice from megatron_tuning: something to act on (a fallback, a stale entry, a typo)."""


_warned: set[tuple[Any, ...]] = set()
_tallies: dict[tuple[Any, ...], set[Hashable]] = {}
_lock = threading.Lock()


def reset_warnings() -> None:
    """Forget which causes were reported and what was tallied, so a new policy reports again."""
    with _lock:
        _warned.clear()
        _tallies.clear()


def warn_once(cause: tuple[Any, ...], message: str, *args: Any, rank_local: bool = False) -> bool:
    """Issue ``message % args`` as a ``TuningWarning`` the first time ``cause`` is seen; return
    whether it was. Under an ``error`` filter it raises, and the next occurrence raises too.
    ``rank_local``: a cause only the ranks that meet it know of (timing on the host clock: rank 0 may
    have adopted every key), so each of them says it, not rank 0 alone."""
    with _lock:
        if cause in _warned:
            return False
        _warned.add(cause)
    text = message % args if args else message
    if not text.startswith(PREFIX):
        text = PREFIX + text
    if not rank_local and _other_rank():  # once per job, not per rank: ranks meet the same causes
        logger.info("%s", text)
        return True
    try:
        _warn_at_caller(text)
    except BaseException:
        with _lock:
            _warned.discard(cause)
        raise
    return True


def tally(group: tuple[Any, ...], item: Hashable) -> int:
    """Add ``item`` to ``group``'s set for this policy; return how many distinct items it holds."""
    with _lock:
        items = _tallies.setdefault(group, set())
        items.add(item)
        return len(items)


def tallies(kind: str) -> dict[tuple[Any, ...], frozenset[Hashable]]:
    """The groups whose first element is ``kind``, with their items, tallied under this policy."""
    with _lock:
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
        where, line, module = _main_program(), 0, "__main__"
    # No ``module_globals``: asking a module's loader for its source raises ImportError for a
    # script run with ``python -m`` (``__main__``); the source line is read from the file instead.
    warnings.warn_explicit(text, TuningWarning, where, line, module=str(module), registry={})


def _main_program() -> str:
    """The file of the program the interpreter ran. Its ``__file__`` is gone at exit (CPython removes
    it once a script returns, before exit handlers run); the module's loader still knows it."""
    main = sys.modules.get("__main__")
    where = getattr(main, "__file__", None)
    if where is None:
        with contextlib.suppress(AttributeError, ImportError, TypeError):
            where = main.__loader__.get_filename()  # type: ignore[union-attr]
    return os.path.abspath(where) if where else "<string>"  # no file: `python -c`


def _other_rank() -> bool:
    """Whether this process is a rank other than 0 (torch.distributed's, else torchrun's ``RANK``)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return bool(dist.get_rank() != 0)
    return os.environ.get("RANK", "0").strip() not in ("", "0")
