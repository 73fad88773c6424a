"""Reading a DCT record as hostile input: every field and section checked before anything of the
record's size is allocated.

:func:`parse_record` is the one parser of the codec's sections: the decoders (:mod:`.dct_decode`), the
transform-domain accumulator, the norm and the coefficients (:mod:`.dct_domain`) all go through it, so a
new index coding or value width is added here once. Each rule broken is a
:class:`~gradwire.errors.FrameError` naming it. :func:`records_parsed_once` lets a server's round close
parse each record once however many times it reads it.
"""

from __future__ import annotations

import contextlib
import contextvars
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from .. import dct as _dct
from .. import wire
from ..errors import FrameError
from ..frame import Entry
from . import record as rec
from .dct import (
    _MODE_NAMES,
    _TAIL,
    INDEX_CODING_FIXED,
    INDEX_CODING_RICE,
    MAX_CHUNK_NDIM,
    MAX_CHUNK_NUMEL,
    MAX_CHUNK_SIDE,
    SECTIONS,
    VALUE_BITS,
    VALUE_BITS_CHOICES,
    dequantize_levels,
    index_bits_for,
    own_record_arrays,
)

__all__ = ["ParsedRecord", "decode_parsed", "own_records_trusted", "parse_record", "records_parsed_once"]


_CODEC = "dct"


def _bad(entry: Entry, rule: str) -> FrameError:
    return rec.bad(entry, _CODEC, rule)


def _check_params(entry: Entry) -> tuple[_dct.ChunkPlan, int, int, int, int]:
    """Validate ``entry.params`` against the record's shape.

    Returns ``(plan, k, index_bits, value_bits, index_coding)``; ``index_bits`` is the coding's
    parameter (packed width or Rice parameter).
    """
    p = entry.params
    if len(p) < 2:
        raise _bad(entry, f"params must be at least 2 bytes (mode, chunk_ndim), got {len(p)}")
    mode, nd = p[0], p[1]
    if mode not in _MODE_NAMES:
        raise _bad(entry, f"mode must be 0 (flat) or 1 (tiles), got {mode}")
    if not 1 <= nd <= MAX_CHUNK_NDIM:
        raise _bad(entry, f"chunk_ndim must lie in 1..{MAX_CHUNK_NDIM}, got {nd}")
    want_len = 2 + 4 * nd + _TAIL.size
    if len(p) != want_len:
        raise _bad(entry, f"params length must be {want_len} bytes for chunk_ndim {nd}, got {len(p)}")
    chunk_shape = struct.unpack_from(f"<{nd}I", p, 2)
    if any(d < 1 for d in chunk_shape):
        raise _bad(entry, f"chunk_shape dimensions must be >= 1, got {chunk_shape}")
    c = 1
    for d in chunk_shape:
        c *= d
    if c > MAX_CHUNK_NUMEL:
        raise _bad(entry, f"chunk element count C = {c} exceeds 2^16")
    if max(chunk_shape) > MAX_CHUNK_SIDE:
        raise _bad(entry, f"chunk side {max(chunk_shape)} exceeds {MAX_CHUNK_SIDE}")
    k, index_bits, value_bits, index_coding, pad_count = _TAIL.unpack_from(p, 2 + 4 * nd)
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
    if mode == _dct.MODE_FLAT:
        want_pad = (c - numel % c) % c
        if pad_count != want_pad:
            raise _bad(entry, f"pad_count must be (C - numel mod C) mod C = {want_pad}, got {pad_count}")
        plan = _dct.plan_flat(entry.shape, chunk_shape)
    else:
        if pad_count != 0:
            raise _bad(entry, f"pad_count must be 0 in mode 1 (tiles), got {pad_count}")
        if numel < 1:
            raise _bad(entry, "mode 1 (tiles) needs a tensor of at least one element")
        want_shape = _dct.tile_chunk_shape(entry.shape)
        if tuple(chunk_shape) != want_shape:
            raise _bad(
                entry,
                f"mode 1 (tiles) chunk_shape must be {want_shape} for tensor shape {tuple(entry.shape)}"
                f" (recomputed), got {tuple(chunk_shape)}",
            )
        plan = _dct.plan_tiles(entry.shape)
    return plan, k, index_bits, value_bits, index_coding


def _check_sections(entry: Entry, plan: _dct.ChunkPlan, k: int, bits: int, value_bits: int, coding: int):
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
    """A DCT record after every check: what it decodes to, before the inverse transform.

    ``idx`` (int64, ``(num_chunks, k)``) holds each chunk's positions, strictly ascending; ``values``
    (float32, same shape) the dequantized coefficients at those positions. Both live on the device
    :func:`parse_record` was given.
    """

    plan: _dct.ChunkPlan
    k: int
    idx: torch.Tensor
    values: torch.Tensor
    #: The same coefficients as grid levels: ``values == levels * scales + mins`` per chunk, levels
    #: integers in [0, 2^value_bits - 1]; what the bit-exact decode (``gradwire.dct.decode_levels``)
    #: works from.
    levels: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor


#: Inside :func:`records_parsed_once`: ``{(id(entry), device): (entry, ParsedRecord)}``.
_PARSED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("gradwire_dct_parsed", default=None)


@contextlib.contextmanager
def records_parsed_once(parsed: Mapping | None = None) -> Iterator[dict]:
    """Within the block, :func:`parse_record` parses each record object once per device and hands every
    later caller the same :class:`ParsedRecord` (which none of them modifies).

    A server's round close reads each node record several times — its direction check, its norm, the
    aggregate — and at 64 nodes the parsing was a third of the close. The records must not change inside
    the block; they are held until it ends, so an ``id`` is never reused for another record.

    The block yields its parses; ``parsed``: the parses an earlier block yielded, to start from (a server
    parses each update when it arrives, and its round close then starts from those parses). Whoever keeps
    a block's parses keeps its records alive with them.
    """
    memo = {} if parsed is None else dict(parsed)
    token = _PARSED.set(memo)
    try:
        yield memo
    finally:
        _PARSED.reset(token)


#: Inside :func:`own_records_trusted`: records this process's codec wrote are taken as it kept them.
_TRUST_OWN: contextvars.ContextVar[bool] = contextvars.ContextVar("gradwire_dct_trust_own", default=False)


@contextlib.contextmanager
def own_records_trusted() -> Iterator[None]:
    """Within the block, :func:`parse_record` of a record this process's DCT codec wrote (the same object,
    not bytes read back) returns what the codec kept — exactly what parsing its bytes gives — without
    checking or decoding its sections again. For a caller that hands back its own records untouched, such
    as a sharded exchange's owner averaging its own pieces with the other ranks' (read from their bytes,
    and parsed as hostile input as always). A record changed in place after it was written must not be
    passed inside the block."""
    token = _TRUST_OWN.set(True)
    try:
        yield
    finally:
        _TRUST_OWN.reset(token)


def parse_record(entry: Entry, device: torch.device | None = None) -> ParsedRecord:
    """Validate a DCT record as hostile input and return its positions and dequantized coefficients.

    The one parser of the codec's sections: the decoder, the transform-domain accumulator and the norm
    all go through it, so a new index coding or value width is added here once.
    """
    if _TRUST_OWN.get():
        own = own_record_arrays(entry, torch.device("cpu") if device is None else torch.device(device))
        if own is not None:
            plan, k, idx, levels, scales, mins = own
            return ParsedRecord(plan, k, idx, dequantize_levels(levels, scales, mins), levels, scales, mins)
    memo = _PARSED.get()
    if memo is None:
        return _parse_record(entry, device)
    key = (id(entry), str(torch.device("cpu") if device is None else torch.device(device)))
    if key not in memo:  # the entry is held with its parse, so its id names no other record meanwhile
        memo[key] = (entry, _parse_record(entry, device))
    return memo[key][1]


def _checked_sections(entry: Entry):
    """``(plan, k, idx, levels, scales, mins)`` of a DCT record as host arrays, every field checked."""
    rec.check_record_dtype(entry, _CODEC)
    plan, k, bits, value_bits, coding = _check_params(entry)
    return (plan, k) + tuple(_check_sections(entry, plan, k, bits, value_bits, coding))


def _parse_record(entry: Entry, device: torch.device | None) -> ParsedRecord:
    plan, k, idx, levels, scale, mins = _checked_sections(entry)
    # Everything is checked; only now is anything of the record's size allocated.
    dev = torch.device("cpu") if device is None else torch.device(device)
    idx_t = torch.from_numpy(idx.astype(np.int64)).to(dev)
    lv_t = torch.from_numpy(np.asarray(levels, dtype=np.int16)).reshape(plan.num_chunks, k).to(dev)
    s_t = torch.from_numpy(np.array(scale, dtype=np.float32)).to(dev)
    m_t = torch.from_numpy(np.array(mins, dtype=np.float32)).to(dev)
    return ParsedRecord(plan, k, idx_t, dequantize_levels(lv_t, s_t, m_t), lv_t, s_t, m_t)


def decode_parsed(parsed: ParsedRecord) -> torch.Tensor:
    """The dense float32 tensor a checked record decodes to (the exact decode)."""
    return _dct.decode_levels(parsed.idx, parsed.levels, parsed.scales, parsed.mins, parsed.plan)
