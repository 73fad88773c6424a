"""The DCT top-k int8 codec (id 1): Panthalia's chunked DCT (mode 0) and DeMo's tiles (mode 1).

Encoding (docs/FORMAT.md §5.2): cut the tensor into chunks, an orthonormal DCT-II along each dimension
of every chunk, keep each chunk's ``k`` coefficients of largest magnitude — their positions sorted
ascending, so the index set is canonical and decoding deterministic — and quantize them to int8 with a
per-chunk scale and minimum. Positions are packed at ``ceil(log2 C)`` bits (12 for 64×64 chunks).

Beyond the public DCT codecs, positions may instead be entropy-coded (``index_coding="rice"``): each
chunk's sorted positions as Golomb-Rice coded gaps with one parameter per tensor, within 2–3 % of the
information floor ``log2(C choose k)`` bits per chunk at ``k/C`` from 1/1024 to 1/16; ``"auto"`` takes
the smaller of fixed and Rice for each tensor. (No bitmap coding: Rice with parameter 0 spends
``i_last + 1 <= C`` bits on a chunk whose last position is ``i_last`` — it *is* the chunk's bitmap, cut
after its last one — so a bitmap is never smaller.) Values may use 8, 4, 2 or 1 bits (``value_bits``):
``2^b`` levels between the chunk's minimum and maximum, packed below a byte.

The math runs in float32 on the tensor's device; only the compact payload (positions, int8 values,
scales, minimums) crosses to the host. The reconstruction :meth:`DCTCodec.compress` returns is computed
by the very function the decoder runs on the same quantized data, so it equals what receivers decode,
bit for bit on the same device.

The decoder treats every record as hostile: each field and section is checked, with a
:class:`~gradwire.errors.FrameError` naming the rule, before the dense output is allocated.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import struct
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import torch

from .. import _native
from .. import dct as _dct
from .. import wire
from ..accumulate import Coefficients, register_accumulator, register_coefficients, register_norm
from ..errors import FrameError
from ..frame import Entry, decode_entry, register_batch_decoder, register_decoder, register_weighted_sum
from . import record as rec
from .base import Codec

__all__ = [
    "DCTAccumulator",
    "DCTCodec",
    "KeptCoefficients",
    "MAX_CHUNK_NUMEL",
    "ParsedRecord",
    "dct_record_norm",
    "dequantize_levels",
    "index_bits_for",
    "index_stream_sizes",
    "pack_params",
    "parse_record",
    "quantize_levels",
    "unpack_params",
]

#: The largest chunk element count ``C`` a record may announce, and the longest chunk side: bounds
#: the work and memory of the exact decode (``gradwire.dct.decode_levels``) for any valid record.
MAX_CHUNK_NUMEL = 1 << 16
MAX_CHUNK_SIDE = 1024
#: Highest ``chunk_ndim``.
MAX_CHUNK_NDIM = 8
VALUE_BITS = 8
#: The value widths a record may use (``2^b`` quantization levels per chunk).
VALUE_BITS_CHOICES = (8, 4, 2, 1)
INDEX_CODING_FIXED = 0
INDEX_CODING_RICE = 1
_INDEX_CODINGS = {"fixed": INDEX_CODING_FIXED, "rice": INDEX_CODING_RICE}
_INDEX_CODING_NAMES = {v: k for k, v in _INDEX_CODINGS.items()}
#: Section names, in their order in a record.
SECTIONS = ("idx", "val", "scale", "min")

_MODES = {"flat": _dct.MODE_FLAT, "tiles": _dct.MODE_TILES}
_TOPK_SCALINGS = ("fixed", "proportional")
_MODE_NAMES = {v: k for k, v in _MODES.items()}
_TAIL = struct.Struct("<IBBBQ")  # k, index_bits, value_bits, index_coding, pad_count


def index_bits_for(c: int) -> int:
    """Bits per packed position for chunks of ``c`` elements: ``max(1, ceil(log2 c))``."""
    return max(1, (int(c) - 1).bit_length())


def pack_params(
    mode: int,
    chunk_shape: Sequence[int],
    k: int,
    pad_count: int,
    *,
    index_coding: int = INDEX_CODING_FIXED,
    index_param: Optional[int] = None,
    value_bits: int = VALUE_BITS,
) -> bytes:
    """The ``params`` bytes of a DCT record (FORMAT.md §5.2).

    The ``index_bits`` field holds the coding's parameter: the packed width (coding 0, always
    ``ceil(log2 C)``) or the Rice parameter (coding 1, ``index_param``).
    """
    c = 1
    for d in chunk_shape:
        c *= int(d)
    nd = len(chunk_shape)
    if index_coding == INDEX_CODING_FIXED:
        index_param = index_bits_for(c)
    elif index_param is None:
        raise ValueError("a Rice-coded record needs its parameter (index_param)")
    return (
        struct.pack(f"<BB{nd}I", mode, nd, *chunk_shape)
        + _TAIL.pack(k, index_param, value_bits, index_coding, pad_count)
    )


def unpack_params(params: bytes) -> dict:
    """Parse a record's ``params`` into a dict (no range checks beyond the layout's length)."""
    if len(params) < 2:
        raise ValueError(f"params too short: {len(params)} bytes")
    mode, nd = params[0], params[1]
    if len(params) != 2 + 4 * nd + _TAIL.size:
        raise ValueError(f"params length {len(params)} does not fit chunk_ndim {nd}")
    chunk_shape = struct.unpack_from(f"<{nd}I", params, 2)
    k, index_bits, value_bits, index_coding, pad_count = _TAIL.unpack_from(params, 2 + 4 * nd)
    return dict(
        mode=mode,
        chunk_shape=tuple(chunk_shape),
        k=k,
        index_bits=index_bits,
        value_bits=value_bits,
        index_coding=index_coding,
        pad_count=pad_count,
    )


def _reconstruct(
    idx: torch.Tensor, levels: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, plan: _dct.ChunkPlan
) -> torch.Tensor:
    """The dense float32 tensor a record decodes to. Encoder and decoder both call exactly this."""
    return _dct.decode_levels(idx, levels.to(torch.int16), scales, mins, plan)


@dataclass(frozen=True)
class KeptCoefficients:
    """What a DCT record keeps of its tensor's coefficients: each chunk's positions ``idx`` (int64,
    ``(num_chunks, k)``, ascending) and their quantized values (``levels`` on the per-chunk grid of
    ``scales`` and ``mins``), on the device they were computed on."""

    plan: _dct.ChunkPlan
    idx: torch.Tensor
    levels: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def values(self) -> torch.Tensor:
        """The kept coefficients as receivers read them (float32, ``(num_chunks, k)``)."""
        return dequantize_levels(self.levels, self.scales, self.mins)

    def decode(self) -> torch.Tensor:
        """The dense float32 tensor receivers decode (the exact decode, ``gradwire.dct.decode_levels``)."""
        return _reconstruct(self.idx, self.levels, self.scales, self.mins, self.plan)


def quantize_levels(values: torch.Tensor, value_bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-chunk linear quantization of ``values`` ``(num_chunks, k)`` to ``L = 2^value_bits − 1`` steps.

    ``scale = max(max − min, 1e-8) / L`` and ``level = clamp(round_half_even((v − min) / scale), 0, L)``
    in float32; at 8 bits exactly :func:`gradwire.dct.quantize_int8` (``level = q + 128``), so 8-bit
    records are unchanged byte for byte. Returns ``(levels int16, scales, mins)``.
    """
    if value_bits == VALUE_BITS:
        q, scales, mins = _dct.quantize_int8(values)
        return q.to(torch.int16) + 128, scales, mins
    top = float((1 << value_bits) - 1)
    v = values.to(torch.float32)
    mins = v.amin(dim=1)
    scales = (v.amax(dim=1) - mins).clamp_min(_dct.MIN_RANGE) / top
    levels = torch.round((v - mins[:, None]) / scales[:, None]).clamp_(0.0, top)
    return levels.to(torch.int16), scales, mins


def dequantize_levels(levels: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """``level · scale + min`` per chunk in float32 (at 8 bits the same numbers as ``dequantize_int8``)."""
    return levels.to(torch.float32) * scales.to(torch.float32).reshape(-1, 1) + mins.to(torch.float32).reshape(-1, 1)


def index_stream_sizes(idx: np.ndarray, c: int) -> dict[int, tuple[int, Optional[int]]]:
    """Bytes of each index coding for ``idx`` ``(num_chunks, k)`` (sorted rows below ``c``), with the
    coding's parameter: ``{coding: (bytes, param)}``. The Rice parameter is the data's optimum."""
    n, k = idx.shape
    bits = index_bits_for(c)
    param, rice_len = wire.rice_param(idx.reshape(-1), c, set_len=k) if n * k else (0, 0)
    return {
        INDEX_CODING_FIXED: ((n * k * bits + 7) // 8, bits),
        INDEX_CODING_RICE: (rice_len, param),
    }


class DCTCodec(Codec):
    """Chunked DCT, top-k per chunk, int8 values.

    ``mode="flat"`` (Panthalia, FORMAT mode 0): the flattened tensor, zero-padded, in chunks of
    ``chunk_shape``. ``mode="tiles"`` (DeMo, mode 1): the tensor as a matrix cut into tiles whose sides
    are the largest divisors ``<= 64`` of its dimensions; where those tiles would be small (fewer than a
    quarter of ``min(numel, 64×64)`` elements, or of ``min(numel, 64)`` for a vector:
    :func:`gradwire.dct.small_tiles`) the tensor goes in flat chunks of ``chunk_shape`` instead, as a
    mode-0 record. Each chunk keeps ``min(topk, C)`` coefficients.

    ``topk_scaling``: ``"fixed"`` (the default: every chunk keeps ``min(topk, C)``) or ``"proportional"``
    (``topk`` is a full ``chunk_shape`` chunk's budget; a tensor whose chunks hold fewer elements — the
    50×50 tiles of a 1000×100 weight, a bias's 64-element chunks — keeps ``topk × C / chunk_numel``
    of each, rounded, at least 1, so every tensor is compressed about equally). The record carries its
    ``k`` either way: readers need nothing new.

    ``index_coding``: ``"fixed"`` (the default: positions packed at ``ceil(log2 C)`` bits, as every
    public DCT codec), ``"rice"`` (sorted gaps, Golomb-Rice with the tensor's best parameter) or
    ``"auto"`` (the smaller of the two, per tensor).
    ``value_bits``: 8 (int8, the default), 4, 2 or 1 bits per kept coefficient.
    """

    codec_id = 1
    name = "dct"

    def __init__(
        self,
        chunk_shape: Union[int, Sequence[int]] = (64, 64),
        topk: int = 32,
        mode: Union[str, int] = "flat",
        index_coding: str = "fixed",
        value_bits: int = VALUE_BITS,
        topk_scaling: str = "fixed",
    ):
        if isinstance(chunk_shape, int):
            chunk_shape = (chunk_shape,)
        chunk_shape = tuple(int(d) for d in chunk_shape)
        if not 1 <= len(chunk_shape) <= MAX_CHUNK_NDIM:
            raise ValueError(f"chunk_shape must have 1 to {MAX_CHUNK_NDIM} dimensions, got {chunk_shape}")
        if any(d < 1 for d in chunk_shape):
            raise ValueError(f"chunk_shape dimensions must be >= 1, got {chunk_shape}")
        c = 1
        for d in chunk_shape:
            c *= d
        if c > MAX_CHUNK_NUMEL or max(chunk_shape) > MAX_CHUNK_SIDE:
            raise ValueError(
                f"chunk_shape {chunk_shape} must have at most 2^16 elements and sides of at most {MAX_CHUNK_SIDE}"
            )
        if isinstance(mode, str):
            if mode not in _MODES:
                raise ValueError(f"mode must be 'flat' or 'tiles', got {mode!r}")
            mode = _MODES[mode]
        elif mode not in _MODE_NAMES:
            raise ValueError(f"mode must be 0 (flat) or 1 (tiles), got {mode!r}")
        topk = int(topk)
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if index_coding != "auto" and index_coding not in _INDEX_CODINGS:
            raise ValueError(f"index_coding must be 'fixed', 'rice' or 'auto', got {index_coding!r}")
        if int(value_bits) not in VALUE_BITS_CHOICES:
            raise ValueError(f"value_bits must be 8, 4, 2 or 1, got {value_bits!r}")
        if topk_scaling not in _TOPK_SCALINGS:
            raise ValueError(f"topk_scaling must be 'fixed' or 'proportional', got {topk_scaling!r}")
        self.chunk_shape = chunk_shape
        self.topk = topk
        self.mode = mode
        self.index_coding = index_coding
        self.value_bits = int(value_bits)
        self.topk_scaling = topk_scaling
        self._full_chunk_numel = c

    def chunk_topk(self, chunk_numel: int) -> int:
        """How many coefficients a chunk of ``chunk_numel`` elements keeps (see ``topk_scaling``)."""
        if self.topk_scaling == "proportional":
            return min(chunk_numel, max(1, round(self.topk * chunk_numel / self._full_chunk_numel)))
        return min(self.topk, chunk_numel)

    def plan(self, shape: Sequence[int]) -> _dct.ChunkPlan:
        """How a tensor of ``shape`` is cut into chunks by this codec."""
        shape = tuple(int(d) for d in shape)
        numel = 1
        for d in shape:
            numel *= d
        if self.mode == _dct.MODE_TILES:
            if numel == 0:
                # Mode 1 needs an element; an empty tensor goes as an (empty) mode-0 record.
                return _dct.plan_flat(shape, (1,))
            # Where tiles would be small (a prime dimension), flat chunks of chunk_shape (mode 0).
            return _dct.plan_tiles_or_flat(shape, self.chunk_shape)
        return _dct.plan_flat(shape, self.chunk_shape)

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        rec.check_float_input(tensor)
        x = tensor.detach()
        plan = self.plan(x.shape)
        coeffs = _dct.encode_chunks(x.to(torch.float32), plan)
        entry, kept = self.compress_coefficients(coeffs, plan, name, tensor.dtype)
        return entry, kept.decode().to(tensor.dtype)

    def compress_coefficients(
        self, coeffs: torch.Tensor, plan: _dct.ChunkPlan, name: str = "", dtype: torch.dtype = torch.float32
    ) -> tuple[Entry, "KeptCoefficients"]:
        """The record of a tensor whose DCT coefficients ``coeffs`` ``(num_chunks, C)`` (float32, cut by
        ``plan``, which must be :meth:`plan` of the tensor's shape) are given rather than computed, tagged
        ``dtype``; with what it keeps (:class:`KeptCoefficients`: its exact decode is what receivers get).

        :meth:`compress` is the forward transform and then this; a sender that holds coefficients already
        (the server's coefficient-domain downlink, :mod:`gradwire.reencode`) skips the transform.
        """
        if plan != self.plan(plan.shape):
            raise ValueError(f"tensor {name!r}: the plan {plan} is not this codec's for shape {plan.shape}")
        c = plan.chunk_numel
        if tuple(coeffs.shape) != (plan.num_chunks, c):
            raise ValueError(f"tensor {name!r}: expected ({plan.num_chunks}, {c}) coefficients, "
                             f"got {tuple(coeffs.shape)}")
        k = self.chunk_topk(c)
        idx, top = _dct.select_topk(coeffs, k)
        levels, scales, mins = quantize_levels(top, self.value_bits)
        # Only the compact payload crosses to the host.
        host = self._to_host(idx, levels, scales, mins, c)
        entry = self._record(name, dtype, plan, k, *host)
        return entry, KeptCoefficients(plan, idx, levels, scales, mins)

    def records_copy_input(self) -> bool:
        """Whether this codec's records and reconstructions never view the tensors it is given (its
        records are new host arrays, its reconstructions new tensors), so a caller may write those tensors
        afterwards (error feedback and the node sides update their buffers in place); ``False`` for a
        subclass with a compress of its own."""
        cls = type(self)
        return (cls.compress is DCTCodec.compress and cls.compress_bundle is DCTCodec.compress_bundle
                and cls.compress_batched is DCTCodec.compress_batched)

    def compress_bundle(self, tensors):
        """As :meth:`Codec.compress_bundle`; the tensors are compressed together (:meth:`compress_batched`).

        On a GPU each step of :meth:`compress` is a few kernel launches per tensor whatever its size, and a
        bundle of many small tensors (the sharded exchange's pieces) spent its time launching them:
        :meth:`compress_batched` runs every step once over all the chunks of one chunk shape. On the CPU
        the bundle is stacked where that keeps every byte of :meth:`compress`'s records.
        """
        # (Not for a subclass with a compress of its own: the batch would bypass it.)
        if len(tensors) > 1 and type(self).compress is DCTCodec.compress:
            if all(t.device.type != "cpu" for t in tensors.values()):
                return self.compress_batched(tensors)
            if all(t.device.type == "cpu" for t in tensors.values()):
                # On the CPU every step but the matrix route's transform works chunk by chunk: stacked,
                # the records are byte for byte compress's (that transform runs tensor by tensor).
                return self.compress_batched(tensors, exact_only=True)
        return super().compress_bundle(tensors)

    def compress_batched(self, tensors, exact_only: bool = False) -> dict[str, tuple[Entry, torch.Tensor]]:
        """:meth:`compress_bundle` with the chunks of every tensor of one chunk shape stacked (cut by one
        ``_foreach_copy_``) and transformed, selected, quantized, moved to the host and exactly decoded
        together (on the CPU the Rust decode runs record by record, writing each tensor in place).

        Every step works chunk by chunk, so on the CPU the records are byte for byte those of
        :meth:`compress` and the reconstructions the same bits (tests hold it); on a GPU the forward
        transform's last bits follow the matrix library's choice for the batch's size, so a coefficient
        at a tie may be kept in place of another, and each record still decodes to exactly its
        reconstruction.

        ``exact_only``: stack only what works chunk by chunk on this device, so each record is byte for
        byte :meth:`compress`'s: on the CPU the transform of chunks other than the Rust transform's (2-D,
        sides powers of two) runs tensor by tensor, as :meth:`compress` runs it; selection, quantization
        and the exact decode are stacked for every chunk shape.
        """
        groups: dict[tuple[int, ...], list[tuple[str, torch.Tensor, _dct.ChunkPlan]]] = {}
        out: dict[str, tuple[Entry, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            rec.check_float_input(tensor)
            if tensor.numel() == 0:  # an empty record of its own, written on the host: no data to copy
                entry, _ = self.compress(torch.empty(tensor.shape, dtype=tensor.dtype), name)
                out[name] = (entry, torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device))
                continue
            plan = self.plan(tensor.shape)
            groups.setdefault(plan.chunk_shape, []).append((name, tensor, plan))
        pending = []
        for dims, members in groups.items():
            c = members[0][2].chunk_numel
            k = self.chunk_topk(c)
            if exact_only and not _chunkwise_on_cpu(dims):
                # The matrix route's last bits could follow the batch's size: each tensor's transform on
                # its own, as compress runs it; selection, quantization and decode work chunk by chunk.
                coeffs = torch.cat([_dct.encode_chunks(t.detach().to(torch.float32), plan)
                                    for _, t, plan in members])
            else:
                chunks = _cut_into_chunks(members, dims, c)
                coeffs = _dct.dct_chunks(chunks.reshape(-1, *dims), overwrite=True).reshape(-1, c)
            idx, top = _dct.select_topk(coeffs, k)
            levels, scales, mins = quantize_levels(top, self.value_bits)
            if coeffs.device.type == "cpu" and coeffs.numel() >= _CPU_STACKED_DECODE_MAX * len(members):
                # Large records: the Rust decode, record by record as compress runs it, writes a matrix's
                # tiles in place (no put-back pass over memory) and each call is one native pass.
                recons, row = [], 0
                for _, _, plan in members:
                    rows = slice(row, row + plan.num_chunks)
                    row += plan.num_chunks
                    recons.append(_reconstruct(idx[rows], levels[rows], scales[rows], mins[rows], plan))
            elif coeffs.device.type == "cpu":
                # Many small records: one Rust decode of all their chunks (taken as one flat record of
                # them; each chunk is decoded on its own, exactly: the same bits) and one put-back copy,
                # rather than a call per record.
                stacked = _dct.plan_flat((coeffs.shape[0] * c,), dims)
                decoded = _dct.decode_levels(idx, levels.to(torch.int16), scales, mins, stacked)
                recons = _put_back_chunks(decoded.reshape(-1, c), members, dims)
            else:
                decoded = _dct.decode_level_chunks(idx, levels, scales, mins, dims)
                recons = _put_back_chunks(decoded.reshape(-1, c), members, dims)
            pending.append((members, k, c, (idx, levels, scales, mins), recons))
        # Every group's payload crosses to the host at once: one copy on a GPU (see _to_host_all).
        hosts = self._to_host_all([(payload, c) for _, _, c, payload, _ in pending])
        for (members, k, c, _, recons), (idx_h, levels_h, scales_h, mins_h) in zip(pending, hosts):
            row = 0
            for (name, tensor, plan), recon in zip(members, recons):
                rows = slice(row, row + plan.num_chunks)
                row += plan.num_chunks
                entry = self._record(name, tensor.dtype, plan, k, idx_h[rows], levels_h[rows].reshape(-1),
                                     scales_h[rows], mins_h[rows])
                out[name] = (entry, recon if recon.dtype == tensor.dtype else recon.to(tensor.dtype))
        return {name: out[name] for name in tensors}

    def _to_host_all(self, groups):
        """:meth:`_to_host` (not flat) of each ``((idx, levels, scales, mins), c)``. Off the CPU the arrays
        of every group are laid end to end as bytes on the device (each padded to 8 bytes, so every array
        stays aligned) and copied to the host in ONE transfer, then cut back into typed views: one
        device-to-host copy per exchange phase whatever the number of tensors or chunk shapes."""
        if not groups or groups[0][0][0].device.type == "cpu":
            return [self._to_host(*payload, c, flat=False) for payload, c in groups]
        parts: list[torch.Tensor] = []
        for (idx, levels, scales, mins), c in groups:
            values = (levels - 128).to(torch.int8) if self.value_bits == VALUE_BITS else levels.to(torch.int32)
            parts += [idx.to(torch.int16 if c <= (1 << 15) else torch.int32), values,
                      scales.to(torch.float32), mins.to(torch.float32)]
        pieces, spans = [], []
        offset = 0
        for t in parts:
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            pad = -raw.numel() % 8
            pieces.append(raw)
            if pad:
                pieces.append(torch.zeros(pad, dtype=torch.uint8, device=raw.device))
            spans.append((offset, t))
            offset += raw.numel() + pad
        blob = torch.cat(pieces).cpu().numpy()
        arrays = []
        for start, t in spans:
            dtype = np.dtype(str(t.dtype).replace("torch.", ""))
            arrays.append(blob[start:start + t.numel() * dtype.itemsize].view(dtype).reshape(tuple(t.shape)))
        return [tuple(arrays[4 * g:4 * g + 4]) for g in range(len(groups))]

    def _to_host(self, idx, levels, scales, mins, c: int, flat: bool = True):
        """``(positions, values, scales, mins)`` as numpy arrays, values as the record stores them (int8
        at 8 bits, else the levels as int32, packed per record by :meth:`_record`); ``flat``: values as
        one row."""
        idx_host = idx.to(torch.int16 if c <= (1 << 15) else torch.int32).cpu().numpy()
        if self.value_bits == VALUE_BITS:
            values = (levels - 128).to(torch.int8).cpu().numpy()
        else:
            values = levels.to(torch.int32).cpu().numpy()
        return idx_host, values.reshape(-1) if flat else values, scales.cpu().numpy(), mins.cpu().numpy()

    def _record(self, name: str, dtype: torch.dtype, plan: _dct.ChunkPlan, k: int, idx_host: np.ndarray,
                values: np.ndarray, scales_host: np.ndarray, mins_host: np.ndarray) -> Entry:
        """The record of ``plan``'s chunks from their host arrays (see :meth:`_to_host`)."""
        if not (np.isfinite(scales_host).all() and np.isfinite(mins_host).all()):
            raise ValueError(f"tensor {name!r} holds non-finite values (or values too large for float32)")
        c = plan.chunk_numel
        if self.value_bits != VALUE_BITS:
            values = np.frombuffer(wire.pack_bits(values, self.value_bits), dtype=np.uint8)
        coding, param, idx_bytes = self._code_indices(
            idx_host.reshape(plan.num_chunks, k).astype(np.uint32), c, index_bits_for(c))
        return Entry(
            name=name, codec=self.codec_id, dtype=dtype, shape=plan.shape,
            params=pack_params(
                plan.mode, plan.chunk_shape, k, plan.pad_count,
                index_coding=coding, index_param=param, value_bits=self.value_bits,
            ),
            sections={
                "idx": np.frombuffer(idx_bytes, dtype=np.uint8),
                "val": values,
                "scale": scales_host.astype(np.float32, copy=False),
                "min": mins_host.astype(np.float32, copy=False),
            },
            section_elems={},
        )

    def _code_indices(self, idx: np.ndarray, c: int, bits: int) -> tuple[int, int, bytes]:
        """``(index_coding, its parameter, the idx section)`` for positions ``idx`` ``(num_chunks, k)``."""
        n, k = idx.shape
        flat = idx.reshape(-1)
        if self.index_coding == "fixed":
            return INDEX_CODING_FIXED, bits, wire.pack_bits(flat, bits)
        if self.index_coding == "rice":
            param = wire.rice_param(flat, c, set_len=k)[0] if n * k else 0
            return INDEX_CODING_RICE, param, wire.rice_encode(flat, c, param, set_len=k)
        sizes = index_stream_sizes(idx, c)
        # Smaller wins; a tie goes to fixed packing, the simpler stream.
        coding = min(sizes, key=lambda cd: (sizes[cd][0], cd))
        param = sizes[coding][1]
        if coding == INDEX_CODING_FIXED:
            return coding, param, wire.pack_bits(flat, bits)
        return coding, param, wire.rice_encode(flat, c, param, set_len=k)

    def __repr__(self) -> str:
        extra = ""
        if self.index_coding != "fixed":
            extra += f", index_coding={self.index_coding!r}"
        if self.value_bits != VALUE_BITS:
            extra += f", value_bits={self.value_bits}"
        if self.topk_scaling != "fixed":
            extra += f", topk_scaling={self.topk_scaling!r}"
        return (
            f"DCTCodec(chunk_shape={self.chunk_shape}, topk={self.topk}, mode={_MODE_NAMES[self.mode]!r}{extra})"
        )


#: Mean elements per record from which :meth:`DCTCodec.compress_batched` decodes a CPU group record by record
#: (into each tensor's own layout, no put-back pass) rather than stacked (one call for many small records).
_CPU_STACKED_DECODE_MAX = 1 << 18


def _chunkwise_on_cpu(dims: Sequence[int]) -> bool:
    """Whether the CPU transform of chunks of ``dims`` is the Rust one (2-D, sides powers of two up to
    ``MATMUL_MAX_N``), which works chunk by chunk whatever the batch."""
    return len(dims) == 2 and all(0 < n <= _dct.MATMUL_MAX_N and n & (n - 1) == 0 for n in dims)


def _chunk_views(members, chunk_rows: torch.Tensor, flat_of, into_chunks: bool):
    """``(destinations, sources, padding)`` views moving every member's elements between the chunk layout
    and its tensor's: ``chunk_rows`` holds every member's chunks ``(rows, C)`` in order, ``flat_of(i)``
    member i's elements in tensor order (a flat view); ``into_chunks`` says which way. Tiles pair a
    ``(grid_u, grid_v, a, b)`` view of the rows with the tensor's tiles, the permutation always on the
    source side (a strided read into a contiguous write: the fast copy on the CPU). Views only, so one
    ``_foreach_copy_`` moves them all."""
    dst, src, pads = [], [], []
    row = 0
    for i, (_, _, plan) in enumerate(members):
        n, c = plan.num_chunks, plan.chunk_numel
        rows = chunk_rows[row:row + n]
        row += n
        flat = flat_of(i)
        if plan.mode == _dct.MODE_TILES and len(plan.chunk_shape) == 2:
            (a, b), (gu, gv) = plan.chunk_shape, plan.grid
            tiles, tensor = rows.view(gu, gv, a, b), flat.view(gu, a, gv, b)
            if into_chunks:
                dst.append(tiles)
                src.append(tensor.permute(0, 2, 1, 3))
            else:
                dst.append(tensor)
                src.append(tiles.permute(0, 2, 1, 3))
        else:
            numel = flat.numel()
            chunked = rows.view(-1)[:numel]
            dst.append(chunked if into_chunks else flat)
            src.append(flat if into_chunks else chunked)
            if n * c > numel:
                pads.append(rows.view(-1)[numel:])
    return dst, src, pads


def _cut_into_chunks(members, dims, c: int) -> torch.Tensor:
    """Every member's chunks (``to_chunks`` of each, float32) stacked ``(rows, C)``, written in place into
    one new buffer: one ``_foreach_copy_`` (and one ``_foreach_zero_`` for flat chunks' padding) whatever
    the number of tensors. Copies and float32 widening are exact: the same values as ``to_chunks``."""
    total = sum(plan.num_chunks for _, _, plan in members)
    device = members[0][1].device
    out = torch.empty((total, c), dtype=torch.float32, device=device)
    sources = [t.detach().reshape(-1) for _, t, _ in members]
    dst, src, pads = _chunk_views(members, out, lambda i: sources[i], into_chunks=True)
    torch._foreach_copy_(dst, src)
    if pads:
        torch._foreach_zero_(pads)
    return out


def _put_back_chunks(decoded: torch.Tensor, members, dims) -> list[torch.Tensor]:
    """Each member's decoded chunks put back into its tensor's shape (``from_chunks``), float32: views of
    one new buffer, written by one ``_foreach_copy_``."""
    sizes = [math.prod(plan.shape) for _, _, plan in members]
    flat = torch.empty(sum(sizes), dtype=torch.float32, device=decoded.device)
    parts = list(torch.split(flat, sizes)) if members else []
    dst, src, _ = _chunk_views(members, decoded, lambda i: parts[i], into_chunks=False)
    torch._foreach_copy_(dst, src)
    return [p.view(plan.shape) for p, (_, _, plan) in zip(parts, members)]


# ---------------------------------------------------------------------------------------------
# Decoding


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
            raise _bad(
                entry, f"index_bits must equal max(1, ceil(log2 C)) = {want_bits} for C = {c}, got {index_bits}"
            )
    elif index_coding == INDEX_CODING_RICE:
        if index_bits > want_bits:
            raise _bad(
                entry, f"index_coding 1 (Rice): the parameter (index_bits) must be <= {want_bits} for C = {c},"
                f" got {index_bits}"
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
        levels = rec.wire_call(
            entry, _CODEC, "section 'val'", wire.unpack_bits_exact, val, value_bits, total
        ).astype(np.int16)
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
_PARSED: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("gradwire_dct_parsed", default=None)


@contextlib.contextmanager
def records_parsed_once() -> Iterator[None]:
    """Within the block, :func:`parse_record` parses each record object once per device and hands every
    later caller the same :class:`ParsedRecord` (which none of them modifies).

    A server's round close reads each node record several times — its direction check, its norm, the
    aggregate — and at 64 nodes the parsing was a third of the close. The records must not change inside
    the block; they are held until it ends, so an ``id`` is never reused for another record.
    """
    token = _PARSED.set({})
    try:
        yield
    finally:
        _PARSED.reset(token)


def parse_record(entry: Entry, device: Optional[torch.device] = None) -> ParsedRecord:
    """Validate a DCT record as hostile input and return its positions and dequantized coefficients.

    The one parser of the codec's sections: the decoder, the transform-domain accumulator and the norm
    all go through it, so a new index coding or value width is added here once.
    """
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


def _parse_record(entry: Entry, device: Optional[torch.device]) -> ParsedRecord:
    plan, k, idx, levels, scale, mins = _checked_sections(entry)
    # Everything is checked; only now is anything of the record's size allocated.
    dev = torch.device("cpu") if device is None else torch.device(device)
    idx_t = torch.from_numpy(idx.astype(np.int64)).to(dev)
    lv_t = torch.from_numpy(np.asarray(levels, dtype=np.int16)).reshape(plan.num_chunks, k).to(dev)
    s_t = torch.from_numpy(np.array(scale, dtype=np.float32)).to(dev)
    m_t = torch.from_numpy(np.array(mins, dtype=np.float32)).to(dev)
    return ParsedRecord(plan, k, idx_t, dequantize_levels(lv_t, s_t, m_t), lv_t, s_t, m_t)


@register_decoder(DCTCodec.codec_id)
def _decode_dct(entry: Entry, device: Optional[torch.device]) -> torch.Tensor:
    """Decode a DCT record, validating every field as hostile input first."""
    return _reconstruct_levels(parse_record(entry, device)).to(entry.dtype)


#: Output elements of one batch of :func:`_decode_dct_batch` (float32: 256 MiB).
_BATCH_DECODE_ELEMS = 1 << 26


def _decodes_stacked(dev: torch.device) -> bool:
    """Whether :func:`_decode_dct_batch` applies on ``dev``: not on the CPU, where the Rust decode of one
    record at a time is faster."""
    return dev.type != "cpu"


@register_batch_decoder(DCTCodec.codec_id)
def _decode_dct_batch(entries: Sequence[Entry], device: Optional[torch.device]) -> Optional[list[torch.Tensor]]:
    """DCT records decoded together on a GPU: the records of one chunk shape and ``k`` stacked, one exact
    decode (:func:`gradwire.dct.decode_level_chunks`, which decodes each chunk on its own: the same bits as
    record by record), in batches of at most :data:`_BATCH_DECODE_ELEMS` outputs. ``None`` on the CPU,
    where the Rust decode of one record at a time is the fast path. Every record is checked before
    anything of the batch is allocated on the device."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if not _decodes_stacked(dev):
        return None
    checked = [_checked_sections(e) for e in entries]
    groups: dict[tuple, list[int]] = {}
    for i, (plan, k, *_rest) in enumerate(checked):
        groups.setdefault((plan.chunk_shape, k), []).append(i)
    out: list[Optional[torch.Tensor]] = [None] * len(entries)
    for (dims, _k), members in groups.items():
        batch: list[int] = []
        size = 0
        for j, i in enumerate(members):
            batch.append(i)
            size += checked[i][0].num_chunks * checked[i][0].chunk_numel
            if size >= _BATCH_DECODE_ELEMS or j == len(members) - 1:
                _decode_stacked([checked[b] for b in batch], dims, dev, [entries[b] for b in batch],
                                batch, out)
                batch, size = [], 0
    return out  # type: ignore[return-value]


def _to_device_all(arrays: Sequence[np.ndarray], dev: torch.device) -> list[torch.Tensor]:
    """The host ``arrays`` on ``dev`` in one host-to-device copy: laid end to end as bytes (each padded to 8
    bytes, so every one stays aligned), copied once, cut back into typed views."""
    spans, offset = [], 0
    for a in arrays:
        spans.append(offset)
        offset += a.nbytes + (-a.nbytes % 8)
    blob = np.zeros(offset, dtype=np.uint8)
    for a, start in zip(arrays, spans):
        blob[start:start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    moved = torch.from_numpy(blob).to(dev)
    return [moved[start:start + a.nbytes].view(getattr(torch, a.dtype.name)).reshape(a.shape) if a.nbytes
            else torch.empty(a.shape, dtype=getattr(torch, a.dtype.name), device=dev)
            for a, start in zip(arrays, spans)]


def _decode_stacked(parts, dims, dev: torch.device, entries, at: list[int], out: list) -> None:
    idx, levels, scales, mins = _to_device_all([
        np.concatenate([p[2].astype(np.int64).reshape(-1, p[1]) for p in parts]),
        np.concatenate([np.asarray(p[3], dtype=np.int16).reshape(-1, p[1]) for p in parts]),
        np.concatenate([np.array(p[4], dtype=np.float32) for p in parts]),
        np.concatenate([np.array(p[5], dtype=np.float32) for p in parts]),
    ], dev)
    decoded = _dct.decode_level_chunks(idx, levels, scales, mins, dims)
    # Every record's chunks put back into its shape by one _foreach_copy_ (exact copies).
    put_back = _put_back_chunks(decoded.reshape(decoded.shape[0], math.prod(dims)), [(None, None, p[0]) for p in parts], dims)
    for t, entry, i in zip(put_back, entries, at):
        out[i] = t if t.dtype == entry.dtype else t.to(entry.dtype)


@register_weighted_sum(DCTCodec.codec_id)
def _weighted_sum_dct(
    entries: Sequence[Entry], weights: Sequence[float], device: Optional[torch.device]
) -> Optional[torch.Tensor]:
    """The fused weighted sum of float32 DCT records chunked alike, on the CPU
    (:func:`gradwire.dct.decode_levels_weighted_sum`); ``None`` for anything else."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type != "cpu" or any(e.dtype != torch.float32 for e in entries):
        return None
    parsed = [parse_record(e, dev) for e in entries]
    plan = parsed[0].plan
    if any(p.plan != plan for p in parsed[1:]):
        return None
    return _dct.decode_levels_weighted_sum(
        [(p.idx, p.levels, p.scales, p.mins) for p in parsed], weights, plan
    )


def _reconstruct_levels(parsed: ParsedRecord) -> torch.Tensor:
    return _dct.decode_levels(parsed.idx, parsed.levels, parsed.scales, parsed.mins, parsed.plan)


# ---------------------------------------------------------------------------------------------
# Summing records in the transform domain (gradwire.accumulate)


class DCTAccumulator:
    """A weighted sum of DCT records of one tensor, added coefficient by coefficient.

    The DCT is linear and orthonormal, so the sum of decoded records is the inverse transform of the
    summed coefficients: records with the first record's layout (same mode, chunk shape, padding) are
    added into one ``(num_chunks, C)`` float32 array and :meth:`finish` runs one inverse transform.
    Records with another layout are decoded densely into a side sum. Each record's positions are
    distinct, so its addition is a gather, an add and a scatter with no colliding writes: the same
    records added in the same order give bit-identical sums on any device (no atomics).
    """

    def __init__(self, first: Entry, device: Optional[torch.device] = None):
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.shape = tuple(first.shape)
        self.plan: Optional[_dct.ChunkPlan] = None
        self.coeffs: Optional[torch.Tensor] = None  # (num_chunks * C,) float32
        self.side: Optional[torch.Tensor] = None  # dense sum of records of another layout
        self.count = 0

    def add(self, entry: Entry, weight: float = 1.0) -> None:
        if tuple(entry.shape) != self.shape:
            raise ValueError(f"record {entry.name!r} has shape {tuple(entry.shape)}, the sum has {self.shape}")
        if entry.codec != DCTCodec.codec_id:
            self._add_dense(decode_entry(entry, self.device), weight)
            return
        parsed = parse_record(entry, self.device)
        if self.plan is None:
            self.plan = parsed.plan
            self.coeffs = torch.zeros(parsed.plan.num_chunks * parsed.plan.chunk_numel, dtype=torch.float32,
                                      device=self.device)
        if parsed.plan != self.plan:
            self._add_dense(_reconstruct_levels(parsed), weight)
            return
        c = self.plan.chunk_numel
        if self.device.type == "cpu":
            # One Rust pass, chunk row by chunk row: the same float32 operations as below.
            w32 = float(torch.tensor(float(weight), dtype=torch.float32))
            _native.scatter_add_rows(parsed.idx.contiguous().reshape(-1).numpy(),
                                     parsed.values.contiguous().reshape(-1).numpy(), parsed.k, c, w32,
                                     self.coeffs.numpy())
            self.count += 1
            return
        flat = (parsed.idx + torch.arange(parsed.plan.num_chunks, device=self.device).unsqueeze(1) * c).reshape(-1)
        vals = parsed.values.reshape(-1)
        if weight != 1.0:
            vals = vals * weight
        # index_select / index_copy_ rather than coeffs[flat] (advanced indexing is slow); the positions
        # of one record are distinct, so the copy has no colliding writes (and no atomics on CUDA).
        self.coeffs.index_copy_(0, flat, self.coeffs.index_select(0, flat) + vals)
        self.count += 1

    def _add_dense(self, t: torch.Tensor, weight: float) -> None:
        t = t.to(device=self.device, dtype=torch.float32)
        if weight != 1.0:
            t = t * weight
        self.side = t if self.side is None else self.side + t
        self.count += 1

    def finish(self) -> torch.Tensor:
        """The dense float32 sum: one inverse transform of the summed coefficients, plus the side sum."""
        out = None
        if self.coeffs is not None:
            n, cs = self.plan.num_chunks, self.plan.chunk_shape
            # One float32 inverse transform of the summed coefficients: fast, and reproducible wherever
            # the same torch build runs with the same thread count (the ranks of one DDP job); unlike
            # decoding a single frame it is not bit-exact across machines (docs/DISTRIBUTED.md).
            out = _dct.from_chunks(_dct.idct_chunks(self.coeffs.reshape(n, *cs)), self.plan)
        if self.side is not None:
            out = self.side if out is None else out + self.side
        if out is None:
            return torch.zeros(self.shape, dtype=torch.float32, device=self.device)
        return out


@register_accumulator(DCTCodec.codec_id)
def _dct_accumulator(first: Entry, device: Optional[torch.device]) -> DCTAccumulator:
    return DCTAccumulator(first, device)


@register_norm(DCTCodec.codec_id)
def dct_record_norm(entry: Entry) -> float:
    """L2 norm of a DCT record from its coefficients alone (Parseval: the transform is orthonormal).

    Exact when the record has no padding (mode 1, or mode 0 with ``numel`` a multiple of ``C``). With
    mode-0 padding the inverse transform also spreads energy into the padded tail, which decoding drops,
    so this is then an upper bound on the decoded tensor's norm — the safe side for a norm ceiling or
    for clipping.
    """
    # The server validates every submission through here, so it stays in NumPy on the checked sections:
    # the same float32 coefficients as parse_record's, without building tensors.
    rec.check_record_dtype(entry, _CODEC)
    plan, k, bits, value_bits, coding = _check_params(entry)
    _, levels, scale, mins = _check_sections(entry, plan, k, bits, value_bits, coding)
    values = levels.reshape(plan.num_chunks, k).astype(np.float32) * scale[:, None] + mins[:, None]
    # Not np.dot: BLAS's threads cost more than this small sum.
    return math.sqrt(float(np.square(values, dtype=np.float64).sum()))


@register_coefficients(DCTCodec.codec_id)
def dct_record_coefficients(entry: Entry) -> Coefficients:
    """A DCT record's kept coefficients as positions in its chunk plan's coefficient space (the transform
    is orthonormal, so inner products there are the decoded tensors' — exact without padding, as for
    :func:`dct_record_norm`)."""
    parsed = parse_record(entry)
    c = parsed.plan.chunk_numel
    flat = (parsed.idx + torch.arange(parsed.plan.num_chunks).unsqueeze(1) * c).reshape(-1)
    return Coefficients(("dct", parsed.plan), parsed.plan.num_chunks * c, flat,
                        parsed.values.reshape(-1).to(torch.float64))
