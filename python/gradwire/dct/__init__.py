"""The orthonormal DCT-II by cached basis matrices, and the two ways of cutting a tensor into chunks.

One namespace, ``gradwire.dct``, over six modules (each imports only the ones above it):

- :mod:`.chunks`: the two chunkings (mode 0 flat, mode 1 tiles), :class:`ChunkPlan`, :func:`to_chunks` /
  :func:`from_chunks`;
- :mod:`.transform`: the cached bases (the one basis cache), :func:`dct` / :func:`idct` along an axis,
  :func:`dct_nd`, the per-chunk :func:`dct_chunks` / :func:`idct_chunks`, :func:`encode_chunks`;
- :mod:`.quantize`: :func:`select_topk` and the per-row int8 grid (:func:`quantize_int8`);
- :mod:`.decode`: :func:`decode_chunks` (float) and the bit-exact :func:`decode_levels` with its routes;
- :mod:`.integer`: exact int64 products through int8 digits and ``torch._int_mm`` (:func:`exact_int_mm`),
  and the decode's "integer" route (:func:`rows_level_sums_int`);
- :mod:`.route_choice`: which exact route a GPU takes, integer or float64, measured on the device
  (:func:`set_exact_decode`, ``GRADWIRE_EXACT_DECODE``).

The public names are re-exported here, so code calls ``gradwire.dct.X``. This is a plain re-export:
assigning a name on ``gradwire.dct`` rebinds it here only. A setting such as ``MATMUL_MAX_N`` or
``_EXACT_BLOCK_ELEMS`` is read from the module that defines it (``gradwire.dct.transform``,
``gradwire.dct.decode``), and a function is looked up in the namespace its caller imported it from.
Patch a name there.
"""

from __future__ import annotations

# The submodules are part of the namespace (the redundant aliases say the import is a re-export).
from . import chunks as chunks
from . import decode as decode
from . import integer as integer
from . import quantize as quantize
from . import route_choice as route_choice
from . import transform as transform
from .chunks import (
    MAX_TILE,
    MODE_FLAT,
    MODE_TILES,
    ChunkPlan,
    cut_into_chunks,
    from_chunks,
    largest_divisor_at_most,
    plan_chunks,
    plan_flat,
    plan_tiles,
    plan_tiles_or_flat,
    put_back_chunks,
    small_tiles,
    tile_chunk_shape,
    to_chunks,
)
from .decode import (
    decode_chunks,
    decode_level_chunks,
    decode_levels,
    decode_levels_weighted_sum,
    fixed_point_bits,
)
from .integer import digit_count, exact_int_mm, int_digits, rows_level_sums_int
from .quantize import MIN_RANGE, dequantize_int8, quantize_int8, select_topk
from .route_choice import set_exact_decode
from .transform import (
    BASIS_CACHE_BYTES,
    MATMUL_MAX_N,
    clear_basis_cache,
    dct,
    dct_basis,
    dct_chunks,
    dct_nd,
    encode_chunks,
    idct,
    idct_chunks,
    idct_nd,
)

__all__ = [
    "BASIS_CACHE_BYTES",
    "MATMUL_MAX_N",
    "MAX_TILE",
    "MIN_RANGE",
    "MODE_FLAT",
    "MODE_TILES",
    "ChunkPlan",
    "cut_into_chunks",
    "clear_basis_cache",
    "dct",
    "dct_basis",
    "dct_chunks",
    "dct_nd",
    "decode_chunks",
    "digit_count",
    "exact_int_mm",
    "int_digits",
    "rows_level_sums_int",
    "set_exact_decode",
    "dequantize_int8",
    "encode_chunks",
    "from_chunks",
    "idct",
    "idct_chunks",
    "decode_level_chunks",
    "decode_levels",
    "decode_levels_weighted_sum",
    "fixed_point_bits",
    "idct_nd",
    "largest_divisor_at_most",
    "plan_chunks",
    "plan_flat",
    "plan_tiles",
    "plan_tiles_or_flat",
    "put_back_chunks",
    "small_tiles",
    "quantize_int8",
    "select_topk",
    "tile_chunk_shape",
    "to_chunks",
]
