"""The torch.compile adapter: compiled graphs launch the decided config of in-scope kernels. At
trace time ``TritonHOPifier.call_triton_kernel`` makes key arguments graph constants, decides, and
hands on a one-config copy (``auto`` may defer a key); at a graph's first run
``CachingAutotuner.benchmark_all_configs`` tunes deferred keys, and any other in-scope kernel
benchmarked there bypassed the pin (a warning, or an error under ``strict``)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import re
import sys
import threading
import weakref
from typing import Any

from ..core.errors import CompiledLaunchNotPinnedError, MegatronTuningError
from ..core.identity import config_signature, from_def_line
from ..core.notices import warn_once
from ..core.policy import TuningPolicy
from . import fastpath, pinning

PASS_THROUGH_MODES = ("off", "record")  # compiled launches keep Inductor's own behaviour
PINNED_ATTR = "_megatron_tuning_pinned_config"  # on compiled code's one-config copies: their config
HOOK_PARAMETERS = ["self", "variable", "args", "kwargs", "tx"]

_lock = threading.RLock()
_originals: dict[str, tuple[Any, Any]] = {}  # name -> (owner class, original attribute)
_unsupported: str | None = None  # why compiled launches cannot be pinned in this process, if so
_tls = threading.local()
_copies: weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, Any]]] = weakref.WeakKeyDictionary()
# Kernel -> the keys ``auto`` left for Inductor's first run to tune (traced with every config).
_deferred: weakref.WeakKeyDictionary[Any, set[Any]] = weakref.WeakKeyDictionary()
_pin: Any = None  # ``interception._pin``, handed over by ``patch`` (that module imports this one)


def torch_version() -> str:
    torch = sys.modules.get("torch")  # imported by whoever could have been intercepted
    return str(torch.__version__) if torch is not None else "(not imported)"


def supported() -> bool:
    return "call_triton_kernel" in _originals


def patch(pin: Any) -> None:
    """Wrap torch's handling of user Triton kernels (``pin`` decides a traced call's config); a torch
    without it only records why. Inductor is wrapped once imported."""
    global _unsupported, _pin
    with _lock:
        _pin = pin
        if _originals:
            return
        hopifier, reason = _hopifier_class()
        _unsupported = reason or None
        if hopifier is not None:
            original = hopifier.__dict__["call_triton_kernel"]
            _originals["call_triton_kernel"] = (hopifier, original)
            hopifier.call_triton_kernel = _make_call_triton_kernel(original)
        if hopifier is None or "torch._inductor.runtime.triton_heuristics" in sys.modules:
            _patch_tripwire()


def _patch_tripwire() -> None:
    with _lock:
        if "benchmark_all_configs" in _originals:
            return
        try:  # without Inductor, compiled code cannot run user Triton kernels through it
            from torch._inductor.runtime.triton_heuristics import CachingAutotuner
        except Exception:
            return
        original = CachingAutotuner.__dict__.get("benchmark_all_configs")
        if original is not None:
            _originals["benchmark_all_configs"] = (CachingAutotuner, original)
            CachingAutotuner.benchmark_all_configs = _make_benchmark_all_configs(original)  # type: ignore[method-assign]


def unpatch() -> None:
    with _lock:
        for name, (owner, original) in _originals.items():
            setattr(owner, name, original)
        _originals.clear()
        _deferred.clear()


def warn_if_unsupported(policy: TuningPolicy) -> None:
    if _unsupported is None or policy.mode in PASS_THROUGH_MODES:
        return
    tripwire = "benchmark_all_configs" in _originals  # then strict mode can fail on them
    strict = ", or set MEGATRON_TUNING_STRICT=1 to fail on them" if tripwire else ""
    warn_once(
        ("inductor-unsupported", torch_version(), _unsupported),
        "megatron_tuning: torch %s cannot be intercepted (%s): in-scope @triton.autotune kernels "
        "called from torch.compile graphs are NOT pinned; Inductor benchmarks their configs itself. "
        "Eager launches are pinned. Use megatron_tuning.autotune_configs at decoration time for such "
        "kernels%s.",
        *(torch_version(), _unsupported, strict),
    )


def _hopifier_class() -> tuple[Any, str]:
    """``TritonHOPifier`` when its ``call_triton_kernel`` has the shape the hook relies on, else why not."""
    try:
        from torch._higher_order_ops import triton_kernel_wrap as tkw
    except Exception as e:  # ImportError, or a torch whose module fails to import
        return None, f"torch._higher_order_ops.triton_kernel_wrap is unavailable: {type(e).__name__}: {e}"
    hopifier = getattr(tkw, "TritonHOPifier", None)
    method = None if hopifier is None else hopifier.__dict__.get("call_triton_kernel")
    if method is None:
        return None, "TritonHOPifier.call_triton_kernel is missing"
    if list(inspect.signature(method).parameters) != HOOK_PARAMETERS:
        return None, f"TritonHOPifier.call_triton_kernel{inspect.signature(method)} changed"
    dynamo = sys.modules.get("torch._dynamo.variables.functions")  # not imported for this (~1 s)
    subclasses = [getattr(tkw, "TracingTritonHOPifier", None), getattr(dynamo, "DynamoTritonHOPifier", None)]
    overriding = [c.__name__ for c in subclasses if c is not None and "call_triton_kernel" in c.__dict__]
    if overriding:
        return None, f"{', '.join(overriding)} overrides call_triton_kernel"
    return hopifier, ""


def _make_call_triton_kernel(original: Any) -> Any:
    from triton.runtime.autotuner import Autotuner

    @functools.wraps(original)
    def call_triton_kernel(self: Any, variable: Any, args: Any, kwargs: Any, tx: Any) -> Any:
        if "benchmark_all_configs" not in _originals and _originals:
            _patch_tripwire()  # deferred from patch(): this process compiles kernels after all
        kernel = variable.kernel
        if getattr(_tls, "depth", 0):
            # The HOPifier recursing on what we handed it: an Autotuner it builds inherits a pin.
            _mark_nested_copy(kernel)
            return original(self, variable, args, kwargs, tx)
        installation = pinning.active
        if (
            installation is None
            or installation.policy.mode in PASS_THROUGH_MODES
            or not isinstance(kernel, Autotuner)
            or PINNED_ATTR in kernel.__dict__
        ):
            return original(self, variable, args, kwargs, tx)
        state = pinning.state_for(kernel, installation)
        if not state.in_scope:
            return original(self, variable, args, kwargs, tx)
        args, kwargs = list(args), dict(kwargs)
        for name, index in state.key_index:  # graph constants: a guard and a recompile per value
            if index < len(args):
                args[index] = variable.specialize_symbolic(_realized(args[index]))
            elif name in kwargs:
                kwargs[name] = variable.specialize_symbolic(_realized(kwargs[name]))
        values = tuple(_concrete(a) for a in args)
        named = {k: _concrete(v) for k, v in kwargs.items()}
        from torch.utils._python_dispatch import _disable_current_modes

        try:
            with _disable_current_modes():  # the agreement check may create tensors: keep them real
                config = _pin(kernel, installation, values, named, may_measure=False, defer=True)[0]
        except pinning.Deferred:  # auto, a miss: tuned at the graph's first run (_tune_at_first_run)
            with _lock:
                _deferred.setdefault(kernel, set()).add(state.key(values, named))
            config = None
        except MegatronTuningError as error:
            if tx is None:  # wrap_triton / make_fx tracing: the error reaches the caller as is
                raise
            # Dynamo would rewrap it as InternalTorchDynamoError; a graph break runs the launch eagerly,
            # where the same decision raises it unwrapped (fullgraph=True reports it as Unsupported).
            self.raise_unsupported(f"megatron_tuning: {type(error).__name__}: {error}")
        if config is not None:  # else (deferred) the node keeps every config
            kernel.best_config = config
            variable = _recreate(self, variable, _one_config_copy(kernel, config))
        _tls.depth = getattr(_tls, "depth", 0) + 1
        try:
            return original(self, variable, args, kwargs, tx)
        finally:
            _tls.depth -= 1

    return call_triton_kernel


def _realized(value: Any) -> Any:
    realize = getattr(value, "realize", None)  # Dynamo's LazyVariableTracker (resume functions)
    return realize() if callable(realize) else value


def _concrete(value: Any) -> Any:
    """A traced argument as decisions see eager ones: ints, bools, tensors with a dtype."""
    value = _realized(value)
    if not hasattr(value, "is_python_constant") or not hasattr(value, "as_proxy"):
        return value  # wrap_triton tracing: already FakeTensors, ints and SymInts
    if value.is_python_constant():
        return value.as_python_constant()
    try:
        node = value.as_proxy().node
    except Exception:  # not a graph value (e.g. a user object): keep the variable itself
        return value
    return node.meta.get("example_value", value)  # FakeTensor, or SymInt for a dynamic int


def _one_config_copy(kernel: Any, config: Any) -> Any:
    import triton

    with _lock:
        per_kernel = _copies.setdefault(kernel, {})
        hit = per_kernel.get(id(config))
        if hit is not None:
            return hit[0]
        copy = triton.autotune(
            configs=[config],
            key=list(kernel.keys),
            reset_to_zero=kernel.reset_to_zero,  # lists on every supported Triton (a copy each)
            restore_value=kernel.restore_value,
        )(kernel.fn)
        _mark_nested_copy(copy)
        per_kernel[id(config)] = (copy, config)  # holding config keeps its id() unique
        return copy


def _mark_nested_copy(kernel: Any) -> None:
    """A one-config copy (ours, or torch's) launches its config, never a state or ``run`` it copied."""
    configs = getattr(kernel, "configs", None)  # an Autotuner (a JITFunction has none)
    if isinstance(configs, list) and len(configs) == 1 and PINNED_ATTR not in kernel.__dict__:
        kernel.__dict__[PINNED_ATTR] = configs[0]
        kernel.__dict__.pop(pinning.STATE_ATTR, None)
        fastpath.disarm(kernel)


def _recreate(hopifier: Any, variable: Any, kernel: Any) -> Any:
    recreate = getattr(hopifier, "recreate_variable", None)
    if recreate is not None:  # torch >= 2.12, keeps the kernel's Dynamo source
        return recreate(variable, kernel=kernel, kernel_idx=None, grid=variable.grid)
    return type(variable)(kernel, None, variable.grid)


def _make_benchmark_all_configs(original: Any) -> Any:
    @functools.wraps(original)
    def benchmark_all_configs(self: Any, *args: Any, **kwargs: Any) -> Any:
        installation = pinning.active
        if (
            installation is not None
            and installation.policy.mode not in PASS_THROUGH_MODES
            and getattr(self, "custom_kernel", False)
            and len(getattr(self, "launchers", ())) > 1
        ):
            chosen = _tune_at_first_run(self, installation, args, kwargs)
            if chosen is not None:  # Inductor keeps the launcher of least time: the only one given
                return {chosen: 0.0}
            _report_bypass(self, installation, args)
        return original(self, *args, **kwargs)

    return benchmark_all_configs


def _tune_at_first_run(caching: Any, installation: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The launcher of a key ``auto`` deferred at trace time, decided now over Inductor's launchers."""
    names = _launcher_arg_names(caching)
    if installation.policy.mode != "auto" or names is None:
        return None
    named = dict(zip(names, args))
    for kernel in _matching_kernels(caching.fn, list(_deferred)):
        state = pinning.state_for(kernel, installation)
        if (key := state.key((), named)) in _deferred.get(kernel, ()):
            break
    else:
        return None
    launchers = {config_signature(launcher.config): launcher for launcher in caching.launchers}
    own = {config_signature(config): config for config in kernel.configs}
    candidates = [own.get(signature, launcher.config) for signature, launcher in launchers.items()]

    def measure(_: Any, candidates: list[Any], *call: Any) -> Any:
        by_options = {_options(c.all_kwargs()): launchers[config_signature(c)] for c in candidates}
        return installation.measure(
            _Launchers(caching, args, kwargs, by_options), candidates, (), {}, *call[2:]
        )

    listed: Any = functools.partial(list, candidates)
    timed = installation.measure and measure
    config = pinning.decide(kernel, state, installation, key, (), named, candidates=listed, measure=timed)
    caching.reset_to_zero_args(*args, **kwargs)  # as Inductor's own benchmark ends
    return launchers.get(config_signature(config))


def _options(options: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((name, repr(value)) for name, value in options.items()))


class _Launchers:
    """What ``measure`` uses of an ``Autotuner``: ``fn.run(**config.all_kwargs())`` launches that
    config's launcher on copies of the mutated arguments; ``pre_hook`` zeroes ``reset_to_zero``."""

    arg_names: tuple[str, ...] = ()

    def __init__(self, caching: Any, args: Any, kwargs: Any, by_options: dict[Any, Any]) -> None:
        self.fn, self._caching, self._by_options = self, caching, by_options
        self._args, self._kwargs = caching.clone_args(*args, **kwargs)
        device = caching.get_device_interface()
        self._stream = device.get_raw_stream(device.current_device())

    def run(self, **options: Any) -> None:
        self._by_options[_options(options)](*self._args, **self._kwargs, stream=self._stream)

    def pre_hook(self, nargs: Any, reset_only: bool = False) -> None:
        self._caching.reset_to_zero_args(*self._args, **self._kwargs)

    post_hook = staticmethod(lambda nargs, exception=None: None)


def _report_bypass(caching_autotuner: Any, installation: Any, args: tuple[Any, ...]) -> None:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    # The user Autotuner the generated kernel copies, found in Dynamo's side table.
    traced = _matching_kernels(caching_autotuner.fn, list(kernel_side_table.id_to_kernel.values()))
    if traced:
        state = pinning.state_for(traced[0], installation)
        if not state.in_scope:
            return
        name, key = state.kernel, "?"
        names = _launcher_arg_names(caching_autotuner)
        with contextlib.suppress(Exception):  # a key that cannot be told still names the kernel
            key = state.key((), dict(zip(names, args))) if names is not None else "?"
    elif installation.policy.scope:
        return  # a kernel this process never traced cannot be matched to a scope
    else:
        name, key = f"<compiled>:{_generated_name(caching_autotuner.fn)}", "?"
    reason = (
        f"torch {torch_version()} is not intercepted: {_unsupported}"
        if _unsupported is not None
        else "the graph was traced before init_deterministic_tuning, or outside Dynamo"
    )
    count = len(caching_autotuner.launchers)
    if installation.policy.strict:
        raise CompiledLaunchNotPinnedError(name, key, count, reason)
    message = "megatron_tuning: compiled code benchmarks %d configs of kernel %s with key %s: not pinned (%s)"
    warn_once(("inductor-bypass", name, key), message, *(count, name, key, reason), rank_local=True)


def _generated_name(fn: Any) -> str:
    return str(getattr(getattr(fn, "fn", fn), "__name__", type(fn).__name__))


def _body_digest(source: str) -> str | None:
    """sha256 of a kernel's source from its ``def`` line on, its name blanked (a copy's is ``name_N``)."""
    body = from_def_line(source)
    if body is None:
        return None
    body = re.sub(r"^def\s+\w+", "def _", body, count=1)
    return hashlib.sha256("\n".join(line.rstrip() for line in body.strip().splitlines()).encode()).hexdigest()


def _matching_kernels(generated: Any, kernels: list[Any]) -> list[Any]:
    """The user Autotuners among ``kernels`` a generated kernel copies (same name, maybe ``_N`` added;
    the same body first), not the HOPifier's own rewrites (``key=[]``) or our copies."""
    from triton.runtime.autotuner import Autotuner

    name = re.sub(r"_\d+$", "", _generated_name(generated))
    digest = _body_digest(getattr(generated, "src", "") or "")
    matches: list[Any] = []
    for kernel in kernels:
        if not isinstance(kernel, Autotuner) or not kernel.keys or PINNED_ATTR in kernel.__dict__:
            continue
        try:
            if kernel.base_fn.__name__ not in (name, _generated_name(generated)):
                continue
            source = inspect.getsource(kernel.base_fn)
        except (OSError, TypeError, AttributeError):
            continue
        matches.append((_body_digest(source) != digest, len(matches), kernel))
    return [kernel for *_, kernel in sorted(matches)]


def _launcher_arg_names(caching_autotuner: Any) -> list[str] | None:
    try:
        names = getattr(caching_autotuner.launchers[0], "def_args", None)
        if names is None:
            signature = caching_autotuner.triton_meta["signature"]
            names = [name for name, kind in signature.items() if kind != "constexpr"]
        return list(names)
    except Exception:  # an unexpected launcher
        return None
