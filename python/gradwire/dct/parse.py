"""Reading a DCT record as hostile input: every field and section checked before anything of the
record's size is allocated.

:func:`checked_arrays` is the one check of a record's params and sections (host arrays out), and
:func:`parse_record` the one parser built on it: the decoders (:mod:`.capabilities`), the coefficient
domain (:mod:`.domain`) and the norm all go through them, so a new index coding or value width is added
here once. Each rule broken is a :class:`~gradwire.errors.FrameError` naming it.

A :class:`ParseCache`, passed to :func:`parse_record` by the caller that holds it, hands back what it holds
for the very record object it is given (never for an equal one) and keeps what it parses: a server's round
close parses each record once however many times it reads it (:func:`records_parsed_once`), and a sharded
owner hands in its own records as its codec kept them (:meth:`gradwire.DCTCodec.own_records`), every
other rank's parsed as hostile input.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .. import wire
from ..codecs import record as rec
from ..errors import FrameError
from ..frame import Entry
from .chunks import MODE_FLAT, ChunkPlan, plan_flat, plan_tiles, tile_chunk_shape
from .decode import decode_levels
from .layout import (
    INDEX_CODING_FIXED,
    INDEX_CODING_RICE,
    MAX_CHUNK_NDIM,
    MAX_CHUNK_NUMEL,
    MAX_CHUNK_SIDE,
    MODE_NAMES,
    PARAMS_TAIL,
    SECTIONS,
    VALUE_BITS,
    VALUE_BITS_CHOICES,
    index_bits_for,
)
from .quantize import dequantize_levels

__all__ = [
    "CheckedArrays",
    "ParseCache",
    "ParsedRecord",
    "checked_arrays",
    "decode_parsed",
    "parse_record",
    "records_parsed_once",
]

_CODEC = "dct"


def _bad(entry: Entry, rule: str) -> FrameError:
    return rec.bad(entry, _CODEC, rule)


def _check_params(entry: Entry) -> tuple[ChunkPlan, int, int, int, int]:
    """Validate ``entry.params`` against the record's shape.

    Returns ``(plan, k, index_bits, value_bits, index_coding)``; ``index_bits`` is the coding's
    parameter (packed width or Rice parameter).
    """
    p = entry.params
    if len(p) < 2:
        raise _bad(entry, f"params must be at least 2 bytes (mode, chunk_ndim), got {len(p)}")
    mode, nd = p[0], p[1]
    if mode not in MODE_NAMES:
        raise _bad(entry, f"mode must be 0 (flat) or 1 (tiles), got {mode}")
    if not 1 <= nd <= MAX_CHUNK_NDIM:
        raise _bad(entry, f"chunk_ndim must lie in 1..{MAX_CHUNK_NDIM}, got {nd}")
    want_len = 2 + 4 * nd + PARAMS_TAIL.size
    if len(p) != want_len:
        raise _bad(entry, f"params length must be {want_len} bytes for chunk_ndim {nd}, got {len(p)}")
    chunk_shape = struct.unpack_from(f"<{nd}I", p, 2)
    if any(d < 1 for d in chunk_shape):
        raise _bad(entry, f"chunk_shape dimensions must be >= 1, got {chunk_shape}")
    c = math.prod(chunk_shape)
    if c > MAX_CHUNK_NUMEL:
        raise _bad(entry, f"chunk element count C = {c} exceeds 2^16")
    if max(chunk_shape) > MAX_CHUNK_SIDE:
        raise _bad(entry, f"chunk side {max(chunk_shape)} exceeds {MAX_CHUNK_SIDE}")
    k, index_bits, value_bits, index_coding, pad_count = PARAMS_TAIL.unpack_from(p, 2 + 4 * nd)
    if not 1 <= k <= c:
        raise _bad(entry, f"k must satisfy 1 <= k <= C = {c}, got {k}")
    want_bits = index_bits_for(c)
    if index_coding == INDEX_CODING_FIXED:
        if index_bits != want_bits:
            raise _bad(entry, f"index_bits must equal max(1, ceil(log2 C)) = {want_bits} for C = {c}, got {index_bits}")
    elif index_coding == INDEX_CODING_RICE:
        if index_bits > want_bits:
            raise _bad(
                entry,
                f"index_coding 1 (Rice): the parameter (index_bits) must be <= {want_bits} for C = {c},"
                f" got {index_bits}",
            )
    else:
        raise _bad(entry, f"index_coding must be 0 (fixed-width) or 1 (Rice), got {index_coding}")
    if value_bits not in VALUE_BITS_CHOICES:
        raise _bad(entry, f"value_bits must be 8, 4, 2 or 1, got {value_bits}")

    numel = entry.numel
    if mode == MODE_FLAT:
        want_pad = (c - numel % c) % c
        if pad_count != want_pad:
            raise _bad(entry, f"pad_count must be (C - numel mod C) mod C = {want_pad}, got {pad_count}")
        plan = plan_flat(entry.shape, chunk_shape)
    else:
        if pad_count != 0:
            raise _bad(entry, f"pad_count must be 0 in mode 1 (tiles), got {pad_count}")
        if numel < 1:
            raise _bad(entry, "mode 1 (tiles) needs a tensor of at least one element")
        want_shape = tile_chunk_shape(entry.shape)
        if tuple(chunk_shape) != want_shape:
            raise _bad(
                entry,
                f"mode 1 (tiles) chunk_shape must be {want_shape} for tensor shape {tuple(entry.shape)}"
                f" (recomputed), got {tuple(chunk_shape)}",
            )
        plan = plan_tiles(entry.shape)
    return plan, k, index_bits, value_bits, index_coding


def _check_sections(entry: Entry, plan: ChunkPlan, k: int, bits: int, value_bits: int, coding: int):
    rec.expect_sections(entry, _CODEC, SECTIONS)

    n = plan.num_chunks
    total = n * k
    c = plan.chunk_numel
    if coding == INDEX_CODING_FIXED:
        idx_bytes = rec.section(
            entry, _CODEC, "idx", np.uint8, (total * bits + 7) // 8, "ceil(num_chunks * k * index_bits / 8)"
        )
    else:
        idx_bytes = rec.byte_section(entry, _CODEC, "idx")
    if value_bits == VALUE_BITS:
        val = rec.section(entry, _CODEC, "val", np.int8, total, "num_chunks * k")
    else:
        val = rec.section(
            entry, _CODEC, "val", np.uint8, (total * value_bits + 7) // 8, f"ceil(num_chunks * k * {value_bits} / 8)"
        )
    scale = rec.section(entry, _CODEC, "scale", np.float32, n, "num_chunks")
    mins = rec.section(entry, _CODEC, "min", np.float32, n, "num_chunks")

    # The Rust decoders check length, padding, order and range, and bound what they allocate by the
    # bytes they are given.
    if coding == INDEX_CODING_FIXED:
        idx = rec.wire_call(entry, _CODEC, "section 'idx'", wire.unpack_bits_exact, idx_bytes, bits, total)
    else:
        idx = rec.wire_call(entry, _CODEC, "section 'idx'", wire.rice_decode, idx_bytes, total, c, bits, k)
    if value_bits == VALUE_BITS:
        levels = val.astype(np.int16) + 128
    else:
        levels = rec.wire_call(entry, _CODEC, "section 'val'", wire.unpack_bits_exact, val, value_bits, total).astype(
            np.int16
        )
    idx = np.asarray(idx).reshape(n, k)
    if total and int(idx.max()) >= c:
        raise _bad(entry, f"index out of range: every index must be < C = {c}, got {int(idx.max())}")
    if k > 1 and n and not bool(np.all(idx[:, 1:] > idx[:, :-1])):
        raise _bad(entry, "indices must be strictly ascending within each chunk (no repeats)")
    if not bool(np.all(np.isfinite(scale))):
        raise _bad(entry, "scales must be finite")
    if not bool(np.all(scale > 0)):
        raise _bad(entry, "scales must be > 0")
    if not bool(np.all(np.isfinite(mins))):
        raise _bad(entry, "mins must be finite")
    with np.errstate(over="ignore", invalid="ignore"):
        top = scale * np.float32((1 << value_bits) - 1)
        ok = np.isfinite(top) & np.isfinite(top + mins)
    if not bool(np.all(ok)):
        raise _bad(
            entry, "dequantized coefficients must be finite ((2^value_bits - 1) * scale + min overflows float32)"
        )
    return idx, levels, scale, mins


@dataclass(frozen=True)
class ParsedRecord:
    """A DCT record's kept coefficients after every check: what it decodes to, before the inverse
    transform. What :func:`parse_record` reads from a record's bytes, and what the codec kept of a record
    as it wrote it (:meth:`gradwire.DCTCodec.compress_coefficients`): the same arrays, bit for bit.

    ``idx`` (int64, ``(num_chunks, k)``) holds each chunk's positions, strictly ascending; ``levels``
    (int16, same shape) the coefficients as integers in [0, 2^value_bits - 1] on each chunk's grid of
    ``scales`` and ``mins`` (float32, one per chunk): what the bit-exact decode works from. All on one
    device.
    """

    plan: ChunkPlan
    k: int
    idx: torch.Tensor
    levels: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @functools.cached_property
    def values(self) -> torch.Tensor:
        """The coefficients as receivers read them, ``levels * scales + mins`` per chunk (float32,
        ``(num_chunks, k)``)."""
        return dequantize_levels(self.levels, self.scales, self.mins)

    def decode(self) -> torch.Tensor:
        """The dense float32 tensor the record decodes to (the exact decode, ``gradwire.dct.decode_levels``)."""
        return decode_levels(self.idx, self.levels, self.scales, self.mins, self.plan)


def _device(device) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


class ParseCache:
    """Parsed records by record object, for the caller that holds the cache and passes it to
    :func:`parse_record`.

    A lookup is by the very object (and device), never by equal contents: a copy of a record, or the same
    bytes read back, is another object, which :func:`parse_record` parses as hostile input (and then keeps
    here). The cache holds every record it was given until it is dropped, so no ``id`` it knows can name
    another object meanwhile. Whoever adds a record with :meth:`add` vouches for what it holds: the writer
    of the record (:meth:`gradwire.DCTCodec.own_records`). A record changed in place after it was added
    must not be looked up again.
    """

    def __init__(self):
        self._parsed: dict[tuple[int, str], tuple[Entry, ParsedRecord]] = {}

    def get(self, entry: Entry, device=None) -> ParsedRecord | None:
        """What the cache holds for ``entry`` (this object) on ``device``; ``None`` if nothing."""
        got = self._parsed.get((id(entry), str(_device(device))))
        return None if got is None or got[0] is not entry else got[1]

    def add(self, entry: Entry, device, parsed: ParsedRecord) -> None:
        """Hold ``parsed`` as what ``entry`` (this object) parses to on ``device``."""
        self._parsed[(id(entry), str(_device(device)))] = (entry, parsed)

    def merge(self, other: ParseCache) -> None:
        """Hold every parse ``other`` holds as well (``other`` vouched for them when it took them)."""
        self._parsed.update(other._parsed)

    def __len__(self) -> int:
        return len(self._parsed)


#: Inside :func:`records_parsed_once`: the block's :class:`ParseCache`.
_BLOCK_CACHE: contextvars.ContextVar[ParseCache | None] = contextvars.ContextVar("gradwire_dct_parsed", default=None)


@contextlib.contextmanager
def records_parsed_once(start: ParseCache | None = None) -> Iterator[ParseCache]:
    """Within the block, :func:`parse_record` calls given no cache share one :class:`ParseCache` (yielded):
    each record object is parsed once per device and every later caller gets the same
    :class:`ParsedRecord` (which none of them modifies).

    For callers that cannot pass a cache down the functions they call: a server's round close reads each
    node record several times through the aggregation rules — its direction check, its norm, the
    aggregate — and at 64 nodes the parsing was a third of the close. It changes no result and no refusal:
    a record that fails its checks is not kept and fails again. The records must not change inside the
    block.

    ``start``: the parses an earlier block yielded, to start from (a server parses each update when it
    arrives, and its round close then starts from those parses). Whoever keeps a block's cache keeps its
    records alive with it.
    """
    cache = ParseCache()
    if start is not None:
        cache.merge(start)
    token = _BLOCK_CACHE.set(cache)
    try:
        yield _BLOCK_CACHE.get()
    finally:
        _BLOCK_CACHE.reset(token)


def parse_record(entry: Entry, device: torch.device | None = None, cache: ParseCache | None = None) -> ParsedRecord:
    """Validate a DCT record as hostile input and return its positions and dequantized coefficients.

    The one parser of the codec's sections: the decoder, the coefficient domain and the norm all go through
    it, so a new index coding or value width is added here once. With ``cache`` (or inside
    :func:`records_parsed_once`), what the cache holds for this very object is returned as it is, and a
    record it does not hold is parsed and kept there.
    """
    cache = _BLOCK_CACHE.get() if cache is None else cache
    if cache is None:
        return _parse_record(entry, device)
    got = cache.get(entry, device)
    if got is None:
        got = _parse_record(entry, device)
        cache.add(entry, device, got)
    return got


class CheckedArrays(NamedTuple):
    """A DCT record's fields after every check, as host arrays: ``idx`` ``(num_chunks, k)`` positions,
    ``levels`` (int16, flat), ``scales`` and ``mins`` (float32, one per chunk)."""

    plan: ChunkPlan
    k: int
    idx: np.ndarray
    levels: np.ndarray
    scales: np.ndarray
    mins: np.ndarray


def checked_arrays(entry: Entry) -> CheckedArrays:
    """Every field of a DCT record checked as hostile input (its dtype, params and sections), the sections
    decoded into host arrays; nothing of the dense tensor's size is allocated."""
    rec.check_record_dtype(entry, _CODEC)
    plan, k, bits, value_bits, coding = _check_params(entry)
    return CheckedArrays(plan, k, *_check_sections(entry, plan, k, bits, value_bits, coding))


def _parse_record(entry: Entry, device: torch.device | None) -> ParsedRecord:
    plan, k, idx, levels, scale, mins = checked_arrays(entry)
    # Everything is checked; only now is anything of the record's size allocated.
    dev = _device(device)
    idx_t = torch.from_numpy(idx.astype(np.int64)).to(dev)
    lv_t = torch.from_numpy(np.asarray(levels, dtype=np.int16)).reshape(plan.num_chunks, k).to(dev)
    s_t = torch.from_numpy(np.array(scale, dtype=np.float32)).to(dev)
    m_t = torch.from_numpy(np.array(mins, dtype=np.float32)).to(dev)
    return ParsedRecord(plan, k, idx_t, lv_t, s_t, m_t)


def decode_parsed(parsed: ParsedRecord) -> torch.Tensor:
    """The dense float32 tensor a checked record decodes to (the exact decode): :meth:`ParsedRecord.decode`."""
    return parsed.decode()
