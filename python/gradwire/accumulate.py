"""Summing many records of one tensor, in the codec's own domain where the codec allows it.

A codec that is linear in its transform domain (the DCT: orthonormal, so sums and L2 norms are the same
in both domains) declares an accumulator factory (its ``accumulator`` capability, :mod:`gradwire.capabilities`). Its
accumulator adds each record's sparse coefficients into one coefficient array and runs one inverse transform at the end,
so the cost of a sum grows with the bytes received, not with senders × parameters. Every other codec
falls back to :class:`DenseAccumulator`, which decodes each record and adds the dense tensors.

Sums run in a fixed order (the order of :meth:`Accumulator.add` calls) and never use atomics, so the
same records added in the same order give bit-identical results on every node.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import torch

from .capabilities import capabilities_of, provide
from .frame import Entry, decode_entry

__all__ = [
    "Accumulator",
    "Coefficients",
    "DenseAccumulator",
    "entry_coefficients",
    "entry_norm",
    "make_accumulator",
    "register_accumulator",
    "register_coefficients",
    "register_norm",
]


class Accumulator(Protocol):
    """A weighted sum of records of one tensor (same name, shape and dtype)."""

    def add(self, entry: Entry, weight: float = 1.0) -> None: ...

    def finish(self) -> torch.Tensor:
        """The dense float32 sum, of the records' shape."""
        ...


class DenseAccumulator:
    """Decodes each record and adds it: works for every codec."""

    def __init__(self, shape: tuple[int, ...], device: torch.device | None = None):
        self.shape = tuple(shape)
        self.device = device
        self.total: torch.Tensor | None = None
        self.count = 0

    def add(self, entry: Entry, weight: float = 1.0) -> None:
        if tuple(entry.shape) != self.shape:
            raise ValueError(f"record {entry.name!r} has shape {tuple(entry.shape)}, the sum has {self.shape}")
        t = decode_entry(entry, self.device).to(torch.float32)
        if weight != 1.0:
            t = t * weight
        self.total = t if self.total is None else self.total + t
        self.count += 1

    def finish(self) -> torch.Tensor:
        if self.total is None:
            return torch.zeros(self.shape, dtype=torch.float32, device=self.device)
        return self.total


AccumulatorFactory = Callable[[Entry, torch.device | None], Accumulator]


def register_accumulator(codec_id: int) -> Callable[[AccumulatorFactory], AccumulatorFactory]:
    """Register a transform-domain accumulator for codec ``codec_id`` (its ``accumulator`` capability).

    The factory gets the first record of the sum and the device; later records of other parameters must
    still be accepted (an accumulator may decode those densely).
    """
    return lambda factory: provide(codec_id, "accumulator", factory)


def register_norm(codec_id: int) -> Callable[[Callable[[Entry], float]], Callable[[Entry], float]]:
    """Register how to compute the L2 norm of a record's tensor without decoding it densely."""
    return lambda fn: provide(codec_id, "norm", fn)


def make_accumulator(first: Entry, device: torch.device | None = None) -> Accumulator:
    """The best accumulator for records like ``first``: its codec's own, or a dense one."""
    factory = capabilities_of(first.codec).accumulator
    if factory is not None:
        return factory(first, device)
    return DenseAccumulator(tuple(first.shape), device)


def entry_norm(entry: Entry) -> float:
    """L2 norm of the tensor a record decodes to (in the codec's domain where it registered one)."""
    fn = capabilities_of(entry.codec).norm
    if fn is not None:
        return float(fn(entry))
    # In float64: float32 squares overflow from |x| ≈ 1.8e19, so finite values would read as infinite.
    return float(decode_entry(entry).to(torch.float32).to(torch.float64).norm())


@dataclass(frozen=True)
class Coefficients:
    """A record's tensor as coordinates in an orthonormal basis, for inner products between records
    without a dense decode: ``values[j]`` is the coordinate at ``idx[j]`` (all others 0), or, with ``idx``
    None, ``values`` holds every coordinate (the decoded tensor, flattened).

    Two records' inner product is the sum over their common positions, provided their ``basis`` values
    compare equal (the DCT: the same chunk plan). ``values`` are float64.
    """

    basis: Hashable
    size: int
    idx: torch.Tensor | None
    values: torch.Tensor


def register_coefficients(
    codec_id: int,
) -> Callable[[Callable[[Entry], Coefficients]], Callable[[Entry], Coefficients]]:
    """Register how to read a record of ``codec_id`` as sparse coordinates in an orthonormal basis."""
    return lambda fn: provide(codec_id, "coefficients", fn)


def entry_coefficients(entry: Entry, dense: bool = False) -> Coefficients:
    """The record's :class:`Coefficients`: its codec's sparse ones where it registered them (and
    ``dense`` is false), else the decoded tensor flattened, in the basis ``("dense", shape)``."""
    fn = None if dense else capabilities_of(entry.codec).coefficients
    if fn is not None:
        return fn(entry)
    flat = decode_entry(entry).to(torch.float32).to(torch.float64).reshape(-1)
    return Coefficients(("dense", tuple(entry.shape)), flat.numel(), None, flat)
