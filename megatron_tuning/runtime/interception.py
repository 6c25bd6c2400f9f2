"""The Triton adapter: the only module that patches Triton's private ``Autotuner`` class. ``run``
launches ``pinning.decide``'s config as Triton's cache-hit path does (``fastpath`` serves a
``kernel[grid](*args)`` call shape after its first launch); ``_bench`` refuses to time where nothing
may; ``record`` logs Triton's winner; ``uninstall()`` restores Triton exactly."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from ..core.chaos import ChaosCoordinator
from ..core.choice import Choice, as_config_table
from ..core.errors import BenchmarkForbiddenError, LaunchOptionError, UnsupportedTritonError
from ..core.identity import config_signature, kernel_id
from ..core.key import render
from ..core.notices import report_policy_end, reset_warnings
from ..core.policy import TuningPolicy
from . import fastpath, inductor, pinning
from .pinning import AutotunerState, Consensus, Installation, Launch, Measure, current_policy, installed

logger = logging.getLogger(__name__)

MIN_TRITON = (3, 3)
_LAUNCH_KEYWORDS = frozenset(("grid", "warmup"))  # what ``kernel[grid](...)`` passes: the call shape armed
Args = tuple[Any, ...]
Kwargs = dict[str, Any]

_lock = threading.RLock()
_generation = 0
_originals: dict[str, Any] = {}
# The entries written into each autotuner's ``cache``, so exactly those are removed again.
_filed: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()
_init_original: tuple[Any, Any] | None = None  # (Autotuner, its own __init__) while patched
_init_users = 0

__all__ = ["current_policy", "install", "installed", "lazy_benchmarker", "uninstall"]


def install(
    policy: TuningPolicy,
    *,
    table: Any = None,
    measure: Measure | None = None,
    consensus: Consensus | None = None,
    chaos: ChaosCoordinator | None = None,
    fast_path: bool = True,
) -> None:
    """Patch Triton's Autotuner (and torch.compile's handling of it) for ``policy``; a second call
    replaces the policy. ``table``: a ``core.choice.ConfigTable`` or a ``{(kernel, key): config}``
    mapping. ``measure`` is required in ``tune``; ``auto`` without one applies the miss rule.
    ``consensus`` (``auto``) and ``chaos`` coordinate the job's ranks; ``None``: this process alone.
    ``fast_path=False``: every call takes the class path (what the launch benchmark compares)."""
    global _generation
    if policy.mode == "tune" and measure is None:
        raise ValueError("policy mode 'tune' needs a measure function (see megatron_tuning.tuning.tuner)")
    check_triton_contract()
    with _lock:
        previous = pinning.active
        if not _originals:
            autotuner = autotuner_class()
            _originals.update(run=autotuner.__dict__["run"], _bench=autotuner.__dict__["_bench"])
            autotuner.run = _make_run(_originals["run"])
            autotuner._bench = _make_bench(_originals["_bench"])
            _use_lazy_init(+1)
            inductor.patch(_pin)
        _generation += 1
        table = as_config_table(table)
        installation = Installation(policy, table, measure, _generation, consensus, chaos, fast_path)
        pinning.set_active(installation)
        _forget_instance_runs_and_filed_entries()
    if previous is not None:
        report_policy_end(previous.policy)
    reset_warnings()  # a new policy reports every notice again, once
    inductor.warn_if_unsupported(policy)
    logger.debug("interception installed: %s", policy.describe())


def uninstall() -> None:
    with _lock:
        previous = pinning.active
        pinning.set_active(None)
        if _originals:
            autotuner = autotuner_class()
            for name, original in _originals.items():
                setattr(autotuner, name, original)
            _originals.clear()
            inductor.unpatch()
            _use_lazy_init(-1)
        _forget_instance_runs_and_filed_entries()
        for instance in pinning.touched():
            instance.__dict__.pop(pinning.STATE_ATTR, None)
    if previous is not None:
        report_policy_end(previous.policy)  # the policy's end: how many keys fell back, and so on
    logger.debug("interception uninstalled")


def _forget_instance_runs_and_filed_entries() -> None:
    for autotuner in pinning.touched():  # (under ``_lock``, as ``_filed`` is written)
        fastpath.disarm(autotuner)
    for autotuner, entries in list(_filed.items()):
        cache = autotuner.__dict__.get("cache", {})
        for key in [k for k, config in entries.items() if cache.get(k) is config]:  # not re-tuned since
            del cache[key]
    _filed.clear()


def _make_bench(original: Any) -> Any:
    @functools.wraps(original)
    def _bench(self: Any, *args: Any, **kwargs: Any) -> Any:
        installation = pinning.active
        # deterministic, chaos and auto never time: a key mismatch must not fall back to timing silently
        if installation is not None and installation.policy.mode in ("deterministic", "chaos", "auto"):
            state = pinning.state_for(self, installation)
            if state.in_scope:
                raise BenchmarkForbiddenError(state.kernel, installation.policy.mode)
        return original(self, *args, **kwargs)

    return _bench


def _make_run(original: Any) -> Any:
    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        pinned = self.__dict__.get(inductor.PINNED_ATTR)
        if pinned is not None:  # a compiled graph's one-config copy: decided when it was traced
            return _launch(self, (pinned, pinned.all_kwargs()), args, kwargs)
        installation = pinning.active
        if installation is None or installation.policy.mode == "off":
            return original(self, *args, **kwargs)
        state = pinning.state_for(self, installation)
        if not state.in_scope:
            return original(self, *args, **kwargs)
        if installation.policy.mode == "record":
            return _record(original, self, state, installation.arch, args, kwargs)
        armable = kwargs.keys() == _LAUNCH_KEYWORDS  # else keywords of the call's own, never generated
        if not armable and not state.config_keywords.isdisjoint(kwargs):
            _refuse_clashes(self, kwargs)  # before deciding: nothing measured, logged or cached
        launch = _pin(self, installation, args, kwargs)
        if armable:
            fastpath.arm(self, state, installation, args)
        return _launch(self, launch, args, kwargs)

    return run


def _pin(autotuner: Any, installation: Installation, args: Args, kwargs: Kwargs, **options: Any) -> Launch:
    """The ``Launch`` of this call, decided now if new and filed in the autotuner's ``cache``."""
    state = pinning.state_for(autotuner, installation)
    launch_key = state.launch_key(args, kwargs)
    launch = state.launches.get(launch_key)
    if launch is None:
        key = state.key(args, kwargs)
        candidates = functools.partial(_live_candidates, autotuner, args, kwargs)
        config = pinning.decide(
            autotuner, state, installation, key, args, kwargs, candidates=candidates, **options
        )
        launch = state.launches.setdefault(launch_key, (config, fastpath.launch_options(config)))
        triton_key = key.triton_key([*state.arg_names[: len(args)], *kwargs])
        with _lock:
            autotuner.cache[triton_key] = config
            _filed.setdefault(autotuner, {})[triton_key] = config
    return launch


def _launch(autotuner: Any, launch: Launch, args: Args, kwargs: Kwargs) -> Any:
    """Triton's cache-hit launch (``fastpath``'s generated ``run`` does the same)."""
    config, options = launch
    autotuner.best_config = config
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(autotuner.arg_names, args)), **kwargs, **config.all_kwargs()})
    return autotuner.fn.run(*args, **kwargs, **options)


def _refuse_clashes(autotuner: Any, kwargs: Kwargs) -> None:
    """Raise for the call's keywords that one of the configs sets, as stock Triton does (its tuner for
    a meta-parameter, its launch for an option): a pinned launch's options leave out what equals the
    backend's defaults, so the call's ``num_warps`` would launch instead. Named: the first config that
    sets one. (A compiled graph's copy passes all its config's: Python itself refuses there.)"""
    for config in autotuner.configs:
        sets = config.all_kwargs()
        clashes = {name: render(kwargs[name]) for name in kwargs if name in sets}
        if clashes:
            raise LaunchOptionError(kernel_id(autotuner), clashes, config_signature(config))


def _record(
    original: Any, autotuner: Any, state: AutotunerState, arch: str, args: Args, kwargs: Kwargs
) -> Any:
    """Record mode: Triton autotunes as usual; its winner and timings are logged once per key."""
    launch_key = state.launch_key(args, kwargs)
    if launch_key in state.launches:
        return original(autotuner, *args, **kwargs)
    before = autotuner.__dict__.get("configs_timings")
    result = original(autotuner, *args, **kwargs)
    key = state.key(args, kwargs)
    with state.lock:
        state.launches[launch_key] = (autotuner.best_config, {})  # seen: never launched from here
        if key in state.pins:
            return result
        after = autotuner.__dict__.get("configs_timings")
        timings = None
        if after is not None and after is not before:  # Triton benchmarked at this call
            as_list = lambda t: list(t) if isinstance(t, (list, tuple)) else [t]  # noqa: E731
            candidates = {config_signature(c): [float(x) for x in as_list(t)] for c, t in after.items()}
            timings = {"candidates": candidates, "bench_time_s": getattr(autotuner, "bench_time", None)}
        choice = Choice(autotuner.best_config, "recorded", timings=timings)
        pinning.log(state, key, choice, arch)
        state.pins[key] = choice.config
    return result


def autotuner_class() -> Any:
    from triton.runtime.autotuner import Autotuner

    return Autotuner


def check_triton_contract() -> None:
    import triton

    major, minor = triton.__version__.split(".")[:2]
    if (int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)) < MIN_TRITON:
        raise UnsupportedTritonError(
            f"megatron_tuning needs Triton >= {MIN_TRITON[0]}.{MIN_TRITON[1]}, found {triton.__version__}; "
            "upgrade Triton (pip install -U triton)."
        )
    autotuner, config = autotuner_class(), triton.Config
    parameters = inspect.signature(autotuner.__init__).parameters
    missing = [name for name in ("run", "_bench", "prune_configs") if not hasattr(autotuner, name)]
    missing += [
        f"__init__({p})" for p in ("fn", "arg_names", "configs", "key", "do_bench") if p not in parameters
    ]
    missing += [] if hasattr(config, "all_kwargs") else ["Config.all_kwargs"]
    if missing:
        raise UnsupportedTritonError(
            f"Triton {triton.__version__} changed the autotuner internals megatron_tuning patches "
            f"(missing: {', '.join(missing)}). Pin a supported Triton or upgrade megatron_tuning."
        )


def _live_candidates(autotuner: Any, args: Args, kwargs: Kwargs) -> list[Any]:
    """The kernel's own pruning (early_config_prune, perf_model/top_k), as Triton applies it."""
    if len(autotuner.configs) <= 1:
        return list(autotuner.configs)
    autotuner.nargs = dict(zip(autotuner.arg_names, args))  # prune_configs reads self.nargs
    try:
        return list(autotuner.prune_configs(kwargs))
    finally:
        autotuner.nargs = None


@contextlib.contextmanager
def lazy_benchmarker() -> Iterator[None]:
    """Let ``@triton.autotune`` decorate without a GPU driver: Triton 3.3 resolves its benchmarker at
    decoration ("0 active drivers"); inside this block (and while installed), at first use."""
    _use_lazy_init(+1)
    try:
        yield
    finally:
        _use_lazy_init(-1)


def _use_lazy_init(change: int) -> None:
    """The first user patches ``Autotuner.__init__`` where Triton resolves its benchmarker eagerly,
    the last restores it (importing nothing: it may run at exit)."""
    global _init_original, _init_users
    with _lock:
        _init_users += change
        if change > 0 and _init_users == 1:
            autotuner = autotuner_class()
            if not isinstance(inspect.getattr_static(autotuner, "do_bench", None), functools.cached_property):
                _init_original = (autotuner, autotuner.__dict__["__init__"])
                autotuner.__init__ = _make_init(_init_original[1])
        elif _init_users == 0 and _init_original is not None:
            autotuner, original = _init_original
            autotuner.__init__ = original
            _init_original = None


def _make_init(original: Any) -> Any:
    signature = inspect.signature(original)

    def _lazy_do_bench(kernel_call: Any, quantiles: Any = None, **kwargs: Any) -> Any:
        from triton.runtime.driver import driver

        return driver.active.get_benchmarker()(kernel_call, quantiles=quantiles, **kwargs)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        legacy = any(bound.arguments.get(name) for name in ("warmup", "rep", "use_cuda_graph"))
        if bound.arguments.get("do_bench") is None and not legacy:
            bound.arguments["do_bench"] = _lazy_do_bench
        original(*bound.args, **bound.kwargs)

    return __init__
