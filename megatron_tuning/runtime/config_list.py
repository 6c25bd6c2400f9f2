"""What an in-scope kernel's config list is checked for once, at its first launch under a policy:
its digest (configs that sign alike must launch alike), the keywords its configs set (a call may not
pass them), whether a table could hold its configs (a mode that stores them refuses it before
measuring) and its listing, which ranks compare (``distributed.store.config_list_row``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import UnstorableConfigError
from ..core.identity import config_data, config_list_digest, config_signature
from ..tables.entry import Invalid, InvalidType, check_config

STORING_MODES = ("auto", "record", "tune")  # they store or share the configs they decide

# Each in-scope config list's configs, by its digest. Sorted, as the digest ignores their order.
_listings: dict[str, str] = {}


@dataclass(frozen=True)
class ConfigList:
    digest: str
    keywords: frozenset[str]  # what any config sets (``Config.all_kwargs()``): a call passing one is refused
    storing_problem: str | None  # why no table could hold one of the configs; ``None``: all fit
    storing_wrong_type: bool  # that problem is a value's type, not its range


def examine(autotuner: Any, kernel: str, mode: str) -> ConfigList:
    """``autotuner``'s config list checked; raises ``AmbiguousConfigError`` (from the digest) or, in a
    mode that would store one of its configs and no table could, ``UnstorableConfigError``."""
    digest = config_list_digest(autotuner)
    if digest not in _listings:
        _listings[digest] = "; ".join(sorted({config_signature(config) for config in autotuner.configs}))
    problem, wrong_type = _storing_problem(autotuner)
    if problem and _would_store(mode, autotuner):
        raise UnstorableConfigError(kernel, mode, problem, wrong_type)
    keywords = frozenset(name for config in autotuner.configs for name in config.all_kwargs())
    return ConfigList(digest, keywords, problem, wrong_type)


def config_listing(digest: str) -> str | None:
    """The signatures of the configs of the list with ``digest``, ``"; "``-joined; ``None`` if unseen."""
    return _listings.get(digest)


def _would_store(mode: str, autotuner: Any) -> bool:
    """Whether ``mode`` could store or share one of ``autotuner``'s configs: ``auto`` and ``tune``
    only measure among several (the only config launches as it is, source ``single``); ``record``
    logs Triton's pick even of one, and its recording keeps it."""
    return mode in STORING_MODES and (mode == "record" or len(autotuner.configs) > 1)


def _storing_problem(autotuner: Any) -> tuple[str | None, bool]:
    """Why a table could not hold one of ``autotuner``'s configs (``None``: it could hold them all),
    and whether a value's type is why."""
    for config in autotuner.configs:
        try:
            check_config(config_data(config))
        except Invalid as exc:
            return str(exc), isinstance(exc, InvalidType)
    return None, False
