"""The per-process pinning state: the active installation, each autotuner's decisions, and how a
new (kernel, key) is decided, recorded and pinned.

Shared by the two adapters that launch pinned configs: ``interception`` (Triton's
``Autotuner.run``) and ``inductor`` (torch.compile's handling of user kernels), so an eager launch
and a compiled one of the same key go through one decision, one decision-log entry and one
agreement check. The only Triton internals used here are the autotuner's pruning
(``prune_configs``/``nargs``) and its ``cache`` (``triton_compat.triton_cache_key``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..core.chaos import ChaosCoordinator, choose_chaos
from ..core.choice import Choice, ConfigTable, choose_deterministically
from ..core.decisions import Decision, decision_log
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
from .auto import Consensus, Measure, auto_choice
from .triton_compat import triton_cache_key

logger = logging.getLogger("megatron_tuning.runtime.interception")

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
    """Chaos mode's job-wide coordinator (``distributed.chaos``); ``None``: the rank formula."""

    @property
    def arch(self) -> str:
        """The arch of the device current now: read when a decision is made, never at install.

        A rank may install before ``torch.cuda.set_device(local_rank)``; reading the device then
        would open a context on GPU 0 and record its arch. Decisions are once per (kernel, key),
        so this is not on the launch path.
        """
        return arch_tag()


class Launch(NamedTuple):
    """What a pinned launch of one key needs, computed once per (autotuner, launch key)."""

    config: Any
    """The decided live ``Config`` (its ``pre_hook`` is read at every launch)."""
    options: dict[str, Any]
    """``config.all_kwargs()``, merged into every ``fn.run`` call (never handed out to be mutated)."""


MAX_LAUNCHES = 4096
"""Launch records kept per autotuner and installation; past this, launches take the slow path
(still correct), so a key argument that is a fresh object every call cannot grow memory."""


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
    """Launch key (``launch_key``) -> ``Launch``: what the hit path reads, one dict lookup a launch."""
    live: Installation | None = None
    """The installation ``launches`` serve: set by the interception once a pinned launch of this
    state was made. The hit path uses ``launches`` only while this ``is`` the active installation,
    so a new policy, table or ``uninstall`` can never launch a record of an old one."""
    arg_set: frozenset[str] = field(init=False)
    fast_key: Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, ...]] = field(init=False)
    """``launch_key`` for this state; ``specialize_launch_key`` replaces it with a compiled one."""

    def __post_init__(self) -> None:
        self.arg_set = frozenset(self.arg_names)
        self.fast_key = functools.partial(launch_key, self)


active: Installation | None = None
"""The installation ``interception.install`` made current; read on every launch (hot path)."""
touched: weakref.WeakSet[Any] = weakref.WeakSet()
"""Autotuners that carry a state, so ``uninstall`` can clear them."""

flush_pending: bool = False
"""Checked once on every pinned hit-path launch (``interception``'s ``run``), normally ``False``.
Set it (with ``flush_hook``) to run work at the first repeated launch after new keys, e.g. an
agreement flush; ``run_pending_flush`` clears it before calling the hook."""
flush_hook: Callable[[], None] | None = None
_flush_lock = threading.Lock()


def run_pending_flush() -> None:
    """Clear ``flush_pending`` and call ``flush_hook`` once, however many threads saw the flag."""
    global flush_pending
    with _flush_lock:
        if not flush_pending:
            return
        flush_pending = False
        hook = flush_hook
    if hook is not None:
        hook()


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


def raw_key(state: AutotunerState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The decision key: the parts of ``tuning_key`` by argument name, without building text.

    The ``key=`` values present, each with its name and type (so ``True``/``1``/``1.0`` stay
    distinct keys, as in ``tuning_key``), then ``(name, dtype)`` of every named argument that has
    a dtype, in parameter order. Positional and keyword passing of the same arguments give the
    same key; arguments that are not the kernel's (``grid``, ``warmup``) play no part.
    """
    named = dict(zip(state.arg_names, args))
    for name, value in kwargs.items():
        if name in state.arg_set:
            named[name] = value
    values = tuple((name, named[name].__class__, named[name]) for name, _ in state.key_index if name in named)
    dtypes = tuple((name, named[name].dtype) for name in state.arg_names if hasattr(named.get(name), "dtype"))
    return (values, dtypes)


_ABSENT = object()  # a key argument not passed at all (its default applies), or no dtype
_KEYWORDS = object()  # starts the keyword part of a launch key
_DTYPE = itertools.repeat("dtype")
_NO_DTYPE = itertools.repeat(_ABSENT)


def launch_key(state: AutotunerState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The hit path's key: at least as fine as ``raw_key``, cheaper to build (no names, no dict).

    Each ``key=`` value with its type, then each positional argument's dtype (``_ABSENT`` where it
    has none), then, only when kernel arguments are passed by keyword, ``(name, dtype)`` of each
    in call order. Equal launch keys imply equal raw keys: the same count of positional
    arguments (the dtype part has one entry per argument), the same keyword names, so the same
    arguments are present, with the same key values and dtypes. It may be finer (keyword order),
    which only costs another record for the same decision.
    """
    count = len(args)
    key: list[Any] = []
    for name, i in state.key_index:
        value = args[i] if i < count else kwargs.get(name, _ABSENT)
        key.append(value.__class__)
        key.append(value)
    key.extend(map(getattr, args, _DTYPE, _NO_DTYPE))
    if not state.arg_set.isdisjoint(kwargs):
        key.append(_KEYWORDS)
        names = state.arg_set
        key.extend((name, getattr(v, "dtype", _ABSENT)) for name, v in kwargs.items() if name in names)
    return tuple(key)


# Exact builtin types whose instances never have a ``dtype``: a class check is cheaper than a
# failed attribute lookup, and gives the same launch-key entry (``_ABSENT``).
_PLAIN_TYPES = {int: "int", float: "float", bool: "bool", str: "str", type(None): "_NONE_TYPE"}


def specialize_launch_key(state: AutotunerState, args: tuple[Any, ...]) -> None:
    """Make ``state.fast_key`` a function compiled for calls shaped like ``args``.

    The hit path builds a launch key at every launch; a loop over the key arguments and a walk
    over ``args`` cost more than the launch they guard. For calls with as many positional
    arguments as ``args`` and no kernel argument by keyword, the compiled function unpacks
    ``args`` and builds the same tuple as ``launch_key`` in one expression (as Triton's own JIT
    binder is generated per signature): ``.dtype`` read directly where ``args`` had a tensor,
    a class check where it had a plain ``int``/``float``/``bool``/``str``/``None``. Any other
    call, or an argument of another kind (``AttributeError``), goes to ``launch_key`` itself, so
    the two agree on every call (``tests/runtime/test_launch_path.py`` checks it). Only integer
    positions and the names above enter the source; argument names never do.
    """
    count = len(args)
    names = [f"a{i}" for i in range(count)]
    parts: list[str] = []
    for _, i in state.key_index:
        parts += [f"{names[i]}.__class__", names[i]] if i < count else ["_ABSENT.__class__", "_ABSENT"]
    for name, value in zip(names, args):
        plain = _PLAIN_TYPES.get(value.__class__)
        if plain is not None:
            parts.append(f"(_ABSENT if {name}.__class__ is {plain} else getattr({name}, 'dtype', _ABSENT))")
        elif hasattr(value, "dtype"):
            parts.append(f"{name}.dtype")
        else:
            parts.append(f"getattr({name}, 'dtype', _ABSENT)")
    source = (
        "def fast_key(args, kwargs):\n"
        f"    if len(args) != {count} or not arg_set.isdisjoint(kwargs):\n"
        "        return launch_key(state, args, kwargs)\n"
        + (f"    {', '.join(names)}, = args\n" if names else "")
        + "    try:\n"
        f"        return ({''.join(part + ', ' for part in parts)})\n"
        "    except AttributeError:  # no dtype where the first call had one\n"
        "        return launch_key(state, args, kwargs)\n"
    )
    scope = {
        "arg_set": state.arg_set,
        "launch_key": launch_key,
        "state": state,
        "_ABSENT": _ABSENT,
        "_NONE_TYPE": type(None),
    }
    exec(compile(source, f"<megatron_tuning launch key {state.kernel}>", "exec"), scope)  # noqa: S102
    state.fast_key = scope["fast_key"]  # type: ignore[assignment]


def live_candidates(autotuner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The kernel's own pruning (early_config_prune, perf_model/top_k), as Triton applies it."""
    if len(autotuner.configs) <= 1:
        return list(autotuner.configs)
    autotuner.nargs = dict(zip(autotuner.arg_names, args))  # prune_configs reads self.nargs
    try:
        return list(autotuner.prune_configs(kwargs))
    finally:
        autotuner.nargs = None


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


def remember_in_triton_cache(
    autotuner: Any, state: AutotunerState, args: tuple[Any, ...], kwargs: dict[str, Any], config: Any
) -> None:
    """File the decision under Triton's own key, as Triton's hit path leaves it, for code that reads it."""
    key = triton_cache_key(autotuner, args, kwargs)
    autotuner.cache[key] = config
    state.triton_keys[key] = config


def forget_triton_cache(autotuner: Any, state: AutotunerState) -> None:
    # Only entries still holding what we wrote: Triton may have re-tuned a key since (mode off).
    cache = autotuner.__dict__.get("cache")
    for key, config in state.triton_keys.items():
        if cache is not None and cache.get(key) is config:
            del cache[key]
    state.triton_keys.clear()
