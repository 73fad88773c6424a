"""DCT records in their coefficient domain: the DCT is linear and orthonormal, so sums, L2 norms and
inner products of decoded tensors are those of the records' coefficients.

Reading: :class:`DCTAccumulator` adds records coefficient by coefficient and runs one inverse transform at
the end (the server's AdamW runs, the DDP hook on a GPU); :func:`dct_record_norm` and
:func:`dct_record_coefficients` read a record's norm and sparse coordinates without a dense decode (the
server's validation, the aggregation rules' direction checks, the sender histories).

Writing: :class:`CoefficientDomain` is where a sender re-encodes a weighted mean of records cut as its
codec cuts them (:class:`gradwire.reencode.ReencodeFeedback`): the records' coefficients are summed into a
residual held as ``(num_chunks, C)`` coefficients and the sum is compressed from there, with no decode of
the records and no forward transform.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from .. import _native
from ..accumulate import Coefficients
from ..frame import Entry, decode_entry
from .chunks import ChunkPlan, from_chunks
from .layout import CODEC_ID
from .parse import ParseCache, ParsedRecord, checked_arrays, decode_parsed, parse_record
from .quantize import dequantize_levels
from .transform import dct_chunks, encode_chunks, idct_chunks

__all__ = [
    "CoefficientDomain",
    "DCTAccumulator",
    "add_records",
    "dct_accumulator",
    "dct_record_coefficients",
    "dct_record_norm",
    "joined",
]


def add_records(coeffs: torch.Tensor, parsed: Sequence[ParsedRecord], weights: Sequence[float]) -> None:
    """``coeffs += Σ wᵢ · parsed[i]`` in place, in order, ``coeffs`` the flat ``(num_chunks · C,)`` float32
    coefficients of the records' plan and each weight a float32 value: one rounded multiply and one
    rounded add per kept coefficient, a record at a time. A record's positions are distinct, so each
    addition is a gather, an add and a scatter with no colliding writes: the same records added in the
    same order give bit-identical sums on any device (no atomics)."""
    for p, w in zip(parsed, weights):
        c = p.plan.chunk_numel
        if coeffs.device.type == "cpu":
            # One Rust pass, chunk row by chunk row: the same float32 operations as below.
            _native.scatter_add_rows(
                p.idx.contiguous().reshape(-1).numpy(),
                p.values.contiguous().reshape(-1).numpy(),
                p.k,
                c,
                w,
                coeffs.numpy(),
            )
            continue
        flat = (p.idx + torch.arange(p.plan.num_chunks, device=coeffs.device).unsqueeze(1) * c).reshape(-1)
        vals = p.values.reshape(-1)
        if w != 1.0:
            vals = vals * w
        # index_select / index_copy_ rather than coeffs[flat] (advanced indexing is slow).
        coeffs.index_copy_(0, flat, coeffs.index_select(0, flat) + vals)


class DCTAccumulator:
    """A weighted sum of DCT records of one tensor, added coefficient by coefficient.

    The DCT is linear and orthonormal, so the sum of decoded records is the inverse transform of the
    summed coefficients: records with the first record's layout (same mode, chunk shape, padding) are
    added into one ``(num_chunks, C)`` float32 array and :meth:`finish` runs one inverse transform.
    Records with another layout are decoded densely into a side sum. The same records added in the same
    order give bit-identical sums on any device (:func:`add_records`).
    """

    def __init__(self, first: Entry, device: torch.device | None = None):
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.shape = tuple(first.shape)
        self.plan: ChunkPlan | None = None
        self.coeffs: torch.Tensor | None = None  # (num_chunks * C,) float32
        self.side: torch.Tensor | None = None  # dense sum of records of another layout
        self.count = 0

    def add(self, entry: Entry, weight: float = 1.0) -> None:
        if tuple(entry.shape) != self.shape:
            raise ValueError(f"record {entry.name!r} has shape {tuple(entry.shape)}, the sum has {self.shape}")
        if entry.codec != CODEC_ID:
            self._add_dense(decode_entry(entry, self.device), weight)
            return
        parsed = parse_record(entry, self.device)
        if self.plan is None:
            self.plan = parsed.plan
            self.coeffs = torch.zeros(
                parsed.plan.num_chunks * parsed.plan.chunk_numel, dtype=torch.float32, device=self.device
            )
        if parsed.plan != self.plan:
            self._add_dense(decode_parsed(parsed), weight)
            return
        add_records(self.coeffs, [parsed], [float(torch.tensor(float(weight), dtype=torch.float32))])
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
            out = from_chunks(idct_chunks(self.coeffs.reshape(n, *cs)), self.plan)
        if self.side is not None:
            out = self.side if out is None else out + self.side
        if out is None:
            return torch.zeros(self.shape, dtype=torch.float32, device=self.device)
        return out


def dct_accumulator(first: Entry, device: torch.device | None) -> DCTAccumulator:
    return DCTAccumulator(first, device)


def dct_record_norm(entry: Entry) -> float:
    """L2 norm of a DCT record from its coefficients alone (Parseval: the transform is orthonormal).

    Exact when the record has no padding (mode 1, or mode 0 with ``numel`` a multiple of ``C``). With
    mode-0 padding the inverse transform also spreads energy into the padded tail, which decoding drops,
    so this is then an upper bound on the decoded tensor's norm — the safe side for a norm ceiling or
    for clipping.
    """
    # The server validates every submission through here, so it stays in NumPy on the checked sections:
    # the same float32 coefficients as parse_record's, without building tensors.
    plan, k, _, levels, scale, mins = checked_arrays(entry)
    values = levels.reshape(plan.num_chunks, k).astype(np.float32) * scale[:, None] + mins[:, None]
    # Not np.dot: BLAS's threads cost more than this small sum.
    return math.sqrt(float(np.square(values, dtype=np.float64).sum()))


def dct_record_coefficients(entry: Entry) -> Coefficients:
    """A DCT record's kept coefficients as positions in its chunk plan's coefficient space (the transform
    is orthonormal, so inner products there are the decoded tensors' — exact without padding, as for
    :func:`dct_record_norm`)."""
    parsed = parse_record(entry)
    c = parsed.plan.chunk_numel
    flat = (parsed.idx + torch.arange(parsed.plan.num_chunks).unsqueeze(1) * c).reshape(-1)
    return Coefficients(
        ("dct", parsed.plan), parsed.plan.num_chunks * c, flat, parsed.values.reshape(-1).to(torch.float64)
    )


def joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` of ``(rows, C)`` buffers, as a view where they lie one after another in one
    storage (:meth:`gradwire.reencode.ReencodeFeedback` keeps a chunk shape's residuals so): no copy of
    the model's coefficients per round."""
    first = parts[0]
    if len(parts) == 1:
        return first
    at, rows = first.storage_offset(), 0
    storage = first.untyped_storage().data_ptr()
    for p in parts:
        if (
            p.dim() != 2
            or not p.is_contiguous()
            or p.untyped_storage().data_ptr() != storage
            or p.storage_offset() != at + rows * first.shape[1]
            or p.shape[1] != first.shape[1]
        ):
            return torch.cat(parts)
        rows += p.shape[0]
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1), at)


class CoefficientDomain:
    """A DCT codec's coefficient domain, where a sender re-encodes a weighted mean of records
    (:class:`gradwire.reencode.ReencodeFeedback`): a tensor of ``shape`` is held as the coefficients of
    its chunks as ``codec`` cuts them, ``(num_chunks, C)`` float32 (:meth:`layout`).

    It takes the records of a tensor that are float32 DCT records all cut as ``codec`` cuts it
    (:meth:`parse`); their weighted sum is added into a residual coefficient by coefficient
    (:meth:`add`), and each sum is compressed from its coefficients with what receivers get of it taken
    out (:meth:`compress`). The transform is linear and orthonormal, so this is the parameter-space error
    feedback in another orthonormal basis."""

    def __init__(self, codec):
        self.codec = codec

    def layout(self, shape: Sequence[int]) -> tuple[int, int]:
        """``(num_chunks, C)``: the coefficients of a tensor of ``shape``."""
        plan = self.codec.plan(shape)
        return plan.num_chunks, plan.chunk_numel

    def forward(self, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """The coefficients ``(num_chunks, C)`` (float32, a new tensor) of ``tensor``, which must have
        ``shape``."""
        return encode_chunks(tensor.to(torch.float32), self.codec.plan(shape)).contiguous()

    def inverse(self, coeffs: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """The float32 tensor of ``shape`` whose coefficients are ``coeffs`` (a float inverse transform)."""
        plan = self.codec.plan(shape)
        return from_chunks(idct_chunks(coeffs.reshape(plan.num_chunks, *plan.chunk_shape)), plan)

    def parse(
        self, entries: Sequence[Entry], device: torch.device, cache: ParseCache | None = None
    ) -> list[ParsedRecord] | None:
        """``entries`` (every sender's record of one tensor) parsed as hostile input (``cache``: see
        :func:`~gradwire.dct.parse.parse_record`), if this domain takes them: float32 DCT records all cut
        as the codec cuts the tensor; ``None`` otherwise."""
        if any(e.codec != CODEC_ID or e.dtype != torch.float32 for e in entries):
            return None
        plan = self.codec.plan(entries[0].shape)
        parsed = []
        for e in entries:
            p = parse_record(e, device, cache)
            if p.plan != plan:
                return None
            parsed.append(p)
        return parsed

    def add(self, coeffs: torch.Tensor, parsed: Sequence[ParsedRecord], weights: Sequence[float]) -> None:
        """``coeffs += Σ wᵢ · parsed[i]`` in place (:func:`add_records`; float32 weights). A mode-0 tensor's
        last chunk is then projected back onto the tensor (inverse transform, padding zeroed, forward
        transform), so no kept coefficient is spent on the padding no receiver applies."""
        add_records(coeffs.reshape(-1), parsed, weights)
        self.project_padding(coeffs, parsed[0].plan)

    @staticmethod
    def project_padding(coeffs: torch.Tensor, plan: ChunkPlan) -> None:
        """A mode-0 tensor's last chunk (of ``coeffs``, ``(num_chunks, C)``) projected back onto the tensor in
        place: inverse transform, padding zeroed, forward transform (nothing for a plan without padding)."""
        if plan.pad_count:
            c = plan.chunk_numel
            last = idct_chunks(coeffs[-1:].reshape(1, *plan.chunk_shape)).reshape(c)
            last[c - plan.pad_count :] = 0.0
            coeffs[-1] = dct_chunks(last.reshape(1, *plan.chunk_shape)).reshape(c)

    def compress(
        self, sums: Mapping[str, tuple[tuple[int, ...], torch.Tensor]]
    ) -> dict[str, tuple[Entry, torch.Tensor]]:
        """The records of ``{name: (shape, coefficients)}``, ``{name: (record, its exact decode, float32)}``;
        each buffer keeps what receivers do not get of it (the dequantized values of its kept coefficients
        leave it, in place). Buffers of one chunk shape go together: one top-k, quantization, host copy and
        exact decode per chunk shape (:meth:`gradwire.DCTCodec.compress_coefficient_groups`, whose records
        and decodes are byte for byte those of one buffer at a time)."""
        groups: dict[tuple[int, ...], list[tuple[str, torch.dtype, ChunkPlan]]] = {}
        for name, (shape, _) in sums.items():
            plan = self.codec.plan(shape)
            groups.setdefault(plan.chunk_shape, []).append((name, torch.float32, plan))
        items = [(members, joined([sums[n][1] for n, _, _ in members])) for members in groups.values()]
        done, kept = self.codec.compress_coefficient_groups(items)
        for (members, _), (idx, levels, scales, mins) in zip(items, kept):
            values = dequantize_levels(levels, scales, mins)
            row = 0
            for name, _, plan in members:
                rows = slice(row, row + plan.num_chunks)
                row += plan.num_chunks
                buf = sums[name][1]
                at = idx[rows].to(buf.device)
                buf.scatter_(1, at, buf.gather(1, at).sub_(values[rows].to(buf.device)))
        return done
