"""The per-process pinning state: the active installation, each autotuner's decisions, and how a
new (kernel, key) is decided, recorded and pinned, in every mode.

Shared by the two adapters that launch pinned configs: ``interception`` (Triton's
``Autotuner.run``) and ``inductor`` (torch.compile's handling of user kernels), so an eager launch
and a compiled one of the same key go through one decision, one decision-log entry and one
agreement check. The Triton internals a decision touches (the autotuner's pruning and its
``cache``) are reached through ``triton_compat``.

``auto`` mode (``auto_choice``): a table entry pins the key as in ``deterministic``; else a decision
another rank of the job already published is adopted (matched back to a live candidate, so its
``Config.pre_hook`` survives); else this rank tunes once and publishes (first writer wins; a rank
that lost the race launches the winner's config). A hit in this node's own ``auto`` cache is
proposed to the job the same way, so per-node caches never split ranks. Where nothing can be
measured the policy's miss rule applies.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core.chaos import ChaosCoordinator, choose_chaos
from ..core.choice import Choice, ConfigTable, choose_deterministically, choose_on_miss, pin_without_fallback
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
    tuning_key,
)
from ..core.policy import TuningPolicy
from ..core.warn import warn_once

# Re-exported: the adapters and tests reach the launch records and keys through this module.
from .launches import (  # noqa: F401
    FAST_RUN_ATTR,
    MAX_LAUNCHES,
    Launch,
    compile_run,
    find_launch,
    launch_key,
    raw_key,
    specialize_find,
)
from .triton_compat import forget_triton_cache, live_candidates, remember_in_triton_cache  # noqa: F401

logger = logging.getLogger("megatron_tuning.runtime.interception")

# measure(autotuner, candidates, args, kwargs, kernel, key) -> (config, timings)
Measure = Callable[[Any, list[Any], tuple[Any, ...], dict[str, Any], str, str], tuple[Any, dict[str, Any]]]


class PublishedDecision(Protocol):
    config: Mapping[str, Any]
    signature: str
    rank: int


class Consensus(Protocol):
    """What ``auto`` needs from the job: ``distributed.store.StoreConsensus`` implements it."""

    rank: int

    def is_local(self, origin: str | None) -> bool: ...

    def lookup(self, kernel: str, key: str, arch: str) -> PublishedDecision | None: ...

    def publish(
        self, kernel: str, key: str, arch: str, config: Mapping[str, Any], signature: str
    ) -> PublishedDecision: ...


STATE_ATTR = "_megatron_tuning_state"
# Set on the one-config Autotuner copies compiled code launches (runtime/inductor.py): the value is
# the config to launch, already decided, so ``run`` launches it without a new decision.
PINNED_ATTR = "_megatron_tuning_pinned_config"


@dataclass(frozen=True)
class Installation:
    policy: TuningPolicy
    table: ConfigTable | None
    measure: Measure | None
    generation: int
    consensus: Consensus | None = None
    chaos: ChaosCoordinator | None = None
    """Chaos mode's job-wide coordinator (``distributed.store``); ``None``: the rank formula."""

    @property
    def arch(self) -> str:
        """The arch of the device current now: read when a decision is made, never at install.

        A rank may install before ``torch.cuda.set_device(local_rank)``; reading the device then
        would open a context on GPU 0 and record its arch. Decisions are once per (kernel, key),
        so this is not on the launch path.
        """
        return arch_tag()


@dataclass
class AutotunerState:
    """Per-autotuner cache, valid for one installation generation."""

    generation: int
    in_scope: bool
    kernel: str
    key_index: tuple[tuple[str, int], ...]
    arg_names: tuple[str, ...]
    pins: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    """Decision key (``raw_key``) -> the decided config: one decision per key."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    source_hash: str | None = None
    triton_keys: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    """Entries this installation wrote into the autotuner's own ``cache`` (removed at uninstall)."""
    launches: dict[tuple[Any, ...], Launch] = field(default_factory=dict)
    """Launch key (``launch_key``) -> ``Launch``: what the hit path reads, one dict lookup a
    launch. Never rebound (``find`` holds its ``get``)."""
    live: Installation | None = None
    """The installation ``launches`` serve: set by the interception once a pinned launch of this
    state was made. The hit path uses ``launches`` only while this ``is`` the active installation,
    so a new policy, table or ``uninstall`` can never launch a record of an old one."""
    arg_set: frozenset[str] = field(init=False)
    find: Any = field(init=False)
    """``find(args, kwargs) -> Launch | None``, the hit path's lookup in ``launches``:
    ``launches.find_launch`` until ``specialize_find`` compiles one for the first call's shape."""

    def __post_init__(self) -> None:
        self.arg_set = frozenset(self.arg_names)
        self.find = functools.partial(find_launch, self)


active: Installation | None = None
"""The installation ``interception.install`` made current; read on every launch (hot path).
Changed only through ``set_active``, which takes every armed instance ``run`` away with it."""
_armed: weakref.WeakSet[Any] = weakref.WeakSet()
"""Autotuners whose instance ``run`` is a compiled hit path (``arm``)."""
_active_lock = threading.Lock()
"""Orders ``set_active`` and ``arm``: a hit path compiled for an installation is never stored after
that installation stopped being the active one."""
_ANY: Any = object()
touched: weakref.WeakSet[Any] = weakref.WeakSet()
"""Autotuners that carry a state, so ``uninstall`` can clear them."""
before_decision: list[Callable[[Installation], Installation]] = []
"""Called at each new (kernel, key) decision, never on a launch of a pinned key; may return a
replacement installation, which becomes the active one. The session registers one while it waits
for a process group created after it started (``session._LateAttach``)."""


def set_active(installation: Installation | None, *, replacing: Any = _ANY) -> bool:
    """Make ``installation`` the active one (``None``: none) and disarm every autotuner.

    With ``replacing``, only if that is still the active installation (returns whether it was).
    Every change of ``active`` goes through here, so no instance ``run`` compiled for an older
    installation survives it (each also checks ``active`` itself, in case one is put back).
    """
    global active
    with _active_lock:
        if replacing is not _ANY and active is not replacing:
            return False
        active = installation
        for autotuner in list(_armed):
            _pop_fast_run(autotuner)
        _armed.clear()
    return True


def arm(autotuner: Any, run: Any) -> bool:
    """Store ``run`` (``launches.compile_run``) as ``autotuner``'s instance ``run``.

    Only while the installation it serves is still active, and never over an instance ``run``
    that is not one of ours (a user's monkeypatch keeps precedence, as it would over Triton's).
    """
    with _active_lock:
        if active is None or active is not run.__dict__[FAST_RUN_ATTR]:
            return False
        current = autotuner.__dict__.get("run")
        if current is not None and serving(current) is None:
            return False
        autotuner.__dict__["run"] = run
        _armed.add(autotuner)
    return True


def disarm(autotuner: Any) -> None:
    """Take ``autotuner``'s compiled instance ``run`` away, if it has one (its class ``run`` applies)."""
    with _active_lock:
        _pop_fast_run(autotuner)
        _armed.discard(autotuner)


def mark_pinned(autotuner: Any, config: Any) -> None:
    """Make ``autotuner`` a compiled graph's one-config copy, launching ``config`` (decided already).

    A ``copy.copy`` of an autotuner carries the original's state and instance ``run`` (a closure
    over the original): both go, so the copy launches its own pin, never the original's records.
    """
    autotuner.__dict__[PINNED_ATTR] = config
    autotuner.__dict__.pop(STATE_ATTR, None)
    disarm(autotuner)


def serving(run: Any) -> Installation | None:
    """The installation a compiled instance ``run`` serves; ``None`` for anything else."""
    if isinstance(run, types.FunctionType):
        served: Installation | None = run.__dict__.get(FAST_RUN_ATTR)
        return served
    return None


def _pop_fast_run(autotuner: Any) -> None:
    if serving(autotuner.__dict__.get("run")) is not None:
        del autotuner.__dict__["run"]


def installed() -> bool:
    return active is not None


def current_policy() -> TuningPolicy | None:
    installation = active
    return None if installation is None else installation.policy


def state_for(autotuner: Any, installation: Installation) -> AutotunerState:
    state = autotuner.__dict__.get(STATE_ATTR)
    if state is not None and state.generation == installation.generation:
        return state
    if state is not None:
        forget_triton_cache(autotuner, state)
    arg_names = list(autotuner.arg_names)
    kernel = kernel_id(autotuner)
    state = AutotunerState(
        generation=installation.generation,
        in_scope=installation.policy.in_scope(kernel_module(autotuner)),
        kernel=kernel,
        key_index=tuple((name, arg_names.index(name)) for name in autotuner.keys if name in arg_names),
        arg_names=tuple(arg_names),
    )
    autotuner.__dict__[STATE_ATTR] = state
    touched.add(autotuner)
    if not state.in_scope:
        decision_log().record(
            Decision(
                kernel=kernel,
                key="*",
                signature="",
                source="out_of_scope",
                arch=installation.arch,
                rank=current_rank(),
            )
        )
    return state


def decide(
    autotuner: Any,
    state: AutotunerState,
    installation: Installation,
    raw: tuple[Any, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    may_measure: bool = True,
) -> Any:
    """Choose, record and pin the config for one (kernel, key); the first use of it in this process.

    ``may_measure=False`` where no real arguments exist (torch.compile trace time): ``tune`` and
    ``auto`` then apply the policy's miss rule instead of measuring. A new key first launched
    while a CUDA graph is being captured is never measured either (timing would break the capture).
    """
    with state.lock:
        config = state.pins.get(raw)
        if config is not None:
            return config
        for hook in tuple(before_decision):
            installation = _replace_active(installation, hook(installation))
        policy = installation.policy
        may_measure = may_measure and not is_capturing()
        key = tuning_key(autotuner, args, kwargs)
        candidates = live_candidates(autotuner, args, kwargs)
        rank = current_rank()
        arch = installation.arch  # the launching device's, resolved once per decision
        timings = None
        if policy.mode == "chaos":
            choice = choose_chaos(
                state.kernel,
                key,
                candidates,
                rank=rank,
                arch=arch,
                coordinator=installation.chaos,
                offline=is_capturing(),  # no store traffic inside a CUDA graph capture
            )
        elif policy.mode == "tune" and len(candidates) > 1 and may_measure:
            assert installation.measure is not None
            config, timings = installation.measure(autotuner, candidates, args, kwargs, state.kernel, key)
            choice = Choice(config, "tuned")
        elif policy.mode == "auto":
            choice, timings = auto_choice(
                autotuner,
                candidates,
                key,
                (args, kwargs),
                kernel=state.kernel,
                arch=arch,
                policy=policy,
                table=installation.table,
                measure=installation.measure,
                consensus=installation.consensus,
                may_measure=may_measure,
            )
        else:
            if policy.mode == "tune" and len(candidates) > 1:
                warn_once(
                    ("tune-cannot-measure", state.kernel, key),
                    "kernel %s key %s is first seen where nothing can be measured (compiled code, "
                    "or a CUDA graph capture); using the deterministic choice instead of tuning it. "
                    "Launch this key once eagerly, outside graph capture, before compiling or "
                    "capturing, so the tuner can time it",
                    state.kernel,
                    key,
                )
            choice = choose_deterministically(
                autotuner,
                candidates,
                key,
                table=installation.table,
                on_miss=policy.on_miss,
                block_sizes=policy.block_sizes,
            )
        config, source, origin = choice.config, choice.source, choice.origin
        if state.source_hash is None:
            state.source_hash = kernel_source_hash(autotuner)
        decision = Decision(
            kernel=state.kernel,
            key=key,
            signature=config_signature(config),
            source=source,
            config=config_data(config),
            arch=arch,
            rank=rank,
            origin=origin,
            source_hash=state.source_hash,
            timings=timings,
            nearest_key=choice.nearest_key,
            matched_by=choice.matched_by,
            entry_kernel=choice.entry_kernel,
            chaos=choice.chaos,
        )
        logger.info(
            "kernel %s key %s -> %s (%s%s%s%s)",
            state.kernel,
            key,
            decision.signature,
            source,
            f" from {origin}" if origin else "",
            f", entry for {choice.nearest_key}" if choice.nearest_key else "",
            f", matched by content: tuned as {choice.entry_kernel}" if choice.matched_by else "",
        )
        decision_log().record(decision)  # listeners (agreement) may raise: then nothing is pinned
        state.pins[raw] = config
        remember_in_triton_cache(autotuner, state, args, kwargs, config)
        return config


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
) -> tuple[Choice, dict[str, Any] | None]:
    """The choice for (kernel, key) in ``auto`` mode, and the timings when this rank measured."""
    pinned = pin_without_fallback(autotuner, candidates, key, table=table, block_sizes=policy.block_sizes)
    if isinstance(pinned, Choice):
        return _proposed(pinned, candidates, kernel, key, arch, consensus), None
    if consensus is not None:
        published = consensus.lookup(kernel, key, arch)
        if published is not None:
            return _adopt(published, candidates, kernel, key, consensus.rank), None
    if not may_measure or measure is None:
        fallback = choose_on_miss(autotuner, candidates, key, pinned, table=table, on_miss=policy.on_miss)
        return _proposed(fallback, candidates, kernel, key, arch, consensus), None
    args, kwargs = call
    config, timings = measure(autotuner, candidates, args, kwargs, kernel, key)
    if consensus is None:
        return Choice(config, "tuned"), timings
    winner = consensus.publish(kernel, key, arch, config_data(config), config_signature(config))
    if winner.rank == consensus.rank and winner.signature == config_signature(config):
        return Choice(config, "tuned"), timings
    # Another rank published first (maybe the same config): launch its config, keep our
    # measurement for the record. A record naming this rank with another config is adopted too.
    return _adopt(winner, candidates, kernel, key, consensus.rank), timings


def _proposed(
    choice: Choice, candidates: Sequence[Any], kernel: str, key: str, arch: str, consensus: Consensus | None
) -> Choice:
    """``choice``, unless it came from this node's own cache in a job: then it is proposed to the
    job (first writer wins) and the winner is launched, so per-node caches never split ranks."""
    if consensus is None or not consensus.is_local(choice.origin):
        return choice
    mine = config_signature(choice.config)
    winner = consensus.publish(kernel, key, arch, config_data(choice.config), mine)
    return choice if winner.signature == mine else _adopt(winner, candidates, kernel, key, consensus.rank)


def _adopt(
    published: PublishedDecision, candidates: Sequence[Any], kernel: str, key: str, rank: int
) -> Choice:
    for candidate in candidates:  # position order: the first live duplicate wins
        if config_signature(candidate) == published.signature:
            # A record naming this rank that this rank did not publish (it is adopting, so its own
            # pick differed or it never tuned) came from elsewhere: say so rather than "this rank".
            origin = (
                f"rank {published.rank}" if published.rank != rank else "the job's store (names this rank)"
            )
            return Choice(candidate, "adopted", origin)
    live = "; ".join(config_signature(c) for c in candidates) or "(none)"
    raise ConsensusError(
        kernel,
        key,
        f"rank {published.rank} published {published.signature}, which is not among this rank's "
        f"{len(candidates)} live configs ({live})",
    )


def _replace_active(old: Installation, new: Installation) -> Installation:
    if new is not old:
        set_active(new, replacing=old)
    return new


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never imports torch itself).

    Nothing may be measured then (timing would break the capture), and the agreement layer sends
    no store or collective traffic.
    """
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return False
    return bool(torch.cuda.is_current_stream_capturing())
