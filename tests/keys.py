"""Keys for tests, built from their parts as launches build them (``core.key.Key``)."""

from __future__ import annotations

from megatron_tuning.core.key import Key


def nx(n: object, dtype: str = "f") -> Key:
    """``n=<n> | x:<dtype>``."""
    return Key({"n": n}, {"x": dtype})  # type: ignore[dict-item]


def ma(m: object, dtype: str = "torch.float16") -> Key:
    """``M=<m> | a:<dtype>``."""
    return Key({"M": m}, {"a": dtype})  # type: ignore[dict-item]


def tag(name: str) -> Key:
    """A key told apart by a name alone: ``tag='<name>' | ``."""
    return Key({"tag": name})
