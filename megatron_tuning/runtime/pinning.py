"""Decisions: which config an in-scope kernel launches for a key, in every mode, once per process.

Holds the active ``Installation`` and each autotuner's state; ``interception`` (eager) and ``inductor``
(compiled) decide here. ``auto``: a table entry pins the key; else a decision another rank published is
adopted; else this rank tunes and publishes (first writer wins). A hit in this node's own ``auto`` cache
is proposed to the job the same way, so per-node caches never split ranks.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core import choice as rules
from ..core.chaos import ChaosCoordinator, choose_chaos
from ..core.choice import Choice, ConfigTable, choose_deterministically, choose_on_miss, pin_without_fallback
from ..core.decisions import Decision, decision_log
from ..core.errors import ConsensusError
from ..core.identity import (
    arch_tag,
    config_data,
    config_list_digest,
    config_signature,
    current_rank,
    kernel_id,
    kernel_module,
    kernel_source_hash,
    tuning_key,
)
from ..core.notices import warn_once
from ..core.policy import TuningPolicy

logger = logging.getLogger("megatron_tuning.runtime.interception")
progress = logging.getLogger("megatron_tuning.tuning.tuner.progress")

Measure = Callable[[Any, list[Any], tuple[Any, ...], dict[str, Any], str, str], tuple[Any, dict[str, Any]]]

STATE_ATTR = "_megatron_tuning_state"
PINNED_ATTR = "_megatron_tuning_pinned_config"  # on compiled code's one-config copies: their config
SERVES_ATTR = "_megatron_tuning_serves"  # on every ``run`` the interception generates: its installation


class PublishedDecision(Protocol):
    config: Mapping[str, Any]
    signature: str
    rank: int
    timings: dict[str, Any] | None


class Consensus(Protocol):
    """What ``auto`` needs from the job: ``distributed.store.StoreConsensus`` implements it."""

    rank: int

    def is_local(self, origin: str | None) -> bool: ...

    def lookup(self, kernel: str, key: str, arch: str) -> PublishedDecision | None: ...

    def publish(
        self, kernel: str, key: str, arch: str, config: Mapping[str, Any], signature: str, timings: Any = None
    ) -> PublishedDecision: ...


class Deferred(Exception):
    """``decide(defer=True)``: ``auto`` must measure this key, later (``inductor``). Nothing was logged."""


@dataclass(frozen=True)
class Installation:
    """What ``interception.install`` was given; a new one (new policy or table) starts afresh."""

    policy: TuningPolicy
    table: ConfigTable | None
    measure: Measure | None
    generation: int
    consensus: Consensus | None = None
    chaos: ChaosCoordinator | None = None  # job-wide (``distributed.store``); ``None``: the rank formula

    @property
    def arch(self) -> str:
        """The current device's arch, read per decision, never at install: a rank may install before
        ``torch.cuda.set_device(local_rank)``, and reading then would touch GPU 0."""
        return arch_tag()


@dataclass
class AutotunerState:
    """One autotuner's decisions under one installation generation."""

    generation: int
    in_scope: bool
    kernel: str
    key_index: tuple[tuple[str, int], ...]  # (name, parameter position) of each ``key=`` argument
    arg_names: tuple[str, ...]
    pins: dict[tuple[Any, ...], Any] = field(default_factory=dict)  # ``raw_key`` -> its one config
    lock: threading.Lock = field(default_factory=threading.Lock)
    source_hash: str | None = None
    config_list_digest: str | None = None


active: Installation | None = None  # read at every launch; changed only through ``set_active``
_touched: weakref.WeakSet[Any] = weakref.WeakSet()  # autotuners given a state (under _active_lock)
# At each new (kernel, key) decision, never on a hit; may return a replacement installation, which
# becomes the active one (``session._LateAttach``, waiting for a process group).
before_decision: list[Callable[[Installation], Installation]] = []
# At each new decision, before its first launch (the ``audit`` command): (autotuner, live candidates,
# ``(args, kwargs)`` or ``None`` where nothing may launch, kernel, key, choice).
after_decision: list[Callable[[Any, list[Any], Any, str, str, Choice], None]] = []
_active_lock = threading.Lock()
_ANY: Any = object()


def set_active(installation: Installation | None, *, replacing: Any = _ANY) -> bool:
    """Make ``installation`` the active one; with ``replacing``, only if that one still is."""
    global active
    with _active_lock:
        if replacing is not _ANY and active is not replacing:
            return False
        active = installation
    return True


def touched() -> list[Any]:
    """The autotuners that were given a state, so ``uninstall`` can clear them."""
    with _active_lock:
        return list(_touched)


def installed() -> bool:
    return active is not None


def current_policy() -> TuningPolicy | None:
    installation = active
    return None if installation is None else installation.policy


def serving(run: Any) -> Installation | None:
    """The installation an instance ``run`` the interception generated serves; ``None`` for any other
    (read from the function's own ``__dict__``: a user's mock answers every attribute)."""
    return run.__dict__.get(SERVES_ATTR) if isinstance(run, types.FunctionType) else None


def mark_pinned(autotuner: Any, config: Any) -> None:
    """Make ``autotuner`` a compiled graph's one-config copy that launches ``config``. A ``copy.copy``
    carries the original's state and instance ``run``: both go, so the copy launches its own pin."""
    autotuner.__dict__[PINNED_ATTR] = config
    autotuner.__dict__.pop(STATE_ATTR, None)
    if serving(autotuner.__dict__.get("run")) is not None:
        del autotuner.__dict__["run"]


def state_for(autotuner: Any, installation: Installation) -> AutotunerState:
    """``autotuner``'s state under ``installation``, made at its first launch under it; kept only while
    ``installation`` is active, so a launch racing ``install``/``uninstall`` cannot outlive it."""
    state = autotuner.__dict__.get(STATE_ATTR)
    if state is not None and state.generation == installation.generation:
        return state
    arg_names = list(autotuner.arg_names)
    kernel = kernel_id(autotuner)
    new = AutotunerState(
        generation=installation.generation,
        in_scope=installation.policy.in_scope(kernel_module(autotuner)),
        kernel=kernel,
        key_index=tuple((name, arg_names.index(name)) for name in autotuner.keys if name in arg_names),
        arg_names=tuple(arg_names),
        config_list_digest=config_list_digest(autotuner),
    )
    with _active_lock:  # ordered with set_active, and a WeakSet is not iterated while it grows
        if installation is active:
            autotuner.__dict__[STATE_ATTR] = new
            _touched.add(autotuner)
    if not new.in_scope:
        decision_log().record(
            Decision(kernel, "*", "", "out_of_scope", arch=installation.arch, rank=current_rank())
        )
    return new


def raw_key(state: AutotunerState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The decision key: the parts of ``tuning_key`` by argument name (each ``key=`` value with its
    type, so ``True``/``1``/``1.0`` differ; then each argument's dtype), without building text."""
    named = dict(zip(state.arg_names, args))
    named.update((name, value) for name, value in kwargs.items() if name in state.arg_names)
    values = tuple((name, named[name].__class__, named[name]) for name, _ in state.key_index if name in named)
    dtypes = tuple((name, named[name].dtype) for name in state.arg_names if hasattr(named.get(name), "dtype"))
    return (values, dtypes)


def decide(
    autotuner: Any,
    state: AutotunerState,
    installation: Installation,
    raw: tuple[Any, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    candidates: Callable[[], list[Any]],
    may_measure: bool = True,
    defer: bool = False,
    measure: Measure | None = None,
) -> Any:
    """The config of one (kernel, key): decided, logged, then pinned at its first use in this process.

    ``candidates()``: the live configs after the kernel's own pruning. ``may_measure=False`` where no
    real arguments exist (tracing): the miss rule applies, or with ``defer`` ``auto`` raises
    ``Deferred``. A key first launched during a CUDA graph capture is never measured.
    """
    with state.lock:
        config = state.pins.get(raw)
        if config is not None:
            return config
        for hook in tuple(before_decision):
            new = hook(installation)
            if new is not installation:
                set_active(new, replacing=installation)
                installation = new
        capturing, live = is_capturing(), candidates()
        key, kernel, policy = tuning_key(autotuner, args, kwargs), state.kernel, installation.policy
        arch = installation.arch  # the launching device's, once per decision
        launchable, call = may_measure and not capturing, (args, kwargs)
        measure, timings = measure or installation.measure, None
        if policy.mode == "chaos":
            rank, coordinator = current_rank(), installation.chaos
            choice = choose_chaos(
                kernel, key, live, rank=rank, arch=arch, coordinator=coordinator, offline=capturing
            )
        elif policy.mode == "tune" and len(live) > 1 and launchable:
            assert measure is not None
            config, timings = measure(autotuner, live, *call, kernel, key)
            choice = Choice(config, "tuned")
        elif policy.mode == "auto":
            choice, timings = auto_choice(
                autotuner,
                live,
                key,
                call,
                kernel=kernel,
                arch=arch,
                policy=policy,
                table=installation.table,
                measure=measure,
                consensus=installation.consensus,
                may_measure=launchable,
                defer=defer,
            )
        else:
            if policy.mode == "tune" and len(live) > 1:
                warn_once(
                    ("tune-cannot-measure", kernel, key),
                    "kernel %s key %s is first seen where nothing can be measured (compiled code, or a "
                    "CUDA graph capture); using the deterministic choice instead of tuning it. Launch "
                    "this key once eagerly, outside graph capture, before compiling or capturing, so "
                    "the tuner can time it",
                    kernel,
                    key,
                )
            table, on_miss, block_sizes = installation.table, policy.on_miss, policy.block_sizes
            choice = choose_deterministically(
                autotuner, live, key, table=table, on_miss=on_miss, block_sizes=block_sizes
            )
        if state.source_hash is None:
            state.source_hash = kernel_source_hash(autotuner)
        rules.check_numerics(policy.numerics, kernel, key, choice)  # may raise: nothing is pinned
        log(state, key, choice, arch, timings)  # listeners (agreement) may raise: nothing is pinned
        for after in tuple(after_decision):
            after(autotuner, live, call if launchable else None, state.kernel, key, choice)
        state.pins[raw] = choice.config
        return choice.config


def log(state: AutotunerState, key: str, choice: Choice, arch: str, timings: dict[str, Any] | None) -> None:
    """Record ``choice`` for (``state.kernel``, ``key``) in the decision log (its listeners run)."""
    decision = Decision(
        kernel=state.kernel,
        key=key,
        signature=config_signature(choice.config),
        source=choice.source,
        config=config_data(choice.config),
        arch=arch,
        rank=current_rank(),
        origin=choice.origin,
        source_hash=state.source_hash,
        config_list_digest=state.config_list_digest,
        timings=timings,
        nearest_key=choice.nearest_key,
        matched_by=choice.matched_by,
        entry_kernel=choice.entry_kernel,
        chaos=choice.chaos,
        deterministic=None if choice.numerics is None else choice.numerics.deterministic,
    )
    logger.info(
        "kernel %s key %s -> %s (%s%s%s%s)",
        state.kernel,
        key,
        decision.signature,
        choice.source,
        f" from {choice.origin}" if choice.origin else "",
        f", entry for {choice.nearest_key}" if choice.nearest_key else "",
        f", matched by content: tuned as {choice.entry_kernel}" if choice.matched_by else "",
    )
    decision_log().record(decision)


def auto_choice(
    autotuner: Any,
    candidates: list[Any],
    key: str,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    kernel: str,
    arch: str,
    policy: TuningPolicy,
    table: ConfigTable | None,
    measure: Measure | None,
    consensus: Consensus | None,
    may_measure: bool = True,
    defer: bool = False,
) -> tuple[Choice, dict[str, Any] | None]:
    """``auto``'s choice for (kernel, key), and the timings when this rank measured."""
    pinned = pin_without_fallback(autotuner, candidates, key, table=table, block_sizes=policy.block_sizes)
    numerics = getattr(pinned, "numerics", None)
    if policy.numerics == "deterministic-only" and numerics is not None and not numerics.deterministic:
        pinned = rules.Miss("the table marks its config non-deterministic on its own")  # re-tuned
    if isinstance(pinned, Choice):
        return _proposed(pinned, candidates, kernel, key, arch, consensus), None
    if consensus is not None:
        published = consensus.lookup(kernel, key, arch)
        if published is not None:
            return _adopt(published, candidates, kernel, key, consensus.rank), published.timings
    if not may_measure or measure is None:
        if defer and measure is not None:
            raise Deferred
        fix, on_miss = rules.FIX_AN_AUTO_MISS, policy.on_miss
        fallback = choose_on_miss(autotuner, candidates, key, pinned, table=table, on_miss=on_miss, fix=fix)
        return _proposed(fallback, candidates, kernel, key, arch, consensus), None
    config, timings = measure(autotuner, candidates, *call, kernel, key)
    if consensus is None:
        return Choice(config, "tuned"), timings
    mine = config_signature(config)
    winner = consensus.publish(kernel, key, arch, config_data(config), mine, timings)
    if winner.rank == consensus.rank and winner.signature == mine:
        return Choice(config, "tuned"), timings
    # Another rank published first (maybe the same config): launch its config, cache its timings.
    return _adopt(winner, candidates, kernel, key, consensus.rank), winner.timings


def _proposed(
    choice: Choice, candidates: Sequence[Any], kernel: str, key: str, arch: str, consensus: Consensus | None
) -> Choice:
    """``choice``, unless it came from this node's own cache in a job: then the job's winner."""
    if consensus is None or not consensus.is_local(choice.origin):
        return choice
    mine = config_signature(choice.config)
    winner = consensus.publish(kernel, key, arch, config_data(choice.config), mine)
    return choice if winner.signature == mine else _adopt(winner, candidates, kernel, key, consensus.rank)


def _adopt(
    published: PublishedDecision, candidates: Sequence[Any], kernel: str, key: str, rank: int
) -> Choice:
    """The live candidate of ``published``'s signature (so its ``Config.pre_hook`` survives)."""
    for candidate in candidates:  # position order: the first live duplicate wins
        if config_signature(candidate) == published.signature:
            # A record naming this rank that it did not publish (it adopts) came from elsewhere.
            origin = f"rank {published.rank}" if published.rank != rank else "the store (names this rank)"
            progress.info("adopted %s from %s for %s [%s]", published.signature, origin, kernel, key)
            return Choice(candidate, "adopted", origin)
    live = "; ".join(config_signature(c) for c in candidates) or "(none)"
    message = f"rank {published.rank} published {published.signature}, which is not among this rank's "
    raise ConsensusError(kernel, key, f"{message}{len(candidates)} live configs ({live})")


def is_capturing() -> bool:
    """Whether the current CUDA stream captures a graph (never imports torch): nothing may be measured
    then, and the agreement layer sends no store or collective traffic."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and bool(torch.cuda.is_current_stream_capturing())
