"""The DCT top-k codec (id 1), the write side: Panthalia's chunked DCT (mode 0) and DeMo's tiles (mode 1).

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

The codec also answers what the layers above ask of a codec's records before they exist
(:class:`~gradwire.codecs.base.Codec`): how a tensor may be cut into parts whose records are the whole
tensor's (:meth:`DCTCodec.cut`), about how many bytes its records spend per element
(:meth:`DCTCodec.bytes_per_element`), its flat twin for a model record's vector
(:meth:`DCTCodec.flat_vector_codec`), its coefficient domain for re-encoding a mean
(:meth:`DCTCodec.coefficient_domain`), and what it kept of the records it wrote
(:meth:`DCTCodec.own_records`).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from .. import _native, wire
from ..codecs import record as rec
from ..codecs.base import Codec, TensorPart
from ..frame import ELEM_F32, ELEM_I8, ELEM_U8, Entry, RecordTemplate
from .chunks import MODE_FLAT, MODE_TILES, ChunkPlan, cut_into_chunks, plan_flat, plan_tiles_or_flat, put_back_chunks
from .decode import decode_level_chunks, decode_levels, subtract_decoded_levels
from .domain import CoefficientDomain
from .layout import (
    CODEC_ID,
    INDEX_CODING_FIXED,
    INDEX_CODING_RICE,
    MAX_CHUNK_NDIM,
    MAX_CHUNK_NUMEL,
    MAX_CHUNK_SIDE,
    MODE_NAMES,
    MODES,
    VALUE_BITS,
    VALUE_BITS_CHOICES,
    index_bits_for,
    pack_params,
)
from .parse import ParseCache, ParsedRecord
from .quantize import quantize_levels, select_topk
from .transform import dct_chunks, encode_chunks, native_tiles

__all__ = ["DCTCodec"]

_INDEX_CODINGS = {"fixed": INDEX_CODING_FIXED, "rice": INDEX_CODING_RICE}
#: ``_native.dct_payloads``'s ``index_coding`` for each of the codec's choices (2: the smaller of the two).
_INDEX_CODINGS_NATIVE = {"fixed": 0, "rice": 1, "auto": 2}
_TOPK_SCALINGS = ("fixed", "proportional")
#: Mean elements per record from which :meth:`DCTCodec.compress_batched` decodes a CPU group record by record
#: (into each tensor's own layout, no put-back pass) rather than stacked (one call for many small records).
_CPU_STACKED_DECODE_MAX = 1 << 18


class _WrittenRecords:
    """The records one codec wrote, by object: ``{id: (weak reference, stacked (idx, levels, scales, mins),
    rows, plan, k)}``, the arrays those its record was coded from. An entry leaves as its record dies,
    before its id can name another object. A copy of the codec (``copy.deepcopy``, pickling) has written
    nothing: it starts empty."""

    def __init__(self):
        self.by_id: dict[int, tuple] = {}

    def add(self, entry: Entry, payload, rows: slice, plan: ChunkPlan, k: int) -> None:
        key, by_id = id(entry), self.by_id
        by_id[key] = (weakref.ref(entry, lambda _ref, key=key: by_id.pop(key, None)), payload, rows, plan, k)

    def get(self, entry: Entry):
        got = self.by_id.get(id(entry))
        return None if got is None or got[0]() is not entry else got[1:]

    def __deepcopy__(self, memo) -> _WrittenRecords:
        return _WrittenRecords()

    def __reduce__(self):
        return (_WrittenRecords, ())


@functools.lru_cache(maxsize=4096)
def _plan(shape: tuple[int, ...], mode: int, chunk_shape: tuple[int, ...]) -> ChunkPlan:
    if mode == MODE_TILES:
        if math.prod(shape) == 0:
            # Mode 1 needs an element; an empty tensor goes as an (empty) mode-0 record.
            return plan_flat(shape, (1,))
        # Where tiles would be small (a prime dimension), flat chunks of chunk_shape (mode 0).
        return plan_tiles_or_flat(shape, chunk_shape)
    return plan_flat(shape, chunk_shape)


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

    codec_id = CODEC_ID
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
        c = math.prod(chunk_shape)
        if c > MAX_CHUNK_NUMEL or max(chunk_shape) > MAX_CHUNK_SIDE:
            raise ValueError(
                f"chunk_shape {chunk_shape} must have at most 2^16 elements and sides of at most {MAX_CHUNK_SIDE}"
            )
        if isinstance(mode, str):
            if mode not in MODES:
                raise ValueError(f"mode must be 'flat' or 'tiles', got {mode!r}")
            mode = MODES[mode]
        elif mode not in MODE_NAMES:
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
        self._written = _WrittenRecords()

    def chunk_topk(self, chunk_numel: int) -> int:
        """How many coefficients a chunk of ``chunk_numel`` elements keeps (see ``topk_scaling``)."""
        if self.topk_scaling == "proportional":
            return min(chunk_numel, max(1, round(self.topk * chunk_numel / self._full_chunk_numel)))
        return min(self.topk, chunk_numel)

    def plan(self, shape: Sequence[int]) -> ChunkPlan:
        """How a tensor of ``shape`` is cut into chunks by this codec (a frozen plan, memoized: a step asks
        for the same shapes' plans several times, and a plan of 64×64 tiles took 30 µs to work out)."""
        return _plan(tuple(int(d) for d in shape), self.mode, tuple(self.chunk_shape))

    # -- what the layers above ask of the records before they exist (Codec's write side) -------------

    def cut(self, shape: Sequence[int], max_numel: int) -> list[TensorPart]:
        """Parts of at most about ``max_numel`` elements, cut by this codec's chunk plan (:meth:`plan`) and
        only where each part gets exactly the whole tensor's chunks, so its record carries what the whole
        tensor's would have for those elements (:meth:`Codec.cut <gradwire.codecs.base.Codec.cut>`):

        - flat chunks (mode 0: a flat-mode codec, a model record, or a tile-mode codec's fallback for small
          tiles — the latter kept whole, since a 1-D part of it would get tiles): the flattened tensor is
          cut at multiples of the chunk size ``C``, each part 1-D; only the last part is padded, as the
          whole tensor is;
        - tiles (mode 1): blocks of rows, each a multiple of the tile's rows, checked with the codec's own
          plan to get tiles of the same shape (with a tile side below 64 — a 1000-row matrix has 50-row
          tiles — a 300-row block would get 60-row tiles, so such sizes are skipped).
        """
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        max_numel = max(1, int(max_numel))
        whole = [TensorPart(0, numel, shape)]
        if numel <= max_numel:
            return whole
        plan = self.plan(shape)
        if plan.mode == MODE_FLAT:
            c = plan.chunk_numel
            step = max(1, max_numel // c) * c
            out = []
            for lo in range(0, numel, step):
                hi = min(numel, lo + step)
                part = self.plan((hi - lo,))
                # A tile-mode codec's fallback stays whole: its 1-D parts would be tiled, not chunked flat.
                if part.mode != MODE_FLAT or part.chunk_shape != plan.chunk_shape:
                    return whole
                out.append(TensorPart(lo, hi, (hi - lo,)))
            return out if len(out) > 1 else whole
        rows = shape[0] if shape else 1
        unit = plan.chunk_shape[0]  # rows of a tile (elements of a vector's tile)
        row_numel = numel // rows
        units = rows // unit
        if units * unit != rows:
            return whole

        def block(k: int) -> tuple[int, ...]:
            return (k * unit, *shape[1:])

        def same_tiles(k: int) -> bool:
            part = self.plan(block(k))
            return (
                part.mode == plan.mode
                and part.chunk_shape == plan.chunk_shape
                and part.pad_count == 0
                and part.grid[1:] == plan.grid[1:]
            )

        target = max(1, max_numel // (unit * row_numel))
        out = []
        at = 0
        while at < units:
            k = min(target, units - at)
            while k > 1 and not same_tiles(k):
                k -= 1
            if not same_tiles(k):
                return whole
            out.append(TensorPart(at * unit * row_numel, (at + k) * unit * row_numel, block(k)))
            at += k
        return out if len(out) > 1 else whole

    def bytes_per_element(self) -> float:
        """About what a record spends per element of its tensor, headers aside: each chunk's ``k`` values at
        ``value_bits`` and positions (packed, or Rice-coded gaps at about ``log2(C/k) + 2`` bits, whichever
        is smaller), and a float32 scale and minimum per chunk, over the chunk's ``C`` elements."""
        c = math.prod(self.chunk_shape)
        k = self.chunk_topk(c)
        index_bits = min(max(1, math.ceil(math.log2(c))), math.log2(c / k) + 2)
        return (k * (self.value_bits + index_bits) / 8 + 8) / c

    def flat_vector_codec(self) -> DCTCodec:
        """A tile-mode codec's flat-mode twin (chunks of its ``chunk_shape``: the tiles of a vector would be
        64 elements long); a flat-mode codec itself."""
        if self.mode != MODE_TILES:
            return self
        return DCTCodec(
            self.chunk_shape, self.topk, "flat", self.index_coding, self.value_bits, topk_scaling=self.topk_scaling
        )

    def coefficient_domain(self) -> CoefficientDomain:
        """The codec's DCT coefficient domain, where a weighted mean of records cut as this codec cuts is
        summed and re-encoded without decoding them (:class:`~gradwire.dct.domain.CoefficientDomain`)."""
        return CoefficientDomain(self)

    def own_records(self, entries, device=None) -> ParseCache:
        """A parse cache holding those of ``entries`` this codec wrote (the very record objects, untouched
        since) as it kept them — exactly what parsing their bytes gives, on ``device`` — for a caller that
        hands its own records back to a reader (a sharded owner averaging its own pieces' records with the
        other ranks'). Any other record, a copy of one of these or the same bytes read back included, is
        not in it: :func:`~gradwire.dct.parse.parse_record` parses it as hostile input."""
        dev = torch.device("cpu") if device is None else torch.device(device)
        cache = ParseCache()
        for entry in entries:
            got = self._written.get(entry)
            if got is None:
                continue
            (idx, levels, scales, mins), rows, plan, k = got
            lv = levels[rows].to(device=dev, dtype=torch.int16)
            sc = scales[rows].to(device=dev, dtype=torch.float32)
            mn = mins[rows].to(device=dev, dtype=torch.float32)
            idx_t = idx[rows].to(device=dev, dtype=torch.int64)
            cache.add(entry, dev, ParsedRecord(plan, k, idx_t, lv, sc, mn))
        return cache

    def _record_params(self, plan: ChunkPlan, k: int, coding: int, param: int | None) -> bytes:
        """The ``params`` of this codec's record of a tensor cut by ``plan``, keeping ``k`` per chunk, its positions
        coded by ``coding`` with ``param``."""
        return pack_params(
            plan.mode,
            plan.chunk_shape,
            k,
            plan.pad_count,
            index_coding=coding,
            index_param=param,
            value_bits=self.value_bits,
        )

    def record_template(self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> RecordTemplate:
        """The record this codec writes for a tensor ``name`` of ``shape`` and ``dtype``, but its payloads
        (:meth:`Codec.record_template <gradwire.codecs.base.Codec.record_template>`): its plan's chunks and
        ``k``, sections ``idx``, ``val``, ``scale``, ``min``. Exact with ``index_coding="fixed"``. Rice's
        parameter is the data's best one, so it is predicted: the parameter
        :func:`~gradwire.wire.rice_param_estimate` gives for ``k`` random positions of ``C`` (where the
        search for the best parameter starts, and stays on a tie), and with ``"auto"`` Rice only where its
        expected bits per position, ``p + 1 + gap / 2^p``, are below the packed width. A record whose
        parameter turns out otherwise carries its own params (about 27 bytes more, still no name or
        shape)."""
        plan = self.plan(shape)
        c = plan.chunk_numel
        k = self.chunk_topk(c)
        coding, param = INDEX_CODING_FIXED, None
        if self.index_coding != "fixed" and k > 0:
            p = wire.rice_param_estimate(k, c)
            rice_bits = p + 1 + (c - k) / (k + 1) / 2**p
            if self.index_coding == "rice" or rice_bits < index_bits_for(c):
                coding, param = INDEX_CODING_RICE, p
        params = self._record_params(plan, k, coding, param)
        val = ELEM_U8 if self.value_bits != VALUE_BITS else ELEM_I8
        sections = (("idx", ELEM_U8), ("val", val), ("scale", ELEM_F32), ("min", ELEM_F32))
        return RecordTemplate(name, self.codec_id, dtype, plan.shape, params, sections)

    # -- encoding ---------------------------------------------------------------------------------

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        rec.check_float_input(tensor)
        x = tensor.detach()
        plan = self.plan(x.shape)
        coeffs = encode_chunks(x.to(torch.float32), plan)
        entry, kept = self.compress_coefficients(coeffs, plan, name, tensor.dtype)
        return entry, kept.decode().to(tensor.dtype)

    def compress_coefficients(
        self, coeffs: torch.Tensor, plan: ChunkPlan, name: str = "", dtype: torch.dtype = torch.float32
    ) -> tuple[Entry, ParsedRecord]:
        """The record of a tensor whose DCT coefficients ``coeffs`` ``(num_chunks, C)`` (float32, cut by
        ``plan``, which must be :meth:`plan` of the tensor's shape) are given rather than computed, tagged
        ``dtype``; with what it keeps (a :class:`~gradwire.dct.ParsedRecord`, exactly what parsing the record's
        bytes gives: its exact decode is what receivers get).

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
        idx, top = select_topk(coeffs, k)
        levels, scales, mins = quantize_levels(top, self.value_bits)
        # Only the compact payload crosses to the host.
        idx_h, values_h, scales_h, mins_h = self._to_host_all([((idx, levels, scales, mins), c)])[0]
        (entry,) = self._records([(name, dtype, plan, k, idx_h, values_h.reshape(-1), scales_h, mins_h)])
        self._written.add(entry, (idx, levels, scales, mins), slice(0, plan.num_chunks), plan, k)
        return entry, ParsedRecord(plan, k, idx, levels, scales, mins)

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
        out: dict[str, tuple[Entry, torch.Tensor]] = {}
        filled = {}
        for name, tensor in tensors.items():
            rec.check_float_input(tensor)
            if tensor.numel() == 0:  # an empty record of its own, written on the host: no data to copy
                entry, _ = self.compress(torch.empty(tensor.shape, dtype=tensor.dtype), name)
                out[name] = (entry, torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device))
                continue
            filled[name] = tensor
        coefficient_groups = self._coefficient_groups(filled, exact_only)
        done, _ = self.compress_coefficient_groups(coefficient_groups)
        for name, (entry, recon) in done.items():
            dtype = tensors[name].dtype
            out[name] = (entry, recon if recon.dtype == dtype else recon.to(dtype))
        return {name: out[name] for name in tensors}

    def compress_bundle_keep_rest(self, tensors):
        """As :meth:`Codec.compress_bundle_keep_rest`; on the CPU, for contiguous float32 tensors, the records
        are :meth:`compress_bundle`'s byte for byte and each tensor's rest is its exact decode subtracted
        straight into it (:func:`~gradwire.dct.decode.subtract_decoded_levels`, one Rust pass per record
        where the decode takes the folded route): the bits of ``tensor − reconstruction``, with no
        reconstruction written out and no pass of its own for the subtraction. Other tensors take
        :meth:`Codec.compress_bundle_keep_rest`'s default, as one bundle of their own."""
        native = type(self).compress is DCTCodec.compress and type(self).compress_bundle is DCTCodec.compress_bundle
        mine, others = {}, {}
        for name, tensor in tensors.items():
            cpu = tensor.device.type == "cpu" and tensor.dtype == torch.float32
            (mine if native and cpu and tensor.is_contiguous() and tensor.numel() > 0 else others)[name] = tensor
        done = super().compress_bundle_keep_rest(others) if others else {}
        if mine:
            coefficient_groups = self._coefficient_groups(mine, exact_only=True)
            records, kept = self.compress_coefficient_groups(coefficient_groups, decode=False)
            for (members, _), (idx, levels, scales, mins) in zip(coefficient_groups, kept):
                row = 0
                for name, _, plan in members:
                    rows = slice(row, row + plan.num_chunks)
                    row += plan.num_chunks
                    part = (idx[rows], levels[rows], scales[rows], mins[rows])
                    if not subtract_decoded_levels(mine[name], *part, plan):
                        mine[name].sub_(decode_levels(*part, plan))
                done.update((name, records[name][0]) for name, _, _ in members)
        return {name: done[name] for name in tensors}

    def _coefficient_groups(self, tensors, exact_only: bool) -> list[tuple[list, torch.Tensor]]:
        """:meth:`compress_batched`'s ``(members, coefficients)`` per chunk shape of ``tensors`` (none empty):
        the chunks cut by one ``_foreach_copy_`` per shape and transformed together (with ``exact_only``,
        tensor by tensor where the transform is not the Rust one, as :meth:`compress_batched` says)."""
        groups: dict[tuple[int, ...], list[tuple[str, torch.Tensor, ChunkPlan]]] = {}
        for name, tensor in tensors.items():
            rec.check_float_input(tensor)
            plan = self.plan(tensor.shape)
            groups.setdefault(plan.chunk_shape, []).append((name, tensor, plan))
        coefficient_groups = []
        for dims, members in groups.items():
            c = members[0][2].chunk_numel
            if exact_only and not native_tiles(dims):
                # The matrix route's last bits could follow the batch's size: each tensor's transform on
                # its own, as compress runs it; selection, quantization and decode work chunk by chunk.
                coeffs = torch.cat([encode_chunks(t.detach().to(torch.float32), plan) for _, t, plan in members])
            else:
                chunks = cut_into_chunks(members, dims, c)
                coeffs = dct_chunks(chunks.reshape(-1, *dims), overwrite=True).reshape(-1, c)
            coefficient_groups.append(([(name, t.dtype, plan) for name, t, plan in members], coeffs))
        return coefficient_groups

    def compress_coefficient_groups(self, groups, decode: bool = True):
        """The records of tensors whose DCT coefficients are given, many at once: ``groups`` is a list of
        ``(members, coeffs)``, ``members`` ``[(name, dtype, plan)]`` of one chunk shape, each ``plan`` this
        codec's for its tensor, and ``coeffs`` their coefficients stacked in that order ``(rows, C)``
        (float32). Returns ``({name: (record, its exact decode, float32)}, kept)``, ``kept`` per group the
        stacked ``(idx, levels, scales, mins)`` of what the records keep. ``decode=False``: no exact decode
        is run and each record's decode is ``None`` (the caller forms what it needs from ``kept``).

        One top-k, one quantization, one host copy and (on the CPU, for small records) one exact decode per
        group, where :meth:`compress_coefficients` runs them per tensor: each works row by row (chunk by
        chunk), so every record and decode is byte for byte :meth:`compress_coefficients`'s.
        """
        pending, kept = [], []
        for members, coeffs in groups:
            dims = members[0][2].chunk_shape
            c = members[0][2].chunk_numel
            k = self.chunk_topk(c)
            idx, top = select_topk(coeffs, k)
            levels, scales, mins = quantize_levels(top, self.value_bits)
            if not decode:
                recons = [None] * len(members)
            elif coeffs.device.type == "cpu" and coeffs.numel() >= _CPU_STACKED_DECODE_MAX * len(members):
                # Large records: the Rust decode, record by record as compress runs it, writes a matrix's
                # tiles in place (no put-back pass over memory) and each call is one native pass.
                recons, row = [], 0
                for _, _, plan in members:
                    rows = slice(row, row + plan.num_chunks)
                    row += plan.num_chunks
                    recons.append(decode_levels(idx[rows], levels[rows], scales[rows], mins[rows], plan))
            elif coeffs.device.type == "cpu":
                # Many small records: one Rust decode of all their chunks (taken as one flat record of
                # them; each chunk is decoded on its own, exactly: the same bits) and one put-back copy,
                # rather than a call per record.
                stacked = plan_flat((coeffs.shape[0] * c,), dims)
                decoded = decode_levels(idx, levels.to(torch.int16), scales, mins, stacked)
                recons = put_back_chunks(decoded.reshape(-1, c), members, dims)
            else:
                decoded = decode_level_chunks(idx, levels, scales, mins, dims)
                recons = put_back_chunks(decoded.reshape(-1, c), members, dims)
            pending.append((members, k, c, (idx, levels, scales, mins), recons))
            kept.append((idx, levels, scales, mins))
        # Every group's payload crosses to the host at once: one copy on a GPU (see _to_host_all).
        hosts = self._to_host_all([(payload, c) for _, _, c, payload, _ in pending])
        records, recons_of = [], {}
        for (members, k, _, _, recons), (idx_h, levels_h, scales_h, mins_h) in zip(pending, hosts):
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
            self._written.add(e, *row_of[e.name])
        return {e.name: (e, recons_of[e.name]) for e in entries}, kept

    def _wire_arrays(self, idx, levels, scales, mins, c: int) -> tuple[torch.Tensor, ...]:
        """``(positions, values, scales, mins)`` in the types the record's host arrays take, on their device:
        positions int16 (int32 above 2^15 elements a chunk), values int8 at 8 bits (else the levels as int32,
        packed per record by :meth:`_records`), scales and minimums float32."""
        values = (levels - 128).to(torch.int8) if self.value_bits == VALUE_BITS else levels.to(torch.int32)
        positions = idx.to(torch.int16 if c <= (1 << 15) else torch.int32)
        return positions, values, scales.to(torch.float32), mins.to(torch.float32)

    def _to_host_all(self, groups) -> list[tuple[np.ndarray, ...]]:
        """:meth:`_wire_arrays` of each ``((idx, levels, scales, mins), c)`` as numpy arrays. Off the CPU the
        arrays of every group are laid end to end as bytes on the device (each padded to 8 bytes, so every
        array stays aligned) and copied to the host in ONE transfer, then cut back into typed views: one
        device-to-host copy per exchange phase whatever the number of tensors or chunk shapes."""
        parts = [t for payload, c in groups for t in self._wire_arrays(*payload, c)]
        if not parts or parts[0].device.type == "cpu":
            arrays = [t.numpy() for t in parts]
        else:
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

    def _records(self, records) -> list[Entry]:
        """The records of ``(name, dtype, plan, k, positions, values, scales, mins)`` host arrays (see
        :meth:`_to_host_all`): every record's positions coded (packed, Rice or the smaller, as the codec says)
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
                    params=self._record_params(plan, k, coding, param),
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
        return f"DCTCodec(chunk_shape={self.chunk_shape}, topk={self.topk}, mode={MODE_NAMES[self.mode]!r}{extra})"
