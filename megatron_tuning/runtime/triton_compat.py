"""Which Triton releases the adapter supports, the autotuner internals a decision touches (its
pruning, its ``cache``), and the lazy benchmarker Triton 3.2/3.3 need on CPU.

``remember_in_triton_cache``/``forget_triton_cache`` take the per-autotuner state's
``triton_keys`` (``pinning.AutotunerState``): the entries written, so exactly those are removed.
Triton 3.2/3.3 resolve the default benchmarker in ``Autotuner.__init__``, which fails with
"0 active drivers" on a machine without a GPU. ``lazy_benchmarker()`` (and an installed
interception) wrap ``__init__`` to pass a benchmarker resolved at first use instead. Contract
tests in ``tests/runtime/test_triton_contract.py`` pin every private attribute used here.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator
from typing import Any

from ..core.errors import UnsupportedTritonError

MIN_TRITON = (3, 3)

_lock = threading.RLock()
_init_original: Any = None
_init_users = 0


def autotuner_class() -> Any:
    from triton.runtime.autotuner import Autotuner

    return Autotuner


def triton_version() -> tuple[int, int]:
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_triton_contract() -> None:
    """Raise ``UnsupportedTritonError`` unless Triton has every attribute the patch relies on."""
    import triton

    if triton_version() < MIN_TRITON:
        raise UnsupportedTritonError(
            f"megatron_tuning needs Triton >= {MIN_TRITON[0]}.{MIN_TRITON[1]}, found {triton.__version__}; "
            "upgrade Triton (pip install -U triton)."
        )
    autotuner = autotuner_class()
    missing = [
        name for name in ("run", "_bench", "prune_configs", "__init__") if not hasattr(autotuner, name)
    ]
    init_params = inspect.signature(autotuner.__init__).parameters
    missing += [
        f"__init__({p})" for p in ("fn", "arg_names", "configs", "key", "do_bench") if p not in init_params
    ]
    if not hasattr(triton.Config, "all_kwargs"):
        missing.append("Config.all_kwargs")
    if missing:
        raise UnsupportedTritonError(
            f"Triton {triton.__version__} changed the autotuner internals megatron_tuning patches "
            f"(missing: {', '.join(missing)}). Pin a supported Triton or upgrade megatron_tuning."
        )


LAUNCH_OPTIONS = ("num_warps", "num_ctas", "num_stages", "maxnreg")
"""The compile options ``Config.all_kwargs()`` adds to a launch, beside the config's own kwargs."""


def launch_option_defaults() -> dict[str, Any]:
    """What ``JITFunction.run`` compiles with for each of ``LAUNCH_OPTIONS`` left out of a launch
    (the active backend's ``parse_options({})`` for the current target); ``{}`` where that cannot
    be read (the interpreter, no GPU driver), so nothing is left out there.

    Read once per decision, never per launch. Triton turns the options of every launch into
    its kernel cache key (``str(options)``), so each option passed costs every launch; one equal
    to the default compiles the same kernel whether passed or not."""
    try:
        from triton.compiler.compiler import make_backend
        from triton.runtime.driver import driver

        target = driver.active.get_current_target()
    except Exception:  # noqa: BLE001 - no active GPU driver (CPU, interpreter): keep every option
        return {}
    return dict(_defaults_for(target, make_backend))


@functools.lru_cache(maxsize=8)
def _defaults_for(target: Any, make_backend: Any) -> tuple[tuple[str, Any], ...]:
    try:
        options = make_backend(target).parse_options({})
    except Exception:  # noqa: BLE001 - a backend that needs more to parse: keep every option
        return ()
    return tuple((name, getattr(options, name)) for name in LAUNCH_OPTIONS if hasattr(options, name))


def triton_cache_key(autotuner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The key Triton's own ``Autotuner.run`` files a call under in ``autotuner.cache`` (3.2+).

    The values of the ``key=`` arguments in ``key=`` order, then ``str(dtype)`` of every argument
    that has one: positional arguments first, then keyword arguments in call order.
    """
    arg_names = autotuner.arg_names
    named = {**dict(zip(arg_names, args)), **kwargs}
    present = {name: value for name, value in named.items() if name in arg_names}
    key = [present[name] for name in autotuner.keys if name in present]
    key.extend(str(value.dtype) for value in present.values() if hasattr(value, "dtype"))
    return tuple(key)


def live_candidates(autotuner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The kernel's own pruning (early_config_prune, perf_model/top_k), as Triton applies it."""
    if len(autotuner.configs) <= 1:
        return list(autotuner.configs)
    autotuner.nargs = dict(zip(autotuner.arg_names, args))  # prune_configs reads self.nargs
    try:
        return list(autotuner.prune_configs(kwargs))
    finally:
        autotuner.nargs = None


def remember_in_triton_cache(
    autotuner: Any, state: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: Any
) -> None:
    """File the decision under Triton's own key, as Triton's hit path leaves it, for code that reads it."""
    key = triton_cache_key(autotuner, args, kwargs)
    autotuner.cache[key] = config
    state.triton_keys[key] = config


def forget_triton_cache(autotuner: Any, state: Any) -> None:
    # Only entries still holding what we wrote: Triton may have re-tuned a key since (mode off).
    cache = autotuner.__dict__.get("cache")
    for key, config in state.triton_keys.items():
        if cache is not None and cache.get(key) is config:
            del cache[key]
    state.triton_keys.clear()


def _needs_lazy_init() -> bool:
    # 3.4+ resolve the benchmarker lazily themselves (a cached_property); 3.2/3.3 do it in __init__.
    autotuner = autotuner_class()
    return not isinstance(inspect.getattr_static(autotuner, "do_bench", None), functools.cached_property)


def acquire_lazy_init() -> None:
    global _init_original, _init_users
    with _lock:
        if _init_users == 0 and _needs_lazy_init():
            autotuner = autotuner_class()
            _init_original = autotuner.__dict__["__init__"]
            autotuner.__init__ = _make_init(_init_original)
        _init_users += 1


def release_lazy_init() -> None:
    global _init_original, _init_users
    with _lock:
        _init_users -= 1
        if _init_users == 0 and _init_original is not None:
            autotuner_class().__init__ = _init_original
            _init_original = None


@contextlib.contextmanager
def lazy_benchmarker() -> Iterator[None]:
    """Let ``@triton.autotune`` decorate without a GPU driver (Triton interpreter on CPU).

    Triton 3.2/3.3 resolve the default benchmarker when the decorator runs, which fails with
    "0 active drivers" on a machine without a GPU. Inside this block (and while the interception
    is installed) decoration passes a benchmarker that is resolved at first use instead.
    Elsewhere this does nothing.
    """
    acquire_lazy_init()
    try:
        yield
    finally:
        release_lazy_init()


class _LazyBenchmarker:
    """Resolves Triton's default benchmarker at first use instead of at decoration."""

    def __call__(self, kernel_call: Any, quantiles: Any = None, **kwargs: Any) -> Any:
        from triton.runtime.driver import driver

        return driver.active.get_benchmarker()(kernel_call, quantiles=quantiles, **kwargs)


def _make_init(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        legacy = any(bound.arguments.get(name) for name in ("warmup", "rep", "use_cuda_graph"))
        if bound.arguments.get("do_bench") is None and not legacy:
            bound.arguments["do_bench"] = _LazyBenchmarker()
        original(*bound.args, **bound.kwargs)

    return __init__
