"""Checks for ``load_state_dict``: a codec's state arrives as untrusted nested data.

A state dict is a nested dict with str keys whose leaves are ``torch.Tensor`` or JSON-plain values
(None, bool, int, float, str, or lists of these). It may have been through a round trip that moved the
tensors to the CPU and turned tuples into lists, so readers accept lists and tensors on any device.
Every helper raises ``ValueError`` naming the field and the rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["fields", "from_float", "integer", "mapping", "sequence", "tensor", "to_float"]


def mapping(value: Any, what: str) -> Mapping[str, Any]:
    """``value`` as a mapping with str keys."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a dict, got {type(value).__name__}")
    for k in value:
        if not isinstance(k, str):
            raise ValueError(f"{what} must have str keys, got {k!r}")
    return value


def fields(state: Any, what: str, required: Iterable[str]) -> Mapping[str, Any]:
    """``state`` as a mapping holding exactly the keys ``required``."""
    state = mapping(state, what)
    required = tuple(required)
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(f"{what} is missing {', '.join(map(repr, missing))}")
    extra = [k for k in state if k not in required]
    if extra:
        raise ValueError(f"{what} has unexpected keys {', '.join(map(repr, extra))} (expected {', '.join(required)})")
    return state


def sequence(value: Any, what: str, length: int | None = None) -> list:
    """``value`` as a list (a tuple is accepted too)."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} must be a list, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise ValueError(f"{what} must have {length} items, got {len(value)}")
    return list(value)


def tensor(
    value: Any,
    what: str,
    *,
    dtype: torch.dtype | None = None,
    floating: bool = False,
    ndim: int | None = None,
    shape: tuple | None = None,
) -> torch.Tensor:
    """``value`` as a tensor of ``dtype`` (or any floating type), rank ``ndim`` or exactly ``shape``."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{what} must be a tensor, got {type(value).__name__}")
    if dtype is not None and value.dtype != dtype:
        raise ValueError(f"{what} must be a {dtype} tensor, got {value.dtype}")
    if floating and not value.is_floating_point():
        raise ValueError(f"{what} must be a floating-point tensor, got {value.dtype}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{what} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{what} must have shape {tuple(shape)}, got {tuple(value.shape)}")
    return value


def integer(value: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{what} must lie in [{lo}, {hi if hi is not None else 'inf'}], got {value}")
    return value


def to_float(x: float) -> float | str:
    """A float as a JSON-plain value: itself, or ``"inf"``, ``"-inf"``, ``"nan"``."""
    return x if math.isfinite(x) else repr(float(x))


def from_float(value: Any, what: str) -> float:
    """The inverse of :func:`to_float`."""
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    return float(value)
