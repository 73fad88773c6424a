"""What each wire codec can do with its records, as one object per codec id.

A frame names its codec by id alone (docs/FORMAT.md), so everything that reads records — decoding,
summing, norms, reading the setting a record was made with — finds the codec's functions from that id.
Each codec declares them together, in one :class:`CodecCapabilities`, with :func:`declare`:

- ``decode`` (required for a wire codec): one record → the dense tensor it stands for;
- ``decode_batch``: several records at once, the same tensors bit for bit (``None`` where it does not
  apply to the records given);
- ``weighted_sum``: ``Σ wᵢ · decode(recordᵢ)`` fused, the same bits as decoding and combining;
- ``accumulator``: a transform-domain sum (:mod:`gradwire.accumulate`);
- ``norm``: the L2 norm of a record's tensor without a dense decode;
- ``coefficients``: a record as sparse coordinates in an orthonormal basis;
- ``setting``: the codec setting a record was made with, from its params (:func:`gradwire.accordion.setting_of`).

Absent capabilities are ``None``; the readers fall back to decoding densely. This is the one registry of
them: :mod:`gradwire.frame`, :mod:`gradwire.accumulate` and :mod:`gradwire.accordion` read it, and their
``register_*`` decorators add one capability to a codec's object (for codecs written outside gradwire).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# This module sits below gradwire.frame (which reads it), so it names no type of frame's or torch's:
# ``Record`` is a gradwire.frame.Entry, ``Device`` an optional torch.device, ``Tensor`` a torch.Tensor.
Record = Any
Device = Any
Tensor = Any

__all__ = ["CAPABILITY_NAMES", "CodecCapabilities", "capabilities_of", "declare", "declared_ids", "provide"]


@dataclass(frozen=True)
class CodecCapabilities:
    """One wire codec's functions over its records (see the module docstring); ``None``: not offered."""

    codec_id: int
    name: str = ""
    decode: Callable[[Record, Device], Tensor] | None = None
    decode_batch: Callable[[Sequence[Record], Device], list | None] | None = None
    weighted_sum: Callable[[Sequence[Record], Sequence[float], Device], Tensor | None] | None = None
    accumulator: Callable[[Record, Device], Any] | None = None
    norm: Callable[[Record], float] | None = None
    coefficients: Callable[[Record], Any] | None = None
    setting: Callable[[Record], dict] | None = None


#: The capabilities a codec may offer, in declaration order.
CAPABILITY_NAMES = tuple(f.name for f in dataclasses.fields(CodecCapabilities) if f.name not in ("codec_id", "name"))

_BY_ID: dict[int, CodecCapabilities] = {}


def declare(caps: CodecCapabilities) -> CodecCapabilities:
    """Declare codec ``caps.codec_id``'s capabilities; returns them.

    Declaring again merges: a capability already given keeps its function, and giving it another one is
    ``ValueError`` naming the codec and the capability (two codecs cannot share an id by accident)."""
    if not isinstance(caps.codec_id, int) or not 0 <= caps.codec_id <= 0xFFFF:
        raise ValueError(f"codec id must be an integer in [0, 65535], got {caps.codec_id!r}")
    old = _BY_ID.get(caps.codec_id)
    if old is None:
        _BY_ID[caps.codec_id] = caps
        return caps
    merged = {}
    for what in CAPABILITY_NAMES:
        mine, theirs = getattr(old, what), getattr(caps, what)
        if mine is not None and theirs is not None and mine is not theirs:
            raise ValueError(f"codec id {caps.codec_id} ({old.name or caps.name or 'unnamed'}) already has {what}")
        merged[what] = mine if mine is not None else theirs
    if old.name and caps.name and old.name != caps.name:
        raise ValueError(f"codec id {caps.codec_id} is already declared as {old.name!r}, not {caps.name!r}")
    _BY_ID[caps.codec_id] = CodecCapabilities(caps.codec_id, old.name or caps.name, **merged)
    return _BY_ID[caps.codec_id]


def provide(codec_id: int, what: str, fn: Callable) -> Callable:
    """Add one capability ``what`` (one of :data:`CAPABILITY_NAMES`) to codec ``codec_id``; returns ``fn``
    (the ``register_*`` decorators of frame, accumulate and accordion are this)."""
    if what not in CAPABILITY_NAMES:
        raise ValueError(f"unknown capability {what!r}; known: {', '.join(CAPABILITY_NAMES)}")
    declare(CodecCapabilities(codec_id, **{what: fn}))
    return fn


_NONE = CodecCapabilities(-1)


def capabilities_of(codec_id: int) -> CodecCapabilities:
    """Codec ``codec_id``'s capabilities; an object offering nothing for an id no codec declared."""
    return _BY_ID.get(codec_id, _NONE)


def declared_ids() -> list[int]:
    """Every codec id with declared capabilities, ascending."""
    return sorted(_BY_ID)
