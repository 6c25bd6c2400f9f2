"""Launch records and the keys that find them: the pinned launch path's data, computed once per key.

``raw_key`` is the decision key (one decision per key, as fine as ``identity.tuning_key``);
``launch_key`` the hit path's key, at least as fine and cheaper to build; ``specialize_find``
compiles the hit path's lookup (key, then record) for the call shape a kernel is launched with,
and ``compile_run`` the whole hit path as one function that ``pinning.arm`` stores as the
autotuner's instance ``run``. A ``Launch`` holds what every launch of a key needs (the config
and its ``all_kwargs()``). The functions read a few fields of ``pinning.AutotunerState``
(``KeyedState``), so this module imports nothing of the runtime package.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple, Protocol


class KeyedState(Protocol):
    """The fields of ``pinning.AutotunerState`` the keys are built from."""

    kernel: str
    key_index: tuple[tuple[str, int], ...]
    arg_names: tuple[str, ...]
    arg_set: frozenset[str]
    launches: dict[tuple[Any, ...], Launch]
    find: Any
    """The hit path's lookup, ``find(args, kwargs) -> Launch | None`` (``specialize_find`` sets it)."""


class Launch(NamedTuple):
    """What a pinned launch of one key needs, computed once per (autotuner, launch key)."""

    config: Any
    """The decided live ``Config`` (its ``pre_hook`` is read at every launch)."""
    options: dict[str, Any]
    """``config.all_kwargs()``: what ``Config.pre_hook`` sees, and what a launch passes to
    ``fn.run`` beside the caller's keywords (never handed out to be mutated)."""
    run_options: dict[str, Any]
    """``options`` less the compile options equal to the backend's defaults (``make_launch``):
    what the compiled hit path passes to ``fn.run``, where the caller passes no keywords of its own."""


def make_launch(config: Any, defaults: dict[str, Any]) -> Launch:
    """The launch record of ``config``: ``defaults`` (``triton_compat.launch_option_defaults``)
    are the compile options ``fn.run`` fills in itself, so passing them changes no kernel and only
    lengthens Triton's per-launch cache key. A caller's own keywords take the full ``options``, so
    an option passed twice still fails as it does under Triton."""
    options = config.all_kwargs()
    run_options = {
        name: value for name, value in options.items() if name not in defaults or defaults[name] != value
    }
    return Launch(config, options, run_options)


MAX_LAUNCHES = 4096
"""Launch records kept per autotuner and installation; past this, launches take the slow path
(still correct), so a key argument that is a fresh object every call cannot grow memory."""


def raw_key(state: KeyedState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The decision key: the parts of ``tuning_key`` by argument name, without building text.

    The ``key=`` values present, each with its name and type (so ``True``/``1``/``1.0`` stay
    distinct keys, as in ``tuning_key``), then ``(name, dtype)`` of every named argument that has
    a dtype, in parameter order. Positional and keyword passing of the same arguments give the
    same key; arguments that are not the kernel's (``grid``, ``warmup``) play no part.
    """
    named = dict(zip(state.arg_names, args))
    for name, value in kwargs.items():
        if name in state.arg_set:
            named[name] = value
    values = tuple((name, named[name].__class__, named[name]) for name, _ in state.key_index if name in named)
    dtypes = tuple((name, named[name].dtype) for name in state.arg_names if hasattr(named.get(name), "dtype"))
    return (values, dtypes)


_ABSENT = object()  # a key argument not passed at all (its default applies), or no dtype
_KEYWORDS = object()  # starts the keyword part of a launch key
_DTYPE = itertools.repeat("dtype")
_NO_DTYPE = itertools.repeat(_ABSENT)


def launch_key(state: KeyedState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The hit path's key: at least as fine as ``raw_key``, cheaper to build (no names, no dict).

    Each ``key=`` value with its type, then each positional argument's dtype (``_ABSENT`` where it
    has none), then, only when kernel arguments are passed by keyword, ``(name, dtype)`` of each
    in call order. Equal launch keys imply equal raw keys: the same count of positional
    arguments (the dtype part has one entry per argument), the same keyword names, so the same
    arguments are present, with the same key values and dtypes. It may be finer (keyword order),
    which only costs another record for the same decision.
    """
    count = len(args)
    key: list[Any] = []
    for name, i in state.key_index:
        value = args[i] if i < count else kwargs.get(name, _ABSENT)
        key.append(value.__class__)
        key.append(value)
    key.extend(map(getattr, args, _DTYPE, _NO_DTYPE))
    if not state.arg_set.isdisjoint(kwargs):
        key.append(_KEYWORDS)
        names = state.arg_set
        key.extend((name, getattr(v, "dtype", _ABSENT)) for name, v in kwargs.items() if name in names)
    return tuple(key)


# Exact builtin types whose instances never have a ``dtype``: a class check is cheaper than a
# failed attribute lookup, and gives the same launch-key entry (``_ABSENT``).
_PLAIN_TYPES = {int: "int", float: "float", bool: "bool", str: "str", type(None): "_NONE_TYPE"}


def find_launch(state: KeyedState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Launch | None:
    """The launch record of this call, if there is one: ``state.find`` before it is specialized."""
    return state.launches.get(launch_key(state, args, kwargs))


def _key_parts(state: KeyedState, args: tuple[Any, ...]) -> tuple[list[str], list[str]]:
    """The local names ``a0, a1, ...`` for ``args`` and, one expression each, the entries of
    ``launch_key`` of an all-positional call shaped like ``args``, built from those names."""
    count = len(args)
    names = [f"a{i}" for i in range(count)]
    parts: list[str] = []
    for _, i in state.key_index:
        parts += [f"{names[i]}.__class__", names[i]] if i < count else ["_ABSENT.__class__", "_ABSENT"]
    for name, value in zip(names, args):
        plain = _PLAIN_TYPES.get(value.__class__)
        if plain is not None:
            parts.append(f"(_ABSENT if {name}.__class__ is {plain} else getattr({name}, 'dtype', _ABSENT))")
        elif hasattr(value, "dtype"):
            parts.append(f"{name}.dtype")
        else:
            parts.append(f"getattr({name}, 'dtype', _ABSENT)")
    return names, parts


def _as_tuple(parts: list[str]) -> str:
    return f"({''.join(part + ', ' for part in parts)})"


def _compile(source: str, name: str, what: str, scope: dict[str, Any]) -> Any:
    scope.update(_ABSENT=_ABSENT, _NONE_TYPE=type(None))
    exec(compile(source, f"<megatron_tuning {what} {name}>", "exec"), scope)  # noqa: S102
    return scope[source[4 : source.index("(")]]


def specialize_find(state: KeyedState, args: tuple[Any, ...]) -> None:
    """Make ``state.find`` a lookup compiled for calls shaped like ``args``.

    The hit path looks up a launch record at every launch; a loop over the key arguments and a
    walk over ``args`` cost more than the launch they guard. For calls with as many positional
    arguments as ``args`` and no kernel argument by keyword, the compiled function unpacks
    ``args``, builds the same tuple as ``launch_key`` in one expression (as Triton's own JIT
    binder is generated per signature) and looks it up in ``state.launches`` (a dict that is
    never rebound): ``.dtype`` read directly where ``args`` had a tensor, a class check where it
    had a plain ``int``/``float``/``bool``/``str``/``None``. Any other call, or an argument of
    another kind (``AttributeError``), is looked up by ``launch_key`` itself, so the two agree on
    every call (``tests/runtime/test_launches.py`` checks it). Only integer positions and the
    names above enter the source; argument names never do.
    """
    names, parts = _key_parts(state, args)
    key = _as_tuple(parts)
    source = (
        "def find(args, kwargs):\n"
        f"    if len(args) != {len(args)} or not arg_set.isdisjoint(kwargs):\n"
        "        return get(launch_key(state, args, kwargs))\n"
        + (f"    {', '.join(names)}, = args\n" if names else "")
        + "    try:\n"
        f"        key = {key}\n"
        "    except AttributeError:  # no dtype where the first call had one\n"
        "        return get(launch_key(state, args, kwargs))\n"
        "    return get(key)\n"
    )
    scope = {"arg_set": state.arg_set, "get": state.launches.get, "launch_key": launch_key, "state": state}
    state.find = _compile(source, state.kernel, "launch lookup", scope)


FAST_RUN_ATTR = "_megatron_tuning_serves"
"""Set on every function ``compile_run`` makes: the installation it serves (how ``pinning`` tells
its own instance ``run`` from anything else found in an autotuner's ``__dict__``)."""


def compile_run(
    state: KeyedState,
    autotuner: Any,
    args: tuple[Any, ...],
    *,
    serves: Any,
    flags: Any,
    slow: Any,
) -> Any:
    """A launch function for ``autotuner.__dict__["run"]``: the whole pinned hit path in one frame.

    ``kernel[grid](...)`` (``KernelInterface.__getitem__``) calls ``self.run(...)`` and
    ``Heuristics.run`` calls ``self.fn.run(...)``: both find an instance attribute before the
    class's ``run``, so this function replaces, per launch, the bound call of the class-level
    wrapper, its ``__dict__`` lookup of the state and the separate ``find`` frame. It serves
    calls shaped like ``args`` (as many positional arguments, ``grid`` and ``warmup`` by keyword
    and nothing else) while ``flags.active is serves``, and only keys that already have a launch
    record; every other call goes to ``slow(autotuner, *args, **kwargs)`` (the class-level
    ``run``; ``grid`` and ``warmup`` first in its keywords, as ``kernel[grid](...)`` passes them),
    so it can only ever launch what the class-level hit path would. Per launch it does
    what that path does: ``best_config`` set, ``Config.pre_hook``
    with the full argument dict, ``autotuner.fn.run`` read and called. ``flags`` is the module
    that holds ``active`` (``runtime.pinning``).
    """
    names, parts = _key_parts(state, args)
    scope: dict[str, Any] = {}
    lines = [
        "def run(*args, grid=_ABSENT, warmup=_ABSENT, **kwargs):",
        f"    if len(args) == {len(args)} and not kwargs and grid is not _ABSENT and warmup is not _ABSENT"
        " and flags.active is serves:",
        *([f"        {', '.join(names)}, = args"] if names else []),
        "        try:",
        *_lookup(state, args, parts, scope),
        "        except AttributeError:  # no dtype where the first call had one",
        "            launch = None",
        "        if launch is not None:",
        "            config, options, run_options = launch",
        "            autotuner.best_config = config",
        "            if config.pre_hook is not None:  # the full argument dict, as on Triton's hit path",
        "                named = dict(zip(arg_names, args))",
        "                config.pre_hook({**named, 'grid': grid, 'warmup': warmup, **options})",
        "            return autotuner.fn.run(*args, grid=grid, warmup=warmup, **run_options)",
        "    if warmup is not _ABSENT:",
        "        kwargs = {'warmup': warmup, **kwargs}",
        "    if grid is not _ABSENT:",
        "        kwargs = {'grid': grid, **kwargs}",
        "    return slow(autotuner, *args, **kwargs)",
    ]
    source = "\n".join(lines) + "\n"
    scope.update(
        arg_names=state.arg_names,
        autotuner=autotuner,
        flags=flags,
        get=state.launches.get,
        serves=serves,
        slow=slow,
    )
    run = _compile(source, state.kernel, "launch", scope)
    setattr(run, FAST_RUN_ATTR, serves)
    return run


def _lookup(state: KeyedState, args: tuple[Any, ...], parts: list[str], scope: dict[str, Any]) -> list[str]:
    """The source lines that set ``launch``: the record of ``args``'s own key compared entry by
    entry first (no tuple built, nothing hashed: what most launches of a kernel repeat), then
    ``state.launches`` by the full launch key.

    The comparison is the one a tuple key makes in a dict (each entry ``is`` or ``==``), over
    constants taken from ``args``; only where every key value there is a plain builtin (an
    ``int`` compared with ``==``, never a user object). A state's record for a key always holds
    the key's one decision, so the record found now stays the right one.
    """
    lookup = [f"            launch = get({_as_tuple(parts)})"]
    expected = launch_key(state, args, {})
    first = state.launches.get(expected)
    values = expected[1 : 2 * len(state.key_index) : 2]
    if first is None or not all(v is _ABSENT or v.__class__ in _PLAIN_TYPES for v in values):
        return lookup
    checks = []
    count = 2 * len(state.key_index)
    for i, (part, value) in enumerate(zip(parts, expected)):
        if part.startswith("_ABSENT"):  # a key argument past the positional ones: constant
            continue
        plain = _PLAIN_TYPES.get(args[i - count].__class__) if i >= count else None
        if plain is not None:  # the dtype entry of what was a plain int/float/...: _ABSENT
            name = f"a{i - count}"
            checks.append(f"({name}.__class__ is {plain} or getattr({name}, 'dtype', _ABSENT) is _ABSENT)")
            continue
        scope[f"K{i}"] = value
        checks.append(f"({part} is K{i} or {part} == K{i})")
    scope["first"] = first
    return [
        f"            if {' and '.join(checks) or 'True'}:",
        "                launch = first",
        "            else:",
        "    " + lookup[0],
    ]
