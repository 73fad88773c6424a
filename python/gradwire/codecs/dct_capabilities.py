"""The DCT codec's capability object (codec id 1): what the frame readers, the accumulators and the
aggregation rules find under its id (:mod:`gradwire.capabilities`)."""

from __future__ import annotations

from ..capabilities import CodecCapabilities, declare
from ..frame import Entry
from .dct import _MODE_NAMES, DCTCodec, unpack_params
from .dct_decode import decode_dct, decode_dct_batch, weighted_sum_dct
from .dct_domain import dct_accumulator, dct_record_coefficients, dct_record_norm

__all__ = ["CAPABILITIES"]


def _dct_setting(entry: Entry) -> dict:
    p = unpack_params(entry.params)
    return {
        "codec": "dct",
        "mode": _MODE_NAMES.get(p["mode"], p["mode"]),
        "chunk_shape": p["chunk_shape"],
        "topk": p["k"],
    }


CAPABILITIES = declare(
    CodecCapabilities(
        DCTCodec.codec_id,
        "dct",
        decode=decode_dct,
        decode_batch=decode_dct_batch,
        weighted_sum=weighted_sum_dct,
        accumulator=dct_accumulator,
        norm=dct_record_norm,
        coefficients=dct_record_coefficients,
        setting=_dct_setting,
    )
)
