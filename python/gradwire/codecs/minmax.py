"""MinMax uint8 (id 10): Bagua's low-precision quantizer (FORMAT.md §5.11).

The flattened tensor is cut into chunks of ``chunk`` elements (the last one may be shorter). Each chunk
sends its minimum and maximum as f32 and one byte per element:
``code = clamp(round((x - min) · 255 / (max - min)), 0, 255)``, decoded as
``min + code · ((max - min) / 255)``. Both ends are clamped, so the minimum always maps to 0 and the
maximum to 255 (one public implementation lets float rounding send the minimum to -1, which wraps to
255 in a byte). A constant chunk (``max == min``) sends code 0 and decodes exactly.

This is the quantizer of low-precision decentralized SGD (Bagua): peers exchange quantized model
differences; it is also an ordinary codec, composable with :class:`~gradwire.ErrorFeedback`.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from ..capabilities import CodecCapabilities, declare
from ..frame import Entry
from . import record as rec
from .base import Codec

__all__ = ["MAX_CHUNK", "MinMaxUInt8", "dequantize", "quantize"]

_CODEC = "minmax"
_PARAMS = struct.Struct("<I")  # chunk
#: Largest ``chunk`` a record may announce.
MAX_CHUNK = 1 << 31
SECTIONS = ("min", "max", "codes")


def _split(flat: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole chunks as ``(full, chunk)`` and the short last chunk (possibly empty), as views:
    nothing of the chunk size is allocated, so a huge ``chunk`` costs nothing."""
    full = flat.numel() // chunk
    return flat[: full * chunk].view(full, chunk), flat[full * chunk :]


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lo, hi = torch.aminmax(x, dim=1)
    span = hi - lo
    # A constant row has x - lo = 0 exactly, so dividing by 1 instead of 0 gives code 0 with no mask.
    safe = torch.where(span > 0, span, torch.ones_like(span))
    c = (x - lo[:, None]).mul_(255.0).div_(safe[:, None]).round_().clamp_(0, 255)
    return c.to(torch.uint8).reshape(-1), lo, hi


def quantize(flat: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes uint8 [n], mins f32 [chunks], maxs f32 [chunks])`` of a flat float32 tensor."""
    head, tail = _split(flat, chunk)
    if not tail.numel():
        return _quantize_rows(head)
    if not head.numel():
        return _quantize_rows(tail[None, :])
    c1, lo1, hi1 = _quantize_rows(head)
    c2, lo2, hi2 = _quantize_rows(tail[None, :])
    return torch.cat([c1, c2]), torch.cat([lo1, lo2]), torch.cat([hi1, hi2])


def dequantize(codes: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk: int) -> torch.Tensor:
    """The flat float32 values of ``codes``. Encoder and decoder both call exactly this."""
    steps = (maxs - mins) / 255.0
    head, tail = _split(codes, chunk)
    full = head.shape[0]
    out = head.to(torch.float32).mul_(steps[:full, None]).add_(mins[:full, None]).reshape(-1)
    if not tail.numel():
        return out
    last = tail.to(torch.float32).mul_(steps[full]).add_(mins[full])
    return torch.cat([out, last])


class MinMaxUInt8(Codec):
    """Per-chunk min/max linear quantization to one byte per element (Bagua's ``MinMaxUInt8``).

    Costs ``numel + 8 · ceil(numel / chunk)`` bytes: 1.008 bytes per element at ``chunk=1024``.
    """

    codec_id = 10
    name = "minmax"

    def __init__(self, chunk: int = 1024):
        chunk = int(chunk)
        if not 1 <= chunk < MAX_CHUNK:
            raise ValueError(f"chunk must lie in [1, 2^31), got {chunk}")
        self.chunk = chunk

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        rec.check_float_input(tensor)
        flat = tensor.detach().reshape(-1).to(torch.float32)
        codes, mins, maxs = quantize(flat, self.chunk)
        mins_host = mins.cpu().numpy()
        maxs_host = maxs.cpu().numpy()
        with np.errstate(over="ignore", invalid="ignore"):
            ok = np.isfinite(maxs_host - mins_host).all()
        if not ok:
            raise ValueError(f"tensor {name!r} holds non-finite values (or a range too wide for float32)")
        recon = dequantize(codes, mins, maxs, self.chunk).reshape(tensor.shape).to(tensor.dtype)
        entry = rec.entry(
            self.codec_id,
            name,
            tensor,
            params=_PARAMS.pack(self.chunk),
            sections={"min": mins_host, "max": maxs_host, "codes": codes.cpu().numpy()},
        )
        return entry, recon

    def __repr__(self) -> str:
        return f"MinMaxUInt8(chunk={self.chunk})"


def unpack_params(params: bytes) -> dict:
    """A record's parameters as a dict (layout only; the decoder checks ranges)."""
    (chunk,) = _PARAMS.unpack(params)
    return dict(chunk=chunk)


def _decode_minmax(entry: Entry, device: torch.device | None) -> torch.Tensor:
    rec.check_record_dtype(entry, _CODEC)
    (chunk,) = rec.params(entry, _CODEC, _PARAMS, "u32 chunk")
    if not 1 <= chunk < MAX_CHUNK:
        raise rec.bad(entry, _CODEC, f"chunk must lie in [1, 2^31), got {chunk}")
    n = entry.numel
    num_chunks = -(-n // chunk)
    rec.expect_sections(entry, _CODEC, SECTIONS)
    mins = rec.section(entry, _CODEC, "min", np.float32, num_chunks, "ceil(numel / chunk)")
    maxs = rec.section(entry, _CODEC, "max", np.float32, num_chunks, "ceil(numel / chunk)")
    codes = rec.section(entry, _CODEC, "codes", np.uint8, n, "numel")
    if not (np.isfinite(mins).all() and np.isfinite(maxs).all()):
        raise rec.bad(entry, _CODEC, "every chunk's min and max must be finite")
    if not bool(np.all(maxs >= mins)):
        raise rec.bad(entry, _CODEC, "every chunk's max must be >= its min")
    with np.errstate(over="ignore", invalid="ignore"):
        ok = np.isfinite(maxs - mins).all()
    if not ok:
        raise rec.bad(entry, _CODEC, "max - min must be finite in float32")
    dev = torch.device("cpu") if device is None else torch.device(device)
    out = dequantize(
        torch.from_numpy(np.array(codes)).to(dev),
        torch.from_numpy(np.array(mins)).to(dev),
        torch.from_numpy(np.array(maxs)).to(dev),
        chunk,
    )
    return out.reshape(entry.shape).to(entry.dtype)


def _minmax_setting(entry: Entry) -> dict:
    return {"codec": "minmax", **unpack_params(entry.params)}


CAPABILITIES = declare(
    CodecCapabilities(MinMaxUInt8.codec_id, "minmax", decode=_decode_minmax, setting=_minmax_setting)
)
