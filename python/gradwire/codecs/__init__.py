"""Codecs: one file per codec, all following :class:`gradwire.codecs.base.Codec`.

Pick one by name with :func:`make_codec` (``make_codec("dct", topk=32)``) or build the class directly.
The DCT codec lives in a package of its own, :mod:`gradwire.dct` (its math, its write side and its
readers), and is re-exported here.
The registry holds wire formats only: :class:`gradwire.Accordion`, a policy choosing between two codecs
per layer, lives above this package (:mod:`gradwire.accordion`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..dct import DCTCodec  # the DCT codec's package, gradwire.dct (it declares its capabilities)
from .base import Codec
from .gcomp import GComp, GCompDecoderState
from .identity import IdentityCodec
from .minmax import MinMaxUInt8
from .powersgd import PowerSGD
from .qsgd import QSGD
from .sign import OneBit, SignSGD
from .sparse import RandomK, TopK
from .threelc import ThreeLC

__all__ = [
    "Codec",
    "DCTCodec",
    "GComp",
    "GCompDecoderState",
    "IdentityCodec",
    "MinMaxUInt8",
    "OneBit",
    "PowerSGD",
    "QSGD",
    "RandomK",
    "SignSGD",
    "ThreeLC",
    "TopK",
    "CODECS",
    "make_codec",
]

#: Codec factories by name.
CODECS: dict[str, Callable[..., Codec]] = {
    "identity": IdentityCodec,
    "dct": DCTCodec,
    "minmax": MinMaxUInt8,
    "3lc": ThreeLC,
    "gcomp": GComp,
    "onebit": OneBit,
    "signsgd": SignSGD,
    "topk": TopK,
    "randomk": RandomK,
    "powersgd": PowerSGD,
    "qsgd": QSGD,
}


def make_codec(name: str, **params) -> Codec:
    """Build the codec called ``name`` with its keyword parameters."""
    try:
        factory = CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(sorted(CODECS))}") from None
    return factory(**params)
