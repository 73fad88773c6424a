"""Frames: building and reading the bytes of docs/FORMAT.md, and decoding them into tensors.

The byte work (layout, limits, CRC-32C) is Rust's; this module turns records into numpy views and
dispatches each record to the decoder registered for its codec id.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import torch

from . import _native
from .capabilities import capabilities_of, provide
from .errors import FrameError
from .wire import BytesLike, as_u8

__all__ = [
    "DEFAULT_LIMITS",
    "ELEM_BF16",
    "ELEM_CODES",
    "ELEM_F16",
    "ELEM_F32",
    "ELEM_F64",
    "ELEM_I16",
    "ELEM_I32",
    "ELEM_I64",
    "ELEM_I8",
    "ELEM_U16",
    "ELEM_U32",
    "ELEM_U64",
    "ELEM_U8",
    "FORMAT_VERSION",
    "FRAME_HEADER_BYTES",
    "FRAME_MAGIC",
    "MAX_NAME_BYTES",
    "MIN_FRAME_BYTES",
    "Entry",
    "Frame",
    "Limits",
    "RecordTemplate",
    "SERVER_SENDER",
    "decode",
    "decode_bundle",
    "decode_entries",
    "decode_entry",
    "frame_length",
    "read_frame",
    "register_batch_decoder",
    "register_decoder",
    "register_weighted_sum",
    "weighted_sum_fused",
    "write_frame",
]

#: The sender id the aggregation server puts on its own frames.
SERVER_SENDER = 0xFFFFFFFF

# Protocol constants of docs/FORMAT.md, taken from the Rust core (never restated here).
#: The frame format version (1).
FORMAT_VERSION: int = _native.FORMAT_VERSION
#: The first four bytes of every frame, ``b"GWIR"``.
FRAME_MAGIC: bytes = _native.FRAME_MAGIC
#: Bytes of the frame header (32).
FRAME_HEADER_BYTES: int = _native.FRAME_HEADER_BYTES
#: The shortest frame, header plus CRC-32C trailer: a bundle with no records (36).
MIN_FRAME_BYTES: int = _native.MIN_FRAME_BYTES
#: The longest record name, in bytes of UTF-8 (1024).
MAX_NAME_BYTES: int = _native.MAX_NAME_BYTES

#: Element and dtype codes of FORMAT.md table 4.1 by type name (``"u8"`` ... ``"f64"``), read-only.
ELEM_CODES: Mapping[str, int] = MappingProxyType(dict(_native.ELEM_CODES))
ELEM_U8: int = ELEM_CODES["u8"]
ELEM_I8: int = ELEM_CODES["i8"]
ELEM_U16: int = ELEM_CODES["u16"]
ELEM_I16: int = ELEM_CODES["i16"]
ELEM_U32: int = ELEM_CODES["u32"]
ELEM_I32: int = ELEM_CODES["i32"]
ELEM_U64: int = ELEM_CODES["u64"]
ELEM_I64: int = ELEM_CODES["i64"]
ELEM_F16: int = ELEM_CODES["f16"]
ELEM_BF16: int = ELEM_CODES["bf16"]
ELEM_F32: int = ELEM_CODES["f32"]
ELEM_F64: int = ELEM_CODES["f64"]

# Element codes by numpy dtype: "u8" is numpy's "u1" (the width in bytes). bf16 has no numpy dtype:
# its payload travels as uint16 words and is tagged through ``Entry.section_elems``.
_ELEM_BY_NUMPY = {
    np.dtype(f"{name[0]}{int(name[1:]) // 8}"): code for name, code in ELEM_CODES.items() if code != ELEM_BF16
}
_NUMPY_BY_ELEM = {code: dt for dt, code in _ELEM_BY_NUMPY.items()}
_NUMPY_BY_ELEM[ELEM_BF16] = np.dtype("<u2")

# The floating-point codes a record's dtype may take, by torch dtype.
_DTYPE_CODE = {torch.float16: ELEM_F16, torch.bfloat16: ELEM_BF16, torch.float32: ELEM_F32, torch.float64: ELEM_F64}
_DTYPE_BY_CODE = {code: dt for dt, code in _DTYPE_CODE.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """The FORMAT.md code of a floating-point torch dtype."""
    try:
        return _DTYPE_CODE[dtype]
    except KeyError:
        raise ValueError(f"gradwire frames carry floating-point tensors, not {dtype}") from None


@dataclass(frozen=True)
class Limits:
    """Ceilings a reader applies before allocating anything the bytes announce."""

    max_frame_bytes: int = 2**31
    max_entries: int = 2**20
    max_tensor_elements: int = 2**31


DEFAULT_LIMITS = Limits()


@dataclass
class Entry:
    """One tensor record: how a codec represents one named tensor.

    ``sections`` maps section names to 1-D numpy arrays; the element type on the wire comes from the
    array's dtype, except that names listed in ``section_elems`` use the code given there (bf16).
    """

    name: str
    codec: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: bytes = b""
    sections: dict[str, np.ndarray] = field(default_factory=dict)
    section_elems: dict[str, int] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def nbytes(self) -> int:
        """Bytes this record's payload takes in a frame (excluding the record's own header)."""
        return len(self.params) + sum(int(a.nbytes) for a in self.sections.values())


@dataclass
class Frame:
    round: int
    sender: int
    bundle: bool
    entries: list[Entry]

    def entry(self) -> Entry:
        """The record of a tensor frame."""
        if self.bundle:
            raise FrameError("expected a tensor frame, got a bundle frame (use decode_bundle)")
        return self.entries[0]


def _section_spec(entry: Entry, name: str, arr) -> tuple[str, int, np.ndarray]:
    if type(arr) is np.ndarray and arr.ndim == 1 and arr.flags.c_contiguous and name not in entry.section_elems:
        # The common case (a codec's own 1-D section), without the conversions below: a frame of
        # a small model's many tensors pays this per section.
        elem = _ELEM_BY_NUMPY.get(arr.dtype)
        if elem is not None:
            return name, elem, arr.view(np.uint8)
    if isinstance(arr, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(arr, dtype=np.uint8)
    arr = np.asarray(arr)
    if name in entry.section_elems:
        elem = entry.section_elems[name]
    else:
        try:
            elem = _ELEM_BY_NUMPY[arr.dtype.newbyteorder("=")]
        except KeyError:
            raise ValueError(f"section {name!r}: numpy dtype {arr.dtype} has no element code") from None
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return name, elem, as_u8(np.ascontiguousarray(arr.reshape(-1)))


@dataclass(frozen=True)
class RecordTemplate:
    """What a reader knows of a record before it arrives (docs/FORMAT.md section 12): everything but its
    payloads. Between ranks that cut a model into the same pieces, a layout frame (:func:`write_frame`
    with ``templates``) writes each record that matches its template as a tag and its payloads' lengths,
    with its params only where they differ from the template's; a record that matches none goes whole.

    ``sections`` are the record's sections' names and element codes (:data:`ELEM_CODES`), in order.
    """

    name: str
    codec: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: bytes = b""
    sections: tuple[tuple[str, int], ...] = ()

    def native(self) -> tuple:
        """The template as ``_native.encode_layout_frame`` and ``decode_layout_frame`` take it."""
        return (
            self.name,
            int(self.codec),
            dtype_code(self.dtype),
            [int(d) for d in self.shape],
            bytes(self.params),
            [(str(n), int(e)) for n, e in self.sections],
        )


def _native_templates(templates: Sequence[RecordTemplate]) -> list[tuple]:
    names = [t.name for t in templates]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"templates must have distinct names; {dup!r} is {names.count(dup)} templates' name")
    return [t.native() for t in templates]


def _entry_spec(e: Entry) -> tuple:
    return (
        e.name,
        int(e.codec),
        dtype_code(e.dtype),
        [int(d) for d in e.shape],
        np.frombuffer(bytes(e.params), dtype=np.uint8),
        [_section_spec(e, n, a) for n, a in e.sections.items()],
    )


def write_frame(
    entries: Sequence[Entry],
    *,
    round: int = 0,
    sender: int = 0,
    bundle: bool = False,
    templates: Sequence[RecordTemplate] | None = None,
) -> bytes:
    """Serialize records into one frame; a tensor frame (``bundle=False``) takes exactly one.

    With ``templates`` (a bundle only): a layout frame of docs/FORMAT.md section 12, the records that
    match a template written compact. Only a reader given the same templates reads it (:func:`read_frame`).
    """
    if not bundle and len(entries) != 1:
        raise ValueError(f"a tensor frame holds exactly one record, got {len(entries)}")
    specs = [_entry_spec(e) for e in entries]
    if templates is None:
        return _native.encode_frame(int(round), int(sender), bool(bundle), specs)
    if not bundle:
        raise ValueError("a layout frame (templates=...) is a bundle frame: pass bundle=True")
    return _native.encode_layout_frame(int(round), int(sender), specs, _native_templates(templates))


def frame_length(data: BytesLike) -> int:
    """The length of the frame that starts ``data``, which may run on into further frames.

    Checks the magic, the version and that ``total_len`` fits (``FrameError`` otherwise); the frame
    itself is checked only by :func:`read_frame` over exactly that many bytes.
    """
    return _native.frame_length(as_u8(data))


def read_frame(
    data: BytesLike, *, limits: Limits | None = None, templates: Sequence[RecordTemplate] | None = None
) -> Frame:
    """Parse and check a frame; sections are zero-copy numpy views into ``data``.

    With ``templates``, a layout frame (docs/FORMAT.md section 12) written with the same templates is read
    too: a compact record takes its template's name, codec, dtype, shape and section names, and its params
    unless it carries its own. Without them a layout frame is refused (``reserved_flags``)."""
    lim = limits or DEFAULT_LIMITS
    buf = as_u8(data)
    if templates is None:
        round_, sender, bundle, raw = _native.decode_frame(
            buf, lim.max_frame_bytes, lim.max_entries, lim.max_tensor_elements
        )
        by_name: dict[str, RecordTemplate] = {}
    else:
        round_, sender, bundle, raw = _native.decode_layout_frame(
            buf, _native_templates(templates), lim.max_frame_bytes, lim.max_entries, lim.max_tensor_elements
        )
        by_name = {t.name: t for t in templates}
    entries = []
    for name, codec, dtype, shape, params, sections in raw:
        secs: dict[str, np.ndarray] = {}
        elems: dict[str, int] = {}
        for sname, elem, s0, s1 in sections:
            secs[sname] = buf[s0:s1].view(_NUMPY_BY_ELEM[elem])
            if elem == ELEM_BF16:
                elems[sname] = ELEM_BF16
        # None: a compact record with its template's params (its name is its template's: names are unique).
        own = by_name[name].params if params is None else buf[params[0] : params[1]].tobytes()
        entries.append(
            Entry(
                name=name,
                codec=codec,
                dtype=_DTYPE_BY_CODE[dtype],
                shape=tuple(shape),
                params=bytes(own),
                sections=secs,
                section_elems=elems,
            )
        )
    return Frame(round=round_, sender=sender, bundle=bundle, entries=entries)


# ---------------------------------------------------------------------------------------------
# Decoding: every codec declares its decoder (and what else it can do with its records) under its id,
# in one gradwire.capabilities.CodecCapabilities.

Decoder = Callable[[Entry, torch.device | None], torch.Tensor]


def register_decoder(codec_id: int) -> Callable[[Decoder], Decoder]:
    """Register the decoder of codec ``codec_id``; ``gradwire.decode`` finds it from the frame alone
    (its ``decode`` capability, :func:`gradwire.capabilities.provide`)."""
    return lambda fn: provide(codec_id, "decode", fn)


def decode_entry(entry: Entry, device: torch.device | None = None) -> torch.Tensor:
    """Decode one record into a dense tensor of its shape and dtype."""
    fn = capabilities_of(entry.codec).decode
    if fn is None:
        raise FrameError(f"record {entry.name!r}: unknown codec id {entry.codec}")
    return fn(entry, device)


#: A codec's decode of several of its records at once (:func:`decode_entries`): the tensors
#: :func:`decode_entry` gives, in order, or ``None`` where it does not apply to these records.
BatchDecoder = Callable[[Sequence[Entry], torch.device | None], list | None]


def register_batch_decoder(codec_id: int) -> Callable[[BatchDecoder], BatchDecoder]:
    """Register codec ``codec_id``'s decode of several records at once (:func:`decode_entries`)."""
    return lambda fn: provide(codec_id, "decode_batch", fn)


def decode_entries(entries: Sequence[Entry], device: torch.device | None = None) -> list[torch.Tensor]:
    """:func:`decode_entry` of each record, in order: the same tensors, bit for bit.

    A codec with a batch decoder decodes its records together where it can (the DCT's, on a GPU: one
    exact decode over every record's chunks, where one record at a time spent its time launching
    kernels); the others are decoded one by one.
    """
    out: list[torch.Tensor | None] = [None] * len(entries)
    by_codec: dict[int, list[int]] = {}
    for i, entry in enumerate(entries):
        by_codec.setdefault(entry.codec, []).append(i)
    for codec, at in by_codec.items():
        batch = capabilities_of(codec).decode_batch
        got = batch([entries[i] for i in at], device) if batch is not None and len(at) > 1 else None
        if got is None:
            got = [decode_entry(entries[i], device) for i in at]
        for i, t in zip(at, got):
            out[i] = t
    return out  # type: ignore[return-value]


#: A codec's fused ``Σ_i w_i · decode(entries[i])`` (see :func:`weighted_sum_fused`): the float32 result,
#: or ``None`` where it does not apply to these records.
WeightedSum = Callable[[Sequence[Entry], Sequence[float], torch.device | None], torch.Tensor | None]


def register_weighted_sum(codec_id: int) -> Callable[[WeightedSum], WeightedSum]:
    """Register codec ``codec_id``'s fused weighted sum of records (:func:`weighted_sum_fused`)."""
    return lambda fn: provide(codec_id, "weighted_sum", fn)


def weighted_sum_fused(
    entries: Sequence[Entry], weights: Sequence[float], device: torch.device | None = None
) -> torch.Tensor | None:
    """``acc = float32(d_0 · w_0)``, then ``acc = acc + float32(d_i · w_i)`` in order, ``d_i`` the
    float32 decode of ``entries[i]`` and each weight rounded to float32 — computed by the records' codec
    without writing each decoded tensor out (the DCT's: in one Rust pass), with the same bits as
    decoding each record and combining them.

    ``None`` where no such path applies (mixed codecs, a codec without one, or records it does not
    take, e.g. another device); the caller then decodes record by record. Records are checked as
    hostile input, as :func:`decode_entry` checks them.
    """
    if not entries:
        return None
    codec = entries[0].codec
    if any(e.codec != codec for e in entries):
        return None
    fn = capabilities_of(codec).weighted_sum
    return None if fn is None else fn(entries, weights, device)


def _as_frame(frame, limits) -> Frame:
    return frame if isinstance(frame, Frame) else read_frame(frame, limits=limits)


def decode(
    frame: BytesLike | Frame, *, device: torch.device | str | None = None, limits: Limits | None = None
) -> torch.Tensor:
    """Decode a tensor frame made by any codec."""
    f = _as_frame(frame, limits)
    return decode_entry(f.entry(), _device(device))


def decode_bundle(
    frame: BytesLike | Frame, *, device: torch.device | str | None = None, limits: Limits | None = None
) -> dict[str, torch.Tensor]:
    """Decode every record of a frame (bundle or tensor frame) into ``{name: tensor}``."""
    f = _as_frame(frame, limits)
    dev = _device(device)
    return {e.name: decode_entry(e, dev) for e in f.entries}


def _device(device) -> torch.device | None:
    return None if device is None else torch.device(device)
