"""The identity codec (id 0): raw values, the uncompressed baseline (FORMAT.md §5.1).

``wire_dtype`` may be narrower than the tensor (an fp16 or bf16 baseline of fp32 gradients); the
reconstruction is then the value rounded to that type, which is what the receiver decodes.
"""

from __future__ import annotations

import torch

from ..capabilities import CodecCapabilities, declare
from ..frame import ELEM_BF16, Entry
from . import record as rec
from .base import Codec

__all__ = ["IdentityCodec"]

_CODEC = "identity"


class IdentityCodec(Codec):
    codec_id = 0
    name = "identity"

    def __init__(self, wire_dtype: torch.dtype | None = None):
        if wire_dtype is not None and wire_dtype not in rec.FLOAT_DTYPES:
            raise ValueError(f"wire_dtype must be a floating-point dtype, got {wire_dtype}")
        self.wire_dtype = wire_dtype

    def compress(self, tensor: torch.Tensor, name: str = "") -> tuple[Entry, torch.Tensor]:
        rec.check_float_input(tensor)
        wire = self.wire_dtype or tensor.dtype
        sent = tensor.detach().to(wire).contiguous()
        payload, elem = rec.values_payload(sent)
        entry = rec.entry(
            self.codec_id,
            name,
            tensor,
            sections={"data": payload},
            section_elems={"data": elem},
        )
        return entry, sent.to(tensor.dtype)

    def __repr__(self) -> str:
        return f"IdentityCodec(wire_dtype={self.wire_dtype})"


def _decode_identity(entry: Entry, device: torch.device | None) -> torch.Tensor:
    rec.check_record_dtype(entry, _CODEC)
    rec.no_params(entry, _CODEC)
    rec.expect_sections(entry, _CODEC, ("data",))
    t = rec.float_section(entry, _CODEC, "data", entry.numel, "numel", allowed=rec.FLOAT_DTYPES, finite=False)
    t = t.reshape(entry.shape).to(entry.dtype)
    return t if device is None else t.to(device)


def _identity_setting(entry: Entry) -> dict:
    data = entry.sections.get("data")
    if entry.section_elems.get("data") == ELEM_BF16:
        return {"codec": "identity", "wire_dtype": "bfloat16"}
    return {"codec": "identity", "wire_dtype": str(data.dtype) if data is not None else None}


CAPABILITIES = declare(
    CodecCapabilities(IdentityCodec.codec_id, "identity", decode=_decode_identity, setting=_identity_setting)
)
