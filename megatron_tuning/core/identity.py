"""Names that cross processes: GPU arch, kernel identity, config signatures. Pure functions of the
code and the config, never of Python's salted ``hash()`` or of set order of ``Config`` objects
(identity-hashed before Triton 3.4): every rank derives the same text."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import re
import sys
import textwrap
import threading
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .errors import CONFIG_HOOKS, AmbiguousConfigError, PolicyError
from .key import render
from .policy import TRUE_WORDS, parse_int

# Config fields beyond kwargs/num_warps/num_stages, with the default that leaves them out of
# signatures: a field only some Triton releases have must not change the signature of a config
# that does not set it.
_OPTIONAL_FIELDS: tuple[tuple[str, Any], ...] = (
    ("num_ctas", 1),
    ("maxnreg", None),
    ("ir_override", None),
    ("num_buffers_warp_spec", 0),
    ("num_consumer_groups", 0),
    ("reg_dec_producer", 0),
    ("reg_inc_consumer", 0),
)
# Every field of ``config_data`` (and so of a table entry's config): a table may hold no other.
CONFIG_FIELDS = ("kwargs", "num_warps", "num_stages", *(name for name, _ in _OPTIONAL_FIELDS))


def _cuda_torch() -> Any:
    """torch when kernels run on a CUDA/HIP device here (not under the interpreter), else ``None``."""
    if os.environ.get("TRITON_INTERPRET", "0").strip().lower() in TRUE_WORDS:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def arch_tag() -> str:
    """``sm<major><minor>`` of the current CUDA device; ``unknown`` off-GPU or under the interpreter."""
    torch = _cuda_torch()
    return "unknown" if torch is None else _arch_for_device(torch.cuda.current_device())


def node_arch() -> str | None:
    """The arch every visible device shares, ``None`` when they differ: for use before a rank has
    picked its device."""
    torch = _cuda_torch()
    if torch is None:
        return "unknown"
    archs = {_arch_for_device(index) for index in range(torch.cuda.device_count())}
    return archs.pop() if len(archs) == 1 else None


def _arch_for_device(index: int) -> str:
    import torch

    if getattr(torch.version, "hip", None):
        name = str(getattr(torch.cuda.get_device_properties(index), "gcnArchName", "gfx-unknown"))
        return name.split(":", 1)[0]
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def _user_function(autotuner: Any) -> Any:
    base = getattr(autotuner, "base_fn", None)
    start = base if inspect.isfunction(base) else autotuner
    fn = next((obj for obj in wrappers(start) if inspect.isfunction(obj)), None)
    if fn is None:
        raise TypeError(f"cannot find the Python function behind {autotuner!r}")
    return fn


def kernel_name(autotuner: Any) -> str:
    return str(_user_function(autotuner).__qualname__)


def kernel_module(autotuner: Any) -> str:
    return str(_user_function(autotuner).__module__)


def base_kernel_id(autotuner: Any) -> str:
    fn = _user_function(autotuner)
    return f"{fn.__module__}:{fn.__qualname__}"


_MAX_WRAPPERS = 8  # heuristics/autotune decorators stacked on one kernel, far above real use
DIGEST_CHARS = 12  # hex digits of the config-list digest in a ``module:qualname@<digest>`` kernel id
_ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_ids_lock = threading.Lock()


def config_list_digest(autotuner: Any) -> str:
    """12 hex digits naming the autotuner's declared configs (not their order, duplicates or hooks)
    and, for a function made in another function, the values it closes over. Every in-scope
    kernel's list passes here before the library picks from it by signature."""
    check_unambiguous(autotuner)
    return _unchecked_digest(autotuner)


def check_unambiguous(autotuner: Any) -> None:
    """Raise ``AmbiguousConfigError`` for two configs that sign alike but launch differently, or run
    different hooks."""
    by_signature: dict[str, tuple[dict[str, Any], tuple[Any, ...]]] = {}
    for config in autotuner.configs:
        data, hooks = config_data(config), tuple(getattr(config, name, None) for name in CONFIG_HOOKS)
        first, first_hooks = by_signature.setdefault(config_signature(data), (data, hooks))
        same_hooks = all(map(_same_hook, first_hooks, hooks))
        if data != first or not same_hooks:  # an equal duplicate launches the same: harmless
            fields = [k for k in first["kwargs"] if first["kwargs"][k] != data["kwargs"].get(k)]
            fields += [k for k in first if k != "kwargs" and first[k] != data.get(k)]
            fields += [name for name, a, b in zip(CONFIG_HOOKS, first_hooks, hooks) if not _same_hook(a, b)]
            raise AmbiguousConfigError(base_kernel_id(autotuner), config_signature(data), fields)


def _same_hook(a: Any, b: Any) -> bool:
    """Whether two hooks run alike: one object, or functions of one code with equal defaults and
    closed-over values, as a factory makes anew per config (``pre_hook=init_to_zero("C")``)."""
    if a is b:
        return True
    if not (inspect.isfunction(a) and inspect.isfunction(b)) or a.__code__ != b.__code__:
        return False
    cells = [(_cell_value(x), _cell_value(y)) for x, y in zip(a.__closure__ or (), b.__closure__ or ())]
    pairs = [*cells, (a.__defaults__, b.__defaults__), (a.__kwdefaults__, b.__kwdefaults__)]
    return all(_same_value(x, y) for x, y in pairs)


_UNBOUND = object()


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an unbound cell
        return _UNBOUND


def _same_value(a: Any, b: Any) -> bool:
    """Equal and of one type (``1``, ``1.0`` and ``True`` apart); a function as ``_same_hook``; a value
    whose ``==`` is no plain answer (a tensor) only as itself."""
    if a is b or (inspect.isfunction(a) and _same_hook(a, b)):
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(map(_same_value, a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a comparison that raises: not known to be the same
        return False


def _digest(autotuner: Any, signatures: Iterable[str]) -> str:
    parts = sorted(signatures)
    fn = _user_function(autotuner)
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        with contextlib.suppress(ValueError):  # an unbound cell has no contents
            parts.append(f"closure {name}={_closure_text(cell.cell_contents)}")
    return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()[:DIGEST_CHARS]


def _closure_text(value: Any) -> str:
    if isinstance(value, types.ModuleType):
        return value.__name__
    try:
        return base_kernel_id(value)  # a function, or a jit function or autotuner over one
    except TypeError:
        return render(value)


def kernel_id(autotuner: Any) -> str:
    """The kernel's identity in tables, logs and across ranks: ``module:qualname`` for the autotuner
    its function's module holds, else ``module:qualname@<config_list_digest>`` (docs/choosing.md)."""
    try:
        cached = _ids.get(autotuner)
    except TypeError:  # not weak-referenceable (a test double): compute every time
        return _compute_kernel_id(autotuner)
    if cached is not None:
        return cached
    kernel = _compute_kernel_id(autotuner)
    with _ids_lock:
        return _ids.setdefault(autotuner, kernel)


def split_kernel_id(kernel: str) -> tuple[str, str, str | None]:
    module, _, rest = kernel.partition(":")
    qualname, sep, digest = rest.partition("@")
    return module, qualname, digest if sep else None


def content_name(kernel: str) -> str:
    """A kernel id without its module: what a content match compares, with the source hash."""
    return kernel.partition(":")[2]


def shared_kernel_id(kernel: str, config_list_digest: str | None, source_hash: str | None = None) -> str:
    """The name ranks key a kernel's shared records by: ``module:qualname@<config_list_digest>``
    whether ``kernel_id`` chose the plain id or not (that choice reads the module's globals at the
    first launch, which can differ between ranks). With ``source_hash``, the content identity
    ``qualname@<config_list_digest>#<source_hash>``, without the module (``auto``'s consensus:
    docs/agreement.md). The one derivation every cross-rank caller uses."""
    module, qualname, digest = split_kernel_id(kernel)
    digest = config_list_digest or digest
    name = (qualname if source_hash is not None else f"{module}:{qualname}") + (
        f"@{digest}" if digest else ""
    )
    return name if source_hash is None else f"{name}#{source_hash}"


def _compute_kernel_id(wrapper: Any) -> str:
    base = base_kernel_id(wrapper)
    autotuner = _autotuner_in(wrapper)
    if autotuner is None:  # a bare @triton.jit (or heuristics) function: nothing to tell apart
        return base
    fn, mine = _user_function(autotuner), _unchecked_digest(autotuner)
    # Plain only for what the function's own module holds (alone, or with others of its config
    # list): an autotuner built anywhere else, or over a function made by a factory, is told apart.
    # Unchecked: an out-of-scope kernel (or a sibling) with an ambiguous list still gets its name.
    home = {_unchecked_digest(o) for o in _module_autotuners_over(fn)}
    return base if home == {mine} and "<locals>" not in fn.__qualname__ else f"{base}@{mine}"


def _unchecked_digest(autotuner: Any) -> str:
    return _digest(autotuner, {config_signature(c) for c in autotuner.configs})


def wrappers(obj: Any) -> Iterator[Any]:
    """``obj``, then what it wraps (``.fn``), down a bounded chain."""
    for _ in range(_MAX_WRAPPERS):
        if obj is None:
            return
        yield obj
        obj = getattr(obj, "fn", None)


def _autotuner_in(wrapper: Any) -> Any:
    for obj in wrappers(wrapper):
        if inspect.isfunction(obj):
            return None
        if isinstance(getattr(obj, "configs", None), (list, tuple)):
            return obj
    return None


def _module_autotuners_over(fn: Any) -> list[Any]:
    """Triton autotuners over ``fn`` among its module's globals and at its qualname."""
    autotuner_type = getattr(sys.modules.get("triton.runtime.autotuner"), "Autotuner", None)
    scope = getattr(fn, "__globals__", None)
    if autotuner_type is None or not isinstance(scope, dict):
        return []
    head, *path = fn.__qualname__.split(".")
    holder = scope.get(head)
    for part in path:
        attributes = getattr(holder, "__dict__", None)  # the class's own, never a __getattr__
        holder = attributes.get(part) if isinstance(attributes, Mapping) else None
    found: list[Any] = []
    for obj in [*scope.values(), holder]:
        try:
            for _ in range(_MAX_WRAPPERS):
                if obj is None or isinstance(obj, (types.ModuleType, type)):
                    break  # never walk a module's or class's attributes (lazy imports, descriptors)
                if isinstance(obj, autotuner_type) and _user_function(obj) is fn:
                    found.append(obj)
                # The instance dict, not getattr: no __getattr__ of a foreign object runs.
                attributes = getattr(obj, "__dict__", None)
                obj = attributes.get("fn") if isinstance(attributes, dict) else None
        except Exception:  # an odd global (a proxy, a half-built object) is no autotuner of ours
            continue
    return found


@functools.cache
def _source_hash_of(fn: Any) -> str | None:
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    # Hash from the ``def`` line on, so decorator arguments (the config list) do not count and
    # the hash is the same for a JITFunction and the interpreter's InterpretedFunction.
    return hashlib.sha256((from_def_line(source) or source).encode("utf-8")).hexdigest()


def from_def_line(source: str) -> str | None:
    """A function's source from its first top-level ``def`` line on (no decorators), else ``None``."""
    match = re.search(r"^def\s+\w+\s*\(", source, re.MULTILINE)
    return source[match.start() :] if match else None


def kernel_source_hash(autotuner: Any) -> str | None:
    return _source_hash_of(_user_function(autotuner))


def config_data(config: Any) -> dict[str, Any]:
    """A ``triton.Config``'s launch options (no hooks); release-specific fields only when not default."""
    data: dict[str, Any] = {
        "kwargs": {k: config.kwargs[k] for k in sorted(config.kwargs)},
        "num_warps": getattr(config, "num_warps", None),
        "num_stages": getattr(config, "num_stages", None),
        "num_ctas": getattr(config, "num_ctas", 1),
        "maxnreg": getattr(config, "maxnreg", None),
    }
    for name, default in _OPTIONAL_FIELDS[2:]:
        value = getattr(config, name, default)
        if value != default:
            data[name] = value
    return data


def config_signature(config: Any) -> str:
    """Stable text of a ``triton.Config`` or its ``config_data``, the same on Triton 3.3-3.9."""
    data = config if isinstance(config, Mapping) else config_data(config)
    parts = [f"{k}={render(v)}" for k, v in sorted(data["kwargs"].items())]
    parts.append(f"num_warps={render(data.get('num_warps'))}")
    parts.append(f"num_stages={render(data.get('num_stages'))}")
    for name, default in _OPTIONAL_FIELDS:
        value = data.get(name, default)
        if value != default:
            parts.append(f"{name}={render(value)}")
    return ", ".join(parts)


def group_exists() -> bool:
    """Whether this process has a ``torch.distributed`` process group."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_available() and dist.is_initialized())


def current_rank() -> int:
    if group_exists():
        import torch.distributed as dist

        return int(dist.get_rank())
    raw = os.environ.get("RANK", "").strip()
    if not raw:
        return 0
    rank = parse_int(raw)  # ASCII digits only: int() would also read "١" or "1_0"
    if rank is None or rank < 0:
        raise PolicyError("RANK", raw, "a non-negative integer")
    return rank
