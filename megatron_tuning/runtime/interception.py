"""The Triton adapter: the only module that touches Triton's private autotuner internals.

``install(policy)`` patches ``triton.runtime.autotuner.Autotuner`` at class level:

* ``run``: for in-scope kernels under ``deterministic``/``chaos``/``tune`` the config is chosen
  at the first use of each key (after the kernel's own pruning), recorded in the decision log,
  and launched the way Triton's cache-hit path launches: ``Config.pre_hook`` then ``fn.run``.
  The decision is also filed in the autotuner's own ``cache`` under Triton's key (removed again
  at ``uninstall``), and ``best_config`` is set at every launch, as Triton's hit path leaves them.
  Every later launch of the key takes the *hit path*: one lookup (``state.find``, compiled per
  call shape, ``runtime/launches.py``) finds the key's launch record (the config and its
  ``all_kwargs()``, computed once), valid only while the installation that made it is active.
  After its first pinned launch an autotuner also gets that whole path compiled into one
  function stored as its instance ``run`` (``launches.compile_run``, ``pinning.arm``), which
  ``kernel[grid](...)`` finds before the class's: calls of another shape or keys without a
  record fall through to the class-level ``run``, and every change of the active installation
  (``pinning.set_active``) takes those functions away again.
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
from typing import Any

from ..core.chaos import ChaosCoordinator
from ..core.choice import as_config_table, report_policy_end
from ..core.decisions import Decision, decision_log
from ..core.errors import BenchmarkForbiddenError
from ..core.identity import (
    config_data,
    config_signature,
    current_rank,
    kernel_source_hash,
    tuning_key,
)
from ..core.policy import TuningPolicy
from ..core.warn import reset_warnings
from . import inductor, pinning
from .launches import Launch, compile_run, launch_key, make_launch, raw_key, specialize_find
from .pinning import (
    PINNED_ATTR,
    STATE_ATTR,
    AutotunerState,
    Consensus,
    Installation,
    Measure,
    current_policy,
    decide,
    forget_triton_cache,
    installed,
    state_for,
)
from .triton_compat import (
    acquire_lazy_init,
    autotuner_class,
    check_triton_contract,
    launch_option_defaults,
    release_lazy_init,
)

logger = logging.getLogger(__name__)

# Modes whose in-scope launches never reach Triton's own benchmarking: ``_bench`` raises there.
_GUARDED_MODES = ("deterministic", "chaos", "auto")
# The keywords ``kernel[grid](...)`` adds to a call: the call shape the instance ``run`` serves.
_LAUNCH_KEYWORDS = frozenset(("grid", "warmup"))

_lock = threading.RLock()
_generation = 0
_originals: dict[str, Any] = {}

__all__ = ["current_policy", "install", "installed", "uninstall"]


def install(
    policy: TuningPolicy,
    *,
    table: Any = None,
    measure: Measure | None = None,
    consensus: Consensus | None = None,
    chaos: ChaosCoordinator | None = None,
) -> None:
    """Patch Triton's Autotuner for ``policy``. Idempotent; a second call replaces the policy.

    ``table`` provides ``lookup`` (``core.choice.ConfigTable``) or is a ``{(kernel, key): config}``
    mapping. ``measure`` (``tuning.tuner.make_measure``) is required in mode ``tune``; in ``auto``
    without one, a miss falls back to the policy's miss rule. ``consensus`` shares ``auto``
    decisions across the job's ranks (``distributed.store``); ``None``: this process alone.
    ``chaos`` lets chaos-mode ranks avoid the job's first pick (``distributed.store``).
    """
    global _generation
    if policy.mode == "tune" and measure is None:
        raise ValueError("policy mode 'tune' needs a measure function (see megatron_tuning.tuning.tuner)")
    check_triton_contract()
    with _lock:
        previous = pinning.active
        if not _originals:
            _patch()
        _generation += 1
        # The arch is read per decision on the launching device (``Installation.arch``): a rank that
        # installs before ``torch.cuda.set_device`` must not touch (and record) GPU 0 here.
        installation = Installation(policy, as_config_table(table), measure, _generation, consensus, chaos)
        pinning.set_active(installation)
    if previous is not None:
        report_policy_end(previous.policy)
    reset_warnings()  # a new policy reports every notice again, once
    inductor.warn_if_unsupported(policy)
    logger.debug("interception installed: %s", policy.describe())


def uninstall() -> None:
    """Restore Triton's Autotuner exactly as it was before ``install``."""
    with _lock:
        previous = pinning.active
        pinning.set_active(None)
        if _originals:
            autotuner = autotuner_class()
            for name, original in _originals.items():
                setattr(autotuner, name, original)
            _originals.clear()
            inductor.unpatch()
            release_lazy_init()
            for instance in list(pinning.touched):
                state = instance.__dict__.pop(STATE_ATTR, None)
                if state is not None:
                    forget_triton_cache(instance, state)
    if previous is not None:
        report_policy_end(previous.policy)  # the policy's end: how many keys fell back, and so on
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
        installation = pinning.active
        if installation is not None and installation.policy.mode in _GUARDED_MODES:
            state = state_for(self, installation)
            if state.in_scope:
                raise BenchmarkForbiddenError(state.kernel, installation.policy.mode)
        return original(self, *args, **kwargs)

    return _bench


def _make_run(original: Any) -> Any:
    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The hit path: a key this autotuner already launched under the active installation.
        # One dict lookup for the state, one for the launch record; everything else was computed
        # at the key's first launch (``_first_launch``).
        state = self.__dict__.get(STATE_ATTR)
        if state is not None and state.live is pinning.active:
            launch = state.find(args, kwargs)
            if launch is not None:
                config, options, _ = launch
                # Triton's cache-hit launch: Config.pre_hook sees the full argument dict, then fn.run.
                self.best_config = config
                if config.pre_hook is not None:
                    config.pre_hook({**dict(zip(self.arg_names, args)), **kwargs, **options})
                return self.fn.run(*args, **kwargs, **options)
        return _first_launch(original, self, args, kwargs)

    return run


def _first_launch(original: Any, autotuner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Every launch the hit path does not take: decide a new key (and keep its launch record for
    the hit path), or route to Triton or record mode."""
    pinned = autotuner.__dict__.get(PINNED_ATTR)
    if pinned is not None:  # a compiled graph's one-config copy: decided when it was traced
        # ``_launch`` passes every option (callers' keywords may be there): no defaults to read.
        return _launch(autotuner, make_launch(pinned, {}), args, kwargs)
    installation = pinning.active
    if installation is None or installation.policy.mode == "off":
        return original(autotuner, *args, **kwargs)
    state = autotuner.__dict__.get(STATE_ATTR)
    if state is None or state.generation != installation.generation:
        state = state_for(autotuner, installation)
    if not state.in_scope:
        return original(autotuner, *args, **kwargs)
    if installation.policy.mode == "record":
        return _record_run(original, autotuner, state, installation, args, kwargs)
    raw = raw_key(state, args, kwargs)
    config = state.pins.get(raw)
    if config is None:
        config = decide(autotuner, state, installation, raw, args, kwargs)
    keep = len(state.launches) < pinning.MAX_LAUNCHES
    # Only a kept record reaches the compiled hit path, the one user of the shorter options.
    launch = make_launch(config, launch_option_defaults() if keep else {})
    if keep:
        if not state.launches:  # the first launch's call pattern is the one compiled for speed
            specialize_find(state, args)
        state.launches[launch_key(state, args, kwargs)] = launch
        state.live = installation
        _arm(autotuner, state, installation, args, kwargs)
    return _launch(autotuner, launch, args, kwargs)


def _arm(
    autotuner: Any,
    state: AutotunerState,
    installation: Installation,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Give ``autotuner`` the compiled hit path as its instance ``run`` (``launches.compile_run``).

    Once per (autotuner, installation), for a call of the shape ``kernel[grid](...)`` makes
    (kernel arguments positional, only ``grid`` and ``warmup`` by keyword), and only while the
    class-level ``run`` the instance sees is this module's (a subclass that overrides ``run``
    keeps its own). Other calls keep taking the class-level hit path.
    """
    if kwargs.keys() != _LAUNCH_KEYWORDS or pinning.serving(autotuner.__dict__.get("run")) is installation:
        return
    patched = _originals and autotuner_class().__dict__.get("run")
    if not patched or getattr(type(autotuner), "run", None) is not patched:
        return
    run = compile_run(state, autotuner, args, serves=installation, flags=pinning, slow=patched)
    pinning.arm(autotuner, run)


def _launch(autotuner: Any, launch: Launch, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Triton's cache-hit launch (``run``'s hit path does the same inline, to save a call)."""
    config, options, _ = launch
    autotuner.best_config = config
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(autotuner.arg_names, args)), **kwargs, **options})
    return autotuner.fn.run(*args, **kwargs, **options)


def _record_run(
    original: Any,
    autotuner: Any,
    state: AutotunerState,
    installation: Installation,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Record mode: Triton autotunes as usual; record its winner and timings once per key."""
    raw = raw_key(state, args, kwargs)
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
