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

The codec's records are read by four modules beside this one: :mod:`.dct_parse` (every record checked
as hostile input, with a :class:`~gradwire.errors.FrameError` naming the rule, before the dense output
is allocated), :mod:`.dct_decode` (the decoders: one record, many at once, the fused weighted sum),
:mod:`.dct_domain` (sums, norms and inner products in the coefficient domain) and
:mod:`.dct_capabilities` (the codec's capability object, which the frame readers find by codec id).
"""

from __future__ import annotations

import functools
import math
import struct
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .. import _native, wire
from .. import dct as _dct
from ..frame import Entry
from . import record as rec
from .base import Codec

__all__ = [
    "DCTCodec",
    "KeptCoefficients",
    "MAX_CHUNK_NUMEL",
    "dequantize_levels",
    "index_bits_for",
    "index_stream_sizes",
    "pack_params",
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
#: ``_native.dct_payloads``'s ``index_coding`` for each of the codec's choices (2: the smaller of the two).
_INDEX_CODINGS_NATIVE = {"fixed": 0, "rice": 1, "auto": 2}
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
    index_param: int | None = None,
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
    return struct.pack(f"<BB{nd}I", mode, nd, *chunk_shape) + _TAIL.pack(
        k, index_param, value_bits, index_coding, pad_count
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


#: The records this process's codecs wrote, by ``id``: ``(weak reference to the record, device, arrays)``,
#: ``arrays`` the stacked ``(idx, levels, scales, mins)`` the record was coded from, its rows and plan.
#: Parsing a record's bytes gives exactly these; :func:`gradwire.codecs.dct_parse.own_records_trusted`
#: lets a caller that hands back its own untouched records skip the parse (a sharded owner's own pieces).
_OWN_RECORDS: dict[int, tuple] = {}


def _remember_own(entry: Entry, payload, rows: slice, plan: _dct.ChunkPlan, k: int) -> None:
    key = id(entry)
    # The callback runs as the record dies, before its id can name another object.
    _OWN_RECORDS[key] = (
        weakref.ref(entry, lambda _ref, key=key: _OWN_RECORDS.pop(key, None)),
        payload[1].device,
        (payload, rows, plan, k),
    )


def own_record_arrays(entry: Entry, device: torch.device):
    """``(plan, k, idx, levels, scales, mins)`` of a record this process's DCT codec wrote, as it kept them
    (idx int64, levels int16, on ``device``); ``None`` for any other record or device."""
    got = _OWN_RECORDS.get(id(entry))
    if got is None or got[0]() is not entry or got[1].type != device.type:
        return None
    if device.index is not None and got[1].index is not None and device.index != got[1].index:
        return None
    (idx, levels, scales, mins), rows, plan, k = got[2]
    return (
        plan,
        k,
        idx[rows].to(torch.int64),
        levels[rows].to(torch.int16),
        scales[rows].to(torch.float32),
        mins[rows].to(torch.float32),
    )


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


@functools.lru_cache(maxsize=4096)
def _plan(shape: tuple[int, ...], mode: int, chunk_shape: tuple[int, ...]) -> _dct.ChunkPlan:
    numel = math.prod(shape)
    if mode == _dct.MODE_TILES:
        if numel == 0:
            # Mode 1 needs an element; an empty tensor goes as an (empty) mode-0 record.
            return _dct.plan_flat(shape, (1,))
        # Where tiles would be small (a prime dimension), flat chunks of chunk_shape (mode 0).
        return _dct.plan_tiles_or_flat(shape, chunk_shape)
    return _dct.plan_flat(shape, chunk_shape)


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


def index_stream_sizes(idx: np.ndarray, c: int) -> dict[int, tuple[int, int | None]]:
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
        chunk_shape: int | Sequence[int] = (64, 64),
        topk: int = 32,
        mode: str | int = "flat",
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
        """How a tensor of ``shape`` is cut into chunks by this codec (a frozen plan, memoized: a step asks
        for the same shapes' plans several times, and a plan of 64×64 tiles took 30 µs to work out)."""
        return _plan(tuple(int(d) for d in shape), self.mode, tuple(self.chunk_shape))

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        rec.check_float_input(tensor)
        x = tensor.detach()
        plan = self.plan(x.shape)
        coeffs = _dct.encode_chunks(x.to(torch.float32), plan)
        entry, kept = self.compress_coefficients(coeffs, plan, name, tensor.dtype)
        return entry, kept.decode().to(tensor.dtype)

    def compress_coefficients(
        self, coeffs: torch.Tensor, plan: _dct.ChunkPlan, name: str = "", dtype: torch.dtype = torch.float32
    ) -> tuple[Entry, KeptCoefficients]:
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
            raise ValueError(
                f"tensor {name!r}: expected ({plan.num_chunks}, {c}) coefficients, got {tuple(coeffs.shape)}"
            )
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
        return (
            cls.compress is DCTCodec.compress
            and cls.compress_bundle is DCTCodec.compress_bundle
            and cls.compress_batched is DCTCodec.compress_batched
        )

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
        coefficient_groups = []
        for dims, members in groups.items():
            c = members[0][2].chunk_numel
            if exact_only and not _chunkwise_on_cpu(dims):
                # The matrix route's last bits could follow the batch's size: each tensor's transform on
                # its own, as compress runs it; selection, quantization and decode work chunk by chunk.
                coeffs = torch.cat([_dct.encode_chunks(t.detach().to(torch.float32), plan) for _, t, plan in members])
            else:
                chunks = _dct.cut_into_chunks(members, dims, c)
                coeffs = _dct.dct_chunks(chunks.reshape(-1, *dims), overwrite=True).reshape(-1, c)
            coefficient_groups.append(([(name, t.dtype, plan) for name, t, plan in members], coeffs))
        done, _ = self.compress_coefficient_groups(coefficient_groups)
        for name, (entry, recon) in done.items():
            dtype = tensors[name].dtype
            out[name] = (entry, recon if recon.dtype == dtype else recon.to(dtype))
        return {name: out[name] for name in tensors}

    def compress_coefficient_groups(self, groups):
        """The records of tensors whose DCT coefficients are given, many at once: ``groups`` is a list of
        ``(members, coeffs)``, ``members`` ``[(name, dtype, plan)]`` of one chunk shape, each ``plan`` this
        codec's for its tensor, and ``coeffs`` their coefficients stacked in that order ``(rows, C)``
        (float32). Returns ``({name: (record, its exact decode, float32)}, kept)``, ``kept`` per group the
        stacked ``(idx, levels, scales, mins)`` of what the records keep.

        One top-k, one quantization, one host copy and (on the CPU, for small records) one exact decode per
        group, where :meth:`compress_coefficients` runs them per tensor: each works row by row (chunk by
        chunk), so every record and decode is byte for byte :meth:`compress_coefficients`'s.
        """
        pending, kept = [], []
        for members, coeffs in groups:
            dims = members[0][2].chunk_shape
            c = members[0][2].chunk_numel
            k = self.chunk_topk(c)
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
                recons = _dct.put_back_chunks(decoded.reshape(-1, c), members, dims)
            else:
                decoded = _dct.decode_level_chunks(idx, levels, scales, mins, dims)
                recons = _dct.put_back_chunks(decoded.reshape(-1, c), members, dims)
            pending.append((members, k, c, (idx, levels, scales, mins), recons))
            kept.append((idx, levels, scales, mins))
        # Every group's payload crosses to the host at once: one copy on a GPU (see _to_host_all).
        hosts = self._to_host_all([(payload, c) for _, _, c, payload, _ in pending])
        records, recons_of = [], {}
        for (members, k, _c, _, recons), (idx_h, levels_h, scales_h, mins_h) in zip(pending, hosts):
            row = 0
            for (name, dtype, plan), recon in zip(members, recons):
                rows = slice(row, row + plan.num_chunks)
                row += plan.num_chunks
                records.append(
                    (name, dtype, plan, k, idx_h[rows], levels_h[rows].reshape(-1), scales_h[rows], mins_h[rows])
                )
                recons_of[name] = recon
        # Every record's positions and values coded in ONE native call (GIL released).
        entries = self._records(records)
        row_of = {}
        for members, k, _, payload, _ in pending:
            row = 0
            for name, _, plan in members:
                row_of[name] = (payload, slice(row, row + plan.num_chunks), plan, k)
                row += plan.num_chunks
        for e in entries:
            _remember_own(e, *row_of[e.name])
        return {e.name: (e, recons_of[e.name]) for e in entries}, kept

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
            parts += [
                idx.to(torch.int16 if c <= (1 << 15) else torch.int32),
                values,
                scales.to(torch.float32),
                mins.to(torch.float32),
            ]
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
            arrays.append(blob[start : start + t.numel() * dtype.itemsize].view(dtype).reshape(tuple(t.shape)))
        return [tuple(arrays[4 * g : 4 * g + 4]) for g in range(len(groups))]

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

    def _record(
        self,
        name: str,
        dtype: torch.dtype,
        plan: _dct.ChunkPlan,
        k: int,
        idx_host: np.ndarray,
        values: np.ndarray,
        scales_host: np.ndarray,
        mins_host: np.ndarray,
    ) -> Entry:
        """The record of ``plan``'s chunks from their host arrays (see :meth:`_to_host`)."""
        return self._records([(name, dtype, plan, k, idx_host, values, scales_host, mins_host)])[0]

    def _records(self, records) -> list[Entry]:
        """The records of ``(name, dtype, plan, k, positions, values, scales, mins)`` host arrays (see
        :meth:`_to_host`): every record's positions coded (packed, Rice or the smaller, as the codec says)
        and its values packed below a byte by one native call, ``_native.dct_payloads``, the GIL released.
        ``ValueError`` naming the first tensor whose scales or minimums are not finite, before any coding."""
        for name, _, _, _, _, _, scales_host, mins_host in records:
            if not (np.isfinite(scales_host).all() and np.isfinite(mins_host).all()):
                raise ValueError(f"tensor {name!r} holds non-finite values (or values too large for float32)")
        if not records:
            return []
        layouts = np.array(
            [(plan.num_chunks, k, plan.chunk_numel) for _, _, plan, k, *_ in records], dtype=np.uint64
        ).reshape(-1)
        positions = np.concatenate([np.asarray(r[4]).reshape(-1) for r in records]).astype(np.uint32, copy=False)
        packs = self.value_bits != VALUE_BITS
        levels = (
            np.concatenate([np.asarray(r[5]).reshape(-1) for r in records]).astype(np.uint32, copy=False)
            if packs
            else np.empty(0, dtype=np.uint32)
        )
        coded = _native.dct_payloads(
            positions, levels, layouts, _INDEX_CODINGS_NATIVE[self.index_coding], self.value_bits
        )
        out = []
        for (name, dtype, plan, k, _, values, scales_host, mins_host), (coding, param, idx_bytes, val) in zip(
            records, coded
        ):
            out.append(
                Entry(
                    name=name,
                    codec=self.codec_id,
                    dtype=dtype,
                    shape=plan.shape,
                    params=pack_params(
                        plan.mode,
                        plan.chunk_shape,
                        k,
                        plan.pad_count,
                        index_coding=coding,
                        index_param=param,
                        value_bits=self.value_bits,
                    ),
                    sections={
                        "idx": np.frombuffer(idx_bytes, dtype=np.uint8),
                        "val": np.frombuffer(val, dtype=np.uint8) if packs else values,
                        "scale": scales_host.astype(np.float32, copy=False),
                        "min": mins_host.astype(np.float32, copy=False),
                    },
                    section_elems={},
                )
            )
        return out

    def __repr__(self) -> str:
        extra = ""
        if self.index_coding != "fixed":
            extra += f", index_coding={self.index_coding!r}"
        if self.value_bits != VALUE_BITS:
            extra += f", value_bits={self.value_bits}"
        if self.topk_scaling != "fixed":
            extra += f", topk_scaling={self.topk_scaling!r}"
        return f"DCTCodec(chunk_shape={self.chunk_shape}, topk={self.topk}, mode={_MODE_NAMES[self.mode]!r}{extra})"


#: Mean elements per record from which :meth:`DCTCodec.compress_batched` decodes a CPU group record by record
#: (into each tensor's own layout, no put-back pass) rather than stacked (one call for many small records).
_CPU_STACKED_DECODE_MAX = 1 << 18


def _chunkwise_on_cpu(dims: Sequence[int]) -> bool:
    """Whether the CPU transform of chunks of ``dims`` is the Rust one (2-D, sides powers of two up to
    ``MATMUL_MAX_N``), which works chunk by chunk whatever the batch."""
    return len(dims) == 2 and all(0 < n <= _dct.MATMUL_MAX_N and n & (n - 1) == 0 for n in dims)
