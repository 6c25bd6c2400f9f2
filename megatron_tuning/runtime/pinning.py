"""Decisions: which config an in-scope kernel launches for a key, in every mode, once per process.
Holds the active ``Installation`` and each autotuner's state; ``interception`` (eager) and
``inductor`` (compiled) decide here."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core import notices
from ..core.chaos import ChaosCoordinator, choose_chaos
from ..core.choice import Choice, ConfigTable, choose
from ..core.decisions import Decision, decision_log
from ..core.errors import ConsensusError
from ..core.identity import (
    arch_tag,
    config_data,
    config_signature,
    current_rank,
    kernel_id,
    kernel_module,
    kernel_source_hash,
    shared_kernel_id,
)
from ..core.key import Key, call_key, render
from ..core.policy import TuningPolicy
from .config_list import examine

logger = logging.getLogger("megatron_tuning.runtime.interception")
progress = logging.getLogger("megatron_tuning.tuning.tuner.progress")

Measure = Callable[[Any, list[Any], tuple[Any, ...], dict[str, Any], str, str], tuple[Any, dict[str, Any]]]

STATE_ATTR = "_megatron_tuning_state"


class PublishedDecision(Protocol):
    config: Mapping[str, Any]
    signature: str
    rank: int
    timings: dict[str, Any] | None


class Consensus(Protocol):
    """What ``auto`` needs from the job: ``distributed.store.StoreConsensus`` implements it."""

    rank: int

    def lookup(
        self, kernel: str, key: str, arch: str, *, identity: str | None = None
    ) -> PublishedDecision | None: ...

    def publish(
        self,
        kernel: str,
        key: str,
        arch: str,
        config: Mapping[str, Any],
        signature: str,
        timings: Any = None,
        *,
        identity: str | None = None,
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
    fast_path: bool = True  # arm ``fastpath``'s generated hit path (off: every launch takes the class path)

    @property
    def arch(self) -> str:
        """The current device's arch, read per decision, never at install: a rank may install before
        ``torch.cuda.set_device(local_rank)``, and reading then would touch GPU 0."""
        return arch_tag()


Launch = tuple[Any, dict[str, Any]]  # a pinned config and the options its launches pass ``fn.run``


@dataclass
class AutotunerState:
    generation: int
    in_scope: bool
    kernel: str
    key_index: tuple[tuple[str, int], ...]  # (name, parameter position) of each ``key=`` argument
    arg_names: tuple[str, ...]
    pins: dict[Key, Any] = field(default_factory=dict)  # each decided key -> its one config
    # ``launch_key`` of each call shape launched -> its ``Launch``: what a launch looks up.
    launches: dict[tuple[Any, ...], Launch] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    source_hash: str | None = None
    # In scope, what ``config_list.examine`` found of its configs (see ``ConfigList``).
    config_list_digest: str | None = None
    config_keywords: frozenset[str] = frozenset()
    storing_problem: str | None = None
    storing_wrong_type: bool = False

    def key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Key:
        return call_key(self.arg_names, [name for name, _ in self.key_index], args, kwargs)

    def launch_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """What each launch looks its ``Launch`` up by, without building a ``Key``: each ``key=``
        value with its type (``True``, ``1``, ``1.0`` apart) and ``launch_value``, then each
        parameter's dtype. Equal launch keys have equal ``Key``s; ``fastpath`` computes the same
        tuple from positions."""
        named = dict(zip(self.arg_names, args))
        named.update((name, value) for name, value in kwargs.items() if name in self.arg_names)
        parts: list[Any] = []
        for name, _ in self.key_index:
            value = named.get(name)
            parts += (value.__class__, launch_value(value)) if name in named else (None, None)
        parts += [getattr(named.get(name), "dtype", None) for name in self.arg_names]
        return tuple(parts)


# Types whose values are equal only where their key text is: for them a launch key holds the value
# itself (a dict lookup by it is the cheapest). Others may be equal and render apart (0.0 and -0.0,
# (1, 2) and (1.0, 2.0)), so they enter as their text.
_EXACT_KEY_TYPES = frozenset((int, bool, str, type(None)))


def launch_value(value: Any) -> Any:
    """A ``key=`` value in a launch key, after its type: itself, or the text the ``Key`` renders."""
    return value if value.__class__ in _EXACT_KEY_TYPES else render(value)


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


@contextlib.contextmanager
def while_active(installation: Installation) -> Iterator[bool]:
    with _active_lock:
        yield active is installation


def touched() -> list[Any]:
    with _active_lock:
        return list(_touched)


def installed() -> bool:
    return active is not None


def current_policy() -> TuningPolicy | None:
    installation = active
    return None if installation is None else installation.policy


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
    )
    if new.in_scope:  # out of scope, Triton picks among the configs itself: nothing to check
        checked = examine(autotuner, kernel, installation.policy.mode)
        new.config_list_digest, new.config_keywords = checked.digest, checked.keywords
        new.storing_problem, new.storing_wrong_type = checked.storing_problem, checked.storing_wrong_type
        new.source_hash = kernel_source_hash(autotuner)
    with _active_lock:  # ordered with set_active, and a WeakSet is not iterated while it grows
        if installation is active:
            autotuner.__dict__[STATE_ATTR] = new
            _touched.add(autotuner)
    if not new.in_scope:
        decision_log().record(
            Decision(kernel, "*", "", "out_of_scope", arch=installation.arch, rank=current_rank())
        )
    return new


def decide(
    autotuner: Any,
    state: AutotunerState,
    installation: Installation,
    key: Key,
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
    real arguments exist (tracing, a CUDA graph capture): the miss rule applies, or with ``defer``
    ``auto`` raises ``Deferred``."""
    with state.lock:
        config = state.pins.get(key)
        if config is not None:
            return config
        for hook in tuple(before_decision):
            new = hook(installation)
            if new is not installation:
                set_active(new, replacing=installation)
                installation = new
        capturing, live = is_capturing(), candidates()
        kernel, policy, arch = state.kernel, installation.policy, installation.arch  # arch: once per decision
        launchable, call, consensus = may_measure and not capturing, (args, kwargs), installation.consensus
        measure = measure or installation.measure
        # auto's decisions: by content where the source is known (one per qualname, config list and
        # source, whatever the module name, as the auto cache keeps them), else by ``shared``.
        decided = shared_kernel_id(kernel, state.config_list_digest, state.source_hash)

        def publish(choice: Choice, consensus: Consensus) -> Choice:
            """Publish ``choice`` and its timings (the first writer wins); return it, or the decision
            another rank published first. A tuned choice then adopts even the same config (to cache
            that rank's timings); a hit in this node's cache keeps its origin."""
            mine = config_signature(choice.config)
            data = config_data(choice.config)
            winner = consensus.publish(kernel, key, arch, data, mine, choice.timings, identity=decided)
            if winner.signature == mine and (winner.rank == consensus.rank or choice.source != "tuned"):
                return choice
            return _adopt(winner, live, kernel, key, consensus.rank)

        def adopt_or_tune(reason: str) -> Choice | None:
            """``auto``'s step for a key no table pins: adopt the decision another rank published, else
            tune and publish it (the first writer wins); ``None`` where nothing may be measured."""
            if (
                consensus is not None
                and (published := consensus.lookup(kernel, key, arch, identity=decided)) is not None
            ):
                return _adopt(published, live, kernel, key, consensus.rank)
            if not launchable or measure is None:
                if defer and measure is not None:
                    raise Deferred
                return None
            config, timings = measure(autotuner, live, *call, kernel, key)
            tuned = Choice(config, "tuned", timings=timings)
            return tuned if consensus is None else publish(tuned, consensus)

        if policy.mode == "chaos":
            offline, coordinator = capturing, installation.chaos
            # Claimed under the id the agreement check compares, so the first claim is what it pairs.
            shared = shared_kernel_id(kernel, state.config_list_digest)
            choice = choose_chaos(
                shared, key, live, rank=current_rank(), arch=arch, coordinator=coordinator, offline=offline
            )
        elif policy.mode == "tune" and len(live) > 1 and launchable:
            assert measure is not None
            config, timings = measure(autotuner, live, *call, kernel, key)
            choice = Choice(config, "tuned", timings=timings)
        else:
            if policy.mode == "tune" and len(live) > 1:
                notices.cannot_measure(kernel, key)
            auto = policy.mode == "auto"
            # A miss's advice (use auto, a table or tune) holds only for configs a table can store;
            # auto never gets here with others.
            fix = notices.FIX_AN_AUTO_MISS if auto else notices.FIX_A_MISS
            if state.storing_problem:
                fix = notices.fix_an_unstorable_miss(
                    state.storing_problem, wrong_type=state.storing_wrong_type
                )
            choice = choose(
                autotuner,
                live,
                key,
                table=installation.table,
                on_miss=policy.on_miss,
                block_sizes=policy.block_sizes,
                numerics=policy.numerics,
                unpinned=adopt_or_tune if auto else None,
                fix=fix,
                list_digest=state.config_list_digest,
            )
            # A hit in this node's own cache (auto's, in a TableSet) is proposed to the job: per-node
            # caches never split ranks.
            cache_file = getattr(installation.table, "cache_file", None)
            if auto and consensus is not None and cache_file is not None and choice.origin == cache_file:
                choice = publish(choice, consensus)
        signature = config_signature(choice.config)
        notices.check_numerics(policy.numerics, kernel, key, choice, signature)  # may raise: nothing pinned
        log(state, key, choice, arch)  # listeners (agreement) may raise: nothing is pinned
        for after in tuple(after_decision):
            after(autotuner, live, call if launchable else None, state.kernel, key, choice)
        state.pins[key] = choice.config
        return choice.config


def log(state: AutotunerState, key: Key, choice: Choice, arch: str) -> None:
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
        timings=choice.timings,
        nearest_key=choice.nearest_key,
        matched_by="content" if choice.entry_kernel else None,
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
        f", matched by content: tuned as {choice.entry_kernel}" if choice.entry_kernel else "",
    )
    decision_log().record(decision)


def _adopt(
    published: PublishedDecision, candidates: Sequence[Any], kernel: str, key: str, rank: int
) -> Choice:
    """The live candidate of ``published``'s signature (so its ``Config.pre_hook`` survives)."""
    for candidate in candidates:  # position order: the first live duplicate wins
        if config_signature(candidate) == published.signature:
            # A record naming this rank that it did not publish (it adopts) came from elsewhere.
            origin = f"rank {published.rank}" if published.rank != rank else "the store (names this rank)"
            progress.info("adopted %s from %s for %s [%s]", published.signature, origin, kernel, key)
            return Choice(candidate, "adopted", origin, timings=published.timings)
    live = "; ".join(config_signature(c) for c in candidates) or "(none)"
    message = f"rank {published.rank} published {published.signature}, which is not among this rank's "
    raise ConsensusError(kernel, key, f"{message}{len(candidates)} live configs ({live})")


def is_capturing() -> bool:
    """Whether the current CUDA stream captures a graph (never imports torch): then nothing may be
    measured, and the agreement layer sends no store or collective traffic."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and bool(torch.cuda.is_current_stream_capturing())
