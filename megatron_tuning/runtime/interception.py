"""The Triton adapter: the only module that touches Triton's private autotuner internals.

``install(policy)`` patches ``triton.runtime.autotuner.Autotuner`` at class level:

* ``run``: an in-scope kernel under ``deterministic``/``chaos``/``tune``/``auto`` launches the
  config ``pinning.decide`` chose for the key among its live (pruned) configs, as Triton's
  cache-hit path launches one: ``best_config`` set, ``Config.pre_hook`` with the full argument
  dict, ``fn.run``. The decision is filed in the autotuner's ``cache`` under Triton's key until the
  next install or uninstall. Autotuner-level ``reset_to_zero``/``restore_value``/``pre_hook``/
  ``post_hook`` protect benchmarking only, so they do not run. ``record`` lets Triton autotune and
  logs its winner; out-of-scope kernels and mode ``off`` get Triton's own ``run``.
* ``_bench``: raises ``BenchmarkForbiddenError`` for in-scope kernels under deterministic, chaos
  and auto, so a key mismatch can never fall back to timing silently.
* ``__init__`` on Triton 3.3 only: a lazy benchmarker (``lazy_benchmarker``).

The hit path: after a pinned ``kernel[grid](*args)`` launch the autotuner gets an instance ``run``
(found before the class's; ``_generate_run``) that serves calls of that shape under the same
installation. Other calls take the class-level ``run``, which finds the key's decision by name.

``install`` also patches torch.compile's handling of user kernels (``inductor``). ``uninstall()``
restores Triton exactly; ``tests/runtime/test_triton_contract.py`` pins each private attribute used.
"""

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
from ..core.choice import Choice, as_config_table, report_policy_end
from ..core.errors import BenchmarkForbiddenError, UnsupportedTritonError
from ..core.identity import config_signature, kernel_source_hash, tuning_key
from ..core.policy import TuningPolicy
from ..core.warn import reset_warnings
from . import inductor, pinning
from .pinning import AutotunerState, Consensus, Installation, Measure, current_policy, installed

logger = logging.getLogger(__name__)

MIN_TRITON = (3, 3)
LAUNCH_OPTIONS = ("num_warps", "num_ctas", "num_stages", "maxnreg")
"""The compile options ``Config.all_kwargs()`` adds to a launch, beside the config's own kwargs."""
# Modes whose in-scope launches never reach Triton's own benchmarking: ``_bench`` raises there.
_GUARDED_MODES = ("deterministic", "chaos", "auto")
# The keywords ``kernel[grid](...)`` adds to a call: the call shape the instance ``run`` serves.
_LAUNCH_KEYWORDS = frozenset(("grid", "warmup"))
_ABSENT = object()  # the launch-key entry of an argument without a dtype; a keyword not passed
Args = tuple[Any, ...]
Kwargs = dict[str, Any]

_lock = threading.RLock()
_generation = 0
_originals: dict[str, Any] = {}
_filed: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()
"""The entries written into each autotuner's ``cache``, so exactly those are removed again."""
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
            autotuner = autotuner_class()
            _originals.update(run=autotuner.__dict__["run"], _bench=autotuner.__dict__["_bench"])
            autotuner.run = _make_run(_originals["run"])
            autotuner._bench = _make_bench(_originals["_bench"])
            _use_lazy_init(+1)
            inductor.patch(_pin)
        _generation += 1
        installation = Installation(policy, as_config_table(table), measure, _generation, consensus, chaos)
        pinning.set_active(installation)
        _forget_instance_runs_and_filed_entries()
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
            _use_lazy_init(-1)
        _forget_instance_runs_and_filed_entries()
        for instance in pinning.touched():
            instance.__dict__.pop(pinning.STATE_ATTR, None)
    if previous is not None:
        report_policy_end(previous.policy)  # the policy's end: how many keys fell back, and so on
    logger.debug("interception uninstalled")


def _forget_instance_runs_and_filed_entries() -> None:
    for autotuner in pinning.touched():  # (under ``_lock``, as ``_filed`` is written)
        if pinning.serving(autotuner.__dict__.get("run")) is not None:
            del autotuner.__dict__["run"]
    for autotuner, entries in list(_filed.items()):
        cache = autotuner.__dict__.get("cache", {})
        for key in [k for k, config in entries.items() if cache.get(k) is config]:  # not re-tuned since
            del cache[key]
    _filed.clear()


def _make_bench(original: Any) -> Any:
    @functools.wraps(original)
    def _bench(self: Any, *args: Any, **kwargs: Any) -> Any:
        installation = pinning.active
        if installation is not None and installation.policy.mode in _GUARDED_MODES:
            state = pinning.state_for(self, installation)
            if state.in_scope:
                raise BenchmarkForbiddenError(state.kernel, installation.policy.mode)
        return original(self, *args, **kwargs)

    return _bench


def _make_run(original: Any) -> Any:
    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        pinned = self.__dict__.get(pinning.PINNED_ATTR)
        if pinned is not None:  # a compiled graph's one-config copy: decided when it was traced
            return _launch(self, pinned, args, kwargs)
        installation = pinning.active
        if installation is None or installation.policy.mode == "off":
            return original(self, *args, **kwargs)
        state = pinning.state_for(self, installation)
        if not state.in_scope:
            return original(self, *args, **kwargs)
        if installation.policy.mode == "record":
            return _record(original, self, state, installation.arch, args, kwargs)
        config = _pin(self, installation, args, kwargs)
        if (
            kwargs.keys() == _LAUNCH_KEYWORDS
            and pinning.serving(self.__dict__.get("run")) is not installation
        ):
            _arm(self, state, installation, args)
        return _launch(self, config, args, kwargs)

    return run


def _pin(autotuner: Any, installation: Installation, args: Args, kwargs: Kwargs, **options: Any) -> Any:
    """The config of this call's key: its decision, made now if the key is new (``inductor`` calls
    this too, with ``pinning.decide``'s options). A new decision is filed in the autotuner's
    ``cache`` under Triton's key."""
    state = pinning.state_for(autotuner, installation)
    raw = pinning.raw_key(state, args, kwargs)
    config = state.pins.get(raw)
    if config is None:
        candidates = functools.partial(_live_candidates, autotuner, args, kwargs)
        config = pinning.decide(
            autotuner, state, installation, raw, args, kwargs, candidates=candidates, **options
        )
        key = triton_cache_key(autotuner, args, kwargs)
        with _lock:
            autotuner.cache[key] = config
            _filed.setdefault(autotuner, {})[key] = config
    return config


def _launch(autotuner: Any, config: Any, args: Args, kwargs: Kwargs) -> Any:
    """Triton's cache-hit launch (the generated ``run`` does the same with fewer options)."""
    options = config.all_kwargs()
    autotuner.best_config = config
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(autotuner.arg_names, args)), **kwargs, **options})
    return autotuner.fn.run(*args, **kwargs, **options)


def _arm(autotuner: Any, state: AutotunerState, installation: Installation, args: Args) -> None:
    """Make the hit path for calls shaped like ``args`` the instance ``run``: only over none or ours (a
    user's own keeps precedence), where the class ``run`` is ours (a subclass may override it), and
    while ``installation`` is active (checked under ``_lock``, which ``uninstall`` holds)."""
    if getattr(type(autotuner), "run", None) is not autotuner_class().__dict__.get("run"):
        return
    run = _generate_run(autotuner, state, installation, args)
    with _lock:
        current = autotuner.__dict__.get("run")
        if pinning.active is installation and (current is None or pinning.serving(current) is not None):
            autotuner.__dict__["run"] = run


def _generate_run(autotuner: Any, state: AutotunerState, installation: Installation, args: Args) -> Any:
    """The pinned hit path for calls with ``len(args)`` positional arguments and ``grid`` and
    ``warmup`` by keyword while ``installation`` is active; any other call goes to the class path.

    Its launch key is one expression over the unpacked arguments: each ``key=`` value with its type
    (``True``, ``1`` and ``1.0`` stay apart), then each argument's ``dtype`` (``.dtype`` where
    ``args`` had one, else ``getattr``). For a fixed count of arguments, equal launch keys mean
    equal decision keys. A key without a record gets its decision from ``learn``. Generated, as
    Triton generates its JIT binder per signature, because a closure's ``map`` over the arguments
    measured 0.26x of what Triton's own hit path adds per launch, this 0.16x, the goal 0.2x
    (``benchmarks/bench_launch_overhead.py --cpu``). Only positions enter the source, never names.
    """
    names = [f"a{i}" for i in range(len(args))]
    parts = [f"{names[i]}.__class__, {names[i]}" for _, i in state.key_index if i < len(args)]
    parts += [
        f"{n}.dtype" if hasattr(a, "dtype") else f"getattr({n}, 'dtype', _ABSENT)"
        for n, a in zip(names, args)
    ]
    unpack = f"{', '.join(names)}, = args" if names else "pass"
    key_source = "".join(part + ", " for part in parts)
    records: dict[tuple[Any, ...], tuple[Any, dict[str, Any]]] = {}

    def learn(key: tuple[Any, ...], args: Args, grid: Any, warmup: Any) -> Any:
        config = _pin(autotuner, installation, args, {"grid": grid, "warmup": warmup})
        # fn.run fills in the backend's defaults itself; each option passed lengthens Triton's
        # per-launch cache key. Config.pre_hook still sees them all.
        defaults = launch_option_defaults()
        options = {k: v for k, v in config.all_kwargs().items() if k not in defaults or defaults[k] != v}
        records[key] = (config, options)  # one per decision key: never more records than pins
        return config, options

    source = f"""\
def run(*args, grid=_ABSENT, warmup=_ABSENT, **kwargs):
    if (kwargs or len(args) != {len(args)} or grid is _ABSENT or warmup is _ABSENT
            or pinning.active is not serves):
        return slow(autotuner, args, grid, warmup, kwargs)
    {unpack}
    try:
        key = ({key_source})
    except AttributeError:  # no dtype where the call that armed this had one
        return slow(autotuner, args, grid, warmup, kwargs)
    launch = get(key)
    if launch is None:
        launch = learn(key, args, grid, warmup)
    config, options = launch
    autotuner.best_config = config
    if config.pre_hook is not None:  # the full argument dict, as on Triton's hit path
        named = dict(zip(arg_names, args))
        config.pre_hook({{**named, "grid": grid, "warmup": warmup, **config.all_kwargs()}})
    return autotuner.fn.run(*args, grid=grid, warmup=warmup, **options)
"""
    scope = dict(
        _ABSENT=_ABSENT,
        arg_names=state.arg_names,
        autotuner=autotuner,
        get=records.get,
        learn=learn,
        pinning=pinning,
        serves=installation,
        slow=_class_run,
    )
    exec(compile(source, f"<megatron_tuning launch {state.kernel}>", "exec"), scope)  # noqa: S102
    run = scope["run"]
    setattr(run, pinning.SERVES_ATTR, installation)
    return run


def _class_run(autotuner: Any, args: Args, grid: Any, warmup: Any, kwargs: Kwargs) -> Any:
    """A call the generated ``run`` does not serve, to the class's ``run`` (Triton's once uninstalled)."""
    launch = {name: value for name, value in (("grid", grid), ("warmup", warmup)) if value is not _ABSENT}
    return type(autotuner).run(autotuner, *args, **launch, **kwargs)


def _record(
    original: Any, autotuner: Any, state: AutotunerState, arch: str, args: Args, kwargs: Kwargs
) -> Any:
    """Record mode: Triton autotunes as usual; its winner and timings are logged once per key."""
    raw = pinning.raw_key(state, args, kwargs)
    if raw in state.pins:
        return original(autotuner, *args, **kwargs)
    before = autotuner.__dict__.get("configs_timings")
    result = original(autotuner, *args, **kwargs)
    with state.lock:
        if raw in state.pins:
            return result
        after = autotuner.__dict__.get("configs_timings")
        timings = None
        if after is not None and after is not before:  # Triton benchmarked at this call
            as_list = lambda t: list(t) if isinstance(t, (list, tuple)) else [t]  # noqa: E731
            candidates = {config_signature(c): [float(x) for x in as_list(t)] for c, t in after.items()}
            timings = {"candidates": candidates, "bench_time_s": getattr(autotuner, "bench_time", None)}
        if state.source_hash is None:
            state.source_hash = kernel_source_hash(autotuner)
        choice = Choice(autotuner.best_config, "recorded")
        pinning.log(state, tuning_key(autotuner, args, kwargs), choice, arch, timings)
        state.pins[raw] = choice.config
    return result


# --------------------------------------------------------------------------- Triton's internals


def autotuner_class() -> Any:
    from triton.runtime.autotuner import Autotuner

    return Autotuner


def check_triton_contract() -> None:
    """Raise ``UnsupportedTritonError`` unless Triton has every attribute the patch relies on."""
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


def triton_cache_key(autotuner: Any, args: Args, kwargs: Kwargs) -> tuple[Any, ...]:
    """The key Triton's own ``Autotuner.run`` files a call under in ``autotuner.cache``: the
    ``key=`` values in ``key=`` order, then ``str(dtype)`` of every argument that has one,
    positional arguments first, then keyword arguments in call order."""
    arg_names = autotuner.arg_names
    named = {**dict(zip(arg_names, args)), **kwargs}
    present = {name: value for name, value in named.items() if name in arg_names}
    key = [present[name] for name in autotuner.keys if name in present]
    key.extend(str(value.dtype) for value in present.values() if hasattr(value, "dtype"))
    return tuple(key)


def _live_candidates(autotuner: Any, args: Args, kwargs: Kwargs) -> list[Any]:
    """The kernel's own pruning (early_config_prune, perf_model/top_k), as Triton applies it."""
    if len(autotuner.configs) <= 1:
        return list(autotuner.configs)
    autotuner.nargs = dict(zip(autotuner.arg_names, args))  # prune_configs reads self.nargs
    try:
        return list(autotuner.prune_configs(kwargs))
    finally:
        autotuner.nargs = None


def launch_option_defaults() -> dict[str, Any]:
    """What ``JITFunction.run`` compiles with for each of ``LAUNCH_OPTIONS`` left out of a launch (the
    backend's ``parse_options({})``); ``{}`` where that cannot be read (the interpreter, no GPU
    driver), so nothing is left out there. Read once per launch record, never per launch."""
    try:
        from triton.runtime.driver import driver

        target = driver.active.get_current_target()
    except Exception:  # noqa: BLE001 - no active GPU driver (CPU, interpreter): keep every option
        return {}
    return dict(_defaults_for(target))


@functools.lru_cache(maxsize=8)
def _defaults_for(target: Any) -> tuple[tuple[str, Any], ...]:
    from triton.compiler.compiler import make_backend

    try:
        options = make_backend(target).parse_options({})
    except Exception:  # noqa: BLE001 - a backend that needs more to parse: keep every option
        return ()
    return tuple((name, getattr(options, name)) for name in LAUNCH_OPTIONS if hasattr(options, name))


@contextlib.contextmanager
def lazy_benchmarker() -> Iterator[None]:
    """Let ``@triton.autotune`` decorate without a GPU driver (Triton interpreter on CPU).

    Triton 3.3 resolves the default benchmarker when the decorator runs, which fails with
    "0 active drivers" without a GPU. Inside this block (and while the interception is
    installed) decoration passes a benchmarker resolved at first use instead. Elsewhere (3.4+
    resolve it lazily themselves) this does nothing.
    """
    _use_lazy_init(+1)
    try:
        yield
    finally:
        _use_lazy_init(-1)


def _use_lazy_init(change: int) -> None:
    """Count the lazy benchmarker's users (an installation, each ``lazy_benchmarker`` block): the
    first patches ``Autotuner.__init__`` where Triton resolves its benchmarker eagerly (3.3; 3.4+
    use a ``cached_property``), the last restores it (importing nothing: it may run at exit)."""
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


def _lazy_do_bench(kernel_call: Any, quantiles: Any = None, **kwargs: Any) -> Any:
    """Triton's default benchmarker, resolved at first use instead of at decoration."""
    from triton.runtime.driver import driver

    return driver.active.get_benchmarker()(kernel_call, quantiles=quantiles, **kwargs)


def _make_init(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        legacy = any(bound.arguments.get(name) for name in ("warmup", "rep", "use_cuda_graph"))
        if bound.arguments.get("do_bench") is None and not legacy:
            bound.arguments["do_bench"] = _lazy_do_bench
        original(*bound.args, **bound.kwargs)

    return __init__
