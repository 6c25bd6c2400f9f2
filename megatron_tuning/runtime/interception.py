"""The Triton adapter: the only module that touches Triton's private autotuner internals.

``install(policy)`` patches ``triton.runtime.autotuner.Autotuner`` at class level:

* ``run``: for in-scope kernels under ``deterministic``/``chaos``/``tune`` the config is chosen
  at the first use of each key (after the kernel's own pruning), recorded in the decision log,
  and launched the way Triton's cache-hit path launches: ``Config.pre_hook`` then ``fn.run``.
  The decision is also filed in the autotuner's own ``cache`` under Triton's key (removed again
  at ``uninstall``), and ``best_config`` is set at every launch, as Triton's hit path leaves them.
  Autotuner-level ``reset_to_zero``/``restore_value``/``pre_hook``/``post_hook`` only protect
  benchmarking, so they do not run when nothing is benchmarked (as on Triton's hit path).
  Under ``record`` Triton autotunes as usual and its winner is recorded. Out-of-scope kernels
  and mode ``off`` go to Triton's own ``run`` untouched.
* ``_bench``: raises ``BenchmarkForbiddenError`` for in-scope kernels under non-measuring
  policies, so a key mismatch can never fall back to timing silently.
* ``__init__`` (only on releases that resolve the benchmarker eagerly, 3.2/3.3): passes a lazy
  benchmarker so kernels can be decorated without a GPU driver (``triton_compat``).

``install`` also patches torch.compile's handling of user kernels (``runtime/inductor.py``), so
compiled graphs launch the same decisions. ``uninstall()`` restores the original attributes
exactly. Contract tests in ``tests/runtime/test_triton_contract.py`` pin every private attribute
used here.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..core.choice import Choice, ConfigTable, as_config_table, chaos_index, choose_deterministically
from ..core.cost import order_by_cost
from ..core.decisions import Decision, decision_log
from ..core.errors import BenchmarkForbiddenError
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
from . import inductor
from .auto import Consensus, Measure, auto_choice
from .triton_compat import (
    acquire_lazy_init,
    autotuner_class,
    check_triton_contract,
    release_lazy_init,
    triton_cache_key,
)

logger = logging.getLogger(__name__)

_STATE_ATTR = "_megatron_tuning_state"
# Set on the one-config Autotuner copies compiled code launches (runtime/inductor.py): the value is
# the config to launch, already decided, so ``run`` launches it without a new decision.
PINNED_ATTR = "_megatron_tuning_pinned_config"

# Modes whose in-scope launches never reach Triton's own benchmarking: ``_bench`` raises there.
_GUARDED_MODES = ("deterministic", "chaos", "auto")


@dataclass(frozen=True)
class _Installation:
    policy: TuningPolicy
    table: ConfigTable | None
    measure: Measure | None
    generation: int
    arch: str
    consensus: Consensus | None = None


@dataclass
class _AutotunerState:
    """Per-autotuner cache, valid for one installation generation."""

    generation: int
    in_scope: bool
    kernel: str
    key_index: tuple[tuple[str, int], ...]
    pins: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    source_hash: str | None = None
    triton_keys: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    """Entries this installation wrote into the autotuner's own ``cache`` (removed at uninstall)."""


_lock = threading.RLock()
_installation: _Installation | None = None
_generation = 0
_originals: dict[str, Any] = {}
_touched: weakref.WeakSet[Any] = weakref.WeakSet()


def installed() -> bool:
    return _installation is not None


def current_policy() -> TuningPolicy | None:
    installation = _installation
    return None if installation is None else installation.policy


def install(
    policy: TuningPolicy,
    *,
    table: Any = None,
    measure: Measure | None = None,
    consensus: Consensus | None = None,
) -> None:
    """Patch Triton's Autotuner for ``policy``. Idempotent; a second call replaces the policy.

    ``table`` provides ``lookup`` (``core.choice.ConfigTable``) or is a ``{(kernel, key): config}``
    mapping. ``measure`` (``tuning.tuner.make_measure``) is required in mode ``tune``; in ``auto``
    without one, a miss falls back to the policy's miss rule. ``consensus`` shares ``auto``
    decisions across the job's ranks (``distributed.consensus``); ``None``: this process alone.
    """
    global _installation, _generation
    if policy.mode == "tune" and measure is None:
        raise ValueError("policy mode 'tune' needs a measure function (see megatron_tuning.tuning.tuner)")
    check_triton_contract()
    with _lock:
        if not _originals:
            _patch()
        _generation += 1
        _installation = _Installation(
            policy, as_config_table(table), measure, _generation, arch_tag(), consensus
        )
    inductor.warn_if_unsupported(policy)
    logger.debug("interception installed: %s", policy.describe())


def uninstall() -> None:
    """Restore Triton's Autotuner exactly as it was before ``install``."""
    global _installation
    with _lock:
        _installation = None
        if not _originals:
            return
        autotuner = autotuner_class()
        for name, original in _originals.items():
            setattr(autotuner, name, original)
        _originals.clear()
        inductor.unpatch()
        release_lazy_init()
        for instance in list(_touched):
            state = instance.__dict__.pop(_STATE_ATTR, None)
            if state is not None:
                _forget_triton_cache(instance, state)
    logger.debug("interception uninstalled")


def _patch() -> None:
    autotuner = autotuner_class()
    for name in ("run", "_bench"):
        _originals[name] = autotuner.__dict__[name]
    autotuner.run = _make_run(_originals["run"])
    autotuner._bench = _make_bench(_originals["_bench"])
    acquire_lazy_init()
    inductor.patch()


def _make_bench(original: Any) -> Any:
    @functools.wraps(original)
    def _bench(self: Any, *args: Any, **kwargs: Any) -> Any:
        installation = _installation
        if installation is not None and installation.policy.mode in _GUARDED_MODES:
            state = _state_for(self, installation)
            if state.in_scope:
                raise BenchmarkForbiddenError(state.kernel, installation.policy.mode)
        return original(self, *args, **kwargs)

    return _bench


def _state_for(autotuner: Any, installation: _Installation) -> _AutotunerState:
    state = autotuner.__dict__.get(_STATE_ATTR)
    if state is not None and state.generation == installation.generation:
        return state
    if state is not None:
        _forget_triton_cache(autotuner, state)
    arg_names = list(autotuner.arg_names)
    kernel = kernel_id(autotuner)
    state = _AutotunerState(
        generation=installation.generation,
        in_scope=installation.policy.in_scope(kernel_module(autotuner)),
        kernel=kernel,
        key_index=tuple((name, arg_names.index(name)) for name in autotuner.keys if name in arg_names),
    )
    autotuner.__dict__[_STATE_ATTR] = state
    _touched.add(autotuner)
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


def _raw_key(state: _AutotunerState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Hot-path cache key: Triton's key values and dtypes, without building text.

    Each key value is paired with its type so ``True``/``1``/``1.0`` stay distinct keys, as they
    are in ``tuning_key`` (in a plain tuple they compare equal and would share one decision).
    """
    count = len(args)
    values: list[Any] = []
    for name, i in state.key_index:
        value = args[i] if i < count else kwargs.get(name)
        values.append((value.__class__, value))
    values.extend(a.dtype for a in args if hasattr(a, "dtype"))
    if kwargs:
        values.extend(v.dtype for v in kwargs.values() if hasattr(v, "dtype"))
    return tuple(values)


def _make_run(original: Any) -> Any:
    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        installation = _installation
        pinned = self.__dict__.get(PINNED_ATTR)
        if pinned is not None:  # a compiled graph's one-config copy: decided when it was traced
            return _launch_pinned(self, pinned, args, kwargs)
        if installation is None or installation.policy.mode == "off":
            return original(self, *args, **kwargs)
        state = self.__dict__.get(_STATE_ATTR)
        if state is None or state.generation != installation.generation:
            state = _state_for(self, installation)
        if not state.in_scope:
            return original(self, *args, **kwargs)
        if installation.policy.mode == "record":
            return _record_run(original, self, state, installation, args, kwargs)
        raw = _raw_key(state, args, kwargs)
        config = state.pins.get(raw)
        if config is None:
            config = _decide(self, state, installation, raw, args, kwargs)
        # Triton's cache-hit launch: Config.pre_hook sees the full argument dict, then fn.run.
        self.best_config = config
        if config.pre_hook is not None:
            config.pre_hook({**dict(zip(self.arg_names, args)), **kwargs, **config.all_kwargs()})
        return self.fn.run(*args, **kwargs, **config.all_kwargs())

    return run


def _launch_pinned(autotuner: Any, config: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    autotuner.best_config = config
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(autotuner.arg_names, args)), **kwargs, **config.all_kwargs()})
    return autotuner.fn.run(*args, **kwargs, **config.all_kwargs())


def _remember_in_triton_cache(
    autotuner: Any, state: _AutotunerState, args: tuple[Any, ...], kwargs: dict[str, Any], config: Any
) -> None:
    """File the decision under Triton's own key, as Triton's hit path leaves it, for code that reads it."""
    key = triton_cache_key(autotuner, args, kwargs)
    autotuner.cache[key] = config
    state.triton_keys[key] = config


def _forget_triton_cache(autotuner: Any, state: _AutotunerState) -> None:
    # Only entries still holding what we wrote: Triton may have re-tuned a key since (mode off).
    cache = autotuner.__dict__.get("cache")
    for key, config in state.triton_keys.items():
        if cache is not None and cache.get(key) is config:
            del cache[key]
    state.triton_keys.clear()


def _live_candidates(autotuner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The kernel's own pruning (early_config_prune, perf_model/top_k), as Triton applies it."""
    if len(autotuner.configs) <= 1:
        return list(autotuner.configs)
    autotuner.nargs = dict(zip(autotuner.arg_names, args))  # prune_configs reads self.nargs
    try:
        return list(autotuner.prune_configs(kwargs))
    finally:
        autotuner.nargs = None


def _decide(
    autotuner: Any,
    state: _AutotunerState,
    installation: _Installation,
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
        may_measure = may_measure and not _capturing()
        key = tuning_key(autotuner, args, kwargs)
        candidates = _live_candidates(autotuner, args, kwargs)
        rank = current_rank()
        timings = None
        if policy.mode == "chaos":
            ordered = order_by_cost(candidates)
            choice = Choice(ordered[chaos_index(state.kernel, key, rank, len(ordered))], "chaos")
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
                arch=installation.arch,
                policy=policy,
                table=installation.table,
                measure=installation.measure,
                consensus=installation.consensus,
                may_measure=may_measure,
            )
        else:
            if policy.mode == "tune" and len(candidates) > 1:
                logger.warning(
                    "megatron_tuning: kernel %s key %s is first seen where nothing can be measured "
                    "(compiled code, or a CUDA graph capture); using the deterministic choice "
                    "instead of tuning it",
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
            arch=installation.arch,
            rank=rank,
            origin=origin,
            source_hash=state.source_hash,
            timings=timings,
            nearest_key=choice.nearest_key,
        )
        logger.info(
            "kernel %s key %s -> %s (%s%s%s)",
            state.kernel,
            key,
            decision.signature,
            source,
            f" from {origin}" if origin else "",
            f", entry for {choice.nearest_key}" if choice.nearest_key else "",
        )
        decision_log().record(decision)  # listeners (agreement) may raise: then nothing is pinned
        state.pins[raw] = config
        _remember_in_triton_cache(autotuner, state, args, kwargs, config)
        return config


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never imports torch itself)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def _record_run(
    original: Any,
    autotuner: Any,
    state: _AutotunerState,
    installation: _Installation,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Record mode: Triton autotunes as usual; record its winner and timings once per key."""
    raw = _raw_key(state, args, kwargs)
    if raw in state.pins:
        return original(autotuner, *args, **kwargs)
    timings_before = autotuner.__dict__.get("configs_timings")
    result = original(autotuner, *args, **kwargs)
    with state.lock:
        if raw in state.pins:
            return result
        config = autotuner.best_config
        timings_after = autotuner.__dict__.get("configs_timings")
        timings: dict[str, Any] | None = None
        if timings_after is not None and timings_after is not timings_before:
            timings = {
                "candidates": {
                    config_signature(c): [float(x) for x in _as_list(t)] for c, t in timings_after.items()
                },
                "bench_time_s": getattr(autotuner, "bench_time", None),
            }
        if state.source_hash is None:
            state.source_hash = kernel_source_hash(autotuner)
        decision_log().record(
            Decision(
                kernel=state.kernel,
                key=tuning_key(autotuner, args, kwargs),
                signature=config_signature(config),
                source="recorded",
                config=config_data(config),
                arch=installation.arch,
                rank=current_rank(),
                source_hash=state.source_hash,
                timings=timings,
            )
        )
        state.pins[raw] = config
    return result


def _as_list(timing: Any) -> list[Any]:
    return list(timing) if isinstance(timing, (list, tuple)) else [timing]
