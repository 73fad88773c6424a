"""The identity codec (id 0): raw values, the uncompressed baseline (FORMAT.md §5.1).

``wire_dtype`` may be narrower than the tensor (an fp16 or bf16 baseline of fp32 gradients); the
reconstruction is then the value rounded to that type, which is what the receiver decodes.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..errors import FrameError
from ..frame import ELEM_BF16, Entry, register_decoder
from .base import Codec

__all__ = ["IdentityCodec"]

_WIRE_TYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


class IdentityCodec(Codec):
    codec_id = 0
    name = "identity"

    def __init__(self, wire_dtype: Optional[torch.dtype] = None):
        if wire_dtype is not None and wire_dtype not in _WIRE_TYPES:
            raise ValueError(f"wire_dtype must be a floating-point dtype, got {wire_dtype}")
        self.wire_dtype = wire_dtype

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        if not tensor.is_floating_point():
            raise ValueError(f"expected a floating-point tensor, got {tensor.dtype}")
        wire = self.wire_dtype or tensor.dtype
        sent = tensor.detach().to(wire).contiguous()
        host = sent.cpu().reshape(-1)
        elems = {}
        if wire == torch.bfloat16:
            payload = host.view(torch.int16).numpy().view(np.uint16)
            elems["data"] = ELEM_BF16
        else:
            payload = host.numpy()
        entry = Entry(
            name=name,
            codec=self.codec_id,
            dtype=tensor.dtype,
            shape=tuple(tensor.shape),
            sections={"data": payload},
            section_elems=elems,
        )
        return entry, sent.to(tensor.dtype)

    def __repr__(self) -> str:
        return f"IdentityCodec(wire_dtype={self.wire_dtype})"


@register_decoder(IdentityCodec.codec_id)
def _decode_identity(entry: Entry, device: Optional[torch.device]) -> torch.Tensor:
    if entry.params:
        raise FrameError(f"record {entry.name!r}: identity codec takes no parameters, got {len(entry.params)} bytes")
    if "data" not in entry.sections or len(entry.sections) != 1:
        raise FrameError(f"record {entry.name!r}: identity codec expects exactly one section 'data'")
    arr = entry.sections["data"]
    if entry.section_elems.get("data") == ELEM_BF16:
        arr = entry.section("data", np.uint16, entry.numel)
        t = torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    else:
        if arr.dtype not in (np.float16, np.float32, np.float64):
            raise FrameError(f"record {entry.name!r}: identity 'data' must be a float type, got {arr.dtype}")
        arr = entry.section("data", arr.dtype, entry.numel)
        t = torch.from_numpy(arr.copy())
    t = t.reshape(entry.shape).to(entry.dtype)
    return t if device is None else t.to(device)
