"""Sign codecs: 1-bit SGD (id 5, Seide et al. 2014) and signSGD / EF-signSGD (id 6, Bernstein et al.
2018; Karimireddy et al. 2019). FORMAT.md §5.6 and §5.7.

Both send one bit per element, packed eight per byte (LSB first, FORMAT.md §6): bit 1 means the value is
``>= 0`` (zeros count as non-negative), bit 0 that it is negative. They differ in what a bit decodes to:

- :class:`OneBit` views the tensor as a matrix ``(shape[0], numel / shape[0])`` (a vector as one
  column) and sends, per column, the mean of its non-negative entries and the mean of its negative
  entries; a bit decodes to its column's mean for its side. This is 1-bit SGD's reconstruction, and
  the method is meant to run with error feedback: ``ErrorFeedback(OneBit())``.
- :class:`SignSGD` sends one scale per tensor and a bit decodes to ``±scale``: ``scale="mean_abs"``
  sends ``mean |g|`` (EF-signSGD's ``‖g‖₁ / d``; use it as ``ErrorFeedback(SignSGD())``),
  ``scale="none"`` sends plain signs, ``±1`` (signSGD).

Bits are packed by the Rust kernel for CPU tensors and on the device for GPU tensors (the same bytes),
so only the packed bits and the scales cross to the host.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from .. import wire
from ..capabilities import CodecCapabilities, declare
from ..frame import Entry
from . import record as rec
from .base import Codec, TensorPart

__all__ = ["OneBit", "SignSGD", "pack_sign_bits", "unpack_sign_bits"]

_SIGN_PARAMS = struct.Struct("<B")  # scale_mode
_SCALE_MODES = {"none": 0, "mean_abs": 1}
_SCALE_NAMES = {v: k for k, v in _SCALE_MODES.items()}
_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_sign_bits(nonneg: torch.Tensor) -> np.ndarray:
    """A boolean tensor (any device) packed at one bit per element, LSB first, as uint8 bytes."""
    flat = nonneg.reshape(-1)
    if flat.device.type == "cpu":
        return np.frombuffer(wire.pack_bits(flat.numpy().view(np.uint8), 1), dtype=np.uint8)
    n = flat.numel()
    nbytes = -(-n // 8)
    padded = torch.zeros(nbytes * 8, dtype=torch.uint8, device=flat.device)
    padded[:n] = flat
    w = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=flat.device)
    return (padded.view(nbytes, 8) * w).sum(dim=1, dtype=torch.uint8).cpu().numpy()


def unpack_sign_bits(entry: Entry, codec: str, n: int) -> torch.Tensor:
    """The ``bits`` section of a record as a CPU boolean tensor of ``n`` elements (checked)."""
    data = rec.section(entry, codec, "bits", np.uint8, -(-n // 8), "ceil(numel / 8)")
    bits = rec.wire_call(entry, codec, "section 'bits'", wire.unpack_bits_exact, data, 1, n)
    return torch.from_numpy(np.asarray(bits).astype(np.bool_))


def _decode_columns(nonneg: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """1-bit SGD's reconstruction; encoder and decoder both call exactly this."""
    m = nonneg.reshape(rows, cols)
    return torch.where(m, pos[None, :], neg[None, :]).reshape(-1)


def _decode_scaled(nonneg: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``±scale``; encoder and decoder both call exactly this."""
    return torch.where(nonneg, scale, -scale).reshape(-1)


class OneBit(Codec):
    """1-bit SGD: sign bits with per-column means of the non-negative and the negative entries.

    Costs ``ceil(n/8) + 8·cols`` bytes for a tensor viewed as ``(rows, cols)``: about 1 bit per element
    plus 64 bits per column. Meant for ``ErrorFeedback(OneBit())``.
    """

    codec_id = 5
    name = "onebit"

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        rec.check_float_input(tensor)
        rows, cols = rec.matrix_shape(tensor.shape)
        m = tensor.detach().reshape(rows, cols).to(torch.float32)
        nonneg = m >= 0
        n_pos = nonneg.sum(dim=0)
        n_neg = rows - n_pos
        zero = torch.zeros((), dtype=torch.float32, device=m.device)
        s_pos = torch.where(nonneg, m, zero).sum(dim=0)
        s_neg = torch.where(nonneg, zero, m).sum(dim=0)
        pos = torch.where(n_pos > 0, s_pos / n_pos.clamp(min=1), zero)
        neg = torch.where(n_neg > 0, s_neg / n_neg.clamp(min=1), zero)
        pos_host, neg_host = pos.cpu().numpy(), neg.cpu().numpy()
        if not (np.isfinite(pos_host).all() and np.isfinite(neg_host).all()):
            raise ValueError(f"tensor {name!r} holds non-finite values (or column sums overflow float32)")
        recon = _decode_columns(nonneg, pos, neg, rows, cols).reshape(tensor.shape).to(tensor.dtype)
        entry = rec.entry(
            self.codec_id,
            name,
            tensor,
            sections={"bits": pack_sign_bits(nonneg), "pos": pos_host, "neg": neg_host},
        )
        return entry, recon

    def cut(self, shape, max_numel: int) -> list[TensorPart]:
        """A tensor of two or more dimensions in blocks of about ``max_numel // rows`` whole columns of its
        matrix view ``(rows, numel / rows)`` (:meth:`Codec.cut`): each column keeps all its rows, so a
        part's signs and bytes are the whole tensor's, and its column means too, up to the float32
        rounding of a column sum (torch orders a reduction by the matrix's width: an ulp at most). A block
        of rows would carry its own means: at 16 rows 4× the bits. A vector stays whole."""
        whole = super().cut(shape, max_numel)
        shape, numel = whole[0].shape, whole[0].stop
        max_numel = max(1, int(max_numel))
        if numel <= max_numel or len(shape) < 2:
            return whole
        rows = shape[0]
        cols = numel // rows if rows else 0
        width = max(1, max_numel // max(1, rows))
        if cols <= width:
            return whole
        ends = [(c0, min(cols, c0 + width)) for c0 in range(0, cols, width)]
        return [TensorPart(c0, c1, (rows, c1 - c0), columns=True) for c0, c1 in ends]

    def bytes_per_element(self) -> float:
        """A sign bit per element (the column means aside)."""
        return 1 / 8

    def __repr__(self) -> str:
        return "OneBit()"


class SignSGD(Codec):
    """signSGD (``scale="none"``: ``±1``) and EF-signSGD (``scale="mean_abs"``: ``±mean|g|``).

    Costs ``ceil(n/8) + 4`` bytes: 1 bit per element, 32× smaller than fp32. EF-signSGD is
    ``ErrorFeedback(SignSGD())``.
    """

    codec_id = 6
    name = "signsgd"

    def __init__(self, scale: str = "mean_abs"):
        if scale not in _SCALE_MODES:
            raise ValueError(f"scale must be 'mean_abs' or 'none', got {scale!r}")
        self.scale = scale

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        rec.check_float_input(tensor)
        x = tensor.detach().reshape(-1).to(torch.float32)
        nonneg = x >= 0
        if self.scale == "none":
            scale = torch.ones((), dtype=torch.float32, device=x.device)
        elif x.numel():
            scale = x.abs().mean()
        else:
            scale = torch.zeros((), dtype=torch.float32, device=x.device)
        scale_host = np.float32(scale.item())
        if not math.isfinite(scale_host):
            raise ValueError(f"tensor {name!r} holds non-finite values (or mean |g| overflows float32)")
        recon = _decode_scaled(nonneg, scale).reshape(tensor.shape).to(tensor.dtype)
        entry = rec.entry(
            self.codec_id,
            name,
            tensor,
            params=_SIGN_PARAMS.pack(_SCALE_MODES[self.scale]),
            sections={"bits": pack_sign_bits(nonneg), "scale": np.array([scale_host], dtype=np.float32)},
        )
        return entry, recon

    def __repr__(self) -> str:
        return f"SignSGD(scale={self.scale!r})"


def unpack_params(params: bytes) -> dict:
    """A signSGD record's parameters as a dict (layout only; the decoder checks ranges)."""
    (mode,) = _SIGN_PARAMS.unpack(params)
    return dict(scale=_SCALE_NAMES.get(mode, mode))


# ---------------------------------------------------------------------------------------------
# Decoding


def _decode_onebit(entry: Entry, device: torch.device | None) -> torch.Tensor:
    codec = "onebit"
    rec.check_record_dtype(entry, codec)
    rec.no_params(entry, codec)
    rec.expect_sections(entry, codec, ("bits", "pos", "neg"))
    rows, cols = rec.matrix_shape(entry.shape)
    pos = rec.section(entry, codec, "pos", np.float32, cols, "numel / shape[0] (columns)")
    neg = rec.section(entry, codec, "neg", np.float32, cols, "numel / shape[0] (columns)")
    if not (np.isfinite(pos).all() and np.isfinite(neg).all()):
        raise rec.bad(entry, codec, "column means must be finite")
    if not (bool(np.all(pos >= 0)) and bool(np.all(neg <= 0))):
        raise rec.bad(entry, codec, "column means must be >= 0 in 'pos' and <= 0 in 'neg'")
    nonneg = unpack_sign_bits(entry, codec, entry.numel)
    dev = torch.device("cpu") if device is None else torch.device(device)
    out = _decode_columns(
        nonneg.to(dev), torch.from_numpy(np.array(pos)).to(dev), torch.from_numpy(np.array(neg)).to(dev), rows, cols
    )
    return out.reshape(entry.shape).to(entry.dtype)


def _decode_signsgd(entry: Entry, device: torch.device | None) -> torch.Tensor:
    codec = "signsgd"
    rec.check_record_dtype(entry, codec)
    (mode,) = rec.params(entry, codec, _SIGN_PARAMS, "u8 scale_mode")
    if mode not in _SCALE_NAMES:
        raise rec.bad(entry, codec, f"scale_mode must be 0 (none) or 1 (mean_abs), got {mode}")
    rec.expect_sections(entry, codec, ("bits", "scale"))
    scale = rec.section(entry, codec, "scale", np.float32, 1, "1")
    s = float(scale[0])
    if mode == _SCALE_MODES["none"] and s != 1.0:
        raise rec.bad(entry, codec, f"scale must be 1 when scale_mode is 0 (none), got {s}")
    if not (math.isfinite(s) and s >= 0):
        raise rec.bad(entry, codec, f"scale must be finite and >= 0, got {s}")
    nonneg = unpack_sign_bits(entry, codec, entry.numel)
    dev = torch.device("cpu") if device is None else torch.device(device)
    out = _decode_scaled(nonneg.to(dev), torch.tensor(np.float32(s), device=dev))
    return out.reshape(entry.shape).to(entry.dtype)


def _onebit_setting(entry: Entry) -> dict:
    return {"codec": "onebit"}


def _signsgd_setting(entry: Entry) -> dict:
    return {"codec": "signsgd", **unpack_params(entry.params)}


ONEBIT_CAPABILITIES = declare(
    CodecCapabilities(OneBit.codec_id, "onebit", decode=_decode_onebit, setting=_onebit_setting)
)
SIGNSGD_CAPABILITIES = declare(
    CodecCapabilities(SignSGD.codec_id, "signsgd", decode=_decode_signsgd, setting=_signsgd_setting)
)
