"""The torch.compile adapter: compiled graphs launch the pinned config of in-scope kernels.

Inductor never calls ``Autotuner.run`` for a user ``@triton.autotune`` kernel. Dynamo turns the
call into a ``triton_kernel_wrapper_mutation`` node that points at the kernel, and Inductor
compiles the kernel's whole config list into a ``CachingAutotuner`` that benchmarks it at the
graph's first run. So the choice has to be made while the call is traced.

``patch()`` (called by ``interception.install``) wraps two torch attributes:

* ``TritonHOPifier.call_triton_kernel``: the one function, shared by Dynamo
  (``DynamoTritonHOPifier``) and ``wrap_triton``/``triton_op`` (``TracingTritonHOPifier``), that
  turns a kernel call into that node. For an in-scope Autotuner under a pinning mode it
  specializes the ``key=`` arguments (a guard per value, so a dynamic-shape graph is recompiled
  per key value, like eager keys), decides through ``pinning.decide`` (by way of the
  interception, which hands this module its decision function) with
  ``may_measure=False`` (same kernel id, key, decision log entry and agreement check as eager),
  and hands the original a one-config ``triton.autotune`` copy of the kernel. Everything
  downstream (heuristics, grids, lowering, codegen, the FX graph cache key) sees one config, so
  Inductor has nothing to benchmark, and CUDA-graph replays launch it too.
* ``CachingAutotuner.benchmark_all_configs``: a tripwire. Inductor benchmarking an in-scope user
  kernel means the pin was bypassed (a torch it cannot intercept, or a graph traced before
  ``install``): it warns, and raises ``CompiledLaunchNotPinnedError`` under ``strict``.

torch is imported here only when ``patch()`` runs, and Dynamo and Inductor (about a second to
import) only when the process already uses them: otherwise the tripwire is installed when the
hook first runs, i.e. when the process first traces a kernel call. Contract tests in
``tests/runtime/test_torch_contract.py`` pin every private torch attribute used here.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import re
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from ..core.errors import CompiledLaunchNotPinnedError, MegatronTuningError
from ..core.identity import tuning_key
from ..core.policy import TuningPolicy
from ..core.warn import warn_once
from . import pinning

logger = logging.getLogger(__name__)

# Modes whose compiled launches keep Inductor's own behaviour (nothing is pinned in them).
PASS_THROUGH_MODES = ("off", "record")
HOOK_PARAMETERS = ["self", "variable", "args", "kwargs", "tx"]
_DYNAMO_HOPIFIER_MODULE = "torch._dynamo.variables.functions"
_INDUCTOR_RUNTIME_MODULE = "torch._inductor.runtime.triton_heuristics"

_lock = threading.RLock()
_originals: dict[str, tuple[Any, Any]] = {}  # name -> (owner class, original attribute)
_unsupported: str | None = None  # why compiled launches cannot be pinned in this process, if so
_tls = threading.local()
_copies: weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, Any]]] = weakref.WeakKeyDictionary()
_pin: Any = None
"""``interception._pin``, handed over by ``patch``: a traced call's decision (this module cannot
import the interception, which imports it)."""


def torch_version() -> str:
    try:
        import torch
    except ImportError:
        return "(not installed)"
    return str(torch.__version__)


def supported() -> bool:
    """Whether compiled launches are pinned in this process (meaningful after ``patch()``)."""
    return "call_triton_kernel" in _originals


def unsupported_reason() -> str | None:
    return _unsupported


def patch(pin: Any) -> None:
    """Wrap torch's handling of user Triton kernels; a torch without it only records why.

    ``pin(kernel, installation, args, kwargs, may_measure=False)`` gives a traced call's
    config (``interception._pin``: the key's decision, made if new, filed in Triton's cache).
    """
    global _unsupported, _pin
    with _lock:
        _pin = pin
        if _originals:
            return
        _unsupported = None
        hopifier, reason = _hopifier_class()
        if hopifier is not None:
            original = hopifier.__dict__["call_triton_kernel"]
            _originals["call_triton_kernel"] = (hopifier, original)
            hopifier.call_triton_kernel = _make_call_triton_kernel(original)
        else:
            _unsupported = reason
        if hopifier is None or _INDUCTOR_RUNTIME_MODULE in sys.modules:
            _patch_tripwire()


def _patch_tripwire() -> None:
    with _lock:
        if "benchmark_all_configs" in _originals:
            return
        caching = _caching_autotuner_class()
        if caching is not None:
            original = caching.__dict__["benchmark_all_configs"]
            _originals["benchmark_all_configs"] = (caching, original)
            caching.benchmark_all_configs = _make_benchmark_all_configs(original)


def unpatch() -> None:
    """Restore every attribute ``patch()`` replaced, exactly."""
    with _lock:
        for name, (owner, original) in _originals.items():
            setattr(owner, name, original)
        _originals.clear()


def warn_if_unsupported(policy: TuningPolicy) -> None:
    """One warning per process when compiled launches of in-scope kernels cannot be pinned."""
    if _unsupported is None or policy.mode in PASS_THROUGH_MODES:
        return
    warn_once(
        ("inductor-unsupported", torch_version(), _unsupported),
        "megatron_tuning: torch %s cannot be intercepted (%s): in-scope @triton.autotune kernels "
        "called from torch.compile graphs are NOT pinned; Inductor benchmarks their configs itself. "
        "Eager launches are pinned. Use megatron_tuning.autotune_configs at decoration time for such "
        "kernels%s.",
        torch_version(),
        _unsupported,
        ""
        if "benchmark_all_configs" not in _originals
        else ", or set MEGATRON_TUNING_STRICT=1 to fail on them",
    )


def _hopifier_class() -> tuple[Any, str]:
    """``TritonHOPifier`` when its ``call_triton_kernel`` has the shape the hook relies on."""
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
    subclasses = [getattr(tkw, "TracingTritonHOPifier", None)]
    dynamo = sys.modules.get(_DYNAMO_HOPIFIER_MODULE)  # not imported for this check (~1 s)
    subclasses.append(getattr(dynamo, "DynamoTritonHOPifier", None))
    overriding = [c.__name__ for c in subclasses if c is not None and "call_triton_kernel" in c.__dict__]
    if overriding:
        return None, f"{', '.join(overriding)} overrides call_triton_kernel"
    return hopifier, ""


def _caching_autotuner_class() -> Any:
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except Exception:  # no Inductor: compiled code cannot run user Triton kernels through it
        return None
    return CachingAutotuner if "benchmark_all_configs" in CachingAutotuner.__dict__ else None


# --------------------------------------------------------------------------- the trace-time pin


def _make_call_triton_kernel(original: Any) -> Any:
    from triton.runtime.autotuner import Autotuner

    @functools.wraps(original)
    def call_triton_kernel(self: Any, variable: Any, args: Any, kwargs: Any, tx: Any) -> Any:
        if "benchmark_all_configs" not in _originals and _originals:
            _patch_tripwire()  # deferred from patch(): this process compiles kernels after all
        kernel = variable.kernel
        if getattr(_tls, "depth", 0):
            # The HOPifier recursing on our one-config copy (heuristics applied, special kwargs
            # moved): the Autotuner it builds inherits the pin.
            _mark_nested_copy(kernel)
            return original(self, variable, args, kwargs, tx)
        installation = pinning.active
        if (
            installation is None
            or installation.policy.mode in PASS_THROUGH_MODES
            or not isinstance(kernel, Autotuner)
            or pinning.PINNED_ATTR in kernel.__dict__
        ):
            return original(self, variable, args, kwargs, tx)
        state = pinning.state_for(kernel, installation)
        if not state.in_scope:
            return original(self, variable, args, kwargs, tx)
        args, kwargs = list(args), dict(kwargs)
        for name, index in state.key_index:
            if index < len(args):
                args[index] = _specialize(variable, args[index])
            elif name in kwargs:
                kwargs[name] = _specialize(variable, kwargs[name])
        values = tuple(_concrete(a) for a in args)
        named = {k: _concrete(v) for k, v in kwargs.items()}
        try:
            with _no_tracing_modes():  # the agreement check may create tensors: keep them real
                config = _pin(kernel, installation, values, named, may_measure=False)
        except MegatronTuningError as error:
            if tx is None:  # wrap_triton / make_fx tracing: the error reaches the caller as is
                raise
            # Dynamo would rewrap it as InternalTorchDynamoError. A graph break runs this launch
            # eagerly instead, where the same decision raises it unwrapped (fullgraph=True
            # reports the message as Unsupported).
            self.raise_unsupported(f"megatron_tuning: {type(error).__name__}: {error}")
        kernel.best_config = config
        pinned = _recreate(self, variable, _one_config_copy(kernel, config))
        _tls.depth = getattr(_tls, "depth", 0) + 1
        try:
            return original(self, pinned, args, kwargs, tx)
        finally:
            _tls.depth -= 1

    return call_triton_kernel


def _specialize(variable: Any, value: Any) -> Any:
    """Make a key argument a constant of the graph: a guard on its value, a recompile per value."""
    realize = getattr(value, "realize", None)  # Dynamo's LazyVariableTracker (resume functions)
    if callable(realize):
        value = realize()
    return variable.specialize_symbolic(value)


def _concrete(value: Any) -> Any:
    """A traced argument as the decision code sees eager ones: ints, bools, tensors with a dtype."""
    realize = getattr(value, "realize", None)
    if callable(realize):
        value = realize()
    if not hasattr(value, "is_python_constant") or not hasattr(value, "as_proxy"):
        return value  # wrap_triton tracing: already FakeTensors, ints and SymInts
    if value.is_python_constant():
        return value.as_python_constant()
    try:
        node = value.as_proxy().node
    except Exception:  # not a graph value (e.g. a user object): keep the variable itself
        return value
    return node.meta.get("example_value", value)  # FakeTensor, or SymInt for a dynamic int


@contextlib.contextmanager
def _no_tracing_modes() -> Iterator[None]:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def _one_config_copy(kernel: Any, config: Any) -> Any:
    """``triton.autotune(configs=[config])`` over the kernel's own function, one per (kernel, config).

    ``reset_to_zero``/``restore_value`` are kept because Inductor reads them for mutation analysis;
    pruning hooks are not (pruning already ran in the decision).
    """
    import triton

    with _lock:
        per_kernel = _copies.setdefault(kernel, {})
        hit = per_kernel.get(id(config))
        if hit is not None:
            return hit[0]
        copy = triton.autotune(
            configs=[config],
            key=list(kernel.keys),
            reset_to_zero=list(getattr(kernel, "reset_to_zero", None) or []) or None,
            restore_value=list(getattr(kernel, "restore_value", None) or []) or None,
        )(kernel.fn)
        pinning.mark_pinned(copy, config)
        per_kernel[id(config)] = (copy, config)  # holding config keeps its id() unique
        return copy


def _mark_nested_copy(kernel: Any) -> None:
    from triton.runtime.autotuner import Autotuner

    if (
        isinstance(kernel, Autotuner)
        and pinning.PINNED_ATTR not in kernel.__dict__
        and len(kernel.configs) == 1
    ):
        pinning.mark_pinned(kernel, kernel.configs[0])


def _recreate(hopifier: Any, variable: Any, kernel: Any) -> Any:
    recreate = getattr(hopifier, "recreate_variable", None)
    if recreate is not None:  # torch >= 2.12, keeps the kernel's Dynamo source
        return recreate(variable, kernel=kernel, kernel_idx=None, grid=variable.grid)
    return type(variable)(kernel, None, variable.grid)


# --------------------------------------------------------------------------- the run-time tripwire


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
            _report_bypass(self, installation, args)
        return original(self, *args, **kwargs)

    return benchmark_all_configs


def _report_bypass(caching_autotuner: Any, installation: Any, args: tuple[Any, ...]) -> None:
    kernel = _original_kernel(caching_autotuner.fn)
    if kernel is not None:
        state = pinning.state_for(kernel, installation)
        if not state.in_scope:
            return
        name, key = state.kernel, _key_text(kernel, caching_autotuner, args)
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
    warn_once(
        ("inductor-bypass", name, key),
        "megatron_tuning: compiled code benchmarks %d configs of kernel %s with key %s: not pinned (%s)",
        count,
        name,
        key,
        reason,
    )


def _generated_name(fn: Any) -> str:
    inner = getattr(fn, "fn", fn)
    return str(getattr(inner, "__name__", type(fn).__name__))


def _body_digest(source: str) -> str | None:
    """sha256 of a kernel's source from its ``def`` line on, with the function name blanked
    (Inductor's copy may rename it ``name_N``) and trailing whitespace dropped."""
    match = re.search(r"^def\s+\w+\s*\(", source, re.MULTILINE)
    if match is None:
        return None
    body = re.sub(r"^def\s+\w+", "def _", source[match.start() :], count=1)
    return hashlib.sha256("\n".join(line.rstrip() for line in body.strip().splitlines()).encode()).hexdigest()


def _original_kernel(generated: Any) -> Any:
    """The user Autotuner a generated kernel copies: same name and body, found in Dynamo's side table."""
    name = re.sub(r"_\d+$", "", _generated_name(generated))
    digest = _body_digest(getattr(generated, "src", "") or "")
    try:
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    except Exception:
        return None
    from triton.runtime.autotuner import Autotuner

    matches = []
    for kernel in list(kernel_side_table.id_to_kernel.values()):
        if not isinstance(kernel, Autotuner) or not kernel.keys or pinning.PINNED_ATTR in kernel.__dict__:
            continue  # the HOPifier's own rewrites (key=[]) and our copies; the user's kernel is there too
        try:
            if kernel.base_fn.__name__ not in (name, _generated_name(generated)):
                continue
            source = inspect.getsource(kernel.base_fn)
        except (OSError, TypeError, AttributeError):
            continue
        matches.append((_body_digest(source) == digest, kernel))
    same_body = [k for exact, k in matches if exact]
    return (same_body or [k for _, k in matches] or [None])[0]


def _key_text(kernel: Any, caching_autotuner: Any, args: tuple[Any, ...]) -> str:
    """The tuning key of the launch Inductor is about to benchmark, from its launcher's arguments."""
    try:
        names = getattr(caching_autotuner.launchers[0], "def_args", None)
        if names is None:  # the launcher's parameters are the signature's non-constexpr arguments
            signature = caching_autotuner.triton_meta["signature"]
            names = [name for name, kind in signature.items() if kind != "constexpr"]
        return tuning_key(kernel, (), dict(zip(list(names), args)))
    except Exception:  # an unexpected launcher: still name the kernel
        return "?"
