"""gradwire: compact, fast and safe transport of gradients and model updates.

The data path reads top to bottom: tensor → codec (:mod:`gradwire.codecs`) → frame bytes
(:mod:`gradwire.frame`, bit-level work in Rust via :mod:`gradwire.wire`) → transport → frame →
decode / aggregate → update.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from . import wire
from .accordion import Accordion
from .codecs import (
    CODECS,
    QSGD,
    Codec,
    DCTCodec,
    GComp,
    GCompDecoderState,
    IdentityCodec,
    MinMaxUInt8,
    OneBit,
    PowerSGD,
    RandomK,
    SignSGD,
    ThreeLC,
    TopK,
)
from .errors import FrameError, WireError
from .feedback import ErrorFeedback
from .frame import (
    Entry,
    Frame,
    Limits,
    decode,
    decode_bundle,
    decode_entry,
    read_frame,
    register_decoder,
    write_frame,
)
from .model_record import ModelSpec, decode_model, encode_model, is_model_record
from .registry import POLICIES, build_codec, codec_names

try:
    __version__ = _version("gradwire")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"

#: Every name of :func:`codec_names` (wire codecs and policies such as ``"accordion"``): one registry, one
#: answer (``gradwire.codecs.make_codec`` builds the wire codecs alone, for the modules below the registry).
make_codec = build_codec

__all__ = [
    "Accordion",
    "CODECS",
    "Codec",
    "DCTCodec",
    "Entry",
    "ErrorFeedback",
    "Frame",
    "FrameError",
    "GComp",
    "GCompDecoderState",
    "IdentityCodec",
    "Limits",
    "MinMaxUInt8",
    "ModelSpec",
    "OneBit",
    "PowerSGD",
    "QSGD",
    "RandomK",
    "SignSGD",
    "ThreeLC",
    "TopK",
    "WireError",
    "decode",
    "decode_bundle",
    "decode_entry",
    "decode_model",
    "encode_model",
    "is_model_record",
    "make_codec",
    "POLICIES",
    "build_codec",
    "codec_names",
    "read_frame",
    "register_decoder",
    "wire",
    "write_frame",
]
