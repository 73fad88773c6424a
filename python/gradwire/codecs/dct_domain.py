"""DCT records in their coefficient domain: the DCT is linear and orthonormal, so sums, L2 norms and
inner products of decoded tensors are those of the records' coefficients.

:class:`DCTAccumulator` adds records coefficient by coefficient and runs one inverse transform at the
end (the server's AdamW runs, the DDP hook on a GPU); :func:`dct_record_norm` and
:func:`dct_record_coefficients` read a record's norm and sparse coordinates without a dense decode (the
server's validation, the aggregation rules' direction checks, the sender histories).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import _native
from .. import dct as _dct
from ..accumulate import Coefficients
from ..frame import Entry, decode_entry
from . import record as rec
from .dct import DCTCodec
from .dct_parse import _CODEC, _check_params, _check_sections, decode_parsed, parse_record

__all__ = ["DCTAccumulator", "dct_accumulator", "dct_record_coefficients", "dct_record_norm"]


class DCTAccumulator:
    """A weighted sum of DCT records of one tensor, added coefficient by coefficient.

    The DCT is linear and orthonormal, so the sum of decoded records is the inverse transform of the
    summed coefficients: records with the first record's layout (same mode, chunk shape, padding) are
    added into one ``(num_chunks, C)`` float32 array and :meth:`finish` runs one inverse transform.
    Records with another layout are decoded densely into a side sum. Each record's positions are
    distinct, so its addition is a gather, an add and a scatter with no colliding writes: the same
    records added in the same order give bit-identical sums on any device (no atomics).
    """

    def __init__(self, first: Entry, device: torch.device | None = None):
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.shape = tuple(first.shape)
        self.plan: _dct.ChunkPlan | None = None
        self.coeffs: torch.Tensor | None = None  # (num_chunks * C,) float32
        self.side: torch.Tensor | None = None  # dense sum of records of another layout
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
            self.coeffs = torch.zeros(
                parsed.plan.num_chunks * parsed.plan.chunk_numel, dtype=torch.float32, device=self.device
            )
        if parsed.plan != self.plan:
            self._add_dense(decode_parsed(parsed), weight)
            return
        c = self.plan.chunk_numel
        if self.device.type == "cpu":
            # One Rust pass, chunk row by chunk row: the same float32 operations as below.
            w32 = float(torch.tensor(float(weight), dtype=torch.float32))
            _native.scatter_add_rows(
                parsed.idx.contiguous().reshape(-1).numpy(),
                parsed.values.contiguous().reshape(-1).numpy(),
                parsed.k,
                c,
                w32,
                self.coeffs.numpy(),
            )
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
    rec.check_record_dtype(entry, _CODEC)
    plan, k, bits, value_bits, coding = _check_params(entry)
    _, levels, scale, mins = _check_sections(entry, plan, k, bits, value_bits, coding)
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
