"""Notices: what the user must act on, a ``TuningWarning`` at the user's frame once per cause and
policy, by rank 0 alone unless the cause is rank-local (other ranks log it at INFO); ``-W`` and
``warnings.filterwarnings`` filter it. A cause is rank-local where it follows from what this rank
launched or found: its kernel ids (module names can differ per rank), keys and live configs, its
table lookups, its node's GPUs; rank 0 may meet none of it. Then what choosing says: fallbacks,
unusable entries, numerics, and the policy's end, which counts the keys that fell back (the tallies)."""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Hashable, Sequence
from typing import Any

from .errors import NumericsError, storable_fix

PREFIX = "megatron_tuning: "

logger = logging.getLogger(__name__)


class TuningWarning(UserWarning):
    """A notice from megatron_tuning: something to act on (a fallback, a stale entry, a typo)."""


_warned: set[tuple[Any, ...]] = set()
_tallies: dict[tuple[Any, ...], set[Hashable]] = {}
_lock = threading.Lock()


def reset_warnings() -> None:
    """Forget which causes were reported and what was tallied: a new policy reports again."""
    with _lock:
        _warned.clear()
        _tallies.clear()


def warn_once(cause: tuple[Any, ...], message: str, *args: Any, rank_local: bool = False) -> bool:
    """Issue ``message % args`` as a ``TuningWarning`` the first time ``cause`` is seen; return
    whether it was (under an ``error`` filter it raises, each time). ``rank_local``: a cause only the
    ranks that meet it know of, so each of them says it, not rank 0 alone."""
    with _lock:
        if cause in _warned:
            return False
        _warned.add(cause)
    text = message % args if args else message
    text = text.removeprefix(PREFIX)
    rank = _job_rank() if rank_local else None  # each rank says it: which one, in a job's merged log
    text = (PREFIX if rank is None else f"{PREFIX}rank {rank}: ") + text
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
    with _lock:
        items = _tallies.setdefault(group, set())
        items.add(item)
        return len(items)


def tallies(kind: str) -> dict[tuple[Any, ...], frozenset[Hashable]]:
    with _lock:
        return {group: frozenset(items) for group, items in _tallies.items() if group and group[0] == kind}


def _warn_at_caller(text: str) -> None:
    """``warnings.warn`` at the first frame outside this library, Triton and torch, with a fresh
    registry: ``warn_once`` decides repeats, not Python's per location."""
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
    """The program the interpreter ran: at exit its ``__file__`` is gone, its loader still knows it."""
    main = sys.modules.get("__main__")
    where = getattr(main, "__file__", None)
    if where is None:
        with contextlib.suppress(AttributeError, ImportError, TypeError):
            where = main.__loader__.get_filename()  # type: ignore[union-attr]
    return os.path.abspath(where) if where else "<string>"  # no file: `python -c`


def _other_rank() -> bool:
    rank = _job_rank()
    return rank is not None and rank != "0"


def _job_rank() -> str | None:
    """This process's rank in a job of more than one process (``None``: no such job)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return str(dist.get_rank()) if dist.get_world_size() > 1 else None
    rank, world = os.environ.get("RANK", "").strip(), os.environ.get("WORLD_SIZE", "").strip()
    in_job = rank not in ("", "0") or world not in ("", "0", "1")  # before init_process_group
    return (rank or "0") if in_job else None


# What the cheapest-config rule costs, measured (benchmarks/RESULTS.md).
CHEAPEST_COST = "on an H200 the cheapest-config rule ran large GEMMs at 12-14% of the best config's speed"
FIX_A_MISS = (
    "use MEGATRON_TUNING_MODE=auto (tunes each new key once per job and caches it), a tuning table "
    "(MEGATRON_TUNING_TABLE=...), or build one with `python -m megatron_tuning tune -- <your command>`"
)
# The same advice where ``auto`` already runs but could not measure this key.
FIX_AN_AUTO_MISS = (
    "let auto tune it: launch the key once in eager code, outside CUDA graph capture and not under `audit` "
    "(which never tunes), or build a table with `python -m megatron_tuning tune -- <your command>`"
)


def fix_an_unstorable_miss(problem: str, *, wrong_type: bool = True) -> str:
    """The advice for a kernel whose configs no table can hold (``problem``: which field and why;
    ``wrong_type``: a value's type, not its range): auto, record and tune refuse it, so
    ``FIX_A_MISS`` would send its user into an error."""
    return (
        "first make its configs storable, since auto, record and tune refuse this kernel as it is: "
        f"{problem}; {storable_fix(wrong_type)}, then use MEGATRON_TUNING_MODE=auto or build a table "
        "with `python -m megatron_tuning tune -- <your command>`"
    )


def entry_matches_nothing(kernel: str, key: str, origin: str, entry: str, live: Sequence[str]) -> None:
    offered = "; ".join(live[:8]) + "; ..." * (len(live) > 8)
    message = (
        f"table entry for kernel {kernel} key {key} in {origin} ({entry}) matches none "
        f"of the {len(live)} live configs after pruning, so it is a miss (auto mode re-tunes it and replaces "
        "such an entry in its cache; other modes apply the miss rule). Re-tune the kernel, or fix the "
        f"entry's config to one the kernel offers: {offered}"
    )
    warn_once(("entry-no-match", kernel, key, origin), message, rank_local=True)


def ambiguous_entry(base: str, kernel: str, key: str, origin: str) -> None:
    message = (
        f"Table {origin} has an entry for kernel {base} (key {key}) but several autotuners with different "
        f"config lists wrap that function, so it is now told apart as {kernel} and the others; the entry "
        "cannot say which autotuner it was tuned for and is not used. Re-tune (tune or auto mode) to get "
        "entries under the new ids. Other keys of this kernel are skipped without another warning."
    )
    warn_once(("ambiguous-entry", base, origin), message, rank_local=True)


def override_names(kernel: str, live: Sequence[Any]) -> None:
    """Tally the config names of a kernel launched with an override, for ``report_policy_end``."""
    for name in {name for c in live for name in getattr(c, "kwargs", {})}:
        tally(("kernel-config-names", kernel), name)


def nearest_used(kernel: str, key: str, neighbour: str, origin: str, fix: str) -> None:
    tally(("nearest", kernel), key)
    message = (
        f"kernel {kernel} has no table entry for key {key}; it launches the entry tuned for the nearest "
        f"shape [{neighbour}] from {origin} (on_miss='nearest'), and so will every other key of this kernel "
        f"without an entry (counted when the policy ends). To pin each shape's own best config, {fix}."
    )
    warn_once(("nearest", kernel), message, rank_local=True)


def cheapest_used(
    kernel: str, key: str, reason: str, on_miss: str, config: str, count: int, fix: str
) -> None:
    tally(("cheapest", kernel), key)
    rule = "on_miss='min_cost'" if on_miss == "min_cost" else "no nearest-shape entry either"
    message = (
        f"kernel {kernel} has no tuned config for key {key} ({reason}; {rule}), so it launches the cheapest "
        f"of its {count} configs by static cost ({config}), and so will every other key of "
        "this kernel without an entry (counted when the policy ends). That is pinned but can be slow: "
        f"{CHEAPEST_COST}. To be pinned and fast, {fix}."
    )
    warn_once(("cheapest", kernel), message, rank_local=True)


def cheapest_at_decoration(configs: Sequence[str], chosen: str) -> None:
    message = (
        f"autotune_configs shrank {len(configs)} configs to the cheapest by static cost "
        f"({chosen}) under deterministic mode (at decoration, where no table is read): "
        f"every key of this kernel launches it. That is pinned but can be slow: {CHEAPEST_COST}. To be "
        f"pinned and fast, pass the whole list to @triton.autotune and {FIX_A_MISS}."
    )
    warn_once(("autotune_configs", tuple(configs)), message)


def cannot_measure(kernel: str, key: str) -> None:
    message = (
        f"kernel {kernel} key {key} is first seen where nothing can be measured (compiled code, or a CUDA "
        "graph capture); using the deterministic choice instead of tuning it. Launch this key once eagerly, "
        "outside graph capture, before compiling or capturing, so the tuner can time it"
    )
    warn_once(("tune-cannot-measure", kernel, key), message, rank_local=True)


def check_numerics(numerics: str, kernel: str, key: str, choice: Any, signature: str) -> None:
    """Where the table marks the pinned config non-deterministic on its own: a ``NumericsError``
    under ``numerics='deterministic-only'`` (``auto`` re-tunes such an entry before this), else one
    notice per kernel."""
    if choice.numerics is None or choice.numerics.deterministic:
        return
    others = "; ".join(choice.numerics.alternatives) or "none among the live configs"
    found = (
        f"the numerics audit in {choice.origin} found {signature} non-deterministic "
        "on its own (its launches on the same inputs gave different bits)"
    )
    if numerics == "deterministic-only":
        why = (
            f"the table entry pins its config, and {found}. Re-tune the key (`tune --numerics "
            "deterministic-only`, or MEGATRON_TUNING_MODE=auto, which re-tunes such an entry), or set the "
            f"entry's config to a deterministic alternative the audit found: {others}"
        )
        raise NumericsError(kernel, key, numerics, why, {})
    message = (
        f"kernel {kernel} key {key}: {found}: pinning the config cannot make this kernel bitwise "
        f"reproducible. Deterministic alternatives the audit found: {others}. Re-tune with "
        "MEGATRON_TUNING_NUMERICS=deterministic-only to pin one (docs/numerics.md)."
    )
    warn_once(("nondeterministic", kernel), message, rank_local=True)


def report_policy_end(policy: Any) -> None:
    """At the end of a policy: how many keys fell back, and override names no launched kernel has."""
    fix = FIX_AN_AUTO_MISS if policy is not None and policy.mode == "auto" else FIX_A_MISS
    for kind, what in (("cheapest", "the cheapest config"), ("nearest", "a nearest-shape entry")):
        by_kernel = {group[1]: len(keys) for group, keys in tallies(kind).items()}
        if sum(by_kernel.values()) > len(by_kernel):  # one key per kernel was said by its own notice
            listing = ", ".join(f"{k} ({n} key{'s' * (n > 1)})" for k, n in sorted(by_kernel.items()))
            message = (
                f"{sum(by_kernel.values())} keys of {len(by_kernel)} kernel(s) launched {what} for lack of a "
                f"table entry under this policy: {listing}. To pin them to their best configs, {fix}."
            )
            warn_once(("policy-end", kind), message, rank_local=True)  # this rank's tallies
    kernels = {group[1]: sorted(map(str, names)) for group, names in tallies("kernel-config-names").items()}
    if policy is None or not policy.block_sizes or not kernels:
        return  # no in-scope kernel launched with the override: nothing to compare it with
    everything = sorted({name for names in kernels.values() for name in names})
    for name, value in policy.block_sizes:
        if name not in everything:
            close = difflib.get_close_matches(name, everything, n=1)
            message = (
                f"block-size override {name}={value} (MEGATRON_TUNING_BLOCK_SIZES / block_sizes) names a "
                f"parameter that none of the {len(kernels)} kernel(s) launched under this policy has, so it "
                f"changed nothing.{f' Did you mean {close[0]}?' if close else ''} The kernels' config names: "
                + "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(kernels.items()))
                + "."
            )
            warn_once(("override-name-unused", name), message)
