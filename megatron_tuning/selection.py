"""Selection core: pure functions that name kernels and keys, and choose configs.

Nothing here measures, performs I/O or talks to other ranks. Every rule is a function
of the candidate list and the call signature only, so every process and every rank
computes the same answer. Nothing relies on Python's salted ``hash()`` or on the
order of sets/dicts of ``Config`` objects (before Triton 3.4 they hash by identity).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import math
import numbers
import os
import re
import textwrap
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .errors import BlockSizeOverrideError, PolicyError, TableMissError
from .policy import TuningPolicy

logger = logging.getLogger(__name__)

ON_MISS_CHOICES = ("min_cost", "error")

# Config fields beyond kwargs/num_warps/num_stages, with the default that leaves them out of
# signatures: a field only some Triton releases have must not change the signature of a
# config that does not set it (3.2/3.3 warp-specialisation fields, 3.4+ ir_override).
_OPTIONAL_FIELDS: tuple[tuple[str, Any], ...] = (
    ("num_ctas", 1),
    ("maxnreg", None),
    ("ir_override", None),
    ("num_buffers_warp_spec", 0),
    ("num_consumer_groups", 0),
    ("reg_dec_producer", 0),
    ("reg_inc_consumer", 0),
)

_warned: set[tuple[Any, ...]] = set()
_warned_lock = threading.Lock()


def reset_warnings() -> None:
    """Forget which warn-once causes were already reported (for tests and long-lived REPLs)."""
    with _warned_lock:
        _warned.clear()


def warn_once(cause: tuple[Any, ...], message: str, *args: Any) -> bool:
    """Log ``message`` at WARNING the first time ``cause`` is seen; return whether it logged."""
    with _warned_lock:
        if cause in _warned:
            return False
        _warned.add(cause)
    logger.warning(message, *args)
    return True


# --------------------------------------------------------------------------- hardware


def _interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def arch_tag() -> str:
    """``sm<major><minor>`` of the current CUDA device; ``unknown`` off-GPU or under the interpreter."""
    if _interpreter_active():
        return "unknown"
    try:
        import torch
    except ImportError:
        return "unknown"
    if not torch.cuda.is_available():
        return "unknown"
    return _arch_for_device(torch.cuda.current_device())


def _arch_for_device(index: int) -> str:
    import torch

    if getattr(torch.version, "hip", None):
        name = str(getattr(torch.cuda.get_device_properties(index), "gcnArchName", "gfx-unknown"))
        return name.split(":", 1)[0]
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


# --------------------------------------------------------------------------- kernel identity


def _user_function(autotuner: Any) -> Any:
    """Unwrap Autotuner -> Heuristics -> JITFunction/InterpretedFunction -> the Python function."""
    fn = getattr(autotuner, "base_fn", None)
    if inspect.isfunction(fn):
        return fn
    fn = autotuner
    for _ in range(16):  # wrappers nest a few levels at most; bound the walk against cycles
        if inspect.isfunction(fn):
            return fn
        inner = getattr(fn, "fn", None)
        if inner is None:
            break
        fn = inner
    raise TypeError(f"cannot find the Python function behind {autotuner!r}")


def kernel_name(autotuner: Any) -> str:
    """Qualified name of the kernel's Python function (e.g. ``matmul_kernel``)."""
    return str(_user_function(autotuner).__qualname__)


def kernel_module(autotuner: Any) -> str:
    """Module that defines the kernel; what the policy's scope matches against."""
    return str(_user_function(autotuner).__module__)


def kernel_id(autotuner: Any) -> str:
    """``module:qualname``: the kernel's identity in tables, logs and across ranks."""
    fn = _user_function(autotuner)
    return f"{fn.__module__}:{fn.__qualname__}"


@functools.cache
def _source_hash_of(fn: Any) -> str | None:
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    # Hash from the ``def`` line on, so decorator arguments (the config list) do not count and
    # the hash is the same for a JITFunction and the interpreter's InterpretedFunction.
    match = re.search(r"^def\s+\w+\s*\(", source, re.MULTILINE)
    body = source[match.start() :] if match else source
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def kernel_source_hash(autotuner: Any) -> str | None:
    """sha256 of the kernel function's source; ``None`` when the source is unavailable."""
    return _source_hash_of(_user_function(autotuner))


# --------------------------------------------------------------------------- keys and signatures


def _render(value: Any) -> str:
    """Stable text for one value: keeps type distinctions (``True`` is not ``1``)."""
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    dtype = getattr(value, "dtype", None)
    shape = getattr(value, "shape", None)
    if dtype is not None and shape is not None:
        return f"tensor({list(shape)}, {dtype})"
    text = repr(value)
    # A default repr carries a memory address, which differs between processes.
    return type(value).__name__ if " at 0x" in text else text


def tuning_key(autotuner: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """Stable text of the tuning key: the ``key=`` argument values, then every tensor dtype.

    At least as fine as Triton's own key (same values and dtypes; bools are kept apart from
    ints), in parameter order, e.g. ``M=64, N=48, K=40 | a_ptr:torch.float16, b_ptr:...``.
    """
    arg_names = list(autotuner.arg_names)
    named: dict[str, Any] = dict(zip(arg_names, args))
    for name, value in kwargs.items():
        if name in arg_names:
            named[name] = value
    values = [f"{name}={_render(named[name])}" for name in autotuner.keys if name in named]
    dtypes = [
        f"{name}:{named[name].dtype}" for name in arg_names if name in named and hasattr(named[name], "dtype")
    ]
    return ", ".join(values) + " | " + ", ".join(dtypes)


def config_data(config: Any) -> dict[str, Any]:
    """Serializable launch options of a ``triton.Config`` (hooks stay on the live object).

    ``kwargs``, ``num_warps``, ``num_stages``, ``num_ctas`` and ``maxnreg`` are always present;
    release-specific fields only when set to a non-default value.
    """
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


def config_from_data(data: Mapping[str, Any]) -> Any:
    """Build a ``triton.Config`` from ``config_data`` output (no hooks)."""
    import triton

    accepted = inspect.signature(triton.Config.__init__).parameters
    options: dict[str, Any] = {}
    for name in ("num_warps", "num_stages") + tuple(name for name, _ in _OPTIONAL_FIELDS):
        if name not in data:
            continue
        if name not in accepted:
            default = dict(_OPTIONAL_FIELDS).get(name)
            if data[name] == default:
                continue
            raise ValueError(
                f"config field {name}={data[name]!r} is not supported by Triton {triton.__version__}"
            )
        options[name] = data[name]
    return triton.Config(dict(data["kwargs"]), **options)


def config_signature(config: Any) -> str:
    """Stable text of a config for logs and cross-rank comparison.

    Sorted kwargs with their types kept, then ``num_warps`` and ``num_stages`` always, then
    other fields only when non-default, so one config reads the same on Triton 3.3-3.9.
    Accepts a ``triton.Config`` or its ``config_data`` dict.
    """
    data = config if isinstance(config, Mapping) else config_data(config)
    parts = [f"{k}={_render(v)}" for k, v in sorted(data["kwargs"].items())]
    parts.append(f"num_warps={_render(data.get('num_warps'))}")
    parts.append(f"num_stages={_render(data.get('num_stages'))}")
    for name, default in _OPTIONAL_FIELDS:
        value = data.get(name, default)
        if value != default:
            parts.append(f"{name}={_render(value)}")
    return ", ".join(parts)


# --------------------------------------------------------------------------- static cost

_SHORT_BLOCK_NAMES = frozenset({"BM", "BN", "BK", "BD", "BH", "BT", "BS", "BC", "BV"})


def is_block_size_name(name: str) -> bool:
    """Whether a kwarg is a tile extent: ``BLOCK_M``, ``BLOCK_SIZE_N``, ``BM``, ``XBLOCK``, ``R0_BLOCK``."""
    upper = name.upper()
    if upper in _SHORT_BLOCK_NAMES:
        return True
    if "BLOCK" not in upper:
        return False
    # Counts and groupings are not tile extents (NUM_BLOCKS, GROUP_SIZE, BLOCKS_PER_SM).
    return not any(word in upper for word in ("NUM", "GROUP", "BLOCKS"))


def estimate_config_cost(cfg: Any) -> tuple[int, int, int]:
    """Static cost ``(block_cost, num_warps, num_stages)``; lower is cheaper. Never measures.

    ``block_cost`` is the product of the tile extents times the pipeline stages, a proxy for
    the shared-memory footprint (``stages * (BM*BK + BK*BN)`` for a matmul grows with it).
    Kwargs that are not tile extents do not count; ties are broken by the caller.
    """
    kwargs = cfg["kwargs"] if isinstance(cfg, Mapping) else cfg.kwargs
    stages = (cfg.get("num_stages") if isinstance(cfg, Mapping) else getattr(cfg, "num_stages", 1)) or 1
    warps = (cfg.get("num_warps") if isinstance(cfg, Mapping) else getattr(cfg, "num_warps", 1)) or 1
    block = math.prod(
        int(v)
        for k, v in kwargs.items()
        if is_block_size_name(k) and isinstance(v, numbers.Integral) and not isinstance(v, bool)
    )
    return (block * int(stages), int(warps), int(stages))


def order_by_cost(configs: Iterable[Any]) -> list[Any]:
    """Configs in a total order: static cost, then signature text, then list position."""
    indexed = list(enumerate(configs))
    indexed.sort(key=lambda item: (estimate_config_cost(item[1]), config_signature(item[1]), item[0]))
    return [config for _, config in indexed]


def cheapest(configs: Sequence[Any]) -> Any:
    """The deterministic fallback: the first config of ``order_by_cost``."""
    if not configs:
        raise ValueError("cheapest() needs at least one config")
    return order_by_cost(configs)[0]


def _as_block_sizes(block_sizes: Mapping[str, int] | Iterable[tuple[str, int]]) -> dict[str, int]:
    return dict(block_sizes.items() if isinstance(block_sizes, Mapping) else block_sizes)


def filter_configs_by_block_sizes(
    configs: Sequence[Any], block_sizes: Mapping[str, int] | Iterable[tuple[str, int]] = ()
) -> list[Any]:
    """Configs whose kwargs match every override name that these configs use.

    Override names no config has are ignored (an override for one kernel family must not
    break the others), so with no relevant names this returns ``configs`` unchanged. An
    empty result means the override is relevant here and matches nothing.
    """
    wanted = _as_block_sizes(block_sizes)
    relevant = {k: v for k, v in wanted.items() if any(k in c.kwargs for c in configs)}
    if not relevant:
        return list(configs)
    return [
        c
        for c in configs
        if all(
            k in c.kwargs and c.kwargs[k] == v and type(c.kwargs[k]) is type(v) for k, v in relevant.items()
        )
    ]


# --------------------------------------------------------------------------- tables


@dataclass(frozen=True, slots=True)
class TableHit:
    """A table entry found for (kernel, key): its config in ``config_data`` form, and where from."""

    config: Mapping[str, Any]
    origin: str


@runtime_checkable
class ConfigTable(Protocol):
    """What ``deterministic_choice`` needs from a table; ``megatron_tuning.table`` implements it."""

    def lookup(
        self, kernel: str, key: str, *, arch: str, source_hash: str | None = None
    ) -> TableHit | None: ...


class InMemoryTable:
    """A table held in a dict ``{(kernel_id, key): config or config_data}``, any arch."""

    def __init__(self, entries: Mapping[tuple[str, str], Any], origin: str = "<memory>") -> None:
        self._entries = {k: (v if isinstance(v, Mapping) else config_data(v)) for k, v in entries.items()}
        self._origin = origin

    def lookup(self, kernel: str, key: str, *, arch: str, source_hash: str | None = None) -> TableHit | None:
        data = self._entries.get((kernel, key))
        return None if data is None else TableHit(data, self._origin)


def as_config_table(table: ConfigTable | Mapping[tuple[str, str], Any] | None) -> ConfigTable | None:
    if table is None or isinstance(table, ConfigTable):
        return table
    if isinstance(table, Mapping):
        return InMemoryTable(table)
    raise TypeError(
        f"table must provide lookup(kernel, key, *, arch, source_hash) or be a mapping, not {table!r}"
    )


# --------------------------------------------------------------------------- choices


@dataclass(frozen=True, slots=True)
class Choice:
    """A chosen live config and why: ``source`` is a ``decisions.SOURCES`` value."""

    config: Any
    source: str
    origin: str | None = None


def choose_deterministically(
    autotuner: Any,
    candidates: Sequence[Any],
    key: str,
    *,
    table: ConfigTable | Mapping[tuple[str, str], Any] | None = None,
    on_miss: str = "min_cost",
    block_sizes: Mapping[str, int] | Iterable[tuple[str, int]] = (),
) -> Choice:
    """``deterministic_choice`` with a precomputed key, returning the source of the choice."""
    if on_miss not in ON_MISS_CHOICES:
        raise PolicyError("on_miss", on_miss, "one of " + "|".join(ON_MISS_CHOICES))
    if not candidates:
        raise ValueError(f"no live configs for kernel {kernel_id(autotuner)}")
    kernel = kernel_id(autotuner)
    lookup = as_config_table(table)
    reason = "no table configured" if lookup is None else "no table entry"
    if lookup is not None:
        hit = lookup.lookup(kernel, key, arch=arch_tag(), source_hash=kernel_source_hash(autotuner))
        if hit is not None:
            wanted = config_signature(hit.config)
            for config in candidates:  # position order: the first live duplicate wins
                if config_signature(config) == wanted:
                    return Choice(config, "table", hit.origin)
            reason = "the table entry matches no live config"
            warn_once(
                ("entry-no-match", kernel, key, hit.origin),
                "Table entry for kernel %s key %s in %s (%s) matches none of the %d live configs "
                "after pruning; treating it as a miss.",
                kernel,
                key,
                hit.origin,
                wanted,
                len(candidates),
            )
    override = _as_block_sizes(block_sizes)
    if override:
        matching = filter_configs_by_block_sizes(candidates, override)
        if not matching:
            raise BlockSizeOverrideError(kernel, override, [config_signature(c) for c in candidates])
        if len(matching) < len(candidates):
            return Choice(cheapest(matching), "override")
    if len(candidates) == 1:
        return Choice(candidates[0], "single")
    if on_miss == "error":
        raise TableMissError(kernel, key, reason)
    return Choice(cheapest(candidates), "cheapest")


def deterministic_choice(
    autotuner: Any,
    candidates: Sequence[Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    table: ConfigTable | Mapping[tuple[str, str], Any] | None = None,
    on_miss: str = "min_cost",
    block_sizes: Mapping[str, int] | Iterable[tuple[str, int]] = (),
) -> Any:
    """Pick one of ``candidates`` (the live, pruned configs) without measuring.

    Order: the table entry for this kernel and key, matched back to a live candidate (so its
    ``pre_hook`` survives); then an explicit block-size override; then the cheapest config by
    static cost. With ``on_miss='error'`` a miss raises ``TableMissError`` naming kernel and key.
    """
    key = tuning_key(autotuner, args, kwargs)
    return choose_deterministically(
        autotuner, candidates, key, table=table, on_miss=on_miss, block_sizes=block_sizes
    ).config


def current_rank() -> int:
    """This process's rank: torch.distributed when initialized, else ``RANK``, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except ImportError:
        pass
    raw = os.environ.get("RANK", "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise PolicyError("RANK", raw, "a non-negative integer") from None


def chaos_index(kernel: str, key: str, rank: int, count: int) -> int:
    """Position in cost order that chaos mode picks: distinct for ranks ``count`` apart or less."""
    offset = int(hashlib.sha256(f"{kernel}\n{key}".encode()).hexdigest()[:8], 16)
    return (rank + offset) % count


def chaos_choice(
    autotuner: Any, candidates: Sequence[Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """A per-rank different config, on purpose: the positive control for the agreement check.

    Reproducible (the same rank picks the same config in every run); with two or more
    candidates, consecutive ranks always pick different configs.
    """
    if not candidates:
        raise ValueError(f"no live configs for kernel {kernel_id(autotuner)}")
    ordered = order_by_cost(candidates)
    key = tuning_key(autotuner, args, kwargs)
    return ordered[chaos_index(kernel_id(autotuner), key, current_rank(), len(ordered))]


def autotune_configs(configs: Sequence[Any], *, policy: TuningPolicy | None = None) -> list[Any]:
    """For a project's own kernels, at decoration: ``@triton.autotune(configs=autotune_configs([...]))``.

    Under deterministic mode (``TuningPolicy.from_env()``: ``MEGATRON_TUNING_MODE`` or torch's
    deterministic algorithms) the list shrinks to the one deterministic choice, honouring a
    block-size override, so neither Triton nor torch.compile's autotuner can benchmark or pick
    differently. Otherwise the list is returned unchanged. Triton's ``TRITON_CACHE_AUTOTUNING``
    is not enough: a cache miss still times the candidates, so the cached winner is whichever
    process wrote last, and the cache is skipped for configs with a ``pre_hook``.
    """
    policy = policy if policy is not None else TuningPolicy.from_env()
    configs = list(configs)
    if policy.mode != "deterministic" or len(configs) <= 1:
        return configs
    matching = filter_configs_by_block_sizes(configs, policy.block_sizes)
    if not matching:
        raise BlockSizeOverrideError(
            "<autotune_configs>", dict(policy.block_sizes), [config_signature(c) for c in configs]
        )
    return [cheapest(matching)]


def warn_if_mamba_env_ignored(policy: TuningPolicy | None = None) -> bool:
    """Warn once when ``MAMBA_DETERMINISTIC`` asks for determinism but our mode is not deterministic."""
    raw = os.environ.get("MAMBA_DETERMINISTIC", "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    policy = policy if policy is not None else TuningPolicy.from_env()
    if policy.mode == "deterministic":
        return False
    return warn_once(
        ("mamba-env", policy.mode),
        "MAMBA_DETERMINISTIC=%s is set but megatron_tuning's mode is %r, so autotuned kernels "
        "are not pinned. Set MEGATRON_TUNING_MODE=deterministic.",
        raw,
        policy.mode,
    )
