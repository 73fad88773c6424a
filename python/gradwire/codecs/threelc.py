"""3LC (id 2): three-value quantization with sparsity multiplication, quartic and zero-run coding
(Lim, Andersen, Kaminsky 2018; FORMAT.md §5.3).

``M = max|T| · s`` with the sparsity multiplier ``s ∈ [1, 2)``; ``q = round(T / M)`` rounding half away
from zero, so ``q ∈ {-1, 0, 1}``; the receiver gets ``M · q``. A larger ``s`` sends more zeros (values
below ``M / 2`` in magnitude) and so compresses better in the zero-run stage, at a larger error. An
all-zero tensor has ``M = 0`` and encodes to all zeros (never NaN). The trits go through the Rust
quartic coder (five trits per byte) and zero-run coder (runs of all-zero bytes shrink to one byte).

3LC relies on error accumulation — the residual ``T − M·q`` carried into the next step — which is
``ErrorFeedback(ThreeLC(...))``; the codec itself is stateless.
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
from .base import Codec

__all__ = ["ThreeLC", "dequantize", "quantize", "quartic_bytes"]

_CODEC = "3lc"
_PARAMS = struct.Struct("<f")  # sparsity
SECTIONS = ("scale", "data")
_PLANE_WEIGHTS = (81, 27, 9, 3, 1)


def quantize(flat: torch.Tensor, sparsity: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 in {-1, 0, 1}, M as a 0-d float32 tensor)`` of a flat float32 tensor."""
    s = torch.tensor(np.float32(sparsity), device=flat.device)
    amax = flat.abs().amax() if flat.numel() else torch.zeros((), device=flat.device)
    m = amax * s
    safe = torch.where(m > 0, m, torch.ones_like(m))
    t = flat / safe
    # |t| <= 1, so rounding half away from zero is a comparison (floor(|t| + 0.5) would round
    # 0.5 - 2^-25 up, as the sum rounds to 1 in float32).
    q = torch.sign(t) * (t.abs() >= 0.5)
    return q.to(torch.int8), m


def dequantize(q: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``M · q`` in float32. Encoder and decoder both call exactly this."""
    return q.to(torch.float32) * m


def quartic_bytes(q: torch.Tensor) -> torch.Tensor:
    """Quartic bytes of trits on their own device (the layout of ``wire.quartic_encode``).

    Five contiguous planes of ``ceil(n/5)`` digits ``q + 1`` (padded with digit 0), byte ``i`` =
    ``81·p0[i] + 27·p1[i] + 9·p2[i] + 3·p3[i] + p4[i]``. Used on GPUs so that only a fifth of the trits'
    bytes cross to the host; on the CPU the Rust kernel does the same work.
    """
    n = q.numel()
    planes = -(-n // 5)
    d = torch.zeros(5 * planes, dtype=torch.int16, device=q.device)
    d[:n] = q.reshape(-1).to(torch.int16) + 1
    d = d.view(5, planes)
    w = torch.tensor(_PLANE_WEIGHTS, dtype=torch.int16, device=q.device)
    return (d * w[:, None]).sum(dim=0).to(torch.uint8)


class ThreeLC(Codec):
    """3-value quantization with sparsity multiplication, quartic and zero-run encoded.

    Costs 4 bytes of ``M`` plus at most ``ceil(n/5)`` bytes (1.6 bits per element), much less when most
    trits are zero: a run of up to 14 all-zero bytes (70 zero trits) costs one byte.
    """

    codec_id = 2
    name = "3lc"

    def __init__(self, sparsity: float = 1.0):
        sparsity = float(sparsity)
        if not (1.0 <= sparsity < 2.0):
            raise ValueError(f"sparsity must lie in [1, 2), got {sparsity}")
        if float(np.float32(sparsity)) >= 2.0:
            raise ValueError(f"sparsity {sparsity} rounds to 2.0 in float32")
        self.sparsity = sparsity

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        rec.check_float_input(tensor)
        flat = tensor.detach().reshape(-1).to(torch.float32)
        q, m = quantize(flat, self.sparsity)
        m_host = np.float32(m.item())
        if not math.isfinite(m_host):
            raise ValueError(f"tensor {name!r} holds non-finite values (or max|T| · s overflows float32)")
        if q.device.type == "cpu":
            quartic = wire.quartic_encode(q.numpy())
        else:
            quartic = quartic_bytes(q).cpu().numpy()
        data = np.frombuffer(wire.zero_run_encode(quartic), dtype=np.uint8)
        recon = dequantize(q, m).reshape(tensor.shape).to(tensor.dtype)
        entry = rec.entry(
            self.codec_id,
            name,
            tensor,
            params=_PARAMS.pack(self.sparsity),
            sections={"scale": np.array([m_host], dtype=np.float32), "data": data},
        )
        return entry, recon

    def __repr__(self) -> str:
        return f"ThreeLC(sparsity={self.sparsity})"


def unpack_params(params: bytes) -> dict:
    """A record's parameters as a dict (layout only; the decoder checks ranges)."""
    (sparsity,) = _PARAMS.unpack(params)
    return dict(sparsity=sparsity)


def _decode_threelc(entry: Entry, device: torch.device | None) -> torch.Tensor:
    rec.check_record_dtype(entry, _CODEC)
    (sparsity,) = rec.params(entry, _CODEC, _PARAMS, "f32 sparsity")
    if not (1.0 <= sparsity < 2.0):
        raise rec.bad(entry, _CODEC, f"sparsity must lie in [1, 2), got {sparsity}")
    rec.expect_sections(entry, _CODEC, SECTIONS)
    scale = rec.section(entry, _CODEC, "scale", np.float32, 1, "1")
    data = rec.byte_section(entry, _CODEC, "data")
    m = float(scale[0])
    if not (math.isfinite(m) and m >= 0):
        raise rec.bad(entry, _CODEC, f"scale M must be finite and >= 0, got {m}")
    n = entry.numel
    quartic = rec.wire_call(entry, _CODEC, "section 'data'", wire.zero_run_decode, data, -(-n // 5))
    trits = rec.wire_call(entry, _CODEC, "section 'data'", wire.quartic_decode, quartic, n)
    dev = torch.device("cpu") if device is None else torch.device(device)
    q = torch.from_numpy(np.asarray(trits, dtype=np.int8)).to(dev)
    m_t = torch.tensor(np.float32(m), device=dev)
    return dequantize(q, m_t).reshape(entry.shape).to(entry.dtype)


def _threelc_setting(entry: Entry) -> dict:
    return {"codec": "3lc", "sparsity": round(unpack_params(entry.params)["sparsity"], 6)}


CAPABILITIES = declare(CodecCapabilities(ThreeLC.codec_id, "3lc", decode=_decode_threelc, setting=_threelc_setting))
