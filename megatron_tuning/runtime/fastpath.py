"""The generated hit path: after a pinned ``kernel[grid](*args)`` launch, ``arm`` gives the autotuner
an instance ``run`` for calls of that many positional arguments that launches the decided ``Launch``
as the class path does; any other call goes to the class path. Generated, as Triton's JIT binder is:
a closure measured 0.26x of Triton's hit-path cost, this 0.13x (``bench_launch_overhead.py --cpu``).
Only positions enter the source, never names; ``tests/runtime/test_fastpath.py`` holds it to the class
path."""

from __future__ import annotations

import functools
import types
from typing import Any

from . import pinning

SERVES_ATTR = "_megatron_tuning_serves"  # on every ``run`` this module generates: its installation
LAUNCH_OPTIONS = ("num_warps", "num_ctas", "num_stages", "maxnreg")  # added by Config.all_kwargs()
_ABSENT = object()  # a launch keyword not passed

__all__ = ["arm", "disarm", "launch_options", "serving"]


def arm(
    autotuner: Any, state: pinning.AutotunerState, installation: pinning.Installation, args: tuple[Any, ...]
) -> None:
    """Serve calls shaped like ``args`` with a generated instance ``run`` while ``installation`` is
    active; never over a user's own instance ``run`` or where a subclass overrides ``run``."""
    current = autotuner.__dict__.get("run")
    if not installation.fast_path or (current is not None and _serves(current) is installation):
        return
    from triton.runtime.autotuner import Autotuner

    if getattr(type(autotuner), "run", None) is not Autotuner.run:
        return
    run = _generate(autotuner, state, installation, args)
    with pinning.while_active(installation) as active:
        current = autotuner.__dict__.get("run")
        if active and (current is None or _serves(current) is not None):
            autotuner.__dict__["run"] = run


def serving(autotuner: Any) -> pinning.Installation | None:
    return _serves(autotuner.__dict__.get("run"))


def disarm(autotuner: Any) -> None:
    if serving(autotuner) is not None:
        del autotuner.__dict__["run"]


def _serves(run: Any) -> pinning.Installation | None:
    # The function's own ``__dict__``: a user's mock answers every attribute.
    return run.__dict__.get(SERVES_ATTR) if isinstance(run, types.FunctionType) else None


def _generate(
    autotuner: Any, state: pinning.AutotunerState, installation: pinning.Installation, args: tuple[Any, ...]
) -> Any:
    """``run`` for ``len(args)`` positional arguments: ``state.launch_key``'s tuple slot by slot."""
    n = len(args)
    names = [f"a{i}" for i in range(n)]
    # ``pinning.launch_value``, with an int (the common key value) checked inline.
    slots = [
        f"{names[i]}.__class__, {names[i]} if {names[i]}.__class__ is int else value({names[i]})"
        if i < n
        else "None, None"
        for _, i in state.key_index
    ]
    for i in range(len(state.arg_names)):
        if i >= n:
            slots.append("None")
        else:
            slots.append(
                f"{names[i]}.dtype" if hasattr(args[i], "dtype") else f"getattr({names[i]}, 'dtype', None)"
            )
    unpack = f"{', '.join(names)}, = args" if names else "pass"
    source = f"""\
def run(*args, grid=_ABSENT, warmup=_ABSENT, **kwargs):
    if kwargs or len(args) != {n} or grid is _ABSENT or warmup is _ABSENT or pinning.active is not serves:
        return slow(args, grid, warmup, kwargs)
    {unpack}
    try:
        launch = get(({"".join(slot + ", " for slot in slots)}))
    except (AttributeError, TypeError):  # no dtype where the arming call had one; an unhashable value
        return slow(args, grid, warmup, kwargs)
    if launch is None:  # a key not decided yet: the class path decides it
        return slow(args, grid, warmup, kwargs)
    config, options = launch
    autotuner.best_config = config
    if config.pre_hook is not None:  # the full argument dict, as on Triton's hit path
        named = dict(zip(arg_names, args))
        config.pre_hook({{**named, "grid": grid, "warmup": warmup, **config.all_kwargs()}})
    return autotuner.fn.run(*args, grid=grid, warmup=warmup, **options)
"""

    def slow(args: tuple[Any, ...], grid: Any, warmup: Any, kwargs: dict[str, Any]) -> Any:
        launch = {name: value for name, value in (("grid", grid), ("warmup", warmup)) if value is not _ABSENT}
        return type(autotuner).run(autotuner, *args, **launch, **kwargs)

    scope = dict(
        _ABSENT=_ABSENT,
        arg_names=state.arg_names,
        autotuner=autotuner,
        get=state.launches.get,
        pinning=pinning,
        value=pinning.launch_value,
        serves=installation,
        slow=slow,
    )
    exec(compile(source, f"<megatron_tuning launch {state.kernel}>", "exec"), scope)  # noqa: S102
    run = scope["run"]
    setattr(run, SERVES_ATTR, installation)
    return run


def launch_options(config: Any, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The options a pinned launch passes ``fn.run``: the config's, less those equal to the backend's
    ``defaults`` (default: the active driver's), which ``fn.run`` fills in itself (each one passed
    lengthens its per-launch cache key)."""
    defaults = _launch_option_defaults() if defaults is None else defaults
    return {k: v for k, v in config.all_kwargs().items() if k not in defaults or defaults[k] != v}


def _launch_option_defaults() -> dict[str, Any]:
    """The backend's defaults for ``LAUNCH_OPTIONS``; ``{}`` without a GPU driver."""
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
