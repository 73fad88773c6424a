"""A DCT record's layout (docs/FORMAT.md §5.2): its params, its sections, the codes and limits they use.

The writer (:mod:`.codec`) packs records with :func:`pack_params`; the reader (:mod:`.parse`) checks every
field against the limits here before it believes one; :func:`unpack_params` reads params without checks
(for tools and the capability's ``setting``).

``params``: ``mode`` (u8), ``chunk_ndim`` (u8), ``chunk_shape`` (``chunk_ndim`` × u32), then
:data:`PARAMS_TAIL`: ``k`` (u32), ``index_bits`` (u8: the packed width, or the Rice parameter),
``value_bits`` (u8), ``index_coding`` (u8), ``pad_count`` (u64), all little-endian. Sections, in order:
:data:`SECTIONS`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np

from .. import wire
from .chunks import MODE_FLAT, MODE_TILES

__all__ = [
    "CODEC_ID",
    "INDEX_CODING_FIXED",
    "INDEX_CODING_RICE",
    "MAX_CHUNK_NDIM",
    "MAX_CHUNK_NUMEL",
    "MAX_CHUNK_SIDE",
    "MODES",
    "MODE_NAMES",
    "PARAMS_TAIL",
    "SECTIONS",
    "VALUE_BITS",
    "VALUE_BITS_CHOICES",
    "index_bits_for",
    "index_stream_sizes",
    "pack_params",
    "unpack_params",
]

#: The DCT codec's id in a record's header.
CODEC_ID = 1
#: The largest chunk element count ``C`` a record may announce, and the longest chunk side: bounds
#: the work and memory of the exact decode (``gradwire.dct.decode_levels``) for any valid record.
MAX_CHUNK_NUMEL = 1 << 16
MAX_CHUNK_SIDE = 1024
#: Highest ``chunk_ndim``.
MAX_CHUNK_NDIM = 8
#: The default value width (int8 values).
VALUE_BITS = 8
#: The value widths a record may use (``2^b`` quantization levels per chunk).
VALUE_BITS_CHOICES = (8, 4, 2, 1)
INDEX_CODING_FIXED = 0
INDEX_CODING_RICE = 1
#: The chunkings by name, and back.
MODES = {"flat": MODE_FLAT, "tiles": MODE_TILES}
MODE_NAMES = {v: k for k, v in MODES.items()}
#: Section names, in their order in a record.
SECTIONS = ("idx", "val", "scale", "min")
#: The params after the chunk shape: k, index_bits, value_bits, index_coding, pad_count.
PARAMS_TAIL = struct.Struct("<IBBBQ")


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
    """The ``params`` bytes of a DCT record.

    The ``index_bits`` field holds the coding's parameter: the packed width (coding 0, always
    ``ceil(log2 C)``) or the Rice parameter (coding 1, ``index_param``).
    """
    nd = len(chunk_shape)
    if index_coding == INDEX_CODING_FIXED:
        index_param = index_bits_for(math.prod(int(d) for d in chunk_shape))
    elif index_param is None:
        raise ValueError("a Rice-coded record needs its parameter (index_param)")
    return struct.pack(f"<BB{nd}I", mode, nd, *chunk_shape) + PARAMS_TAIL.pack(
        k, index_param, value_bits, index_coding, pad_count
    )


def unpack_params(params: bytes) -> dict:
    """Parse a record's ``params`` into a dict (no range checks beyond the layout's length)."""
    if len(params) < 2:
        raise ValueError(f"params too short: {len(params)} bytes")
    mode, nd = params[0], params[1]
    if len(params) != 2 + 4 * nd + PARAMS_TAIL.size:
        raise ValueError(f"params length {len(params)} does not fit chunk_ndim {nd}")
    chunk_shape = struct.unpack_from(f"<{nd}I", params, 2)
    k, index_bits, value_bits, index_coding, pad_count = PARAMS_TAIL.unpack_from(params, 2 + 4 * nd)
    return dict(
        mode=mode,
        chunk_shape=tuple(chunk_shape),
        k=k,
        index_bits=index_bits,
        value_bits=value_bits,
        index_coding=index_coding,
        pad_count=pad_count,
    )


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
