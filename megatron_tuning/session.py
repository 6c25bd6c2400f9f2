"""``init_deterministic_tuning``: wires policy, tables, interception and agreement together."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from .core.choice import warn_if_mamba_env_ignored
from .core.decisions import decision_log, get_decisions, print_decision
from .core.errors import (
    EXIT_DIVERGENCE,
    DivergenceError,
    InputMismatchError,
    MegatronTuningError,
    PolicyError,
)
from .core.identity import arch_tag, current_rank, group_exists, node_arch
from .core.notices import warn_once
from .core.policy import ENV_DECISION_LOG, ENV_RECORD_DIR, TuningPolicy
from .runtime import interception
from .runtime.pinning import Measure
from .tables.cache import open_cache
from .tables.files import output_file_problem, output_folder_problem
from .tables.records import write_decisions, write_recording
from .tables.search import TableSet
from .tuning.audit import with_numerics
from .tuning.tuner import make_measure

logger = logging.getLogger(__name__)

_active_lock = threading.Lock()
_active: TuningHandle | None = None
_initializing = threading.local()
exit_hooks: list[Callable[[], None]] = []
"""Run by ``close_at_exit`` after the close, before the exit status is fixed: a launcher's report."""


class TuningHandle:
    """The running tuning session. ``close()`` (or leaving ``with``) restores Triton."""

    def __init__(self, policy: TuningPolicy, table: Any, agreement: Any, cache: Any = None) -> None:
        self.policy = policy
        self.table = table
        self.cache = cache  # auto mode's tables.cache.AutoCache
        self._agreement = agreement
        self._late: Any = None  # a distributed.attach.LateAttach while waiting for a process group
        self._closed = False
        if cache is not None:  # kill-safe: each key this rank measures reaches the file at once
            decision_log().add_listener(cache.on_decision)

    @property
    def closed(self) -> bool:
        return self._closed

    def persist(self) -> int:
        """Write the decisions ``auto`` tuned or adopted so far to the cache table; return how many.
        ``close()`` does this too; call it at a checkpoint to bound what a crash can lose."""
        return self.cache.persist(get_decisions()) if self.cache is not None else 0

    def close(self) -> None:
        """Stop agreement checks, write requested outputs, and uninstall the interception."""
        self._close(final_check=True)

    def _close(self, *, final_check: bool) -> None:
        global _active
        if self._closed:
            return
        self._closed = True
        try:
            if self._late is not None:  # attaches now if the group exists: the checks below cover it
                self._late.finish()
                self._agreement = self._late.agreement or self._agreement
            if self._agreement is not None:
                self._agreement.stop(final_check=final_check)
            self.persist()
            if self.cache is not None:
                decision_log().remove_listener(self.cache.on_decision)
            decision_log().remove_listener(print_decision)
            policy = self.policy
            if policy.mode in ("record", "tune") and policy.record_dir:
                write_recording(None, policy.record_dir, current_rank())
            elif policy.mode in ("record", "tune"):
                message = "mode %s without a record_dir (%s): measured winners are only in the decision log"
                warn_once(("no-record-dir", policy.mode), message, policy.mode, ENV_RECORD_DIR)
            if policy.decision_log:
                path = decision_log_path(policy.decision_log)
                write_decisions(path)
                logger.info("decision log written to %s", path)
        finally:
            with _active_lock:
                if _active is self:
                    _active = None
            interception.uninstall()

    def __enter__(self) -> TuningHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decision_log_path(template: str) -> str:
    """The decision log file of this process: ``{rank}`` and ``{pid}`` replaced."""
    return template.replace("{rank}", str(current_rank())).replace("{pid}", str(os.getpid()))


def init_deterministic_tuning(
    policy: TuningPolicy | None = None,
    *,
    table: Any = None,
    group: Any = None,
    measure: Measure | None = None,
) -> TuningHandle:
    """Install deterministic tuning for this process; calling it again replaces the previous session.

    Call it after ``init_process_group`` when you can; called before, it attaches to the default group
    at the first new (kernel, key) launched once the group exists, at ``verify_agreement()`` or at
    close, whichever comes first, and checks the earlier decisions.
    ``policy`` defaults to ``TuningPolicy.from_env()``. ``table`` overrides the policy's tables (a
    ``ConfigTable`` or ``{(kernel, key): config}``; ``auto`` still writes its cache). ``group``: the
    process group of the checks and chaos (default: world). ``measure``: what ``tune`` and ``auto``
    time a key's candidates with (default: ``tuning.tuner.make_measure``'s noise-aware tuner).
    """
    _initializing.depth = getattr(_initializing, "depth", 0) + 1
    try:
        return _init(policy, table, group, measure)
    finally:
        _initializing.depth -= 1


def initializing() -> bool:
    """Whether ``init_deterministic_tuning`` is running in this thread: an armed process whose
    ``import triton`` happens inside the job's own call must not start a second session there."""
    return getattr(_initializing, "depth", 0) > 0


def _init(policy: TuningPolicy | None, table: Any, group: Any, measure: Measure | None) -> TuningHandle:
    global _active
    policy = policy if policy is not None else TuningPolicy.from_env()
    check_output_paths(policy)  # outputs are written at close: a bad path must fail now, not then
    warn_if_mamba_env_ignored(policy)
    if policy.mode == "auto" and not group_exists() and _launcher_world_size() > 1:  # else: at the attach
        from .distributed.store import check_auto_world

        check_auto_world(_launcher_world_size())
    with _active_lock:
        previous = _active
    if previous is not None:
        from .distributed.agreement import CLOSE_CHECKED, checked_mode

        # A re-init runs no check at close of its own (the new session's, or verify_agreement, covers the
        # log): a rank that re-inits more often must not pair that check with the others' calls. Only a
        # verify session replaced by one that runs none at close does, as its per-key checks are none.
        final = (
            checked_mode(previous.policy, group) == "verify"
            and checked_mode(policy, group) not in CLOSE_CHECKED
        )
        previous._close(final_check=final)
    cache = open_cache(policy, _cache_arch) if policy.mode == "auto" else None
    consensus: Any = None  # a distributed.store.StoreConsensus: pinning's Consensus
    chaos = None
    # record and tune measure (tune same-class keeps its table's bits); off passes through
    resolved_table = table
    pins = policy.mode in ("deterministic", "chaos", "auto")
    if table is None and (pins or (policy.mode, policy.numerics) == ("tune", "same-class")):
        resolved_table = TableSet.from_policy(policy, cache=(cache.path, cache.table) if cache else None)
    if policy.mode not in ("tune", "auto"):
        measure = None
    elif measure is None:
        measure = make_measure(policy)
    if measure is not None and policy.numerics != "any":  # audit first, time only the allowed configs
        measure = with_numerics(measure, policy.numerics, resolved_table, policy.audit_runs)
    if policy.mode in ("auto", "chaos"):
        from .distributed import store

        consensus = store.start_consensus() if policy.mode == "auto" else None
        chaos = store.StoreChaos(group) if policy.mode == "chaos" else None
    interception.install(policy, table=resolved_table, measure=measure, consensus=consensus, chaos=chaos)
    try:
        if policy.print_decisions:  # before the check's listener: the line comes before its error
            decision_log().add_listener(print_decision)
        from .distributed.agreement import describe_inputs, start_agreement

        # Tables and versions are compared once here, so a rank with other tables fails at init.
        agreement = start_agreement(policy, group, inputs=describe_inputs(policy, resolved_table))
    except BaseException:
        decision_log().remove_listener(print_decision)
        interception.uninstall()
        raise
    handle = TuningHandle(policy, resolved_table, agreement, cache)
    if not group_exists():  # what crosses ranks (inputs, checks, auto's consensus) waits for the group
        from .distributed.attach import LateAttach

        handle._late = LateAttach(policy, resolved_table, group, _launcher_world_size())
    with _active_lock:
        _active = handle
    files = getattr(resolved_table, "files", None)
    listed = f" table files: {', '.join(files) or '(none yet)'}" if files is not None else ""
    logger.info("megatron_tuning: %s (rank %d)%s", policy.describe(), current_rank(), listed)
    return handle


def check_output_paths(policy: TuningPolicy) -> None:
    """Raise ``PolicyError`` when an output the policy names could not be written at close."""
    path = decision_log_path(policy.decision_log) if policy.decision_log else ""
    if path and (problem := output_file_problem(path)):
        name, allowed = f"decision_log ({ENV_DECISION_LOG})", f"a writable file ({path} {problem})"
        raise PolicyError(name, policy.decision_log, allowed)
    measuring = policy.mode in ("record", "tune") and policy.record_dir
    if measuring and (problem := output_folder_problem(policy.record_dir or "")):
        name, allowed = f"record_dir ({ENV_RECORD_DIR})", f"a folder files can be written to ({problem})"
        raise PolicyError(name, policy.record_dir, allowed)


def _cache_arch() -> str:
    """The arch of the default cache folder, read at init without the current device (a rank may
    install before ``torch.cuda.set_device``)."""
    arch = node_arch()
    if arch is not None:
        return arch
    current = arch_tag()
    warn_once(
        ("cache-arch-mixed",),
        "megatron_tuning: this node's GPUs are of more than one arch, so auto mode's default cache "
        "folder is the current device's (%s) at init_deterministic_tuning. A rank that launches on a "
        "device of another arch misses that cache and persists its entries there: call "
        "init_deterministic_tuning after torch.cuda.set_device(local_rank), or name a cache file per "
        "arch with MEGATRON_TUNING_CACHE.",
        current,
        rank_local=True,  # this node's GPUs: rank 0's node may hold one arch
    )
    return current


def _launcher_world_size() -> int:
    """The job's size before its process group exists, as torchrun tells it (``WORLD_SIZE``), else 1."""
    raw = os.environ.get("WORLD_SIZE", "").strip()
    return int(raw) if raw.isdigit() else 1


@atexit.register
def close_at_exit(*, join: bool = False) -> None:
    """Close the session. A divergence or input mismatch the process died of, or that the check at
    close found, makes it exit ``EXIT_DIVERGENCE``; any other error closing it, 1. Either skips later
    exit handlers (Python's status is fixed by then). ``join``: the bootstrap's call for an armed
    process that never imported Triton (so started no session): where its session would run a check
    at close, it joins the other ranks' one with an empty log, so theirs does not time out."""
    error = getattr(sys, "last_value", None)  # what the process died of, if anything
    failed = False
    handle = _active
    try:
        if join:
            from .distributed.agreement import CLOSE_CHECKED, checked_mode
            from .distributed.verify import verify_at_close

            policy = TuningPolicy.from_env_if_asked()
            mode = checked_mode(policy)
            if mode in CLOSE_CHECKED:
                verify_at_close(None, policy.agreement_timeout_s, rows=mode == "verify")
        elif handle is not None and not handle.closed:
            handle.close()
    except Exception as exc:  # told once: never a traceback storm at a clean interpreter exit
        failed = isinstance(exc, MegatronTuningError)
        error = exc if failed else error
        logger.debug("megatron_tuning: closing at exit failed", exc_info=True)
        what = "the tuning session's checks at exit" if failed else "closing the tuning session at exit"
        with contextlib.suppress(Warning):  # an error filter: the exit status below still tells
            warn_once(("exit",), f"{what} failed: %s", exc, rank_local=True)
    for hook in exit_hooks:
        with contextlib.suppress(Exception):  # the exit status still says what went wrong
            hook()
    agreement_error = isinstance(error, (DivergenceError, InputMismatchError))
    if agreement_error or failed:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_DIVERGENCE if agreement_error else 1)
