"""The call key: which values of a launch pick its config (docs/choosing.md#keys-and-identity).

Each ``key=`` argument's value, then the dtype of every argument that has one: at least as fine as
Triton's own key, with ``True``, ``1`` and ``1.0`` apart. Built once per (kernel, key), at its first
launch or from a table's stored parts; its text, Triton's cache key and the agreement digest derive
from it, and nothing reads the text back.
"""

from __future__ import annotations

import functools
import math
import numbers
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # what msgpack stores


@dataclass(frozen=True, slots=True)
class Shown:
    """A key value kept as its stable text: a tensor, a tuple or another object, a float that is
    not finite, an integer beyond 64 bits. It compares as that text, never as a number."""

    text: str


Value = None | bool | int | float | str | Shown
_KINDS = frozenset((type(None), bool, int, float, str, Shown))


def render(value: Any) -> str:
    """Stable text for one value: keeps type distinctions (``True`` is not ``1``), never an address."""
    kind = type(value)
    if kind is int:
        return str(value)
    if kind is Shown:
        return value.text  # type: ignore[no-any-return]
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
    if dtype is not None and shape is not None:
        return f"tensor({list(shape)}, {dtype})"
    text = repr(value)
    if " at 0x" not in text:
        return text
    # A default repr carries a memory address, which differs between processes. A function, class
    # or jit function is named where it is defined instead, the same in every process, so ``relu``
    # and ``gelu`` stay apart. Anything else is its type alone: ``config_list_digest`` refuses a
    # kernel whose configs that leaves equal.
    name = _defined_at(value)
    return f"{type(value).__name__}({name})" if name else type(value).__name__


def _defined_at(value: Any) -> str | None:
    """``module:qualname`` of a function or class, or of the function a wrapper holds (``.fn``: the
    interpreter's jit function); ``None`` for anything else."""
    fn = getattr(value, "fn", None)
    for obj in (value, fn) if isinstance(fn, types.FunctionType) else (value,):
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if type(module) is str and type(qualname) is str:
            return f"{module}:{qualname}"
    return None


def key_value(value: Any) -> Value:
    """A launch's argument value in a key: a scalar a table can store as itself, else ``Shown``."""
    if type(value) is not bool and isinstance(value, numbers.Real):
        value = int(value) if isinstance(value, numbers.Integral) else float(value)
    try:
        return _checked(value)
    except ValueError:  # not a scalar, a number beyond 64 bits or not finite, a lone surrogate
        return Shown(render(value))


def _checked(value: Any) -> Value:
    kind = type(value)
    if (kind is int and not INT_MIN <= value <= INT_MAX) or (kind is float and not math.isfinite(value)):
        raise ValueError(f"key value {value!r}: a number beyond what a table stores as one")
    if kind not in _KINDS:
        raise ValueError(f"key value {value!r}: expected None, bool, int, float or str")
    if kind is str and not has_utf8(value):
        raise ValueError(f"key value {value!r} is not valid Unicode (lone surrogate)")
    return value  # type: ignore[no-any-return]


def has_utf8(text: str) -> bool:
    """Whether ``text`` has a UTF-8 form (one msgpack can store): a lone surrogate, what a JSON
    ``\\ud800`` escape gives, has none."""
    try:
        return text.isascii() or bool(text.encode("utf-8"))  # never empty: the text is not ASCII
    except UnicodeEncodeError:
        return False


class Key(str):
    """A call's key: its text (``M=64, N=48 | a_ptr:torch.float16``: what people, logs and digests
    read) with the parts it is rendered from (``names`` and ``values`` of the ``key=`` arguments,
    ``dtypes``: what tables store and the nearest-shape rule compares). Equal keys have equal text."""

    __slots__ = ("names", "values", "dtypes")
    names: tuple[str, ...]
    values: tuple[Value, ...]
    dtypes: tuple[tuple[str, str], ...]  # (argument name, dtype text), in parameter order

    def __new__(
        cls, values: Mapping[str, Value] | None = None, dtypes: Mapping[str, str] | None = None
    ) -> Key:
        values, dtypes = values or {}, dtypes or {}
        return cls.of(tuple(values), tuple(values.values()), tuple(dtypes.items()))

    @classmethod
    def of(
        cls, names: tuple[str, ...], values: tuple[Value, ...], dtypes: tuple[tuple[str, str], ...]
    ) -> Key:
        """The key of these parts; ``ValueError`` names a part no table can store."""
        if len(values) != len(names):
            raise ValueError(f"key values {values!r}: one per name of {names!r}")
        for value in values:
            _checked(value)
        try:
            names, dtypes_text = _parts(names, dtypes)
        except TypeError:  # a list or a map where a name belongs
            raise ValueError(f"key names {names!r}: expected distinct strings") from None
        text = ", ".join([f"{n}={render(v)}" for n, v in zip(names, values)]) + dtypes_text
        key = super().__new__(cls, text)
        key.names, key.values, key.dtypes = names, values, dtypes
        return key

    def __reduce__(self) -> tuple[Any, ...]:
        return (Key.of, (self.names, self.values, self.dtypes))

    def triton_key(self, passed: Sequence[str]) -> tuple[Any, ...]:
        """Triton's ``Autotuner.cache`` key of a call with this key: its values, then its dtypes in the
        order of ``passed``, the argument names as the call passed them (as Triton orders them)."""
        dtypes = dict(self.dtypes)
        values = (v.text if type(v) is Shown else v for v in self.values)
        return (*values, *(dtypes[name] for name in passed if name in dtypes))

    def to_data(self) -> dict[str, Any]:
        """The stored form (JSON views, decision logs): maps in key order, never sorted."""
        values = {n: stored_value(v) for n, v in zip(self.names, self.values)}
        return {"dtypes": dict(self.dtypes), "values": values}

    @classmethod
    def from_data(cls, data: Any) -> Key:
        """A key from its stored form; ``ValueError`` names what is wrong."""
        if isinstance(data, str):
            raise text_key_error(data)
        if type(data) is not dict or data.keys() != {"dtypes", "values"}:
            raise ValueError(f"key must be a map with fields dtypes and values, got {data!r}")
        if type(data["values"]) is not dict or type(data["dtypes"]) is not dict:
            raise ValueError("key values and dtypes must be maps")
        return cls({n: value_from_stored(v) for n, v in data["values"].items()}, data["dtypes"])

    def order(self) -> tuple[Any, ...]:
        """Sort key that reads numbers as numbers (``M=8`` before ``M=100``), then the text."""
        parts = [
            (name, 0, v, "") if type(v) in (int, float) else (name, 1, 0, render(v))
            for name, v in zip(self.names, self.values)
        ]
        return (*parts, self.dtypes, str(self))


@functools.lru_cache(maxsize=4096)
def _parts(names: tuple[str, ...], dtypes: tuple[tuple[str, str], ...]) -> tuple[tuple[str, ...], str]:
    """Names and dtypes checked once per kernel (whose keys share one names tuple), and the text
    the dtypes add."""
    if not all(type(n) is str for n in names) or len(set(names)) != len(names):
        raise ValueError(f"key names {names!r}: expected distinct strings")
    pairs = all(type(p) is tuple and len(p) == 2 and type(p[0]) is type(p[1]) is str for p in dtypes)
    if not pairs or len({p[0] for p in dtypes}) != len(dtypes):
        raise ValueError(f"key dtypes {dtypes!r}: expected (name, dtype text) pairs, each name once")
    return names, " | " + ", ".join(f"{n}:{d}" for n, d in dtypes)


def text_key_error(text: str) -> ValueError:
    """Why a key given as text is refused where its parts are stored, and what to pass instead."""
    return ValueError(
        f"key {text[:200]!r} is text, which is never read back into its parts: pass the Key that "
        "megatron_tuning.tuning_key(autotuner, args, kwargs) returns, or build one with "
        "megatron_tuning.core.key.Key({'M': 32, 'N': 32}, {'a_ptr': 'torch.float16'})"
    )


def stored_value(value: Value) -> Any:
    """A key value as tables store it: itself, or ``{"text": ...}`` for a ``Shown`` one."""
    return {"text": value.text} if type(value) is Shown else value


def value_from_stored(data: Any) -> Any:
    if type(data) is dict and data.keys() == {"text"} and type(data["text"]) is str:
        return Shown(data["text"])
    return data  # anything else is checked by ``Key``


def call_key(
    arg_names: Sequence[str], key_names: Sequence[str], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Key:
    """The key of one call: each of ``key_names`` passed, then each argument's dtype, by name."""
    named: dict[str, Any] = dict(zip(arg_names, args))
    named.update((name, value) for name, value in kwargs.items() if name in arg_names)
    values = {name: key_value(named[name]) for name in key_names if name in named}
    return Key(
        values, {name: str(named[name].dtype) for name in arg_names if hasattr(named.get(name), "dtype")}
    )


def tuning_key(autotuner: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Key:
    """The key of a call of ``autotuner``: its text reads ``M=64, N=48, K=40 | a_ptr:torch.float16, ...``."""
    return call_key(list(autotuner.arg_names), list(autotuner.keys), args, kwargs)
